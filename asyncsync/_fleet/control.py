"""The fleet's control calls: one call fanned out to the targeted servers.

`FleetControl` is the part of a `asyncsync.Fleet` that sends vLLM's RL, cache and
health routes: `Fleet`'s control methods plan their call (`asyncsync._wire.control`)
and hand it here, which sends it to every target at once (`fan_out`) and applies the
partial-failure policy. What the answers mean for each server is the ledger's business
(each endpoint reports to it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from asyncsync._core.errors import ProtocolError, ServerError
from asyncsync._core.types import CallOutcome, FleetResult, Require, check_require
from asyncsync._fleet.fanout import Plan, fan_out
from asyncsync._fleet.members import Members
from asyncsync._fleet.monitor import probe
from asyncsync._http.transport import Transport

__all__ = ["FleetControl"]

T = TypeVar("T")
_Targets = Iterable[str] | None


class FleetControl:
    """Sends a fleet's control calls (see the module docstring)."""

    def __init__(
        self, members: Members, transport: Transport, require: Callable[[], Require]
    ) -> None:
        self.members = members
        self.ledger = members.ledger
        self._transport = transport
        self._require = require

    def policy(self, require: Require | None) -> Require:
        return check_require(self._require() if require is None else require)

    async def fan(
        self, op: str, plan: Plan[T], targets: _Targets, require: Require | None, **kw: bool
    ) -> FleetResult[T]:
        """``op`` on every target at once; argument errors raise before anything is
        sent; then the partial-failure policy decides whether the result raises."""
        require = self.policy(require)
        self._transport.open()
        result = await fan_out(self.members, op, plan, self.members.resolve(targets), **kw)
        result.raise_on_failure(require)
        return result

    async def health(self, targets: _Targets, require: Require | None) -> FleetResult[None]:
        """The health probe (`asyncsync._fleet.monitor.probe`): ``/health``, then each
        answering server's identity."""
        require = self.policy(require)
        self._transport.open()
        result = await probe(self.members, self.members.resolve(targets))
        result.raise_on_failure(require)
        return result

    async def rejected_update(
        self, plan: Plan[None], targets: _Targets, require: Require | None
    ) -> FleetResult[None]:
        """An update sent to be rejected (``expect_failure=True``): an HTTP error answer
        is the successful outcome (the server dropped its active update), a 2xx answer
        or no answer a failed one. The rejection is the answer asked for, not a failure:
        each server's last error keeps what went wrong before (the cause of the round
        that is being ended)."""
        urls = self.members.resolve(targets)
        before = {u: self.members.record(u).last_error for u in urls}
        result = await self.fan("update_weights", plan, urls, "none")
        result = FleetResult(result.operation, {u: _rejected(o) for u, o in result.items()})
        for url, outcome in result.items():
            if outcome.ok and url in before and url in self.members:
                self.ledger.error_restored(url, before[url])
        result.raise_on_failure(self.policy(require))
        return result

    def record_if_all(self, result: FleetResult[Any], version: str | None) -> None:
        """A version every targeted server now holds is published (by hand: the control
        routes called directly, not by a round, which records its own)."""
        if result.ok and version is not None:
            self.ledger.published_by_hand(version, result.succeeded)


def _rejected(outcome: CallOutcome[Any]) -> CallOutcome[Any]:
    """The outcome of an update sent to be rejected: an HTTP error answer means the
    server dropped its active update (success); a 2xx or no answer is a failure."""
    error = outcome.error
    if isinstance(error, ServerError) and error.status is not None:
        return CallOutcome(outcome.url, value=None, seconds=outcome.seconds)
    if error is None:
        return CallOutcome(
            outcome.url,
            error=ProtocolError(
                "the server accepted an update that was sent to be rejected "
                "(expect_failure=True): its update may still be active",
                server=outcome.url,
                route="/update_weights",
            ),
            seconds=outcome.seconds,
        )
    return outcome
