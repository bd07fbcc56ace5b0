"""Shared-memory segments owned by the trainer process: anonymous memfds, never a name
in /dev/shm.

A segment is a ``memfd_create`` file (mode 0600) that this process keeps open and maps.
Servers on the same machine map it through ``/proc/<trainer pid>/fd/<fd>`` (which the
kernel allows only to processes of the same user that may inspect the trainer), and
check that the link there names the segment they were told (``memfd:<name>``). The
memory belongs to whoever maps it: when the trainer closes a segment (on
`Segment.close`, garbage collection, interpreter exit) or dies, even by SIGKILL,
the kernel frees the memory as soon as the last server dropped its mapping; nothing is
ever left in /dev/shm to sweep.

Measured before choosing (``scripts/measure_shm_handoff.py``, docs/security.md): a fresh
named segment per round, unlinked once every server mapped it, costs ~10x the per-round
time of a reused one (allocation and page faults every round), and still leaks when the
trainer dies between create and unlink; a reused memfd costs the same as a reused named
segment and cannot leak.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

from asyncsync._transport.wire import SEGMENT_NAME, segment_path

__all__ = [
    "SEGMENT_NAME",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Segment",
    "leaked_segments",
    "open_segments",
    "segment_path",
    "sweep_stale_segments",
]

SHM_DIR = Path("/dev/shm")
#: Every segment asyncsync creates is named ``asyncsync-<pid>-<random>``.
SEGMENT_PREFIX = "asyncsync-"

_live: weakref.WeakSet[Segment] = weakref.WeakSet()
_live_lock = threading.Lock()


#: How much of a new segment is faulted in at once (`_touch`).
TOUCH_STEP = 16 * 1024 * 1024


def _touch(mm: mmap.mmap) -> None:
    """Fault every page of ``mm`` in, ``TOUCH_STEP`` bytes at a time. One
    ``MAP_POPULATE`` of 256 MiB held the process's memory map long enough to stop its
    event loop for 150-420 ms (a loop thread that needs memory waits for it; measured
    under memory pressure); in steps, the loop runs between them (at most 15 ms)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - the trainer side has numpy (torch extra)
        view = memoryview(mm)
        zeros = bytes(min(TOUCH_STEP, len(mm)))
        for start in range(0, len(mm), TOUCH_STEP):
            end = min(start + TOUCH_STEP, len(mm))
            view[start:end] = zeros[: end - start]
        view.release()
        return
    pages = np.frombuffer(mm, dtype=np.uint8)
    for start in range(0, pages.size, TOUCH_STEP):
        pages[start : start + TOUCH_STEP] = 0  # numpy fills with the GIL released
    del pages


class Segment:
    """A shared-memory segment of ``size`` bytes, mapped read-write in this process.

    Workers open `path` (``/proc/<pid>/fd/<fd>``) and verify that it links to
    ``memfd:<name>``. `close`, garbage collection and interpreter exit close the
    file descriptor; the memory is freed once no process maps it any more.
    """

    def __init__(self, size: int, *, populate: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        self.size = size
        self.owner_pid = os.getpid()
        self.name = f"{SEGMENT_PREFIX}{self.owner_pid}-{uuid.uuid4().hex[:16]}"
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)  # owner only (memfds start as 0777)
            os.ftruncate(fd, size)
            self.mm: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            if populate:  # every page faulted in now, so packing runs at memcpy speed
                _touch(self.mm)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._finalizer = weakref.finalize(self, _close_fd, fd)
        with _live_lock:
            _live.add(self)

    @property
    def path(self) -> Path:
        """``/proc/<pid>/fd/<fd>``: what a server of the same user opens."""
        return Path(segment_path(self.name, self.owner_pid, self.fd))

    @property
    def closed(self) -> bool:
        return self.mm is None

    def buffer(self) -> Any:
        """The writable mapping (for ``torch.frombuffer``)."""
        if self.mm is None:
            raise ValueError(f"segment {self.name} is closed")
        return self.mm

    def close(self) -> None:
        """Close the file descriptor and drop this process's mapping (idempotent).

        Views created from `buffer` must be gone; if one is still referenced the
        mapping is left to the garbage collector, but the descriptor is closed
        regardless (no server can open the segment any more).
        """
        self._finalizer()  # close the descriptor now, exactly once
        mm, self.mm = self.mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Segment {self.name} {self.size} bytes {state}>"


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def open_segments(pid: int | None = None) -> list[str]:
    """Names of the asyncsync segments that process ``pid`` (default: this one) holds
    open (each once, though a mapping holds a duplicate descriptor), read from
    ``/proc/<pid>/fd``."""
    fd_dir = Path(f"/proc/{os.getpid() if pid is None else pid}/fd")
    names: set[str] = set()
    with contextlib.suppress(FileNotFoundError, PermissionError):
        for entry in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(entry)
                if target.startswith(f"/memfd:{SEGMENT_PREFIX}"):
                    names.add(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    return sorted(names)


def leaked_segments(pid: int | None = None) -> list[str]:
    """Names of asyncsync segments left in /dev/shm (of ``pid`` when given).

    Segments are memfds and never have a name there; this finds what earlier asyncsync
    builds (which named their segments in /dev/shm) left behind.
    """
    prefix = SEGMENT_PREFIX if pid is None else f"{SEGMENT_PREFIX}{pid}-"
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink named asyncsync segments in /dev/shm whose creating process is gone (left
    by asyncsync versions that named their segments). Returns the names removed."""
    removed = []
    for name in leaked_segments():
        pid_text = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
            removed.append(name)
    return removed


@atexit.register
def _close_all() -> None:
    with _live_lock:
        segments = list(_live)
    for segment in segments:
        segment.close()
