"""Thread-side adapters: blocking backend sends call back into the event loop.

A backend's trainer-side send is synchronous (vLLM's ``trainer_send_weights`` and
``TrainerWeightTransferEngine.send_weights`` alike), so it runs in a worker thread. Its
rank-0 callback (0.23 style) or its ``VLLMWeightSyncClient`` (0.3x style) must not return
before every server answered, so each call schedules the fleet's fan-out on the event
loop with `asyncio.run_coroutine_threadsafe` and blocks the *worker* thread on the
result. The event loop keeps running other work meanwhile. A transport that must act
while the HTTP call is in flight (a rendezvous, a broadcast) starts the fan-out with a
``begin_*`` method instead and waits on the returned future when it is done.

Calling an adapter from the event loop's own thread would deadlock; it raises instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from asyncsync._core.encoding import encoded
from asyncsync.backends.contract import InitInfo, UpdateInfo

__all__ = ["FleetCalls", "LoopBridge", "RoundClient"]

T = TypeVar("T")


class LoopBridge:
    """Runs coroutines on ``loop`` from worker threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, cancel: threading.Event) -> None:
        self.loop = loop
        self.cancel = cancel
        self._loop_thread_id: int | None = None

    def bind_loop_thread(self) -> None:
        """Record the loop's thread (call from inside the loop)."""
        self._loop_thread_id = threading.get_ident()

    def submit(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> Future[T]:
        """Schedule ``factory()`` on the loop and return its future at once."""
        if threading.get_ident() == self._loop_thread_id:
            raise RuntimeError(
                "asyncsync bridge called from the event loop's own thread: this would "
                "deadlock. Blocking sends must run in a worker thread."
            )
        return asyncio.run_coroutine_threadsafe(factory(), self.loop)

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``factory()`` on the loop; block this (worker) thread until it is done.

        Errors raised on the loop side propagate here unchanged (with their server
        outcomes), so they surface from the backend's send and then from ``publish``.
        """
        return self.submit(factory).result()


class FleetCalls(Protocol):
    """The loop-side fan-outs behind a `RoundClient` (a publish round)."""

    async def init(self, init_info: InitInfo) -> None: ...

    async def start(self) -> None: ...

    async def update(self, update_info: UpdateInfo) -> None: ...

    async def finish(self, weight_version: str | None) -> None: ...

    async def world_sizes(self) -> dict[str, int]: ...

    async def servers(self) -> list[str]: ...


class RoundClient:
    """The `asyncsync.backends.contract.SyncFleetClient` a round hands its backend:
    vLLM's synchronous ``VLLMWeightSyncClient`` protocol, over an async fleet.

    Each method fans out to the targeted servers on the event loop and blocks the
    calling worker thread until all of them answered; ``begin_init`` and
    ``begin_update`` start the fan-out and return its future at once. The fan-outs are
    `FleetCalls` of the current round, which records outcomes and timings.
    ``finish_weight_update`` carries the round's version even when the backend's engine
    calls it without one (vLLM's built-in engines do), so that the version travels with
    the data.
    """

    def __init__(self, bridge: LoopBridge, calls: FleetCalls, *, version: str | None) -> None:
        self._bridge = bridge
        self._calls = calls
        self.version = version
        self._pending: list[Future[Any]] = []
        self._pending_lock = threading.Lock()

    @classmethod
    def on_running_loop(
        cls, calls: FleetCalls, *, cancel: threading.Event, version: str | None = None
    ) -> RoundClient:
        """A client for worker threads, bound to the running loop (call on the loop)."""
        bridge = LoopBridge(asyncio.get_running_loop(), cancel=cancel)
        bridge.bind_loop_thread()
        return cls(bridge, calls, version=version)

    def _begin(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> Future[T]:
        future = self._bridge.submit(factory)
        with self._pending_lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)
        return future

    def begin_init(self, init_info: InitInfo) -> Future[None]:
        """Start ``/init_weight_transfer_engine`` on every server; do not wait."""
        return self._begin(lambda: self._calls.init(init_info))

    def begin_update(self, update_info: UpdateInfo) -> Future[None]:
        """Start ``/update_weights`` on every server; do not wait. The payload's JSON
        is made here, in the worker thread, not on the event loop (`encoded`)."""
        info = encoded(update_info)
        return self._begin(lambda: self._calls.update(info))

    def init_weight_transfer_engine(self, init_info: InitInfo) -> None:
        self.begin_init(init_info).result()

    def start_weight_update(self) -> None:
        self._bridge.call(self._calls.start)

    def update_weights(self, update_info: UpdateInfo) -> None:
        self.begin_update(update_info).result()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self._bridge.call(lambda: self._calls.finish(version))

    def world_sizes(self) -> dict[str, int]:
        """Each targeted server's ``/get_world_size`` (NCCL rank offsets)."""
        return self._bridge.call(self._calls.world_sizes)

    def lane(self, urls: Sequence[str]) -> RoundClient:
        """A client whose calls go only to ``urls`` of this client's servers (one
        transport's share of a mixed round), recorded in the same round."""
        lane = getattr(self._calls, "lane", None)
        if lane is None:
            raise TypeError(f"{type(self._calls).__name__} calls cannot be split into lanes")
        return RoundClient(self._bridge, lane(urls), version=self.version)

    def servers(self) -> list[str]:
        """The targeted servers still in the round."""
        return self._bridge.call(self._calls.servers)

    def update_deadline(self) -> float | None:
        """The update deadline (seconds) of the targeted servers' calls, if the calls
        know it: a transport bounds its own collective by it."""
        deadline = getattr(self._calls, "update_deadline", None)
        return deadline() if callable(deadline) else None

    def settle(self) -> None:
        """Wait for every fan-out begun here (their errors were raised where they were
        awaited, or are in the round's outcomes): none outlives the send."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for future in pending:
            with contextlib.suppress(BaseException):
                future.result()
