"""Python's cyclic garbage collector paused while a round runs.

A collection stops every thread of the process (it holds the GIL) for as long as it
walks the objects it tracks: with torch, vLLM and a model loaded, a full one takes
hundreds of milliseconds, and during it the event loop answers nothing. A round's
send allocates per tensor (vLLM's IPC engine: a handle, its dict and a deep copy of
both for each of 10,000 tensors) and holds those objects until the round ends, so the
young collections their allocation sets off promote them, and the promotions set off a
full collection in the middle of the round (measured: 0.48-0.52 s of loop lag at
10,000 tensors on CPU, 383 ms on an H200). Paused, the collector runs none of those;
the round's objects are freed by reference counting when it ends, as before, and the
collector resumes with nothing of the round left to walk. What else the process
allocates meanwhile (generations on the loop, a data loader's thread) is collected once
the round ends: a round lasts seconds.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collections_paused"]


class _Pauses:
    """How many blocks want the collector paused, and whether to resume it after."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.resume = False


_pauses = _Pauses()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """The cyclic collector paused in this process until the block ends (reference
    counting goes on). Nested and concurrent uses are counted: it resumes when the last
    one ends, and only if it was enabled when the first began."""
    with _pauses.lock:
        if _pauses.holders == 0:
            _pauses.resume = gc.isenabled()
            gc.disable()
        _pauses.holders += 1
    try:
        yield
    finally:
        with _pauses.lock:
            _pauses.holders -= 1
            if _pauses.holders == 0 and _pauses.resume:
                gc.enable()
