"""Generations across a fleet: admission to an eligible server, failover, staleness.

`Dispatcher` waits for a server that `choose` accepts
(probing unhealthy ones in the background while it waits), counts the request on it,
runs the generation there, resends elsewhere only a request that never reached its
server, and tags each completion with its staleness.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

from asyncsync._core import hooks as _hooks
from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError, GenerationAborted, GenerationError
from asyncsync._core.state import ServerState
from asyncsync._fleet.adapters import AdapterTable, served_name, tag
from asyncsync._fleet.members import Members
from asyncsync._fleet.routing import (
    SessionTable,
    StalenessStats,
    VersionHistory,
    choose,
    staleness_of,
)
from asyncsync._generation.engine import CompletionStream, GenerationEngine
from asyncsync._http.transport import never_sent
from asyncsync._wire.generation import GenerationRequest, SendOptions

__all__ = ["Dispatcher", "RoutingPolicy"]

T = TypeVar("T")
P = ParamSpec("P")

logger = logging.getLogger("asyncsync.generate")

#: How often unhealthy servers are probed while generations wait (seconds).
_PROBE_INTERVAL = 1.0
#: The longest a waiting generation sleeps before it looks again (state changes wake it).
_RECHECK = 0.5


@dataclass(slots=True)
class RoutingPolicy:
    """The fleet-wide routing settings (the Fleet's public attributes read these)."""

    max_staleness: int | None = 0
    admission_timeout: float | None = 60.0


@dataclass(slots=True)
class _Probes:
    """Background health probes of unhealthy servers, at most one round a second."""

    run: Callable[[list[str]], Awaitable[object]]
    tasks: set[asyncio.Task[object]] = field(default_factory=set)
    last: float = -math.inf

    def maybe_start(self, states: Sequence[ServerState]) -> None:
        unhealthy = [s.url for s in states if not s.healthy]
        now = time.monotonic()
        if not unhealthy or now - self.last < _PROBE_INTERVAL:
            return
        self.last = now
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(
            self._probe(unhealthy), name="asyncsync:probe-unhealthy"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _probe(self, urls: list[str]) -> object:
        return await self.run(urls)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()


class Dispatcher:
    """Routes generations over ``members`` (see the module docstring)."""

    def __init__(
        self,
        members: Members,
        history: VersionHistory,
        policy: RoutingPolicy,
        probe: Callable[[list[str]], Awaitable[object]],
        adapters: AdapterTable | None = None,
    ) -> None:
        self.members = members
        #: LoRA adapters and who holds them (a generation with ``lora=name``)
        self.adapters = adapters if adapters is not None else AdapterTable()
        self.history = history
        self.policy = policy
        self.sessions = SessionTable()
        self.staleness = StalenessStats()
        self.probes = _Probes(probe)

    async def admit(self, send: SendOptions, exclude: Set[str] = frozenset()) -> ServerState:
        """Wait for an eligible server and count a request on it."""
        members, session_id = self.members, send.session_id
        limit = self.policy.admission_timeout
        limit = limit if send.admission_timeout is None else send.admission_timeout
        # time.monotonic(), not the loop's clock: no loop lookup on this hot path.
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            pinned = self.sessions.get(session_id) if session_id is not None else None
            states = members.states()
            lacking = None
            if send.lora is not None:  # servers without a recent version of the adapter
                lacking = self.adapters.skipped(send.lora, states, self.policy.max_staleness)
            state, skipped = choose(
                states, self.history, max_staleness=self.policy.max_staleness,
                min_version=send.min_version, pinned=pinned,
                exclude=exclude if not lacking else exclude | set(lacking),
            )  # fmt: skip
            if lacking:
                skipped.update(lacking)
            if state is not None:
                state.outstanding += 1
                state.routed += 1
                if session_id is not None:
                    self.sessions.pin(session_id, state.url)
                return state
            if not states or all(s.url in exclude for s in states):
                why = "the fleet is empty" if not states else "every server failed"
                raise GenerationError(f"no server to generate on: {why}")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                detail = ", ".join(f"{u} ({r})" for u, r in skipped.items())
                pin = f"; session {session_id!r} is pinned to {pinned}" if pinned else ""
                raise GenerationError(f"no eligible server within {limit:g} s: {detail}{pin}")
            self.probes.maybe_start(states)
            await members.changed(_RECHECK if remaining is None else min(_RECHECK, remaining))

    def engine(self, state: ServerState) -> GenerationEngine:
        """The generation engine that serves a request admitted on ``state``."""
        return self.members.generator(state)

    def release(self, state: ServerState) -> None:
        state.outstanding -= 1
        self.members.notify()

    def tag(self, completions: Sequence[Completion]) -> None:
        """Set each completion's staleness and record it in `staleness`."""
        history, record = self.history, self.staleness.record
        for c in completions:
            c.staleness = staleness_of(history, c)
            record(c.server, c.staleness)
        _hooks.generated(completions)

    def failed_over(self, send: SendOptions, state: ServerState, err: AsyncSyncError) -> bool:
        """After a failure on ``state``'s server: whether the request never reached it
        (then the session, if any, is unpinned and the caller may try another one)."""
        if not never_sent(err):
            return False
        logger.info("generation never reached %s (%s): trying another server", state.url, err)
        if send.session_id is not None:
            self.sessions.drop(send.session_id)
        return True

    async def routed(
        self,
        send: SendOptions,
        call: Callable[Concatenate[GenerationEngine, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """``call(engine, *args, **kwargs)`` on an admitted server's engine; a request
        that never reached its server (connection refused / not established) is sent to
        another one."""
        tried: frozenset[str] = frozenset()
        while True:
            state = await self.admit(send, tried)
            try:
                return await call(self.engine(state), *args, **kwargs)
            except AsyncSyncError as err:
                if not self.failed_over(send, state, err):
                    raise
                tried = tried | {state.url}
                if len(tried) >= len(self.members):
                    raise
            finally:
                self.release(state)

    async def generate(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> list[Completion]:
        """One routed generation; its completions tagged with their staleness."""
        call = GenerationEngine.generate if send.lora is None else self.adapters.bind(send.lora)
        try:
            out = await self.routed(send, call, prompt, req, send)
        except GenerationAborted as err:
            self.tag(err.completions)
            raise
        self.tag(out)
        return out

    def stream(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> CompletionStream:
        return CompletionStream(_FleetLease(self, send), prompt, req, send)


class _FleetLease:
    """A stream's server, chosen by routing when it opens and held until it closes."""

    def __init__(self, dispatcher: Dispatcher, send: SendOptions) -> None:
        self._dispatcher = dispatcher
        self._send = send
        self._held: ServerState | None = None
        self._tried: set[str] = set()
        #: (server, adapter, version) a ``lora=name`` stream is sent with, in use until
        #: it ends (its directory is kept as long)
        self._using: tuple[str, str, str] | None = None

    async def acquire(self) -> GenerationEngine:
        self._let_go()
        state = self._held = await self._dispatcher.admit(self._send, self._tried)
        return self._dispatcher.engine(state)

    def unreached(self, err: AsyncSyncError) -> bool:
        assert self._held is not None
        self._tried.add(self._held.url)
        self._dispatcher.failed_over(self._send, self._held, err)
        return len(self._tried) < len(self._dispatcher.members)

    def request(self, engine: GenerationEngine, req: GenerationRequest) -> GenerationRequest:
        name = self._send.lora
        if name is None:
            return req
        url = engine.endpoint.url
        adapters = self._dispatcher.adapters
        version = adapters.held(url, name)
        if version is None:  # unloaded between admission and now: never silently
            raise GenerationError(f"adapter {name!r} is not loaded on {url}", server=url)
        adapters.begin_use(url, name, version)
        self._using = (url, name, version)
        return req._replace(model=served_name(name, version))

    def release(self, completions: list[Completion] | None) -> None:
        if completions:
            if self._using is not None:
                tag(completions, self._using[1], self._using[2])
            self._dispatcher.tag(completions)
        self._let_go()

    def _let_go(self) -> None:
        if self._using is not None:
            self._dispatcher.adapters.end_use(*self._using)
            self._using = None
        if self._held is not None:
            self._dispatcher.release(self._held)
            self._held = None
