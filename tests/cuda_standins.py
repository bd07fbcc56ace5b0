"""Stand-ins for what vLLM's NCCL and IPC engines need CUDA for, so that the installed
vLLM's real engine classes (0.32, 0.27.1) run on CPU (not a test module).

Only the CUDA-bound calls are replaced, nothing of vLLM's logic:

- :class:`CudaOnCpu`: the ``torch`` that vLLM's weight-transfer modules see: streams,
  device indices and properties, ``synchronize``/``ipc_collect`` are no-ops on CPU, and
  ``torch.empty(..., device="cuda")`` allocates on CPU. Everything else is real torch.
- :class:`NcclHub` and :class:`TrainerComm`: a communicator with NCCL's ``broadcast``
  shape, returned where vLLM's own ``trainer_init`` and worker init open their group
  (``stateless_init_process_group``). Like NCCL, the trainer's broadcast completes
  only when every peer takes part: here, when each fake server's worker joined (its
  ``/update_weights`` arrived there and vLLM's update-info class accepted it) after
  that server's latest ``/start_weight_update``. A server that refused the update
  never joins, and the broadcast stays blocked, as NCCL's would, until the test
  releases it. What rank 0 broadcast is kept, and :class:`ReplayComm` gives it to
  vLLM's worker-side engine.
- :class:`IpcHandles`: the CUDA IPC handle producer (``reduce_tensor``) and opener
  (``rebuild_cuda_tensor``): a handle has the shape of torch's (the device index at
  position 6) and names a tensor in a registry; opening it aliases that tensor, as
  opening a real handle maps the trainer's memory.
- :class:`SharedIpcHandles`: the same across processes: a handle names the tensor's
  storage in shared memory (torch's file-system sharing, a file in ``/dev/shm``), which
  the receiving process maps; with ``install_cuda_on_cpu(..., shared=True)`` the
  buffers vLLM allocates "on the device" live there too. Opening a handle aliases the
  trainer's memory, as CUDA IPC does: a packed buffer rewritten for the next chunk is
  seen rewritten (``scripts/gpu_e2e.py --standins`` runs its receivers this way).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncsync.testing import FakeVLLMServer

#: How long a stand-in waits for a condition before it reports a hang.
HANG_S = 60.0

STANDIN_GPU_UUID = "GPU-standin-0000"


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _Cuda:
    """``torch.cuda`` as vLLM's transfer code uses it, on CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def Stream(device: Any = None) -> _Stream:
        return _Stream()

    @staticmethod
    def current_stream(device: Any = None) -> _Stream:
        return _Stream()

    @staticmethod
    def stream(stream: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def ipc_collect() -> None:
        pass

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(uuid=STANDIN_GPU_UUID, name="stand-in")


class _Accelerator:
    @staticmethod
    def current_device_index() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


class CudaOnCpu:
    """The ``torch`` module vLLM's weight-transfer modules see (see the module doc).
    ``shared``: "device" memory is allocated in shared memory (`SharedIpcHandles`)."""

    cuda = _Cuda()
    accelerator = _Accelerator()

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, device: Any = None, **options: Any) -> torch.Tensor:
        on_device = device is not None and str(device).startswith("cuda")
        tensor = torch.empty(*size, device="cpu" if on_device else device, **options)
        if on_device and self.shared:
            tensor.untyped_storage()._share_filename_cpu_()
        return tensor


#: vLLM's modules whose ``torch`` is replaced.
_SHIMMED = (
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.nccl_common",
    "vllm.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.packed_tensor",
    "vllm.distributed.weight_transfer.ipc_engine",
)


def install_cuda_on_cpu(monkeypatch: pytest.MonkeyPatch, *, shared: bool = False) -> None:
    import importlib

    from vllm.distributed.weight_transfer import packed_tensor

    shim = CudaOnCpu(shared=shared)
    for name in _SHIMMED:
        monkeypatch.setattr(importlib.import_module(name), "torch", shim)
    cached = getattr(packed_tensor, "_get_streams", None)  # vLLM >= 0.28 caches streams
    if cached is not None:
        cached.cache_clear()  # its streams are the stand-in's from now


def wait_for(condition: Callable[[], bool], what: str, cv: threading.Condition) -> None:
    """Wait (holding ``cv``) until ``condition()``; TimeoutError naming ``what``."""
    if not cv.wait_for(condition, timeout=HANG_S):
        raise TimeoutError(f"stand-in waited {HANG_S:.0f} s for {what}")


# --------------------------------------------------------------------------- NCCL
class Released(RuntimeError):
    """The test released a broadcast that could never complete."""


def _port(init_info: Any) -> Any:
    """The group an init names (its master port)."""
    return init_info.get("master_port") if isinstance(init_info, dict) else None


class NcclHub:
    """What the stand-in communicators of one test share: which servers' workers joined
    a broadcast, and what rank 0 broadcast."""

    def __init__(self, fakes: list[FakeVLLMServer]) -> None:
        self.fakes = fakes
        self.cv = threading.Condition()
        #: URL -> when its worker last joined a broadcast (monotonic, as the fake records
        #: requests) and the group it joined (the master port of its latest init)
        self.joined: dict[str, tuple[float, Any]] = {}
        #: what rank 0 broadcast, in order (cleared by the test between rounds)
        self.sent: list[torch.Tensor] = []
        #: the trainer endpoints opened (the trainer's NCCLTrainerInitInfo fields)
        self.endpoints: list[dict[str, Any]] = []
        #: (URL, worker's rank, world size) of each worker-side group opened
        self.worker_ranks: list[tuple[str, int, int]] = []
        self.released = False

    def worker_hook(self, fake: FakeVLLMServer, parse: Callable[..., Any]) -> Callable[[Any], None]:
        """The fake's ``update_hook``: vLLM's update-info class parses the update (an
        abort is refused there, like in vLLM's worker), then the worker joins."""

        def hook(info: Any) -> None:
            parse(**info)
            group = _port(fake.init_infos[-1]) if fake.init_infos else None
            with self.cv:
                self.joined[fake.url] = (time.monotonic(), group)
                self.cv.notify_all()

        return hook

    def _all_joined(self, group: Any) -> bool:
        """Every worker of ``group`` (the servers whose latest init named it) joined its
        broadcast since its latest start: a group rebuilt without a server completes
        without it, as NCCL's would."""
        members = [f for f in self.fakes if f.init_infos and _port(f.init_infos[-1]) == group]
        if not members:
            return False
        for fake in members:
            starts = fake.requests_to("/start_weight_update")
            at, joined_group = self.joined.get(fake.url, (-1.0, None))
            if not starts or joined_group != group or at < starts[-1].at:
                return False
        return True

    def release(self) -> None:
        """End every broadcast still waiting (a test's teardown)."""
        with self.cv:
            self.released = True
            self.cv.notify_all()

    def open_trainer(self, master_address: str, master_port: int, world_size: int) -> TrainerComm:
        """Rank 0's group, as vLLM's ``trainer_init`` opens it."""
        with self.cv:
            self.endpoints.append(
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "world_size": world_size,
                }
            )
        return TrainerComm(self, master_port)


class TrainerComm:
    """Rank 0's communicator of one group (named by its master port): NCCL's
    ``broadcast(tensor, src, stream=None)``. A broadcast left blocked in an abandoned
    group stays blocked when the servers join a newer group, as with NCCL."""

    def __init__(self, hub: NcclHub, group: Any) -> None:
        self.hub = hub
        self.group = group
        self.destroyed = False

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        assert src == 0, "the trainer is the broadcast's source"
        hub = self.hub
        with hub.cv:
            wait_for(
                lambda: hub.released or hub._all_joined(self.group),
                "every server's worker to join (its /update_weights to arrive)",
                hub.cv,
            )
            if hub.released:
                raise Released("the test released a broadcast its peers never joined")
            hub.sent.append(tensor.clone())

    def destroy(self) -> None:
        self.destroyed = True


class ReplayComm:
    """A worker's communicator: receives, in order, what rank 0 broadcast."""

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self._sent: Iterator[torch.Tensor] = iter(list(sent))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        received = next(self._sent)
        expected = (tuple(tensor.shape), tensor.dtype)
        assert (tuple(received.shape), received.dtype) == expected, (
            f"rank 0 sent {tuple(received.shape)} {received.dtype}, the worker expected "
            f"{expected}: the chunk boundaries differ"
        )
        tensor.copy_(received)

    def destroy(self) -> None:
        pass


class RecordingModel:
    """What vLLM's worker engine loads into: ``load_weights`` keeps a copy of each."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights: Any) -> set[str]:
        self.calls += 1
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


def worker_engine(
    engine_cls: type[Any], backend: str, *, rank: int, world_size: int, model: RecordingModel
) -> Any:
    """vLLM's worker-side engine for one worker of a server (``rank`` of its
    ``world_size`` workers), loading into ``model``."""
    from vllm.config.weight_transfer import WeightTransferConfig

    parallel = SimpleNamespace(data_parallel_index=0, world_size=world_size, rank=rank)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
    return engine_cls(
        WeightTransferConfig(backend=backend), vllm_config, torch.device("cpu"), model
    )


# --------------------------------------------------------------------------- IPC
class IpcHandles:
    """The handle producer and opener (see the module doc)."""

    def __init__(self) -> None:
        self.tensors: dict[bytes, torch.Tensor] = {}
        self.produced = 0
        self.opened = 0

    def reduce_tensor(self, tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        """Like torch's ``reduce_tensor`` for a CUDA tensor: ``(rebuild, args)``."""
        key = uuid.uuid4().bytes
        self.tensors[key] = tensor
        self.produced += 1
        args = (
            type(tensor),
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
            "stand-in storage",
            tensor.dtype,
            0,  # the device index: the receiver overwrites it with its own
            key,
            tensor.untyped_storage().nbytes(),
            0,
            False,
            b"",
            0,
            b"",
            False,
        )
        return self.rebuild_cuda_tensor, args

    def rebuild_cuda_tensor(self, *args: Any) -> torch.Tensor:
        """Like torch's ``rebuild_cuda_tensor``: open a handle (here: the same memory)."""
        self.opened += 1
        return self.tensors[args[7]]


def install_ipc_handles(monkeypatch: pytest.MonkeyPatch) -> IpcHandles:
    from torch.multiprocessing import reductions
    from vllm.distributed.weight_transfer import ipc_engine, packed_tensor

    handles = IpcHandles()
    monkeypatch.setattr(ipc_engine, "reduce_tensor", handles.reduce_tensor)
    monkeypatch.setattr(packed_tensor, "reduce_tensor", handles.reduce_tensor)
    monkeypatch.setattr(ipc_engine, "rebuild_cuda_tensor", handles.rebuild_cuda_tensor)
    # PackedBufferImporter imports it when it opens a packed buffer.
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", handles.rebuild_cuda_tensor)
    return handles


class SharedIpcHandles:
    """CUDA IPC handles across processes, on CPU (see the module doc). A handle has the
    shape of torch's: the device index at position 6, the storage's shared-memory name
    (manager socket, file name, size) at position 7; offsets, sizes and strides are in
    elements as torch's are. The opening process keeps the last few storages it mapped
    (a model's, a packed buffer's), as vLLM's importer keeps its buffer."""

    def __init__(self, keep: int = 8) -> None:
        self.produced = 0
        self.opened = 0
        self._keep = keep
        self._mapped: dict[tuple[bytes, bytes, int], torch.UntypedStorage] = {}

    def reduce_tensor(self, tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        """Like torch's ``reduce_tensor`` for a CUDA tensor: ``(rebuild, args)``."""
        storage = tensor.untyped_storage()
        manager, name, nbytes = storage._share_filename_cpu_()  # in place; once per storage
        self.produced += 1
        args = (
            type(tensor),
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
            "stand-in shared storage",
            tensor.dtype,
            0,  # the device index: the receiver overwrites it with its own
            (manager, name, nbytes),
            nbytes,
            0,
            False,
            b"",
            0,
            b"",
            False,
        )
        return self.rebuild_cuda_tensor, args

    def rebuild_cuda_tensor(self, *args: Any) -> torch.Tensor:
        """Like torch's ``rebuild_cuda_tensor``: map the storage, view the tensor."""
        _cls, size, stride, offset, _kind, dtype, _device, key = args[:8]
        key = (bytes(key[0]), bytes(key[1]), int(key[2]))
        storage = self._mapped.pop(key, None)
        if storage is None:
            storage = torch.UntypedStorage._new_shared_filename_cpu(*key)
        self._mapped[key] = storage  # the most recent last
        while len(self._mapped) > self._keep:
            self._mapped.pop(next(iter(self._mapped)))
        self.opened += 1
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def install_shared_ipc_handles(monkeypatch: pytest.MonkeyPatch) -> SharedIpcHandles:
    """`SharedIpcHandles` where vLLM's IPC engines produce and open handles."""
    from torch.multiprocessing import reductions
    from vllm.distributed.weight_transfer import ipc_engine, packed_tensor

    handles = SharedIpcHandles()
    monkeypatch.setattr(ipc_engine, "reduce_tensor", handles.reduce_tensor)
    monkeypatch.setattr(packed_tensor, "reduce_tensor", handles.reduce_tensor)
    monkeypatch.setattr(ipc_engine, "rebuild_cuda_tensor", handles.rebuild_cuda_tensor)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", handles.rebuild_cuda_tensor)
    return handles
