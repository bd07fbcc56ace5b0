"""LoopLagMonitor: whether the loop ran during a window, independent of the machine's load."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncsync.testing import LoopLagMonitor

pytestmark = pytest.mark.asyncio


async def test_ticks_inside_a_window_show_whether_the_loop_ran() -> None:
    async with LoopLagMonitor() as lag:
        start = time.perf_counter()
        await asyncio.sleep(0.05)  # the loop is free: the 1 ms timer fires first
        free = (start, time.perf_counter())
        start = time.perf_counter()
        time.sleep(0.05)  # noqa: ASYNC251 - blocking the loop on purpose
        blocked = (start, time.perf_counter())
    assert lag.ticks_between(*free) >= 1
    assert lag.ticks_between(*blocked) == 0
    assert len(lag.times) == len(lag.samples)
    assert lag.times == sorted(lag.times)
