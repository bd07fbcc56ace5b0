"""Requests across a fleet: admission to an eligible server, failover, staleness.

`Dispatcher.admit` is the one admission function: every request a fleet sends to one of
its servers passes through it (generate, score, stream, the chat layer's render,
derender and fallback through `Dispatcher.lease`). It waits for a server that
`choose` accepts (the change signal of the ledger wakes it), counts the request on it
(`Ledger.admitted`), and the caller releases it when done. A request that never
reached its server is sent to another one; an answer whose weight versions the fleet
does not accept (a restarted server answering with its checkpoint's version, a server
that lies) is never returned as current: its server becomes suspect and the request is
sent again elsewhere (a stream, whose tokens were delivered, is returned with its true
versions and a warning in the log). Each completion is tagged with its staleness.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence, Set
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

from asyncsync._core import hooks as _hooks
from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError, GenerationAborted, GenerationError
from asyncsync._core.ledger import ServerRecord
from asyncsync._core.state import Reason
from asyncsync._fleet import adapters
from asyncsync._fleet.members import Members
from asyncsync._fleet.routing import StalenessStats, choose, contradicts, staleness_of
from asyncsync._generation.engine import CompletionStream, GenerationEngine
from asyncsync._http.transport import never_sent
from asyncsync._wire.generation.options import GenerationRequest, SendOptions

__all__ = ["Dispatcher", "RoutingPolicy"]

T = TypeVar("T")
P = ParamSpec("P")

logger = logging.getLogger("asyncsync.generate")


@dataclass(slots=True)
class RoutingPolicy:
    """The fleet-wide admission settings (the ledger keeps ``max_staleness``)."""

    admission_timeout: float | None = 60.0


class Dispatcher:
    """Routes requests over ``members`` (see the module docstring)."""

    def __init__(self, members: Members, policy: RoutingPolicy) -> None:
        self.members = members
        self.ledger = members.ledger
        self.policy = policy
        self.staleness = StalenessStats()

    # ------------------------------------------------------------------ admission
    async def admit(self, send: SendOptions, exclude: Set[str] = frozenset()) -> ServerRecord:
        """Wait for an eligible server (not in ``exclude``) and count a request on it:
        the one admission function (see the module docstring)."""
        ledger, session_id = self.ledger, send.session_id
        limit = self.policy.admission_timeout
        limit = limit if send.admission_timeout is None else send.admission_timeout
        # time.monotonic(), not the loop's clock: no loop lookup on this hot path.
        deadline = None if limit is None else time.monotonic() + limit
        skipped: dict[str, Reason] = {}
        pinned: str | None = None

        def eligible() -> ServerRecord | None:
            """The server to admit on now, if any (and why the others were skipped)."""
            nonlocal skipped, pinned
            pinned = ledger.session_server(session_id) if session_id is not None else None
            records = ledger.records()
            lacking = None
            if send.lora is not None:  # servers without a recent version of the adapter
                lacking = adapters.skipped(ledger, send.lora, records, ledger.max_staleness)
            record, skipped = choose(
                records, ledger.history(), max_staleness=ledger.max_staleness,
                min_version=send.min_version, pinned=pinned,
                exclude=exclude if not lacking else exclude | set(lacking),
            )  # fmt: skip
            if lacking:
                skipped.update(lacking)
            if record is None and (not records or all(r.url in exclude for r in records)):
                why = "the fleet is empty" if not records else "every server failed"
                raise GenerationError(f"no server to generate on: {why}")
            return record

        record = await ledger.wait_until(eligible, deadline)
        if record is None:
            detail = ", ".join(f"{u} ({r})" for u, r in skipped.items())
            pin = f"; session {session_id!r} is pinned to {pinned}" if pinned else ""
            raise GenerationError(f"no eligible server within {limit:g} s: {detail}{pin}")
        ledger.admitted(record, session_id)
        return record

    def engine(self, record: ServerRecord) -> GenerationEngine:
        """The generation engine that serves a request admitted on ``record``."""
        return self.members.generator(record)

    def release(self, record: ServerRecord) -> None:
        self.ledger.released(record)

    @contextlib.asynccontextmanager
    async def lease(self, send: SendOptions) -> AsyncIterator[ServerRecord]:
        """An admitted server for the duration of the block (a chat layer's render,
        derender or fallback turn): counted in flight, released at the end."""
        record = await self.admit(send)
        try:
            yield record
        finally:
            self.release(record)

    # ------------------------------------------------------------------ answers
    def tag(self, completions: Sequence[Completion]) -> None:
        """Set each completion's staleness and record it in `staleness`."""
        history, record = self.ledger.history(), self.staleness.record
        for c in completions:
            c.staleness = staleness_of(history, c)
            record(c.server, c.staleness)
        _hooks.generated(completions)

    def contradicted(
        self, record: ServerRecord, completions: Sequence[Completion], published: int
    ) -> bool:
        """Whether ``completions`` carry versions the fleet did not accept when their
        request was admitted, with ``published`` versions in its history then (then their
        server is suspect: `Ledger.contradicted`)."""
        ledger = self.ledger
        history, bound = ledger.history(), ledger.max_staleness
        bad: list[str | None] = []
        for c in completions:
            found = contradicts(history, bound, c, published=published)
            bad += [v for v in found if v not in bad]
        if not bad:
            return False
        ledger.contradicted(record, bad)
        return True

    def failed_over(self, send: SendOptions, record: ServerRecord, err: AsyncSyncError) -> bool:
        """After a failure on ``record``'s server: whether the request never reached it
        (then the session, if any, is unpinned and the caller may try another one)."""
        if not never_sent(err):
            return False
        logger.info("generation never reached %s (%s): trying another server", record.url, err)
        if send.session_id is not None:
            self.ledger.session_ended(send.session_id)
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
        return await self._routed(send, frozenset(), call, *args, **kwargs)

    async def _routed(
        self,
        send: SendOptions,
        rejected: frozenset[str],
        call: Callable[Concatenate[GenerationEngine, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        tried = rejected
        while True:
            record = await self.admit(send, tried)
            try:
                return await call(self.engine(record), *args, **kwargs)
            except AsyncSyncError as err:
                if not self.failed_over(send, record, err):
                    raise
                tried = tried | {record.url}
                if len(tried) >= len(self.members):
                    raise
            finally:
                self.release(record)

    async def generate(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> list[Completion]:
        """One routed generation; its completions tagged with their staleness. An
        answer whose versions the fleet does not accept is sent again on another server
        (its own is suspect now), at most once per server."""
        ledger = self.ledger
        call = GenerationEngine.generate if send.lora is None else adapters.bind(ledger, send.lora)
        rejected: frozenset[str] = frozenset()
        while True:
            published = len(ledger.history())
            try:
                out = await self._routed(send, rejected, call, prompt, req, send)
            except GenerationAborted as err:
                self.tag(err.completions)
                raise
            server = out[0].server if out else ""
            if server not in ledger or not self.contradicted(ledger.record(server), out, published):
                self.tag(out)
                return out
            rejected = rejected | {server}
            if send.session_id is not None:
                ledger.session_ended(send.session_id)
            versions = sorted({str(s.version) for c in out for s in c.weight_versions})
            if len(rejected) >= len(self.members):
                raise GenerationError(
                    f"every server answered with weight versions the fleet does not accept "
                    f"(last: {', '.join(versions)} from {server}); they are suspect until "
                    "their identity is read, and stale ones are caught up",
                    server=server,
                )
            logger.warning(
                "generation on %s came back with version(s) %s, which the fleet does not "
                "accept: sent again on another server", server, ", ".join(versions),
            )  # fmt: skip

    def stream(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> CompletionStream:
        return CompletionStream(_FleetLease(self, send), prompt, req, send)


class _FleetLease:
    """A stream's server, chosen by routing when it opens and held until it closes."""

    def __init__(self, dispatcher: Dispatcher, send: SendOptions) -> None:
        self._dispatcher = dispatcher
        self._send = send
        self._held: ServerRecord | None = None
        self._published = 0
        self._tried: set[str] = set()
        #: (server, adapter, version) a ``lora=name`` stream is sent with, in use until
        #: it ends (its directory is kept as long)
        self._using: tuple[str, str, str] | None = None

    async def acquire(self) -> GenerationEngine:
        self._let_go()
        self._published = len(self._dispatcher.ledger.history())
        record = self._held = await self._dispatcher.admit(self._send, self._tried)
        return self._dispatcher.engine(record)

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
        ledger = self._dispatcher.ledger
        version = ledger.adapter_held(url, name)
        if version is None:  # unloaded between admission and now: never silently
            raise GenerationError(f"adapter {name!r} is not loaded on {url}", server=url)
        ledger.adapter_use_began(url, name, version)
        self._using = (url, name, version)
        return req._replace(model=adapters.served_name(name, version))

    def release(self, completions: list[Completion] | None) -> None:
        if completions:
            if self._using is not None:
                adapters.tag(completions, self._using[1], self._using[2])
            held = self._held
            if held is not None and self._dispatcher.contradicted(
                held, completions, self._published
            ):
                logger.warning(
                    "a stream from %s came back with versions the fleet does not accept "
                    "(%s): returned with its true versions (Completion.weight_versions); the "
                    "server is suspect until its identity is read",
                    held.url,
                    ", ".join(repr(s.version) for c in completions for s in c.weight_versions),
                )
            self._dispatcher.tag(completions)
        self._let_go()

    def _let_go(self) -> None:
        if self._using is not None:
            self._dispatcher.ledger.adapter_use_ended(*self._using)
            self._using = None
        if self._held is not None:
            self._dispatcher.release(self._held)
            self._held = None
