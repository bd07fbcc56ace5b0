"""What a fleet sent and how each call ended, recorded as it happened.

docs/testing.md ("Ordering in tests"): a test that proves "one deadline, not two" by a
wall-clock bound fails on a slow machine (the round itself can take longer than the
margin) and passes one that waited twice on a fast one. The calls that timed out, and
what was sent to a server after its deadline fired, say it whatever the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import asyncsync as az

__all__ = ["PROBES", "CallLog", "Sent", "recording"]

#: The fleet's health probe of a server: ``GET /health``, then its identity.
PROBES = ("health", "identity")


@dataclass(frozen=True)
class Sent:
    """One send of a call to a server (a retried or resent call is one per try)."""

    url: str
    op: str  # e.g. "start_weight_update"
    route: str  # e.g. "/start_weight_update"
    phase: str  # the deadline it ran under: connect, control, update or generate
    error: BaseException | None  # None: answered (CancelledError: cancelled in flight)
    seconds: float  # reported when a test prints it, never asserted

    @property
    def timed_out(self) -> bool:
        """The call's deadline fired (no answer within it)."""
        return isinstance(self.error, az.ServerTimeout)


class CallLog:
    """The sends of the clients being recorded, in the order they ended."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []

    def mark(self) -> int:
        """A place in the log: `since` returns what ended after it."""
        return len(self.sent)

    def since(self, mark: int) -> list[Sent]:
        return self.sent[mark:]

    def to(self, url: str, since: int = 0) -> list[Sent]:
        """The sends to ``url`` (after ``since``)."""
        return [s for s in self.sent[since:] if s.url == url]

    def round_calls(self, url: str, since: int = 0) -> list[Sent]:
        """The sends to ``url`` (after ``since``) less the fleet's own health probes of
        it (``/health`` and the identity read), which the ledger's monitor runs beside a
        round once a server is suspect and which hold no round."""
        return [s for s in self.to(url, since) if s.op not in PROBES]

    def slowest_answer(self, url: str, phase: str) -> float:
        """Seconds of the slowest answered send to ``url`` under ``phase``'s deadline
        (0 when none): the margin that deadline had, for a test to print."""
        answered = [s.seconds for s in self.to(url) if s.phase == phase and s.error is None]
        return max(answered, default=0.0)

    def timed_out(self, since: int = 0) -> list[Sent]:
        """The sends whose deadline fired (after ``since``): one per deadline waited."""
        return [s for s in self.sent[since:] if s.timed_out]


@contextmanager
def recording(clients: Iterable[az.AsyncVLLMClient]) -> Iterator[CallLog]:
    """Record every send of ``clients`` (e.g. ``fleet.client(url) for url in fleet.urls``)
    while the block runs: one `Sent` per try, as it ends."""
    log = CallLog()
    endpoints = [client._endpoint for client in clients]
    for endpoint in endpoints:
        endpoint._send_once = _recorded(endpoint, endpoint._send_once, log)  # type: ignore[method-assign]
    try:
        yield log
    finally:
        for endpoint in endpoints:
            del endpoint._send_once


def _recorded(
    endpoint: Any, send: Callable[..., Awaitable[Any]], log: CallLog
) -> Callable[..., Awaitable[Any]]:
    async def send_once(call: Any, body: bytes | None, timeouts: Any) -> Any:
        began = time.monotonic()
        error: BaseException | None = None
        try:
            return await send(call, body, timeouts)
        except BaseException as exc:  # an error, or cancelled in flight
            error = exc
            raise
        finally:
            seconds = time.monotonic() - began
            log.sent.append(Sent(endpoint.url, call.op, call.route, call.phase, error, seconds))

    return send_once
