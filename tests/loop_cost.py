"""What the event loop costs, measured so that a busy machine does not change it (not a
test module): the CPU of each callback it runs (`LoopWork`), and its lag less the OS's
scheduling delay (`OwnLag`)."""

from __future__ import annotations

import asyncio
import asyncio.events
import contextlib
import threading
import time
from pathlib import Path
from typing import Any


class LoopWork:
    """The CPU time of every callback the event loop runs while entered
    (``asyncio.events.Handle._run`` timed with ``time.thread_time``): the loop's own
    work, whatever else the machine runs (a busy machine delays a callback, it does not
    make it cost more CPU)."""

    def __init__(self) -> None:
        self.callbacks: list[tuple[float, str]] = []

    def __enter__(self) -> LoopWork:
        self._run = run = asyncio.events.Handle._run
        callbacks = self.callbacks

        def timed(handle: Any) -> Any:
            began = time.thread_time()
            try:
                return run(handle)
            finally:
                callbacks.append((time.thread_time() - began, _describe(handle)))

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._run  # type: ignore[method-assign]

    @property
    def total(self) -> float:
        return sum(c for c, _ in self.callbacks)

    @property
    def longest(self) -> tuple[float, str]:
        return max(self.callbacks, default=(0.0, ""))


def _describe(handle: Any) -> str:
    """A callback named so a reader can find it: a task's step names the task's
    coroutine and the innermost frame it was at after the step (where the step ended
    is beside the code that ran)."""
    task = getattr(getattr(handle, "_callback", None), "__self__", None)
    if not isinstance(task, asyncio.Task):
        return repr(handle)[:160]
    coro: Any = task.get_coro()
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return f"task {task.get_name()} step, at {' > '.join(where) or 'its end'}"


class OwnLag:
    """A 1 ms timer's lateness less the time the loop thread was runnable but given no
    core by the OS (Linux ``schedstat``'s run delay over the same interval): what this
    process itself held the loop for (work on it, a wait for the GIL, a collection)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: Any = None

    async def _run(self) -> None:
        stat = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")

        def delay() -> float:
            return int(stat.read_text().split()[1]) / 1e9 if stat.exists() else 0.0

        while True:
            asked, waited = time.perf_counter(), delay()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - asked - 0.001
            self.samples.append(max(0.0, late - (delay() - waited)))

    async def __aenter__(self) -> OwnLag:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
