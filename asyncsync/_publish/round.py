"""One weight-sync round across a fleet, as named phases run by a round object.

The phases, in order: ``init`` (the publisher's first round) -> ``probe`` (servers
known to be unhealthy) -> ``pause``? -> ``start`` -> ``update`` (once per payload) ->
``finish`` -> ``reset_prefix_cache``? -> ``verify``? -> commit -> ``resume``? (resume
also after a failure; before ``verify`` when a probe must generate). Start, update and
finish are driven by the backend's blocking send in a worker thread (vLLM's trainer
engines do so), through a `RoundClient` whose calls land on this round's phase
methods; the round runs the other phases around the send.

A round is partial: each phase fans out to the servers still in the round (``live``),
and a server that fails there (an error answer, a malformed one, no answer, a refused
connection) drops out: it is marked dirty and never sent anything more in this round,
while the others go on. The round is published (`commit`) when at least ``need``
servers went through every phase; below that it fails at once (`rollback`, then
`PublishError`), leaving the version unchanged. Per-server transports (shm, ipc) just go
on without the lost server. A collective transport (gloo, nccl) cannot: a lost member
breaks the collective. There the round stops the send, ends the survivors' updates and
sends the whole round once more to the survivors, whose backend builds a new group
without the lost servers (see `PublishRound.send`).

A mixed round (``backend="auto"``: shm to the servers on the trainer's host, gloo to the
others) is still one round with one version: its backend sends each transport's share
through a `Lane`, the same calls restricted to some of the round's servers. Every
phase records into the one round (outcomes, drops, timings); only the servers of a
collective transport (``collective``, a set of URLs) make a loss a regroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from asyncsync._core.errors import (
    AsyncSyncError,
    FleetError,
    PublishError,
    ServerTimeout,
    ServerUnavailableError,
)
from asyncsync._core.types import CallOutcome, FleetResult
from asyncsync._http.transport import never_sent
from asyncsync._publish.bridge import RoundClient
from asyncsync._publish.report import (
    SECONDS_ORDER,
    Phase,
    PublishReport,
    ServerOutcome,
    publish_error,
)
from asyncsync._publish.verify import TrainerDigests, Verify, VerifyResult, verify_servers
from asyncsync.backends.contract import InitInfo, RoundCancelled, SendStats, UpdateInfo

if TYPE_CHECKING:
    from asyncsync._core.ledger import Target
    from asyncsync.fleet import Fleet

T = TypeVar("T")

__all__ = [
    "InitCalls",
    "Lane",
    "Phase",
    "PublishReport",
    "PublishRound",
    "SendJob",
    "ServerOutcome",
    "is_stale_round_error",
    "run_to_the_end",
]

PauseMode = Literal["keep", "wait", "abort"]

logger = logging.getLogger("asyncsync.publish")

#: What the worker thread runs for a round: the backend's send through the client.
SendJob = Callable[[RoundClient, threading.Event], SendStats]
#: A phase's fan-out to the servers still in the round.
_Call = Callable[[list[str]], Awaitable[FleetResult[Any]]]


def is_stale_round_error(error: object) -> bool:
    """Whether a failed ``/start_weight_update`` means the server still holds a round
    that an earlier trainer opened and never ended (it died mid-round).

    vLLM refuses a start while an update is active with a worker failure (HTTP 500)
    whose message is ``"start_weight_update called while a weight update is already
    active. Call finish_weight_update first."`` (vLLM 0.32, the worker's
    ``start_weight_update``); that message is the only signal HTTP gives.
    """
    return "already active" in str(error)


class _TooFew(FleetError):
    """Fewer servers than the round needs are left: the round fails. A `FleetError` of
    the lost servers' errors, so that a backend that explains a server's error (the
    error reaches it in the worker thread) sees them."""


class _Regroup(Exception):
    """A collective transport lost a server: the send stops, to go again without it."""


#: Some of a round's servers (a lane), or None: all of them.
_Only = Set[str] | None


class InitCalls:
    """The fan-outs a backend may make outside a round's phases (its init, world sizes),
    to the servers in the round (``live``), or to those of them in ``only``."""

    def __init__(self, fleet: Fleet, targets: Sequence[str]) -> None:
        self.fleet = fleet
        self.live = list(targets)

    def _live(self, only: _Only) -> list[str]:
        """The servers still in the round (of ``only``), and still in the fleet."""
        return [url for url in self.live if (only is None or url in only) and url in self.fleet]

    def lane(self, urls: Sequence[str]) -> Lane:
        """These calls restricted to ``urls`` (one transport's servers)."""
        return Lane(self, frozenset(urls))

    async def servers(self, only: _Only = None) -> list[str]:
        """The servers still in the round (of ``only``)."""
        return self._live(only)

    async def init(self, init_info: InitInfo, only: _Only = None) -> None:
        await self.fleet.init_weight_transfer_engine(
            init_info, targets=self._live(only), require="all"
        )

    async def world_sizes(self, only: _Only = None) -> dict[str, int]:
        result = await self.fleet.get_world_size(targets=self._live(only), require="all")
        return dict(result.values_by_url)

    def update_deadline(self, only: _Only = None) -> float | None:
        """The shortest update deadline of the servers (None: some have none)."""
        limits = [self.fleet.client(url).timeouts.update for url in self._live(only)]
        known = [x for x in limits if x is not None]
        return min(known) if known and len(known) == len(limits) else None

    async def start(self, only: _Only = None) -> None:
        raise RuntimeError("start_weight_update is only allowed inside a publish round")

    async def _start_route(self, urls: list[str]) -> FleetResult[None]:
        """The start of a round into the served model (`DraftRound`: its draft)."""
        return await self.fleet.start_weight_update(targets=urls, require="none")

    #: what the round loads into (`DraftRound`: the draft model)
    target: Target = "main"

    def _mark_dirty(self, urls: list[str]) -> None:
        """What this round may have left half loaded on ``urls`` is dirty (the served
        model's weights; `DraftRound`: the draft model's)."""
        for url in urls:
            self.fleet.ledger.server_lost(url, self.target)

    async def update(self, update_info: UpdateInfo, only: _Only = None) -> None:
        raise RuntimeError("update_weights is only allowed inside a publish round")

    async def finish(self, weight_version: str | None, only: _Only = None) -> None:
        raise RuntimeError("finish_weight_update is only allowed inside a publish round")


class Lane:
    """A round's calls restricted to some of its servers: what one transport of a mixed
    round sends through (`asyncsync._publish.bridge.FleetCalls`). Its phases are the
    round's: outcomes, drops and timings land in the one round."""

    def __init__(self, calls: InitCalls, urls: frozenset[str]) -> None:
        self._calls = calls
        self.urls = urls

    async def servers(self) -> list[str]:
        return await self._calls.servers(self.urls)

    async def init(self, init_info: InitInfo) -> None:
        await self._calls.init(init_info, self.urls)

    async def world_sizes(self) -> dict[str, int]:
        return await self._calls.world_sizes(self.urls)

    def update_deadline(self) -> float | None:
        return self._calls.update_deadline(self.urls)

    async def start(self) -> None:
        await self._calls.start(self.urls)

    async def update(self, update_info: UpdateInfo) -> None:
        await self._calls.update(update_info, self.urls)

    async def finish(self, weight_version: str | None) -> None:
        await self._calls.finish(weight_version, self.urls)


class PublishRound(InitCalls):
    """One round: its phases, timings, per-server outcomes, rollback and commit.

    ``need``: how many servers must go through the whole round for it to be published
    (``publish(min_servers=...)``). ``collective``: the backend's payloads are
    collectives across every server (a lost server breaks them); or the set of servers
    whose transport is collective (a mixed round). ``resendable``: the
    weights can be iterated again (a collective round is then sent again once without
    a lost server). ``abort_info`` is the backend's update that ends an open update on a
    server (``TrainerBackend.abort_info``). ``published_version`` is the last published
    version; `commit` advances it. ``catch_up``: the round sends the published version
    again to servers that lack it (`asyncsync._publish.catchup`): its commit records
    them caught up and publishes nothing new. ``on_probed`` is called with the servers
    whose process the probe found new (restarted since ``identities``, the identity
    each had when the publisher last reached it), before anything is sent.
    """

    def __init__(
        self,
        fleet: Fleet,
        targets: Sequence[str],
        *,
        version: str,
        need: int,
        pause: PauseMode | None,
        reset_prefix_cache: bool,
        abort_info: Mapping[str, Any],
        published_version: str | None,
        collective: bool | Set[str] = False,
        resendable: bool = True,
        seconds: dict[str, float] | None = None,
        verify: Verify | None = None,
        digests: TrainerDigests | None = None,
        catch_up: bool = False,
        identities: Mapping[str, str | None] | None = None,
        on_probed: Callable[[list[str]], None] | None = None,
    ) -> None:
        super().__init__(fleet, targets)
        self.targets = list(targets)
        self.version = version
        self.need = need
        #: the servers on a collective transport (losing one of them is a regroup)
        self.collective = frozenset(self.targets if collective is True else collective or ())
        self.resendable = resendable
        self.pause_mode = pause
        self.reset_cache = reset_prefix_cache
        self.abort_info = abort_info
        self.published_version = published_version
        self.seconds: dict[str, float] = dict(seconds or {})
        self.outcomes = {url: ServerOutcome(url, ok=True) for url in self.targets}
        #: servers holding this round's (or a stale round's) active update
        self.open: set[str] = set()
        #: servers this round's start was sent to: on a failure they hold weights of no
        #: published version (dirty), finished or not
        self.touched: set[str] = set()
        #: servers a call of this round connected to (it answered, or may have run
        #: there): a lost server outside it was never reached (`ServerOutcome.reached`)
        self.connected: set[str] = set()
        #: servers a pause was attempted on (resumed whatever happens), from the start
        #: those an earlier round left paused (its rollback skips a server that did not
        #: answer: this round resumes it once it answers again)
        self.to_resume: list[str] = [
            url for url in self.targets if url in fleet and fleet.ledger.record(url).paused
        ]
        #: whether the round reached the servers' start (bad input never does)
        self.start_attempted = False
        #: a collective attempt lost a server; `attempts` is 2 once it was sent again
        self.regroup = False
        self.attempts = 1
        self.verify = verify
        self.digests = digests
        self.verified: dict[str, VerifyResult] = {}
        self.catch_up = catch_up
        self.identities = dict(identities or {})
        self.on_probed = on_probed

    # ------------------------------------------------------------------ the round
    async def run(
        self, job: SendJob, executor: Executor, init: Callable[[], Awaitable[None]] | None = None
    ) -> PublishReport:
        """init? -> probe -> pause? -> send (start, update(s), finish) ->
        reset_prefix_cache? -> verify? -> commit -> resume?; too few servers left:
        rollback, then the error."""
        began = time.perf_counter()
        what = "catching up" if self.catch_up else "publishing"
        logger.info("%s %r to %d server(s)", what, self.version, len(self.targets))
        self.fleet.ledger.round_started(self.version, self.targets, self.target)
        try:
            if init is not None:
                await self._init(init)
            if self.pause_mode is not None:
                await self._probe_and_pause()
            else:
                await self.probe()
            stats = await self.send(job, executor)
            if self.reset_cache:
                await self.reset_prefix_cache()
            if self.verify is not None:
                await self.verify_weights(executor)
        except BaseException as exc:
            logger.warning("publishing %r failed (%s): rolling back", self.version, _name(exc))
            await run_to_the_end(self.rollback())
            if self._passes_through(exc):
                raise
            raise self.error(exc) from self._root_cause(exc)
        self.commit()
        await run_to_the_end(self.wind_down())
        return self.report(stats, time.perf_counter() - began)

    def _root_cause(self, exc: BaseException) -> BaseException:
        """What made the round fail: too few servers left means the first lost one's
        error (a one-server round's is the server's own)."""
        if isinstance(exc, _TooFew | _Regroup):
            for outcome in self.outcomes.values():
                if outcome.error is not None:
                    return outcome.error
        return exc

    def _passes_through(self, exc: BaseException) -> bool:
        """Cancellation, and bad input refused before any server's start, are raised
        as they are; every other failure becomes a PublishError."""
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | RoundCancelled):
            return True
        return isinstance(exc, ValueError | TypeError) and not self.start_attempted

    # ------------------------------------------------------------------ phases
    async def _init(self, init: Callable[[], Awaitable[None]]) -> None:
        """The backend's init (the publisher's first round). A collective transport that
        lost a server here has no group: the first send builds one for those left."""
        try:
            await self._timed(Phase.INIT, init)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | _TooFew):
                raise
            if not self.regroup:
                raise
            self.regroup = False

    async def init(self, init_info: InitInfo, only: _Only = None) -> None:
        await self._phase(
            Phase.INIT,
            lambda live: self.fleet.init_weight_transfer_engine(
                init_info, targets=live, require="none"
            ),
            only,
        )

    async def world_sizes(self, only: _Only = None) -> dict[str, int]:
        result = await self._phase(
            Phase.INIT, lambda live: self.fleet.get_world_size(targets=live, require="none"), only
        )
        return {url: result[url].unwrap() for url in self._live(only)}

    async def probe(self) -> None:
        """Every server answers the health probe (``/health`` and its identity, under
        the control deadline) or drops out now, before anything waits an update
        deadline for it. A server whose process is new since the publisher last
        reached it (restarted) is reported to `on_probed` before anything is sent."""
        await self._phase(Phase.PROBE, lambda live: self.fleet.health(targets=live, require="none"))
        ledger = self.fleet.ledger
        restarted = [
            url
            for url in self._live(None)
            if self.identities.get(url) is not None
            and ledger.record(url).identity != self.identities[url]
        ]
        if restarted and self.on_probed is not None:
            self.on_probed(restarted)

    async def _probe_and_pause(self) -> None:
        """The probe and the pause at once: the pause is not held up by the probe's
        answers (generations keep running on old weights meanwhile); a server the probe
        drops was paused too, and is resumed with the others."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.probe())
                group.create_task(self.pause())
        except BaseExceptionGroup as failed:
            raise _first(failed) from None

    async def pause(self) -> None:
        assert self.pause_mode is not None
        mode = self.pause_mode
        # resumed even if the pause fails midway
        self.to_resume.extend(url for url in self.live if url not in self.to_resume)
        await self._phase(
            Phase.PAUSE, lambda live: self.fleet.pause(mode, targets=live, require="none")
        )

    async def send(self, job: SendJob, executor: Executor) -> SendStats:
        """The backend's blocking send in the worker thread. A collective transport that
        lost a server is sent again, once, to the servers left (the backend builds a new
        group for them: `InitCalls.world_sizes` now names only those)."""
        try:
            return await self._send_once(job, executor)
        except BaseException as exc:
            if not self._may_regroup(exc):
                raise
        self.attempts, self.regroup = 2, False
        logger.warning(
            "round %r: the collective lost %s; sending it again to %s in a new group",
            self.version, ", ".join(self.lost()), ", ".join(self.live),
        )  # fmt: skip
        await self._end_updates([url for url in sorted(self.open) if url in self.live])
        return await self._send_once(job, executor)

    def _may_regroup(self, exc: BaseException) -> bool:
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | RoundCancelled | _TooFew):
            return False
        return self.regroup and self.attempts == 1 and self.resendable

    async def _send_once(self, job: SendJob, executor: Executor) -> SendStats:
        """One run of the send. Cancelling stops it at the next chunk boundary; the
        thread is never abandoned mid-chunk."""
        cancel = threading.Event()
        client = RoundClient.on_running_loop(self, cancel=cancel, version=self.version)
        future = asyncio.get_running_loop().run_in_executor(executor, job, client, cancel)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()  # the thread stops at its next chunk boundary
            with contextlib.suppress(Exception):  # its RoundCancelled, or its error
                await run_to_the_end(future)
            raise

    async def start(self, only: _Only = None) -> None:
        self.start_attempted = True
        await self._phase(Phase.START, self._start_on, only)

    async def _start_on(self, live: list[str]) -> FleetResult[None]:
        """Start on ``live``; a server still holding a round an earlier trainer left
        open has that round ended, then is started again."""
        self.touched.update(live)
        result = await self._start_route(live)
        self.open.update(result.succeeded)
        stale = [u for u in result.failed if is_stale_round_error(result[u].error)]
        if not stale:
            return result
        for url in stale:  # whichever model the stale round was loading
            self.fleet.ledger.server_lost(url)
        await self._end_updates(stale)
        again = await self._start_route(stale)
        self.open.update(again.succeeded)
        return FleetResult(result.operation, {**result.outcomes, **again.outcomes})

    async def update(self, update_info: UpdateInfo, only: _Only = None) -> None:
        await self._phase(
            Phase.UPDATE,
            lambda live: self.fleet.update_weights(update_info, targets=live, require="none"),
            only,
        )

    async def finish(self, weight_version: str | None, only: _Only = None) -> None:
        await self._phase(Phase.FINISH, lambda live: self._finish_on(live, weight_version), only)

    async def _finish_on(self, live: list[str], weight_version: str | None) -> FleetResult[None]:
        # The round holds these servers: the finish records no version, the commit does.
        result = await self.fleet.finish_weight_update(weight_version, targets=live, require="none")
        self.open.difference_update(result.succeeded)  # those hold the round's weights
        return result

    async def reset_prefix_cache(self) -> None:
        await self._phase(
            Phase.RESET_PREFIX_CACHE,
            lambda live: self.fleet.reset_prefix_cache(targets=live, require="none"),
        )

    async def verify_weights(self, executor: Executor) -> None:
        """Check every server left against the trainer; one that does not match (or
        cannot be checked) drops out. A probe generates, so paused servers are resumed
        first."""
        assert self.verify is not None
        verify = self.verify
        if verify.probe is not None and self.to_resume:
            await self.fleet.resume(targets=self.to_resume, require="none")
            self.to_resume = []  # resumed: neither the commit nor a rollback resumes again
        await self._phase(Phase.VERIFY, lambda live: self._verify_on(live, verify, executor))

    async def _verify_on(
        self, live: list[str], verify: Verify, executor: Executor
    ) -> FleetResult[None]:
        expected = self.digests.expected() if self.digests is not None else {}
        results = await verify_servers(self.fleet, live, verify, expected, executor)
        self.verified = {url: r for url, r in results.items() if isinstance(r, VerifyResult)}
        outcomes: dict[str, CallOutcome[None]] = {}
        for url, found in results.items():
            error = found if isinstance(found, Exception) else (None if found.ok else found.error())
            outcomes[url] = CallOutcome(url, error=error)
        return FleetResult("verify", outcomes)

    # ------------------------------------------------------------------ who is left
    async def _phase(self, phase: Phase, call: _Call, only: _Only = None) -> FleetResult[Any]:
        """One fan-out of ``phase`` to the servers left (of ``only``): its seconds added,
        the servers it failed on dropped (`_drop`); a server removed from the fleet
        meanwhile (``Fleet.remove_server``, a watch) drops out first."""
        self._drop_removed(phase)
        result: FleetResult[Any] = await self._timed(phase, lambda: call(self._live(only)))
        self.connected.update(
            url for url, o in result.items() if o.error is None or not never_sent(o.error)
        )
        self._drop(phase, result)
        return result

    async def _timed(self, phase: Phase, call: Callable[[], Awaitable[T]]) -> T:
        began = time.perf_counter()
        try:
            return await call()
        finally:
            key, seconds = phase.seconds_key, time.perf_counter() - began
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            logger.debug("round %r: %s took %.4f s", self.version, phase.value, seconds)

    def _drop(self, phase: Phase, result: FleetResult[Any]) -> None:
        """The servers ``phase`` failed on leave the round. In a collective transport's
        init or update, a server that answered an error while another gave no answer
        is the collective's casualty, not lost: it stays for the round sent again. A
        server on a per-server transport is lost by its own failure alone."""
        failed = [url for url in result.failed if url in self.live]
        if not failed:
            return
        in_collective = phase in (Phase.INIT, Phase.START, Phase.UPDATE)
        collective = [url for url in failed if in_collective and url in self.collective]
        lost = [url for url in failed if url not in collective]  # each its own failure
        silent = [url for url in collective if _no_answer(result[url].error)]
        lost += silent if silent and phase in (Phase.INIT, Phase.UPDATE) else collective
        for url in lost:
            self._lose(url, phase, result[url].error or RuntimeError("failed"))
        if len(self.live) < self.need:
            raise _TooFew(
                f"{len(self.live)} server(s) left after {phase.value}, {self.need} needed",
                [result[url].error or RuntimeError("failed") for url in lost],
                operation=phase.value,
                outcomes={url: result[url] for url in failed},
            )
        if collective:
            self.regroup = True
            raise _Regroup(f"the collective lost {', '.join(lost)} at {phase.value}")

    def _drop_removed(self, phase: Phase) -> None:
        removed = [url for url in self.live if url not in self.fleet]
        if not removed:
            return
        errors: list[Exception] = []
        for url in removed:
            why = AsyncSyncError("removed from the fleet during the round", server=url)
            self._lose(url, phase, why)
            errors.append(why)
        if len(self.live) < self.need:
            raise _TooFew(
                f"{len(self.live)} server(s) left after {phase.value}, {self.need} needed "
                f"(removed from the fleet: {', '.join(removed)})",
                errors,
                operation=phase.value,
            )

    def _lose(self, url: str, phase: Phase, error: BaseException) -> None:
        """``url`` drops out at ``phase``: dirty, sent nothing more in this round."""
        self.live.remove(url)
        reached = url in self.connected or not never_sent(error)
        self.outcomes[url] = ServerOutcome(
            url, ok=False, phase=phase, error=error, dirty=True, reached=reached
        )
        self._mark_dirty([url])

    def lost(self) -> list[str]:
        """The servers that dropped out, in fleet order."""
        return [url for url in self.targets if not self.outcomes[url].ok]

    def _timed_out(self, url: str) -> bool:
        """Whether ``url``'s failure in this round was a deadline (no answer)."""
        return isinstance(self.outcomes[url].error, ServerTimeout)

    # ------------------------------------------------------------------ ends
    def commit(self) -> None:
        """Enough servers went through the round: the version is published on them (a
        catch-up: they hold the published version again)."""
        ledger = self.fleet.ledger
        if self.catch_up:
            ledger.caught_up(self.version, self.live, self.targets)
        else:
            ledger.round_committed(self.version, self.live, self.targets, self.target)
        self.published_version = self.version

    async def wind_down(self) -> None:
        """After the commit: end the updates lost servers may still hold (those that
        answer), resume the paused ones; a server that does not resume drops out."""
        lost = self.lost()
        await self._end_updates(
            [u for u in sorted(self.open) if u in lost and not self._timed_out(u)]
        )
        resumable = [
            url for url in self.to_resume if not self._timed_out(url) and url in self.fleet
        ]
        if resumable:
            result: FleetResult[None] = await self._timed(
                Phase.RESUME, lambda: self.fleet.resume(targets=resumable, require="none")
            )
            for url in result.failed:
                if url in self.live:
                    self._lose(url, Phase.RESUME, result[url].error or RuntimeError("failed"))
        lost = self.lost()
        if lost:
            logger.warning(
                "published %r to %s; lost %s (dirty until a round reaches them)",
                self.version, ", ".join(self.live) or "no server", ", ".join(lost),
            )  # fmt: skip
        else:
            logger.info("published %r to %s", self.version, ", ".join(self.live))

    async def rollback(self) -> None:
        """The round cannot be published: leave no answering server with an active
        update, mark every server the round started dirty (finished or not, they hold
        weights of no published version; a frozen server whose start got no answer
        included: it may run the start when it thaws) and resume the paused ones that
        answer. A server whose call timed out is sent nothing more: it would wait
        another deadline; the next round ends whatever update it still holds
        (`is_stale_round_error`) and resumes it."""
        await self._end_updates([u for u in sorted(self.open) if not self._timed_out(u)])
        reached = [u for u in self.targets if u in self.touched or self.outcomes[u].dirty]
        for url in reached:
            self.outcomes[url] = dataclasses.replace(self.outcomes[url], dirty=True)
        if reached:
            logger.warning("round %r left %s dirty", self.version, ", ".join(reached))
        # a pause that got no answer may still run: those servers count as paused
        unanswered = [url for url in self.to_resume if self._timed_out(url)]
        self.fleet.ledger.rolled_back(reached, self.targets, self.target, paused=unanswered)
        resumable = [
            url for url in self.to_resume if not self._timed_out(url) and url in self.fleet
        ]
        if resumable:
            result = await self.fleet.resume(targets=resumable, require="none")
            for url in result.failed:
                if self.outcomes[url].ok:
                    self.outcomes[url] = ServerOutcome(
                        url, ok=False, phase=Phase.RESUME, error=result[url].error
                    )

    async def _end_updates(self, urls: list[str]) -> None:
        """End the active update on ``urls`` with the backend's abort update. A rejection
        is the expected answer (the server then holds no active update); a server that
        accepted it, or did not answer, stays dirty."""
        urls = [url for url in urls if url in self.fleet]
        if not urls:
            return
        result = await self.fleet.update_weights(
            self.abort_info, targets=urls, require="none", expect_failure=True
        )
        self.open.difference_update(result.succeeded)

    def report(self, stats: SendStats, total: float) -> PublishReport:
        measured = {"start": 0.0, "transfer": 0.0, "finish": 0.0, **self.seconds}
        measured["pack"] = stats.pack_seconds
        seconds = {key: measured[key] for key in SECONDS_ORDER if key in measured}
        seconds["total"] = total
        return PublishReport(
            version=self.version,
            servers=list(self.live),
            bytes=stats.bytes,
            chunks=stats.chunks,
            params=stats.params,
            seconds=seconds,
            outcomes=self.outcomes,
            verified=self.verified,
            lost=self.lost(),
            attempts=self.attempts,
        )

    def error(self, exc: BaseException) -> PublishError:
        return publish_error(self.version, self.published_version, self.outcomes, exc)


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The failure of a phase run beside another: too few servers left, if that is one
    of them (what the round's error explains), else the first."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup) and not isinstance(exc, FleetError):
            pending.extend(exc.exceptions)  # the task group's, not a fleet call's error
        else:
            leaves.append(exc)
    for exc in leaves:
        if isinstance(exc, _TooFew):
            return exc
    return leaves[0]


def _no_answer(error: BaseException | None) -> bool:
    """The call got no answer: a deadline, or the connection was refused or lost."""
    return isinstance(error, ServerTimeout | ServerUnavailableError)


async def run_to_the_end(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even when the calling task is cancelled meanwhile
    (once or many times), then re-raise the cancellation. For what must not be left
    half done: a worker thread's send, a rollback, a resume. Each of them is bounded by
    the fleet's deadlines, so a cancelled caller still returns in bounded time."""
    future = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():  # the awaitable itself was cancelled
                raise
            cancelled = True  # the caller was: go on waiting
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
