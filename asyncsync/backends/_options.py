"""Typed options of the built-in transports: what ``AsyncWeightPublisher(fleet,
backend=...)`` takes besides a name.

Each is a frozen dataclass validated when it is built, so a bad option is refused where
the user wrote it, before any server or buffer exists::

    az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=64 << 20))
    az.AsyncWeightPublisher(fleet, backend="shm")   # the same as backend=Shm()

Imports neither torch nor vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from asyncsync.backends.contract import BackendOptions

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_PACKED_BUFFER_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "INSECURE_SERIALIZATION_OPT_IN",
    "IPC",
    "NCCL",
    "Auto",
    "Gloo",
    "Shm",
    "ZeroCopyMode",
    "check_zero_copy_mode",
]

#: Each of the shm and gloo backends' two buffers (and each server's two receive
#: buffers for gloo): 256 MiB.
DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
#: vLLM's packed broadcast of the NCCL and IPC engines: its buffer size and count.
DEFAULT_PACKED_BUFFER_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2

#: ``zero_copy``: False (pack), True (read the trainer's tensors in place, all of them
#: in shared memory), ``"auto"`` (in place when every tensor allows it).
ZeroCopyMode = bool | Literal["auto"]


#: Why ``allow_insecure_serialization=True`` is needed (the error when it is missing).
INSECURE_SERIALIZATION_OPT_IN = (
    "backend 'ipc' sends CUDA IPC handles to the servers pickled over HTTP, the only way "
    "vLLM's IPC engine takes them there; the servers must run with "
    "VLLM_ALLOW_INSECURE_SERIALIZATION=1, which lets anyone who can reach their RL routes "
    "run code in them. Keep those routes on a trusted host or network and pass "
    "allow_insecure_serialization=True to accept this (docs/transports/ipc.md)"
)


def check_zero_copy_mode(mode: object) -> None:
    if mode not in (True, False, "auto"):
        raise ValueError(f"zero_copy must be True, False or 'auto', got {mode!r}")


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


def _positive_seconds(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{owner}.{name} must be seconds > 0, got {value!r}")


def _rate(owner: str, value: object) -> None:
    if value is None:
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{owner}.link_gb_per_s must be GB/s > 0 or None, got {value!r}")


def _port(owner: str, value: object) -> None:
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536
    ):
        raise ValueError(f"{owner}.master_port must be a TCP port (1-65535) or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Shm(BackendOptions):
    """``"shm"``: CPU shared memory, servers on this host (docs/transports/shm.md).

    Attributes:
        buffer_bytes: each of the two shared-memory buffers; they bound the trainer's
            extra memory whatever the model size, and one must hold the largest tensor.
        zero_copy: ``True``: the servers read the trainer's tensors in place, every one
            of which must live in shared memory (`asyncsync.share_weights` or
            ``module.share_memory()``; a round where one does not is refused before any
            server is touched); ``"auto"``: in place when every tensor allows it, packed
            otherwise. In place, the weights must not change until ``publish`` returns
            (`asyncsync.WeightsModifiedError` otherwise).
        send_deltas: ``publish(..., delta=True)`` sends patches over shm too (each
            server keeps a mirror of the model). Off by default: on the trainer's host
            copying the whole model costs less than comparing it with the last version,
            so a ``delta=True`` round reaches shm servers whole (docs/delta.md).
    """

    name: ClassVar[str] = "shm"
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    zero_copy: ZeroCopyMode = False
    send_deltas: bool = False

    def __post_init__(self) -> None:
        _positive_int("Shm", "buffer_bytes", self.buffer_bytes)
        check_zero_copy_mode(self.zero_copy)
        if not isinstance(self.send_deltas, bool):
            raise TypeError(f"Shm: send_deltas must be True or False, got {self.send_deltas!r}")
        if self.send_deltas and self.zero_copy is True:
            raise ValueError(
                "Shm: send_deltas=True packs patches, which zero_copy=True cannot carry"
            )


@dataclass(frozen=True, kw_only=True)
class Gloo(BackendOptions):
    """``"gloo"``: a torch.distributed gloo broadcast, CPU, across hosts
    (docs/transports/gloo.md).

    Attributes:
        buffer_bytes: each of the trainer's two pack buffers and each server's two
            receive buffers; one must hold the largest tensor.
        master_address: what the servers connect to (default: loopback when every
            server is local, else the local address that routes to them).
        master_port: the trainer's store port (default: a free one).
        create_timeout_s: the rendezvous's deadline.
        op_timeout_s: gloo's own bound on an abandoned operation (default: the fleet's
            update deadline + 30 s).
        link_gb_per_s: the link's rate to the servers in GB/s, the ceiling a round's
            `PublishReport.efficiency` is measured against (default: measured on
            loopback, else the interface's own rate).
    """

    name: ClassVar[str] = "gloo"
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    master_address: str | None = None
    master_port: int | None = None
    create_timeout_s: float = 60.0
    op_timeout_s: float | None = None
    link_gb_per_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("Gloo", "buffer_bytes", self.buffer_bytes)
        _port("Gloo", self.master_port)
        _positive_seconds("Gloo", "create_timeout_s", self.create_timeout_s)
        _positive_seconds("Gloo", "op_timeout_s", self.op_timeout_s, optional=True)
        _rate("Gloo", self.link_gb_per_s)


@dataclass(frozen=True, kw_only=True)
class NCCL(BackendOptions):
    """``"nccl"``: vLLM's own NCCL engine, GPUs (docs/transports/nccl.md).

    Attributes:
        master_address: what the servers' workers connect to (default: loopback when
            every server is local, else the local address that routes to them).
        master_port: the rendezvous port (default: a free one, new for each group).
        packed: vLLM's packed broadcast.
        packed_buffer_size_bytes: its buffer size.
        packed_num_buffers: its buffer count.
        link_gb_per_s: the link's rate to the servers' GPUs in GB/s (NVLink, the
            network), the ceiling a round's `PublishReport.efficiency` is measured
            against; None: no ceiling (asyncsync cannot measure it from one side).
    """

    name: ClassVar[str] = "nccl"
    master_address: str | None = None
    master_port: int | None = None
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    link_gb_per_s: float | None = None

    def __post_init__(self) -> None:
        _port("NCCL", self.master_port)
        _positive_int("NCCL", "packed_buffer_size_bytes", self.packed_buffer_size_bytes)
        _positive_int("NCCL", "packed_num_buffers", self.packed_num_buffers)
        _rate("NCCL", self.link_gb_per_s)


@dataclass(frozen=True, kw_only=True)
class IPC(BackendOptions):
    """``"ipc"``: vLLM's own CUDA IPC engine, GPUs on one host (docs/transports/ipc.md).

    Attributes:
        allow_insecure_serialization: must be True: vLLM's route takes the handles only
            pickled (servers need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); see
            docs/security.md.
        packed: vLLM's packed transfer (tensors copied into one staging buffer, one
            handle per chunk) or not (one handle per tensor, no copy). None (default):
            chosen per round from the model, by the rule of docs/transports/ipc.md
            (`asyncsync.backends.ipc.packed_by_default`: packed when the model has
            many small tensors); True or False always wins.
        packed_buffer_size_bytes: the staging buffer's size (at most the model's size
            when the rule chose packing).
    """

    name: ClassVar[str] = "ipc"
    allow_insecure_serialization: bool = False
    packed: bool | None = None
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES

    def __post_init__(self) -> None:
        if self.allow_insecure_serialization is not True:
            raise ValueError(INSECURE_SERIALIZATION_OPT_IN)
        if self.packed not in (None, True, False):
            raise TypeError(f"IPC: packed must be True, False or None, got {self.packed!r}")
        _positive_int("IPC", "packed_buffer_size_bytes", self.packed_buffer_size_bytes)


@dataclass(frozen=True, kw_only=True)
class Auto(BackendOptions):
    """``"auto"``: each server on the transport its host allows, in one round: ``shm`` for
    the servers on the trainer's host, ``gloo`` for the others (servers run
    ``asyncsync_auto``, which takes either; docs/ray.md#one-round-two-transports).

    Attributes:
        buffer_bytes: each buffer of both transports (see `Shm` and `Gloo`).
        zero_copy: the shm servers read the trainer's tensors in place (see `Shm`).
        master_address: what the gloo servers connect to (see `Gloo`).
        master_port: the trainer's gloo store port (see `Gloo`).
        create_timeout_s: the gloo rendezvous's deadline.
        op_timeout_s: gloo's own bound on an abandoned operation (see `Gloo`).
    """

    name: ClassVar[str] = "auto"
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    zero_copy: ZeroCopyMode = False
    master_address: str | None = None
    master_port: int | None = None
    create_timeout_s: float = 60.0
    op_timeout_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("Auto", "buffer_bytes", self.buffer_bytes)
        check_zero_copy_mode(self.zero_copy)
        _port("Auto", self.master_port)
        _positive_seconds("Auto", "create_timeout_s", self.create_timeout_s)
        _positive_seconds("Auto", "op_timeout_s", self.op_timeout_s, optional=True)
