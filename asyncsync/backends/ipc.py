"""The ``"ipc"`` backend: vLLM's own CUDA IPC weight transfer, driven by asyncsync.

Trainer and servers share the GPUs: the trainer hands the servers CUDA IPC handles to
its tensors (or to a packed staging buffer) and each server's workers open them and load
the weights, with no copy over a network. The servers run vLLM's built-in engine
(``--weight-transfer-config '{"backend": "ipc"}'``); the trainer side is vLLM's too, in
whichever API the installed vLLM offers (`asyncsync._vllm.caps.installed_trainer_api`):
``WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(...), client=...,
source=...)`` then ``send_weights()`` (vLLM 0.28 and later), or the static
``IPCWeightTransferEngine.trainer_send_weights(iterator, IPCTrainerSendWeightsArgs(
send_mode=<callback>, ...))`` whose rank-0 callback asyncsync bridges to the loop (vLLM
0.23-0.27).

Packed or not: ``IPC(packed=None)`` (the default) chooses per round from the model
(`packed_by_default`, docs/transports/ipc.md): packing saves 0.04-0.09 ms a tensor
(one handle to make and open per chunk instead of per tensor) and costs 0.8-2.6 ms a GB
(a copy of every byte into the staging buffer and the servers' clone of it), so many
small tensors are packed and a few large ones are not. An explicit ``packed=True`` or
``False`` always wins.

Over HTTP the handles can only travel pickled (``ipc_handles_pickled``), and vLLM's
servers unpickle them only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: whoever can
reach a server's ``/update_weights`` can then run code in it. The backend therefore
needs ``allow_insecure_serialization=True``, and a server without the variable fails the
round with an error that says what to set. Multi-rank trainers: every rank runs vLLM's
engine (its handle all-gather is a collective); only rank 0 calls the servers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncsync.backends._ceiling import device_copy_ceiling
from asyncsync.backends._ipc_handles import encode_ipc_update
from asyncsync.backends._options import (
    DEFAULT_PACKED_BUFFER_BYTES,
    INSECURE_SERIALIZATION_OPT_IN,
    IPC,
)
from asyncsync.backends._vllm_drive import (
    EngineClient,
    VllmEngineBackend,
    VllmSource,
    explain_insecure_serialization,
)
from asyncsync.backends.contract import Ceiling, SendControl, SendStats, TrainerApi

if TYPE_CHECKING:
    from asyncsync.backends.contract import SyncFleetClient, WeightSource

__all__ = [
    "INSECURE_SERIALIZATION_OPT_IN",
    "PACK_MEAN_BYTES",
    "PACK_MIN_TENSORS",
    "IpcBackend",
    "packed_by_default",
]

logger = logging.getLogger("asyncsync.publish")

#: The packing rule (docs/transports/ipc.md): pack a round of at least this many
#: tensors...
PACK_MIN_TENSORS = 64
#: ...whose mean size is under this many bytes. From rounds of a dense model (51
#: tensors, 4 GB) and an MoE-like one (9,314-9,339 tensors, 5.1-5.3 GB) on one H200 with
#: vLLM 0.32's engines (docs/performance.md): packing saves d a tensor and costs c a GB;
#: it pays below d / c = 33 MB (vLLM's own client, the issue's run), 36 MB (vLLM's own
#: client) and 58 MB (asyncsync) a tensor (this project's run).
PACK_MEAN_BYTES = 32 * 1024 * 1024


def packed_by_default(tensors: int | None, nbytes: int | None) -> bool:
    """Whether a round of ``tensors`` tensors holding ``nbytes`` in all goes packed when
    ``IPC(packed=None)``: yes when there are at least `PACK_MIN_TENSORS` and their mean
    size is under `PACK_MEAN_BYTES`. Weights that cannot describe themselves (a stream,
    None) go packed: their count is unknown, and packed holds one buffer where unpacked
    holds every tensor until the round ends."""
    if tensors is None or nbytes is None:
        return True
    return tensors >= PACK_MIN_TENSORS and nbytes < tensors * PACK_MEAN_BYTES


class IpcBackend(VllmEngineBackend):
    """``"ipc"``: vLLM's CUDA IPC engine (servers run ``{"backend": "ipc"}`` with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

    Options: ``allow_insecure_serialization`` (required, see the module docstring),
    ``packed`` (vLLM's packed mode: tensors copied into one reused staging buffer of
    ``packed_buffer_size_bytes``, one update per chunk; or one update carrying a handle
    per tensor, no copy; None: chosen per round by `packed_by_default`, the buffer then
    at most the model's size). `last_packed` says what the last round did. The installed
    vLLM decides which of its trainer APIs runs (``publisher.api`` says which); ``api``
    is not consulted.
    """

    name = "ipc"
    options_class = IPC
    server_backend = "ipc"

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        allow_insecure_serialization: bool = False,
        packed: bool | None = None,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
    ) -> None:
        if allow_insecure_serialization is not True:
            raise ValueError(INSECURE_SERIALIZATION_OPT_IN)
        super().__init__(rank=rank, world_size=world_size, api=api)
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        #: whether the last round went packed (None before the first)
        self.last_packed: bool | None = None
        self._engine: Any = None
        #: the servers the engine was initialized for, and its (packed, buffer size)
        self._members: list[str] | None = None
        self._mode: tuple[bool, int] = (bool(packed), packed_buffer_size_bytes)

    def init_info(self) -> Mapping[str, Any]:
        # vLLM 0.28+ sends the packed flag itself (trainer_init); 0.23-0.27 take none.
        return {}

    def servers_restarted(self, urls: Sequence[str]) -> None:
        """A restarted server's engine was never initialized: the next send does."""
        if urls:
            self._members = None

    # ------------------------------------------------------------------ init
    def init(self, client: SyncFleetClient) -> None:
        self._connect(client, list(client.world_sizes()), self._mode)

    def _connect(self, client: SyncFleetClient, members: list[str], mode: tuple[bool, int]) -> None:
        drive = EngineClient(client)
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()
        self._mode = mode
        if self.api == "engine":
            self._engine = self._trainer_init(drive)
        else:
            drive.init_weight_transfer_engine(dict(self.init_info()))
        self._members = members

    def _trainer_init(self, client: EngineClient) -> Any:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        packed, buffer_bytes = self._mode
        info = IPCTrainerInitInfo(
            packed=packed, packed_buffer_size_bytes=buffer_bytes, rank=self.rank
        )
        return self.factory_init(info, client)

    def round_mode(self, source: WeightSource) -> tuple[bool, int]:
        """This round's (packed, staging buffer size): the options when ``packed`` was
        given, else `packed_by_default` of the weights' metadata (the buffer then at
        most the model's size)."""
        if self.packed is not None:
            return self.packed, self.packed_buffer_size_bytes
        meta = source.metadata()
        if meta is None:
            return True, self.packed_buffer_size_bytes
        nbytes = source.total_bytes()
        if nbytes is None or not packed_by_default(len(meta), nbytes):
            return False, self.packed_buffer_size_bytes
        return True, max(1, min(self.packed_buffer_size_bytes, nbytes))

    # ------------------------------------------------------------------ a round
    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        weights = VllmSource(source)
        mode = self.round_mode(source)
        if mode != self._mode:
            logger.info(
                "backend 'ipc': this round goes %s (docs/transports/ipc.md)",
                "packed" if mode[0] else "unpacked, one handle per tensor",
            )
        self.last_packed = mode[0]
        if client is None:
            return self._send_non_sender(weights, mode)
        members = list(client.world_sizes())
        fresh = self.api == "engine" and self._engine is None
        if self._members != members or fresh or mode != self._mode:
            self._connect(client, members, mode)
        drive = EngineClient(
            client,
            control=control,
            encode=encode_ipc_update,
            cancel_updates=True,
            explain=explain_insecure_serialization,
        )
        if self.api == "engine":
            self._engine.client, self._engine.source = drive, weights
            self._engine.send_weights()
        else:
            self._send_static(weights, drive)
        return SendStats(chunks=drive.updates, bytes=drive.bytes, params=self._params(source))

    def _send_static(self, weights: VllmSource, client: EngineClient) -> None:
        """vLLM 0.23-0.27: start; vLLM's static send calls the rank-0 callback once per
        payload (it must return only when every server loaded it: the buffer is reused
        next); finish with the version."""
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerSendWeightsArgs,
            IPCWeightTransferEngine,
        )

        fields = {f.name for f in dataclasses.fields(IPCTrainerSendWeightsArgs)}
        if "send_mode" not in fields:
            import vllm

            from asyncsync._core.errors import UnsupportedVLLMError

            raise UnsupportedVLLMError(
                str(getattr(vllm, "__version__", "unknown")),
                "its IPCTrainerSendWeightsArgs takes no send_mode callback (only its own "
                "'http'/'ray' modes)",
            )

        def send_mode(update_info: Any) -> None:
            info = (
                dataclasses.asdict(update_info)
                if dataclasses.is_dataclass(update_info) and not isinstance(update_info, type)
                else dict(update_info)
            )
            client.update_weights(info)

        options: dict[str, Any] = {"send_mode": send_mode}
        packed, buffer_bytes = self._mode
        if "packed" in fields:
            options["packed"] = packed
        if "packed_buffer_size_bytes" in fields:
            options["packed_buffer_size_bytes"] = buffer_bytes
        args = IPCTrainerSendWeightsArgs(**options)
        client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(weights), args)
        client.finish_weight_update()

    def _send_non_sender(self, weights: VllmSource, mode: tuple[bool, int]) -> SendStats:
        """Rank > 0: vLLM's engine iterates the weights and joins the handle
        all-gather; it calls no server."""
        if self.api == "engine":
            if self._engine is None or mode != self._mode:
                if self._engine is not None:
                    self._engine.shutdown()
                self._mode = mode
                self._engine = self._trainer_init(EngineClient(None))
            self._engine.source = weights
            self._engine.send_weights()
        else:
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerSendWeightsArgs,
                IPCWeightTransferEngine,
            )

            def refuse(_: Any) -> None:
                raise RuntimeError("a trainer rank other than 0 tried to send")

            fields = {f.name for f in dataclasses.fields(IPCTrainerSendWeightsArgs)}
            options: dict[str, Any] = {"send_mode": refuse}
            if "packed" in fields:
                options["packed"] = mode[0]
            IPCWeightTransferEngine.trainer_send_weights(
                iter(weights), IPCTrainerSendWeightsArgs(**options)
            )
        return SendStats()

    @staticmethod
    def _params(source: WeightSource) -> int:
        meta = source.metadata()
        return len(meta) if meta is not None else 0

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """A device-to-device copy on the trainer's GPU: the servers open the trainer's
        memory and copy out of it on the same device (packed: twice more)."""
        del urls
        return device_copy_ceiling()

    def close(self) -> None:
        engine, self._engine, self._members = self._engine, None, None
        if engine is not None:
            engine.shutdown()
