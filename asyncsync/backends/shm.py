"""Trainer side of the ``asyncsync_shm`` backend: CPU shared memory, no pickle.

Packing lives in :mod:`asyncsync.backends._shm_pack`; this module offers it in the two
shapes of vLLM's trainer engines, so that asyncsync's bridge is exercised exactly as with
vLLM's own engines:

- vLLM 0.3x style: :meth:`ShmTrainerEngine.trainer_init` with a synchronous
  ``VLLMWeightSyncClient`` (four methods), then :meth:`ShmTrainerEngine.send_weights`
  drives start -> update(s) -> finish through it.
- vLLM 0.23 style: :func:`trainer_send_weights` ``(iterator, ShmTrainerSendWeightsArgs)``
  calls ``args.send_mode(update_info)`` once per chunk on rank 0; the caller drives
  start/finish.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from asyncsync.backends._base import RoundCancelled, SendStats
from asyncsync.backends._shm_pack import (
    DEFAULT_BUFFER_BYTES,
    ShmBuffers,
    manifest_of,
    plan_chunks,
    stream_chunks,
)
from asyncsync.backends._wire import BACKEND_NAME, Manifest, ShmInitFields

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "RoundCancelled",
    "SendStats",
    "ShmBuffers",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmTrainerSendWeightsArgs",
    "StartOnFirstChunk",
    "SyncWeightClient",
    "manifest_of",
    "plan_chunks",
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


# --------------------------------------------------------------------------- 0.3x style
@dataclass
class ShmTrainerInitInfo:
    """Trainer-side init info (vLLM 0.3x ``TrainerInitInfo`` shape)."""

    backend: ClassVar[str] = BACKEND_NAME
    rank: int = 0
    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class ShmTrainerEngine:
    """Trainer engine in vLLM 0.3x's shape: ``trainer_init`` then ``send_weights``.

    ``source`` yields ``(name, tensor)``; when it has ``metadata()`` (a list of
    ``(name, dtype, shape)``-like entries, e.g. vLLM's ``ModuleSource``) the round's
    manifest is sent with chunk 0 so workers validate before loading anything.
    """

    def __init__(
        self,
        *,
        client: SyncWeightClient,
        source: Any,
        is_sender: bool,
        buffers: ShmBuffers,
        cancel: threading.Event | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        self.client = client
        self.source = source
        #: the source's manifest when the caller already knows it (else read at send)
        self.manifest = manifest
        self.is_sender = is_sender
        self.buffers = buffers
        self.cancel = cancel
        self.on_chunk: Callable[[int, int], None] | None = None
        self.last_stats: SendStats | None = None

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
        self.last_stats = stream_chunks(  # plans first: bad input is refused before start
            items,
            manifest,
            self.buffers,
            StartOnFirstChunk(self.client.start_weight_update, self.client.update_weights),
            cancel=self.cancel,
            on_chunk=self.on_chunk,
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


def trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
    trainer_args: ShmTrainerSendWeightsArgs,
) -> None:
    """0.23-style static send: every rank iterates, rank 0 packs and calls send_mode."""
    send = trainer_args.send_mode if trainer_args.rank == 0 else None
    stats = stream_chunks(
        iterator,
        trainer_args.manifest,
        trainer_args.buffers,
        send,
        cancel=trainer_args.cancel,
        on_chunk=trainer_args.on_chunk,
    )
    if trainer_args.stats is not None:
        trainer_args.stats.__dict__.update(stats.__dict__)
