"""Zero-copy shm rounds: servers read the trainer's own tensors where they already live in
shared memory, and the pack (a copy of every byte) disappears.

Where the memory comes from:

- `share_weights` moves a module's parameters into one asyncsync memfd (mode 0600,
  named ``asyncsync-<pid>-<16 hex>``, never a name in /dev/shm), held by the tensors'
  own storage: the memory lives exactly as long as the parameters do.
- ``module.share_memory()`` (torch's default ``file_descriptor`` strategy) puts each
  storage in a /dev/shm file that torch unlinks at once and keeps open (mode 0600).

`SharedMemoryIndex` finds, for a tensor, the file that holds it and the
descriptor through which this process holds that file (``/proc/self/maps`` and
``/proc/self/fd``, read once per round); servers open it as ``/proc/<pid>/fd/<fd>``,
exactly as they open a packed chunk's segment (see docs/security.md).

The safety rule: the servers read the trainer's live weights during the whole round,
so they must not change until ``publish`` returns. `send_in_place` checks what it
can: each tensor's version counter (``tensor._version``, moved by every in-place torch
operation that autograd tracks) is read when the round is announced and again after
every chunk is loaded; a moved counter fails the round with
`WeightsModifiedError` before ``finish``, so torn weights are never
published.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncsync._core.errors import AsyncSyncError, WeightsModifiedError
from asyncsync._transport.wire import (
    ALIGNMENT,
    SEGMENT_NAME,
    Manifest,
    SegmentRef,
    ShmUpdateFields,
    align,
)
from asyncsync.backends._options import ZeroCopyMode, check_zero_copy_mode
from asyncsync.backends._segments import SEGMENT_PREFIX
from asyncsync.backends._shm_pack import SendChunk, dtype_name, plan_chunks
from asyncsync.backends.contract import RoundCancelled, SendStats, check_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "InPlaceRound",
    "NotInSharedMemory",
    "SharedMemoryIndex",
    "ZeroCopyMode",
    "check_zero_copy_mode",
    "place",
    "send_in_place",
    "share_weights",
]

#: ``zero_copy`` option of the shm backend: never (pack), always (every tensor must
#: live in shared memory), or when every tensor does.

_HOW = (
    "call asyncsync.share_weights(model) (or model.share_memory()) before publishing, "
    "or publish with zero_copy=False"
)


class NotInSharedMemory(AsyncSyncError, ValueError):
    """A tensor servers cannot read in place (``zero_copy="auto"`` then packs)."""


# --------------------------------------------------------------------------- memory
def share_weights(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module``'s parameters into one asyncsync shared-memory segment, in place,
    and return the module, so that ``publish(module, ...)`` with ``zero_copy`` lets the
    servers read them where they are.

    The segment is an anonymous memfd (owner-only, never a name in /dev/shm) held by the
    parameters' storage: it is freed when the parameters are. Parameters keep their
    identity (optimizers built before or after keep working), values, shapes, strides
    and the sharing between them (tied weights stay tied). CPU parameters only.
    """
    import torch

    params = list(module.parameters())
    storages: dict[int, tuple[Any, int]] = {}  # data_ptr -> (storage, offset in segment)
    size = 0
    for p in params:
        if p.device.type != "cpu":
            raise ValueError(f"share_weights moves CPU parameters; one is on {p.device}")
        storage = p.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (storage, size)
            size = align(size + storage.nbytes(), ALIGNMENT)
    if not params:
        return module
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)  # owner only (memfds start as 0777)
        os.ftruncate(fd, max(size, 1))
        # torch keeps its own duplicate of the descriptor for as long as the storage
        # lives (what torch.multiprocessing uses to rebuild shared storages).
        shared = torch.UntypedStorage._new_shared_fd_cpu(fd, max(size, 1))
    finally:
        os.close(fd)
    whole = torch.empty(0, dtype=torch.uint8).set_(shared)
    for storage, offset in storages.values():
        count = storage.nbytes()
        if count:
            src = torch.empty(0, dtype=torch.uint8).set_(storage)
            whole[offset : offset + count].copy_(src)
    with torch.no_grad():
        for p in params:
            _, offset = storages[p.untyped_storage().data_ptr()]
            item = p.element_size()
            moved = torch.empty(0, dtype=p.dtype).set_(
                shared, offset // item + p.storage_offset(), p.shape, p.stride()
            )
            p.data = moved
    return module


@dataclass(frozen=True)
class _Region:
    """One shared mapping of this process: ``[start, end)`` maps file (dev, inode) from
    byte ``file_offset``."""

    start: int
    end: int
    file_offset: int
    file: tuple[int, int]
    path: str


_MEMFD = re.compile(rf"/memfd:({SEGMENT_PREFIX}[0-9]+-[0-9a-f]{{16}})(?: \(deleted\))?")
_TORCH = re.compile(r"/dev/shm/(torch_[0-9]+_[0-9]+_[0-9]+)( \(deleted\))?")


def _segment_name(path: str) -> tuple[str | None, str]:
    """The segment name a mapped path or descriptor link stands for, or None and why
    it cannot be handed to a server."""
    match = _MEMFD.fullmatch(path)
    if match:
        return match.group(1), ""
    match = _TORCH.fullmatch(path)
    if match and match.group(2):
        return match.group(1), ""
    if match:
        return None, (
            f"it lies in {path}, a name left in /dev/shm (torch's file_system sharing "
            "strategy); use the default file_descriptor strategy"
        )
    return None, f"it lies in {path}, not in memory asyncsync or torch shared"


class SharedMemoryIndex:
    """This process's shared mappings of asyncsync and torch shared-memory files, and the
    descriptors holding those files (read from ``/proc/self`` when built: build one per
    round, after the weights were moved)."""

    def __init__(self) -> None:
        regions = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or "s" not in parts[1]:
                    continue  # private or anonymous: no file a server could open
                lo, hi = parts[0].split("-")
                major, minor = parts[3].split(":")
                regions.append(
                    _Region(
                        int(lo, 16),
                        int(hi, 16),
                        int(parts[2], 16),
                        (os.makedev(int(major, 16), int(minor, 16)), int(parts[4])),
                        parts[5].rstrip("\n"),
                    )
                )
        regions.sort(key=lambda r: r.start)
        self._regions = regions
        self._starts = [r.start for r in regions]
        self._fds: dict[tuple[int, int], tuple[int, os.stat_result, str]] = {}
        pid = os.getpid()
        for entry in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{entry}")
                name, _ = _segment_name(link)
                if name is None:
                    continue
                stat = os.fstat(int(entry))
            except OSError:  # closed meanwhile (the listing's own descriptor)
                continue
            key = (stat.st_dev, stat.st_ino)
            if key not in self._fds or int(entry) < self._fds[key][0]:
                self._fds[key] = (int(entry), stat, name)
        self.pid = pid

    def locate(self, name: str, tensor: torch.Tensor) -> tuple[SegmentRef, int]:
        """The file holding ``tensor`` and the byte offset of its first element there;
        ValueError naming ``name`` and why when servers cannot read it in place."""
        check_tensor(name, tensor)
        why = _unfit(tensor)
        if why is None:
            dtype_name(tensor.dtype)  # TypeError for a dtype the wire cannot carry
            why, found = self._find(tensor)
            if found is not None:
                return found
        raise NotInSharedMemory(
            f"parameter {name!r} cannot be published without a copy: {why}; {_HOW}"
        )

    def _find(self, tensor: torch.Tensor) -> tuple[str, tuple[SegmentRef, int] | None]:
        ptr = int(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(self._starts, ptr) - 1
        region = self._regions[i] if i >= 0 else None
        if region is None or not region.start <= ptr < region.end:
            return "it is not in shared memory", None
        if ptr + size > region.end:
            return "it spans more than one mapping", None
        name, why = _segment_name(region.path)
        if name is None:
            return why, None
        held = self._fds.get(region.file)
        if held is None:
            return f"this process holds no descriptor of {region.path}", None
        fd, stat, _ = held
        if stat.st_mode & 0o077 or stat.st_uid != os.geteuid():
            return (
                f"{region.path} has mode {stat.st_mode & 0o777:o} and owner {stat.st_uid}: "
                "only owner-only memory of this user is handed to servers",
                None,
            )
        if not SEGMENT_NAME.fullmatch(name):  # pragma: no cover - the patterns agree
            return f"{name!r} is not a segment name servers accept", None
        offset = ptr - region.start + region.file_offset
        return "", (SegmentRef(name, int(stat.st_size), self.pid, fd), offset)


def _unfit(tensor: torch.Tensor) -> str | None:
    """Why a tensor cannot be read in place whatever memory it lies in, or None."""
    if tensor.device.type != "cpu":
        return f"it is on {tensor.device}"
    if getattr(tensor, "full_tensor", None) is not None:
        return "it is a distributed tensor (gathered into new memory each round)"
    if not tensor.is_contiguous():
        return "it is not contiguous"
    if tensor.is_conj() or tensor.is_neg():
        return "it is a lazily conjugated or negated view"
    if tensor.numel() == 0:
        return "it holds no elements"
    return None


# --------------------------------------------------------------------------- rounds
@dataclass
class _Placed:
    name: str
    tensor: torch.Tensor
    ref: SegmentRef
    offset: int
    version: int


class InPlaceRound:
    """One zero-copy round over ``placed`` tensors: chunks announced in order (each
    returning once every server loaded it), the version counters checked after each."""

    def __init__(
        self,
        placed: list[_Placed],
        manifest: Manifest | None,
        chunk_bytes: int,
        send: SendChunk,
        *,
        cancel: threading.Event | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        self.placed = placed
        self.manifest = manifest or Manifest.from_entries(
            (p.name, dtype_name(p.tensor.dtype), tuple(p.tensor.shape)) for p in placed
        )
        if manifest is not None and list(manifest.names) != [p.name for p in placed]:
            raise ValueError(
                "weights yielded other names (or another order) than their metadata "
                f"announced ({len(placed)} yielded, {len(manifest)} announced)"
            )
        self.plan = plan_chunks(self.manifest, chunk_bytes, oversized_alone=True)
        self.send = send
        self.cancel = cancel
        self.on_chunk = on_chunk
        self.round_id = uuid.uuid4().hex

    def infos(self) -> list[tuple[dict[str, Any], int]]:
        """Each chunk's update_info and its payload bytes."""
        by_name = {p.name: p for p in self.placed}
        out = []
        for index, chunk in enumerate(self.plan):
            members = [by_name[n] for n in chunk.names]
            refs: dict[SegmentRef, int] = {}
            for p in members:
                refs.setdefault(p.ref, len(refs))
            info = ShmUpdateFields(
                round=self.round_id,
                chunk=index,
                last=index == len(self.plan) - 1,
                num_chunks=len(self.plan),
                owner_pid=os.getpid(),
                names=[p.name for p in members],
                dtype_names=[dtype_name(p.tensor.dtype) for p in members],
                shapes=[[int(d) for d in p.tensor.shape] for p in members],
                offsets=[p.offset for p in members],
                manifest=self.manifest.to_json() if index == 0 else None,
                segments=list(refs),
                segment_of=[refs[p.ref] for p in members],
            ).to_json()
            out.append((info, sum(p.tensor.numel() * p.tensor.element_size() for p in members)))
        return out

    def run(self, stats: SendStats, began: float) -> SendStats:
        infos = self.infos()
        stats.pack_seconds += time.perf_counter() - began
        for info, payload in infos:
            if self.cancel is not None and self.cancel.is_set():
                raise RoundCancelled("publish cancelled at a chunk boundary")
            stats.chunks += 1
            stats.params += len(info["names"])
            stats.bytes += payload
            if self.on_chunk is not None:
                self.on_chunk(stats.chunks, stats.bytes)
            self.send(info)  # returns once every server loaded this chunk
            self.check_unchanged()
        return stats

    def check_unchanged(self) -> None:
        """Servers read these tensors in place: one modified in place since the round
        was announced may have been loaded half old, half new."""
        moved = [p.name for p in self.placed if p.tensor._version != p.version]
        if moved:
            shown = ", ".join(repr(n) for n in moved[:5])
            more = f" and {len(moved) - 5} more" if len(moved) > 5 else ""
            raise WeightsModifiedError(
                f"the trainer modified {shown}{more} in place while servers read them "
                "(zero-copy publish): do not step the optimizer or write the weights "
                "until publish returns",
                parameters=moved,
            )


def place(
    items: Iterable[tuple[str, torch.Tensor]], *, fallback: bool = False
) -> tuple[list[_Placed] | None, Iterator[tuple[str, torch.Tensor]]]:
    """Every tensor located in shared memory, with its version counter as of now, and
    an exhausted iterator. The first tensor that is not raises
    `NotInSharedMemory`, or (``fallback``) ends the search: then None and every
    item (those already seen first) for the packing path."""
    index = SharedMemoryIndex()
    seen: set[str] = set()
    placed: list[_Placed] = []
    rest = iter(items)
    for name, tensor in rest:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in the weights")
        seen.add(name)
        try:
            ref, offset = index.locate(name, tensor)
        except NotInSharedMemory:
            if not fallback:
                raise
            seen_items = [(p.name, p.tensor) for p in placed]
            return None, itertools.chain(seen_items, [(name, tensor)], rest)
        placed.append(_Placed(name, tensor, ref, offset, tensor._version))
    if not placed:
        raise ValueError("no weights to publish: the source yielded nothing")
    return placed, rest


def send_in_place(
    items: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest | None,
    chunk_bytes: int,
    send: SendChunk,
    *,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> SendStats:
    """A zero-copy round: every tensor of ``items`` is located (before ``send`` is first
    called, so that a tensor outside shared memory touches no server), then announced in
    chunks of at most ``chunk_bytes`` (a tensor larger alone), each ``send`` returning
    once every server loaded it; a tensor modified in place meanwhile fails the round
    with `WeightsModifiedError`."""
    began = time.perf_counter()
    placed, _ = place(items)
    assert placed is not None
    round_ = InPlaceRound(placed, manifest, chunk_bytes, send, cancel=cancel, on_chunk=on_chunk)
    return round_.run(SendStats(), began)
