"""Packing for the ``asyncsync_shm`` trainer side: plan chunks, fill the double buffers,
announce each chunk while the next one is packed.

The trainer packs tensors into bounded, double-buffered POSIX shared-memory segments and
sends plain-JSON update infos (`ShmUpdateFields`). Every
local vLLM server maps the same segment, so the bytes are packed once however many
servers there are. Packing chunk k+1 overlaps the servers loading chunk k.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncsync._transport.wire import (
    DTYPE_SIZES,
    Manifest,
    ShmUpdateFields,
    align,
    nbytes,
)
from asyncsync.backends._options import DEFAULT_BUFFER_BYTES
from asyncsync.backends._segments import Segment
from asyncsync.backends.contract import RoundCancelled, SendStats, check_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "ChunkStream",
    "PlannedChunk",
    "ShmBuffers",
    "dtype_name",
    "manifest_of",
    "plan_chunks",
    "round_fields_of",
    "stream_chunks",
]

_MIB = 1024 * 1024

#: Delivers one chunk's update_info; returns when every server has loaded it.
SendChunk = Callable[[dict[str, Any]], None]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise TypeError(f"dtype {dtype} cannot be sent over asyncsync_shm")
    return name


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


def round_fields_of(source: Any) -> dict[str, Any] | None:
    """What a source asks chunk 0 to carry beside its tensors (a delta chain's round:
    ``ShmUpdateFields.delta``), or None."""
    fields = getattr(source, "round_fields", None)
    return fields() if callable(fields) else None


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class PlannedChunk:
    """Names of one chunk and their offsets inside a buffer."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _group_key(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _layer_groups(names: Sequence[str]) -> list[int]:
    """The layer group of each name: consecutive names sharing a key (``model.layers.N``)
    share a group; a name without one is a group of its own."""
    groups: list[int] = []
    index = -1
    current: tuple[str, int] | None = None
    for name in names:
        key = _group_key(name)
        if key is None or key != current:
            index += 1
        current = key
        groups.append(index)
    return groups


def plan_chunks(
    manifest: Manifest, buffer_bytes: int, *, oversized_alone: bool = False
) -> list[PlannedChunk]:
    """Cut the manifest (in its order) into chunks that fit ``buffer_bytes``.

    Chunks end at layer-group boundaries (``model.layers.N``) when a group fits, so that
    each vLLM layer usually completes within one chunk; a group larger than the buffer
    is split between tensors. A single tensor larger than the buffer is an error, or
    (``oversized_alone``, when nothing is copied into a buffer) a chunk of its own.
    """
    sizes = [nbytes(d, s) for d, s in zip(manifest.dtype_names, manifest.shapes, strict=True)]
    groups = _layer_groups(manifest.names)
    group_bytes: dict[int, int] = {}
    for group, size in zip(groups, sizes, strict=True):
        group_bytes[group] = group_bytes.get(group, 0) + align(size)
    chunks: list[PlannedChunk] = []
    names: list[str] = []
    offsets: list[int] = []
    used, previous = 0, -1
    for name, size, group in zip(manifest.names, sizes, groups, strict=True):
        if size > buffer_bytes and not oversized_alone:
            raise ValueError(
                f"parameter {name!r} needs {size} bytes but the shm buffer holds "
                f"{buffer_bytes}; raise buffer_bytes"
            )
        # Start a group in a fresh chunk rather than split it; never overflow.
        splits_group = group != previous and used + group_bytes[group] > buffer_bytes
        if used and (splits_group or align(used) + size > buffer_bytes):
            chunks.append(PlannedChunk(tuple(names), tuple(offsets), used))
            names, offsets, used = [], [], 0
        offsets.append(align(used))
        names.append(name)
        used, previous = offsets[-1] + size, group
    if names:
        chunks.append(PlannedChunk(tuple(names), tuple(offsets), used))
    return chunks


# --------------------------------------------------------------------------- buffers
class ShmBuffers:
    """Two shared-memory segments of ``buffer_bytes`` each, reused across rounds.

    Reuse keeps the pages touched (packing then runs at memcpy speed); the segments
    are unlinked by `close`, on garbage collection and at interpreter exit.
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
            self._segments.append(self._new_segment(size))
        segment = self._segments[slot]
        if segment.size < want:
            segment.close()
            segment = self._segments[slot] = self._new_segment(size)
        return segment

    def _new_segment(self, size: int) -> Segment:
        """A pre-touched buffer of ``size`` bytes (subclasses may use other memory)."""
        return Segment(size)

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


def _materialize(tensor: Any) -> Any:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


# --------------------------------------------------------------------------- streaming
@dataclass
class _OpenChunk:
    """The chunk being packed: its segment and the tensors placed in it so far."""

    segment: Segment
    pack_started: float
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[Sequence[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    used: int = 0

    def add(self, name: str, tensor: torch.Tensor, offset: int, size: int) -> None:
        _pack(self.segment, offset, tensor)
        self.names.append(name)
        self.dtype_names.append(dtype_name(tensor.dtype))
        self.shapes.append([int(d) for d in tensor.shape])
        self.offsets.append(offset)
        self.used = offset + size


class ChunkStream:
    """Packs ``(name, tensor)`` pairs into the double buffers and sends one update per
    chunk; use once, through `run`.

    State: the chunk being packed (``_open``, index ``_index``), the planned chunk it
    follows when a manifest is known (``_plan_chunk``, ``_position`` in it), and the chunk
    in flight (``_in_flight``). ``send`` runs on a helper thread so that packing chunk k+1
    overlaps chunk k's delivery; buffer ``k % 2`` is reused only after chunk k-2 was
    acknowledged. A set ``cancel`` event stops the stream at the next chunk boundary with
    `RoundCancelled`.
    """

    def __init__(
        self,
        manifest: Manifest | None,
        buffers: ShmBuffers,
        send: SendChunk,
        *,
        cancel: threading.Event | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        self.manifest = manifest
        #: what chunk 0 carries beside the manifest (`round_fields_of`)
        self.fields = fields
        self.buffers = buffers
        self.send = send
        self.cancel = cancel
        self.on_chunk = on_chunk
        self.stats = SendStats()
        self.round_id = uuid.uuid4().hex
        # Planned before anything is packed: bad input is refused before any send.
        self._plan = plan_chunks(manifest, buffers.buffer_bytes) if manifest is not None else None
        self._planned: Iterator[PlannedChunk] = iter(self._plan or ())
        self._plan_chunk: PlannedChunk | None = next(self._planned, None)
        self._position = 0
        self._seen = 0
        self._stream_names: set[str] = set()
        self._index = 0
        self._open: _OpenChunk | None = None
        self._in_flight: Future[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncsync-shm-send")

    def run(self, items: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        try:
            for name, raw in items:
                self._add(name, _materialize(raw))
                del raw  # a gathered tensor is freed before the next one is produced
            self._end()
        except BaseException:
            self._drain()
            raise
        finally:
            self._pool.shutdown(wait=True)
        return self.stats

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        check_tensor(name, tensor)
        self._check_order(name)
        size = tensor.numel() * tensor.element_size()
        chunk, offset = self._place(name, size)
        chunk.add(name, tensor, offset, size)
        planned = self._plan_chunk
        if planned is not None and self._position == len(planned.names):
            following = next(self._planned, None)
            self._emit(last=following is None)
            self._plan_chunk, self._position = following, 0

    def _place(self, name: str, size: int) -> tuple[_OpenChunk, int]:
        """The chunk and offset for the next tensor: the planned ones, or greedily after
        the open chunk's last tensor (sending the open chunk first when it is full)."""
        planned = self._plan_chunk
        if planned is not None:
            chunk = self._open or self._open_chunk(planned.nbytes)
            self._position += 1
            return chunk, planned.offsets[self._position - 1]
        chunk = self._open or self._open_chunk(None)
        offset = align(chunk.used)
        if offset + size <= self.buffers.buffer_bytes:
            return chunk, offset
        if not chunk.names:
            raise ValueError(
                f"parameter {name!r} needs {size} bytes but the shm buffer "
                f"holds {self.buffers.buffer_bytes}; raise buffer_bytes"
            )
        self._emit(last=False)
        return self._open_chunk(None), 0

    def _open_chunk(self, needed: int | None) -> _OpenChunk:
        self._check_cancel()
        # Buffer _index % 2 is free: the chunk that used it was awaited.
        segment = self.buffers.get(self._index, needed)
        self._open = _OpenChunk(segment, time.perf_counter())
        return self._open

    def _emit(self, last: bool) -> None:
        """Announce the open chunk once the previous one was loaded everywhere."""
        chunk = self._open
        assert chunk is not None
        info = ShmUpdateFields(
            round=self.round_id,
            chunk=self._index,
            last=last,
            num_chunks=len(self._plan) if self._plan is not None else None,
            segment=chunk.segment.name,
            segment_size=chunk.segment.size,
            owner_pid=chunk.segment.owner_pid,
            fd=chunk.segment.fd,
            names=chunk.names,
            dtype_names=chunk.dtype_names,
            shapes=chunk.shapes,
            offsets=chunk.offsets,
            manifest=self.manifest.to_json() if (self._index == 0 and self.manifest) else None,
            delta=self.fields if self._index == 0 else None,
        ).to_json()
        self.stats.pack_seconds += time.perf_counter() - chunk.pack_started
        self._wait_in_flight()  # chunk k-1 must be loaded before chunk k is announced
        self._check_cancel()
        self.stats.chunks += 1
        self.stats.bytes += chunk.used
        self.stats.params += len(chunk.names)
        if self.on_chunk is not None:
            self.on_chunk(self.stats.chunks, self.stats.bytes)
        self._in_flight = self._pool.submit(self.send, info)
        self._index += 1
        self._open = None

    def _end(self) -> None:
        """After the last tensor: every announced one came, the last chunk is sent and
        loaded."""
        expected = self.manifest.names if self.manifest is not None else None
        if expected is not None and self._seen != len(expected):
            raise ValueError(
                f"weights yielded {self._seen} tensors but {len(expected)} were announced"
            )
        if self._plan_chunk is None and self._open is not None and self._open.names:
            self._emit(last=True)
        elif self._plan is None and self._index == 0:
            raise ValueError("no weights to publish: the source yielded nothing")
        self._wait_in_flight()

    def _check_order(self, name: str) -> None:
        expected = self.manifest.names if self.manifest is not None else None
        if expected is None:  # a stream: no manifest to refuse a repeated name
            if name in self._stream_names:
                raise ValueError(f"parameter {name!r} appears twice in the weights")
            self._stream_names.add(name)
        seen = self._seen
        if expected is not None and (seen >= len(expected) or name != expected[seen]):
            want = expected[seen] if seen < len(expected) else "<end>"
            raise ValueError(
                f"weights yielded {name!r} where {want!r} was announced; the "
                "iteration order must match the metadata"
            )
        self._seen += 1

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise RoundCancelled("publish cancelled at a chunk boundary")

    def _wait_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _drain(self) -> None:
        """Let a chunk in flight finish: its buffer is ours until the servers answer."""
        if self._in_flight is not None:
            with contextlib.suppress(BaseException):  # the original error matters
                self._in_flight.result()


def stream_chunks(
    items: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest | None,
    buffers: ShmBuffers,
    send: SendChunk | None,
    *,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    fields: dict[str, Any] | None = None,
) -> SendStats:
    """Pack ``items`` into the double buffers and call ``send(update_info)`` per chunk
    (see `ChunkStream`; ``fields``: what chunk 0 carries, `round_fields_of`).
    ``send=None`` means a non-sender rank: tensors are still
    materialized (collectives stay aligned), nothing is packed or sent."""
    if send is None:
        stats = SendStats()
        for _name, tensor in items:
            _materialize(tensor)
            stats.params += 1
        return stats
    stream = ChunkStream(manifest, buffers, send, cancel=cancel, on_chunk=on_chunk, fields=fields)
    return stream.run(items)
