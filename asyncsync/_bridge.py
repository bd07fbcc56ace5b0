"""Thread-side adapters: blocking backend sends call back into the event loop.

A backend's trainer-side send is synchronous (vLLM's ``trainer_send_weights`` and
``TrainerWeightTransferEngine.send_weights`` alike), so it runs in a worker thread. Its
rank-0 callback (0.23 style) or its ``VLLMWeightSyncClient`` (0.3x style) must not return
before every server answered, so each call schedules the fleet's fan-out on the event
loop with :func:`asyncio.run_coroutine_threadsafe` and blocks the *worker* thread on the
result. The event loop keeps running other work meanwhile.

Calling an adapter from the event loop's own thread would deadlock; it raises instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["LoopBridge", "PhaseTimes", "SyncFleetClient"]

T = TypeVar("T")


class LoopBridge:
    """Runs coroutines on ``loop`` from worker threads and waits for their results."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, cancel: threading.Event) -> None:
        self.loop = loop
        self.cancel = cancel
        self._loop_thread_id: int | None = None

    def bind_loop_thread(self) -> None:
        """Record the loop's thread (call from inside the loop)."""
        self._loop_thread_id = threading.get_ident()

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``factory()`` on the loop; block this (worker) thread until it is done.

        Errors raised on the loop side propagate here unchanged (with their server
        outcomes), so they surface from the backend's send and then from ``publish``.
        """
        if threading.get_ident() == self._loop_thread_id:
            raise RuntimeError(
                "asyncsync bridge called from the event loop's own thread: this would "
                "deadlock. Blocking sends must run in a worker thread."
            )
        future = asyncio.run_coroutine_threadsafe(factory(), self.loop)
        return future.result()


@dataclass
class PhaseTimes:
    """Seconds spent per phase of a round (wall clock as seen by the trainer)."""

    start: float = 0.0
    transfer: float = 0.0
    finish: float = 0.0


class SyncFleetClient:
    """vLLM's synchronous ``VLLMWeightSyncClient`` protocol, over an async fleet.

    Each method fans out to the targeted servers on the event loop and blocks the
    calling worker thread until all of them answered. ``finish_weight_update`` carries
    the round's version even when the backend's engine calls it without one (vLLM's
    built-in engines do), so that the version travels with the data.
    """

    def __init__(
        self,
        bridge: LoopBridge,
        *,
        init: Callable[[dict[str, Any]], Awaitable[Any]],
        start: Callable[[], Awaitable[Any]],
        update: Callable[[Any], Awaitable[Any]],
        finish: Callable[[str | None], Awaitable[Any]],
        version: str | None,
    ) -> None:
        self._bridge = bridge
        self._init = init
        self._start = start
        self._update = update
        self._finish = finish
        self.version = version
        self.times = PhaseTimes()
        self.started = False
        self.finished = False

    @staticmethod
    async def _await(awaitable: Awaitable[T]) -> T:
        return await awaitable

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._bridge.call(lambda: self._await(self._init(init_info)))

    def start_weight_update(self) -> None:
        t0 = time.perf_counter()
        self.started = True
        self._bridge.call(lambda: self._await(self._start()))
        self.times.start += time.perf_counter() - t0

    def update_weights(self, update_info: Any) -> None:
        t0 = time.perf_counter()
        self._bridge.call(lambda: self._await(self._update(update_info)))
        self.times.transfer += time.perf_counter() - t0

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        t0 = time.perf_counter()
        self._bridge.call(lambda: self._await(self._finish(version)))
        self.times.finish += time.perf_counter() - t0
        self.finished = True
