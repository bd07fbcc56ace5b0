"""POSIX shared-memory segments owned by the trainer process.

Python 3.11's ``multiprocessing.shared_memory`` registers every segment with the
resource tracker (no ``track=`` before 3.13), which may unlink segments that other
processes still use. These segments are created, mapped and unlinked explicitly
instead: unlinked on close, on garbage collection, and at interpreter exit.
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

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "Segment", "leaked_segments", "sweep_stale_segments"]

SHM_DIR = Path("/dev/shm")
#: Every segment asyncsync creates is named ``asyncsync-<pid>-<random>``.
SEGMENT_PREFIX = "asyncsync-"

_live: weakref.WeakSet[Segment] = weakref.WeakSet()
_live_lock = threading.Lock()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class Segment:
    """A shared-memory segment of ``size`` bytes, mapped read-write in this process.

    ``name`` is what workers open (``/dev/shm/<name>``). The segment is unlinked by
    :meth:`close`, when the object is garbage-collected, and at interpreter exit.
    """

    def __init__(self, size: int, *, populate: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        sweep_stale_segments()
        self.size = size
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED
            if populate and hasattr(mmap, "MAP_POPULATE"):
                # Fault every page in now, so packing runs at memcpy speed.
                flags |= mmap.MAP_POPULATE
            self.mm: mmap.mmap | None = mmap.mmap(
                fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        with _live_lock:
            _live.add(self)

    @property
    def closed(self) -> bool:
        return self.mm is None

    def buffer(self) -> Any:
        """The writable mapping (for ``torch.frombuffer``)."""
        if self.mm is None:
            raise ValueError(f"segment {self.name} is closed")
        return self.mm

    def close(self) -> None:
        """Unlink the segment and drop this process's mapping (idempotent).

        Views created from :meth:`buffer` must be gone; if one is still referenced the
        mapping is left to the garbage collector, but the name is unlinked regardless.
        """
        self._finalizer()  # unlink now, exactly once
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink asyncsync segments whose creating process no longer exists.

    A trainer killed with SIGKILL (or SIGTERM without a handler) cannot unlink its
    segments; the next :class:`Segment` created on the machine removes them. Returns the
    names removed.
    """
    removed = []
    for name in leaked_segments():
        pid_text = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            _unlink(SHM_DIR / name)
            removed.append(name)
    return removed


def leaked_segments(pid: int | None = None) -> list[str]:
    """Names of asyncsync segments in /dev/shm (of ``pid`` when given)."""
    prefix = SEGMENT_PREFIX if pid is None else f"{SEGMENT_PREFIX}{pid}-"
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


@atexit.register
def _close_all() -> None:
    with _live_lock:
        segments = list(_live)
    for segment in segments:
        segment.close()
