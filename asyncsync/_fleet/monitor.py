"""Health probes of a fleet's servers, and the background task that runs them.

`probe` is the fleet's health probe (``Fleet.health``): ``GET /health`` on each
server, then, on those that answered, ``GET /server_info`` for the process identity
(`asyncsync._wire.control.plan_identity`), reported to the ledger
(`Ledger.identified`: a new identity is a restart). A server that does not answer one
of them failed the probe (`Ledger.probe_failed`).

`Monitor` probes, in the background, every server the ledger holds suspect or dead
(its last call failed, an answer contradicted the record): at once, then after a
back-off that doubles up to `MAX_PROBE_INTERVAL`. It also settles the ledger again when a
flapping server's hold ends. It runs only while there is something to do, woken by the
ledger's change signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from asyncsync._core.errors import AsyncSyncError
from asyncsync._core.ledger import Ledger, ServerRecord
from asyncsync._core.types import CallOutcome, FleetResult
from asyncsync._fleet.fanout import fan_out
from asyncsync._fleet.members import Members
from asyncsync._wire import control as wire

__all__ = ["MAX_PROBE_INTERVAL", "Monitor", "probe"]

logger = logging.getLogger("asyncsync.fleet")

#: The longest wait between two probes of a server that does not answer (seconds).
MAX_PROBE_INTERVAL = 5.0
#: The wait after a server's first failed probe (doubles with each further one).
_FIRST_INTERVAL = 0.5
#: The shortest deadline of an identity read: vLLM answers its first ``/server_info``
#: only once it has collected its environment (``pip list``, the CPU...), 1.7 s on an
#: idle 2-core machine, far longer on a loaded one. It is asked only of a server that
#: has just answered ``/health``: a frozen or dead server fails that first, under the
#: control deadline.
IDENTITY_DEADLINE = 120.0


async def probe(members: Members, urls: list[str]) -> FleetResult[None]:
    """``GET /health``, then the identity of each server that answered (see the module);
    each server's outcome is the probe's (an identity that could not be read fails it,
    unless the server does not serve ``/server_info``)."""
    ledger = members.ledger
    health: FleetResult[None] = await fan_out(
        members, "health", lambda _p, _u: wire.plan_health(), urls
    )
    outcomes = dict(health.outcomes)
    answered = [url for url in urls if health[url].ok]
    if answered:
        identities: FleetResult[str | None] = await fan_out(
            members, "identity", lambda _p, _u: wire.plan_identity(), answered,
            at_least=IDENTITY_DEADLINE,
        )  # fmt: skip
        for url in answered:
            found = identities[url]
            record = _record(members, url)
            if record is None:
                continue
            if found.ok:
                ledger.identified(record, found.value)
            elif _not_served(found.error):
                ledger.identified(record, None)  # no identity to read: none to compare
            else:
                outcomes[url] = CallOutcome(url, error=found.error, seconds=found.seconds)
    for url, outcome in outcomes.items():
        record = _record(members, url)
        if outcome.error is not None and record is not None:
            ledger.probe_failed(record, outcome.error)
    return FleetResult("health", outcomes)


def _record(members: Members, url: str) -> ServerRecord | None:
    """``url``'s record, unless it left the fleet meanwhile."""
    return members.record(url) if url in members else None


def _not_served(error: BaseException | None) -> bool:
    """``/server_info`` is not there (404: a server without dev mode's routes, a fake)."""
    return isinstance(error, AsyncSyncError) and error.status == 404


class Monitor:
    """Background probes of a fleet's suspect and dead servers (see the module)."""

    def __init__(self, ledger: Ledger, check: Callable[[list[str]], Awaitable[object]]) -> None:
        self._ledger = ledger
        self._check = check
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._due: dict[str, float] = {}
        self._closed = True

    def start(self) -> None:
        """Listen to the ledger (the fleet is open)."""
        self._closed = False
        self._ledger.add_listener(self._kick)
        self._kick()

    async def aclose(self) -> None:
        self._closed = True
        self._ledger.remove_listener(self._kick)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _needs(self) -> list[ServerRecord]:
        return [r for r in self._ledger.records() if r.suspect or not r.healthy or r.dead]

    def _kick(self) -> None:
        """The ledger changed: wake the task, or start it when there is work."""
        if self._closed:
            return
        if self._task is not None and not self._task.done():
            if self._wake is not None:
                self._wake.set()
            return
        if not self._ledger.unwell:  # every server healthy: nothing to probe or wait for
            return
        if not self._needs() and self._ledger.next_hold_end() is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet (a fleet built outside one): later
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="asyncsync:fleet-monitor")

    async def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while not self._closed:
            now = time.monotonic()
            needs = self._needs()
            hold_end = self._ledger.next_hold_end()  # of a hold still running
            if not needs and hold_end is None:
                self._due.clear()
                return
            due = [r for r in needs if self._due.get(r.url, 0.0) <= now]
            if due:
                for record in due:
                    self._due[record.url] = now + _interval(record)
                try:
                    await self._check([r.url for r in due])
                except Exception:  # a probe must never take the monitor down
                    logger.exception("probing %s failed", ", ".join(r.url for r in due))
                continue
            wake.clear()
            times = [self._due.get(r.url, now) for r in needs]
            if hold_end is not None:
                times.append(hold_end)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(min(times) - now, 0.0) if times else None):
                    await wake.wait()
            if hold_end is not None and time.monotonic() >= hold_end:
                # A hold ended: its server settles again (held out no more, it is stale
                # or healthy, and a catch-up may follow). `next_hold_end` names only
                # holds still running, so this is the one moment that sees it end.
                self._ledger.tick()
            # forget servers that recovered or left
            known = {r.url for r in self._ledger.records()}
            self._due = {u: t for u, t in self._due.items() if u in known}


def _interval(record: ServerRecord) -> float:
    """The wait before ``record``'s next probe: 0.5 s after a first failure, doubling,
    up to `MAX_PROBE_INTERVAL`."""
    if record.failures <= 0:
        return _FIRST_INTERVAL
    return min(_FIRST_INTERVAL * 2.0**record.failures, MAX_PROBE_INTERVAL)
