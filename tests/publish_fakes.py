"""Helpers for publishing rounds against FakeVLLMServer (not a test module)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from asyncsync.testing import FakeVLLMServer

#: The update the shm backend sends to end an open update (the engine rejects it).
ABORT = {"abort": True, "round": "abort"}
#: The routes of a round, in the order a server sees them.
ROUND_ROUTES = (
    "/pause",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
)


def like_the_shm_engine(info: Any) -> None:
    """The real engine fails an abort on purpose (vLLM then clears its active update)."""
    if isinstance(info, dict) and info.get("abort"):
        raise RuntimeError("asyncsync_shm: round 'abort' aborted by the trainer")


@asynccontextmanager
async def shm_fakes(count: int = 2, **options: Any) -> AsyncIterator[list[FakeVLLMServer]]:
    """``count`` fakes whose engine rejects aborts like ``asyncsync_shm``."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                FakeVLLMServer(update_hook=like_the_shm_engine, **options)
            )
            for _ in range(count)
        ]


def aborts_received(fake: FakeVLLMServer) -> list[Any]:
    """The abort updates the fake received (it rejects them, so ``updates`` never
    lists them)."""
    bodies = [r.json["update_info"] for r in fake.requests_to("/update_weights")]
    return [b for b in bodies if isinstance(b, dict) and b.get("abort")]


def round_calls(fake: FakeVLLMServer) -> list[str]:
    """The round routes the fake received, in order (an abort update as "abort")."""
    calls = []
    for request in fake.requests:
        if request.path not in ROUND_ROUTES:
            continue
        info = request.json.get("update_info") if isinstance(request.json, dict) else None
        calls.append("abort" if isinstance(info, dict) and info.get("abort") else request.path)
    return calls
