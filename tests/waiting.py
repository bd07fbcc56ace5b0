"""Waiting in tests for what was observed, never for a fixed time.

docs/development.md ("Checking a test under load"): a test that sleeps a fixed time to
let something happen depends on the machine's speed; one that waits for the observed
condition (a recorded request, a sampled token, a state) does not. The deadline here
only catches a hang, so it is generous: a loaded CI runner is slow, not stuck.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from asyncsync._http.transport import h1_pool
from asyncsync.testing import FakeVLLMServer

__all__ = [
    "HANG",
    "arrived",
    "checked_out",
    "engine_running",
    "wait_until",
    "wait_until_blocking",
]

#: Seconds after which a condition not reached is a hang, not a slow machine.
HANG = 60.0
#: How often the condition is looked at (it is a plain attribute read).
_POLL = 0.005


async def wait_until(
    condition: Callable[[], bool], *, within: float = HANG, what: str | None = None
) -> None:
    """Return as soon as ``condition()`` holds; fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {within:g} s: {what or condition}")
        await asyncio.sleep(_POLL)


def wait_until_blocking(
    condition: Callable[[], bool], *, within: float = HANG, what: str | None = None
) -> None:
    """`wait_until` for a thread without an event loop (the blocking facade's tests)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within:g} s: {what or condition}")
        time.sleep(_POLL)


async def arrived(server: FakeVLLMServer, route: str, count: int = 1) -> None:
    """Wait until ``server`` has recorded ``count`` requests to ``route`` (a request is
    recorded as it arrives, before any fault holds it)."""
    await wait_until(
        lambda: len(server.requests_to(route)) >= count,
        what=f"{count} request(s) to {route} on {server.url}",
    )


def checked_out(session: Any) -> int:
    """Connections of ``session`` (a fleet's or a client's) with an exchange still in
    progress: aiohttp's (streams) and the lean pool's (plain requests) together."""
    assert session is not None
    pool = h1_pool(session)
    return len(session.connector._acquired) + (pool.in_use if pool is not None else 0)


_RUNNING = re.compile(rb"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


async def engine_running(url: str) -> int:
    """Samples a real vLLM server's engine is stepping now (``vllm:num_requests_running``
    on its ``/metrics``: each sample of an ``n > 1`` request counts; the server must keep
    its statistics, ``LocalVLLMServer(log_stats=True)``). What a test waits on to know a
    request reached the engine, which no client-side count can tell."""
    timeout = aiohttp.ClientTimeout(total=HANG)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{url}/metrics") as answer,
    ):
        assert answer.status == 200, answer.status
        text = await answer.read()
    values = _RUNNING.findall(text)
    assert values, f"{url}/metrics has no vllm:num_requests_running (log stats off?)"
    return sum(int(float(v)) for v in values)
