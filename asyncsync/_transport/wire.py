"""Wire types shared by the trainer side and the vLLM plugin (plain JSON, no pickle).

Imported by `asyncsync.backends` (trainer side) and `asyncsync.vllm_plugin`
(worker side, inside vLLM): it imports neither torch nor vLLM. The plugin's vLLM-facing
info classes subclass vLLM's bases *and* the dataclasses here, so both sides read and
write the same fields.

``asyncsync_shm`` rounds are ``start -> update(chunk 0) ... update(chunk n-1) -> finish``.
Each update_info is a JSON object (`ShmUpdateFields`):

``{"round": str, "chunk": int, "last": bool, "num_chunks": int | None, "segment": str,
"segment_size": int, "owner_pid": int, "fd": int, "names": [...], "dtype_names": [...],
"shapes": [[...]], "offsets": [...], "manifest": {...} | None, "abort": false}``

- ``segment`` names a shared-memory segment (an anonymous memfd named
  ``asyncsync-<pid>-<16 hex>``) owned by the trainer ``owner_pid``, which holds it open
  as file descriptor ``fd``: a worker opens ``/proc/<owner_pid>/fd/<fd>`` and checks
  that it links to ``memfd:<segment>`` before mapping it. Nothing is ever named in
  /dev/shm, so a trainer that dies leaves no file behind. The tensor ``names[i]`` lies
  at byte ``offsets[i]`` with ``dtype_names[i]`` and ``shapes[i]``, C-contiguous.
- Chunk 0 carries the ``manifest`` of the whole round (every name with its dtype and
  shape), so that a worker validates the round *before it loads anything*.
- Zero-copy chunks (the trainer's own tensors, already in shared memory) leave the single
  ``segment`` fields empty and list ``segments`` instead: ``[{"segment": str,
  "segment_size": int, "owner_pid": int, "fd": int}, ...]``, one per shared-memory file
  the chunk's tensors live in, with ``segment_of[i]`` the index of the file that holds
  ``names[i]`` at byte ``offsets[i]`` (aligned to its element size; tensors may share
  bytes, as tied weights do). A segment is then either an asyncsync memfd
  (``asyncsync.share_weights``) or a deleted ``/dev/shm/torch_<pid>_<n>_<n>`` file that
  torch's ``share_memory_()`` keeps open; either is owner-only and opened through
  ``/proc/<owner_pid>/fd/<fd>`` like a packed chunk's segment.
- Rounds of a delta chain (``publish(..., delta=True)``) carry ``delta`` in chunk 0:
  ``{"mode": "mirror", "version": V}`` (a full round the worker also keeps in its
  mirror) or ``{"mode": "delta", "version": V, "base": P, "base_digest": int,
  "manifest": {...}}`` (every tensor of the model; the chunk entries are patch payloads
  of the changed ones, uint8, see `asyncsync._transport.delta_codec`). The key is sent
  only when set, so rounds outside a chain keep the older wire.
- ``{"abort": true, "round": "abort"}`` ends a round that the trainer gave up on: the
  worker restores what it can and fails the call, which makes vLLM clear its
  active-update flag.

The init_info (`ShmInitFields`) carries `PROTOCOL_VERSION`; a worker that
speaks another version refuses it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncsync._core.errors import AsyncSyncError

__all__ = [
    "ALIGNMENT",
    "BACKEND_NAME",
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "SEGMENT_NAME",
    "Manifest",
    "SegmentRef",
    "ShmFormatError",
    "ShmInitFields",
    "ShmUpdateFields",
    "align",
    "segment_links",
    "segment_path",
    "validate_chunk_layout",
    "validate_segments_layout",
]

#: Version of the trainer <-> plugin protocol, sent in every init_info; both sides of a
#: publish must run the same asyncsync protocol (3: zero-copy chunks, ``segments``).
PROTOCOL_VERSION = 3

#: vLLM ``--weight-transfer-config`` backend name under which the plugin registers.
BACKEND_NAME = "asyncsync_shm"

#: Byte alignment of every tensor inside a segment.
ALIGNMENT = 64

#: Element size of each dtype name accepted on the wire (vLLM's dtype naming).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


#: What a segment name looks like; a worker maps nothing else: asyncsync's memfds, and
#: (zero-copy only) the deleted /dev/shm files of torch's ``share_memory_()``.
SEGMENT_NAME = re.compile(r"asyncsync-[0-9]+-[0-9a-f]{16}|torch_[0-9]+_[0-9]+_[0-9]+")


class ShmFormatError(AsyncSyncError, ValueError):
    """An update_info does not fit the shm wire format or the model it targets."""


def segment_path(segment: str, owner_pid: int, fd: int) -> str:
    """Where a process of the trainer's user opens segment ``segment``
    (``/proc/<owner_pid>/fd/<fd>``), after checking the three fields' shape."""
    if not SEGMENT_NAME.fullmatch(segment):
        raise ShmFormatError(f"segment name {segment!r} is not an asyncsync segment")
    if owner_pid <= 0 or fd < 0:
        raise ShmFormatError(
            f"segment {segment!r}: owner_pid {owner_pid} and fd {fd} do not name a descriptor"
        )
    return f"/proc/{owner_pid}/fd/{fd}"


def segment_links(segment: str) -> tuple[str, ...]:
    """What ``/proc/<pid>/fd/<fd>`` may link to for segment ``segment``: an asyncsync
    memfd, or (torch's) a /dev/shm file already unlinked, so that no name is left."""
    if segment.startswith("torch_"):
        return (f"/dev/shm/{segment} (deleted)",)
    return (f"/memfd:{segment} (deleted)", f"/memfd:{segment}")


def align(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def nbytes(dtype_name: str, shape: Sequence[int]) -> int:
    try:
        size = DTYPE_SIZES[dtype_name]
    except KeyError:
        raise ShmFormatError(
            f"unsupported dtype {dtype_name!r}; supported: {sorted(DTYPE_SIZES)}"
        ) from None
    return size * numel(shape)


@dataclass(frozen=True)
class Manifest:
    """Every parameter of one round: name -> (dtype name, shape)."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ShmFormatError(
                f"manifest lists differ in length: {len(self.names)} names, "
                f"{len(self.dtype_names)} dtype_names, {len(self.shapes)} shapes"
            )
        for i, name in enumerate(self.names):
            if name in self._index:
                raise ShmFormatError(f"parameter {name!r} appears twice in the manifest")
            self._index[name] = i

    @classmethod
    def from_entries(cls, entries: Iterable[tuple[str, str, Sequence[int]]]) -> Manifest:
        names, dtypes, shapes = [], [], []
        for name, dtype_name, shape in entries:
            names.append(name)
            dtypes.append(dtype_name)
            shapes.append(tuple(int(d) for d in shape))
        return cls(tuple(names), tuple(dtypes), tuple(shapes))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            names = [str(n) for n in data["names"]]
            dtypes = [str(d) for d in data["dtype_names"]]
            shapes = [tuple(int(x) for x in s) for s in data["shapes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ShmFormatError(f"malformed manifest: {exc!r}") from exc
        return cls(tuple(names), tuple(dtypes), tuple(shapes))

    def to_json(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
        }

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.names)

    def entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        i = self._index[name]
        return self.dtype_names[i], self.shapes[i]

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(d, s) for d, s in zip(self.dtype_names, self.shapes, strict=True))


@dataclass
class ShmInitFields:
    """The ``asyncsync_shm`` init_info (``/init_weight_transfer_engine``)."""

    protocol: int = PROTOCOL_VERSION
    trainer_pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "trainer_pid": self.trainer_pid}

    def check_protocol(self) -> None:
        """Refuse a trainer that speaks another protocol version."""
        if self.protocol != PROTOCOL_VERSION:
            raise ValueError(
                f"{BACKEND_NAME}: trainer speaks protocol {self.protocol}, this worker "
                f"speaks {PROTOCOL_VERSION}; install the same asyncsync on both sides"
            )


@dataclass(frozen=True)
class SegmentRef:
    """One shared-memory file a zero-copy chunk reads: its name, size in bytes, and the
    descriptor ``fd`` through which its owner ``owner_pid`` holds it."""

    segment: str
    segment_size: int
    owner_pid: int
    fd: int

    def to_json(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "segment_size": self.segment_size,
            "owner_pid": self.owner_pid,
            "fd": self.fd,
        }

    @classmethod
    def parse(cls, data: Any) -> SegmentRef:
        if isinstance(data, SegmentRef):
            return data
        try:
            return cls(
                segment=str(data["segment"]),
                segment_size=int(data["segment_size"]),
                owner_pid=int(data["owner_pid"]),
                fd=int(data["fd"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShmFormatError(f"malformed segment entry {data!r:.200}: {exc!r}") from exc

    @property
    def path(self) -> str:
        return segment_path(self.segment, self.owner_pid, self.fd)


@dataclass
class ShmUpdateFields:
    """One ``asyncsync_shm`` update_info: a chunk of tensors in a segment (or an abort)."""

    round: str = ""
    chunk: int = 0
    last: bool = False
    num_chunks: int | None = None
    segment: str = ""
    segment_size: int = 0
    owner_pid: int = 0
    fd: int = -1
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[Sequence[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    abort: bool = False
    #: zero-copy chunks: the files the tensors live in, and which one holds each tensor
    segments: list[SegmentRef] | None = None
    segment_of: list[int] | None = None
    #: chunk 0 of a delta chain's round (see the module docstring)
    delta: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object sent as ``update_info`` (lists are shared, not copied)."""
        out = self._json()
        if self.delta is not None:
            out["delta"] = self.delta
        return out

    def _json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "chunk": self.chunk,
            "last": self.last,
            "num_chunks": self.num_chunks,
            "segment": self.segment,
            "segment_size": self.segment_size,
            "owner_pid": self.owner_pid,
            "fd": self.fd,
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
            "offsets": self.offsets,
            "manifest": self.manifest,
            "abort": self.abort,
            "segments": None if self.segments is None else [s.to_json() for s in self.segments],
            "segment_of": self.segment_of,
        }

    @staticmethod
    def abort_json() -> dict[str, Any]:
        """The update a worker rejects on purpose to end an open round (vLLM clears its
        active-update flag when an update fails)."""
        return {"abort": True, "round": "abort"}

    @classmethod
    def parse(cls, info: Mapping[str, Any] | ShmUpdateFields) -> ShmUpdateFields:
        """A normalized copy of ``info`` (a JSON object, or an instance built by vLLM
        with ``cls(**update_info)``): strings, ints and shape tuples, checked."""
        get = info.get if isinstance(info, Mapping) else lambda key, default: getattr(info, key)
        try:
            return cls(
                round=str(get("round", "") or ""),
                chunk=int(get("chunk", 0)),
                last=bool(get("last", False)),
                num_chunks=get("num_chunks", None),
                segment=str(get("segment", "")),
                segment_size=int(get("segment_size", 0)),
                owner_pid=int(get("owner_pid", 0)),
                fd=int(get("fd", -1)),
                names=[str(n) for n in get("names", [])],
                dtype_names=[str(d) for d in get("dtype_names", [])],
                shapes=[tuple(int(x) for x in s) for s in get("shapes", [])],
                offsets=[int(o) for o in get("offsets", [])],
                manifest=get("manifest", None),
                abort=bool(get("abort", False)),
                segments=_segments(get("segments", None)),
                segment_of=_optional_ints(get("segment_of", None)),
                delta=get("delta", None),
            )
        except (TypeError, ValueError) as exc:
            raise ShmFormatError(f"malformed update_info: {exc!r}") from exc

    def round_manifest(self) -> Manifest | None:
        """The round's manifest carried by chunk 0, if any."""
        return Manifest.from_json(self.manifest) if self.manifest else None

    @property
    def zero_copy(self) -> bool:
        """Whether the chunk's tensors are read in place from the trainer's own memory."""
        return self.segments is not None


def _segments(raw: Any) -> list[SegmentRef] | None:
    return None if raw is None else [SegmentRef.parse(s) for s in raw]


def _optional_ints(raw: Any) -> list[int] | None:
    return None if raw is None else [int(i) for i in raw]


def validate_chunk_layout(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    segment_size: int,
) -> None:
    """Check that a chunk's tensors are well-formed, aligned, inside the segment and
    do not overlap. Raises `ShmFormatError` naming the offending parameter."""
    n = len(names)
    if not (len(dtype_names) == len(shapes) == len(offsets) == n):
        raise ShmFormatError(
            f"chunk lists differ in length: {n} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes, {len(offsets)} offsets"
        )
    spans = []
    for name, dtype_name, shape, offset in zip(names, dtype_names, shapes, offsets, strict=True):
        if any(int(d) < 0 for d in shape):
            raise ShmFormatError(f"parameter {name!r}: negative dimension in shape {list(shape)}")
        size = nbytes(dtype_name, shape)
        if offset < 0 or offset % ALIGNMENT:
            raise ShmFormatError(f"parameter {name!r}: offset {offset} is not {ALIGNMENT}-aligned")
        if offset + size > segment_size:
            raise ShmFormatError(
                f"parameter {name!r}: bytes [{offset}, {offset + size}) exceed the "
                f"segment size {segment_size}"
            )
        spans.append((offset, offset + size, name))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise ShmFormatError(f"parameters {first!r} and {second!r} overlap in the segment")


def validate_segments_layout(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    segments: Sequence[SegmentRef],
    segment_of: Sequence[int] | None,
) -> None:
    """A zero-copy chunk's layout: every tensor inside the file that holds it, at an
    offset aligned to its element size. Tensors may share bytes (tied weights): they are
    only read. Raises `ShmFormatError` naming the offending parameter."""
    n = len(names)
    if segment_of is None or not (
        len(dtype_names) == len(shapes) == len(offsets) == len(segment_of) == n
    ):
        raise ShmFormatError(
            f"zero-copy chunk lists differ in length: {n} names, {len(dtype_names)} "
            f"dtype_names, {len(shapes)} shapes, {len(offsets)} offsets, "
            f"{None if segment_of is None else len(segment_of)} segment_of"
        )
    for name, dtype_name, shape, offset, index in zip(
        names, dtype_names, shapes, offsets, segment_of, strict=True
    ):
        if not 0 <= index < len(segments):
            raise ShmFormatError(
                f"parameter {name!r}: segment index {index} outside the chunk's "
                f"{len(segments)} segment(s)"
            )
        if any(int(d) < 0 for d in shape):
            raise ShmFormatError(f"parameter {name!r}: negative dimension in shape {list(shape)}")
        size = nbytes(dtype_name, shape)
        if offset < 0 or offset % DTYPE_SIZES[dtype_name]:
            raise ShmFormatError(
                f"parameter {name!r}: offset {offset} is not aligned to its {dtype_name} elements"
            )
        segment = segments[index]
        if offset + size > segment.segment_size:
            raise ShmFormatError(
                f"parameter {name!r}: bytes [{offset}, {offset + size}) exceed the size "
                f"{segment.segment_size} of segment {segment.segment!r}"
            )
