"""One control call sent to many servers at once, each payload encoded once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from asyncsync._core.errors import AsyncSyncError, ProtocolError
from asyncsync._core.timeouts import Timeouts
from asyncsync._core.types import CallOutcome, FleetResult, Phase, ProtocolGeneration
from asyncsync._fleet.members import Members
from asyncsync._wire.control import Call

__all__ = ["Plan", "fan_out"]

T = TypeVar("T")

#: Builds the call for a protocol generation and a server URL.
Plan = Callable[[ProtocolGeneration, str], Call[T]]

_PROTOCOLS: tuple[ProtocolGeneration, ...] = ("0.32", "0.23")


class _Plans(Generic[T]):
    """Calls planned once per protocol generation (or per server, when the payload
    differs per server) and encoded once, when a server first needs them: the same
    bytes go to every server of that generation."""

    def __init__(self, plan: Plan[T], *, per_server: bool) -> None:
        self._plan = plan
        self._per_server = per_server
        self._calls: dict[Any, Call[T] | ProtocolError] = {}
        self._bodies: dict[Any, bytes | None] = {}
        if not per_server:  # argument errors raise here, before anything is sent
            for protocol in _PROTOCOLS:
                self._make(protocol, "", protocol)

    def _make(self, protocol: ProtocolGeneration, url: str, key: Any) -> None:
        try:
            self._calls[key] = self._plan(protocol, url)
        except ProtocolError as err:  # this generation lacks the route: per-server error
            self._calls[key] = err

    def get(self, protocol: ProtocolGeneration, url: str) -> tuple[Call[T], bytes | None]:
        key: Any = (protocol, url) if self._per_server else protocol
        if key not in self._calls:
            self._make(protocol, url, key)
        call = self._calls[key]
        if isinstance(call, ProtocolError):
            raise ProtocolError(call.message, server=url, route=call.route)
        if key not in self._bodies:
            self._bodies[key] = call.encode()
        return call, self._bodies[key]


async def fan_out(
    members: Members,
    op: str,
    plan: Plan[T],
    urls: list[str],
    *,
    per_server: bool = False,
    at_least: float | None = None,
) -> FleetResult[T]:
    """Send ``op`` to every server in ``urls`` concurrently and wait for all of them.

    Each server's failure is its `CallOutcome`; nothing is raised for it
    here. Each server's endpoint reports its answer to the ledger as it arrives; a call
    cancelled in flight leaves a server that was mid-update dirty (`Ledger.cancelled`).
    ``at_least``: the call's deadline is at least this many seconds (a call whose
    first answer is slow by nature: the identity's).
    """
    plans: _Plans[T] = _Plans(plan, per_server=per_server)
    loop = asyncio.get_running_loop()
    ledger = members.ledger

    async def one(url: str) -> CallOutcome[T]:
        if url not in members:  # removed since the call was planned: nothing sent
            gone = AsyncSyncError("removed from the fleet", server=url)
            return CallOutcome(url, error=gone, seconds=0.0)
        client = members.client(url)
        record = client._endpoint.record
        started = loop.time()
        ledger.call_began(record)
        try:
            call, body = plans.get(await client.protocol(), url)
            timeouts = client.timeouts
            if at_least is not None:
                timeouts = _at_least(timeouts, call.phase, at_least)
            value = await client._endpoint.request(call, body, timeouts=timeouts)
        except asyncio.CancelledError:
            ledger.cancelled(record, op)
            raise
        except Exception as exc:  # each server's failure is its outcome
            return CallOutcome(url, error=exc, seconds=loop.time() - started)
        finally:
            ledger.call_ended(record)
        return CallOutcome(url, value=value, seconds=loop.time() - started)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(url), name=f"asyncsync:{op}:{url}") for url in urls]
    return FleetResult(op, {url: t.result() for url, t in zip(urls, tasks, strict=True)})


def _at_least(timeouts: Timeouts, phase: Phase, seconds: float) -> Timeouts:
    """``timeouts`` with ``phase``'s deadline raised to ``seconds`` (never lowered)."""
    current = timeouts.for_phase(phase)
    if current is None or current >= seconds:
        return timeouts
    return dataclasses.replace(timeouts, **{phase: seconds})
