"""Measure event-loop lag: how late a periodic timer fires while other work runs."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from types import TracebackType

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Samples the event loop's responsiveness while it is entered.

    A task sleeps ``interval`` seconds in a loop and records how much later than asked
    it woke up. A blocked loop shows up as large samples::

        async with LoopLagMonitor() as lag:
            await publisher.publish(model, version="v1")
        print(lag.summary())  # {'samples': ..., 'p50_ms': ..., 'p99_ms': ..., 'max_ms': ...}

    `times` holds when each sample was taken (``time.perf_counter()``): whether the
    loop ran at all during a given window (e.g. while a request was in flight) does not
    depend on how loaded the machine is, unlike how late its timers fire.
    """

    def __init__(self, interval: float = 0.001) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
        self.samples: list[float] = []
        self.times: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            now = time.perf_counter()
            self.samples.append(max(0.0, now - asked - self.interval))
            self.times.append(now)

    async def __aenter__(self) -> LoopLagMonitor:
        self._task = asyncio.create_task(self._run(), name="asyncsync:loop-lag")
        await asyncio.sleep(0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def ticks_between(self, start: float, end: float) -> int:
        """Samples taken strictly inside ``(start, end)`` (``perf_counter`` times)."""
        return sum(1 for t in self.times if start < t < end)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile of the lag samples, in seconds."""
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]

    def summary(self) -> dict[str, float]:
        """Samples count and p50/p99/max lag in milliseconds."""
        return {
            "samples": float(len(self.samples)),
            "p50_ms": 1000 * (statistics.median(self.samples) if self.samples else 0.0),
            "p99_ms": 1000 * self.percentile(99),
            "max_ms": 1000 * (max(self.samples) if self.samples else 0.0),
        }
