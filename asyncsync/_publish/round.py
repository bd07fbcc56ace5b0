"""One weight-sync round across a fleet, as named phases run by a round object.

The phases, in order: ``pause``? -> ``start`` -> ``update`` (once per payload) ->
``finish`` -> ``reset_prefix_cache``? -> ``verify``? -> ``resume``? (resume also after a
failure; before ``verify`` when a probe must generate).
Start, update and finish are driven by the backend's blocking send in a worker thread
(vLLM's trainer engines do so), through a `SyncFleetClient`
whose calls land on this round's phase methods; the round runs the other phases around
the send. `PublishRound` holds everything a round knows: per-server outcomes
(the phase a server failed in), each phase's seconds, which servers hold an open update
(for the rollback) and which were paused. Rollback and commit each happen in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from asyncsync._core.errors import (
    AsyncSyncError,
    FleetError,
    PublishError,
    ServerTimeout,
    WeightsModifiedError,
)
from asyncsync._core.types import Outcome
from asyncsync._publish.bridge import InitInfo, SyncFleetClient, UpdateInfo
from asyncsync._publish.verify import TrainerDigests, Verification, Verify, verify_servers
from asyncsync.backends._base import RoundCancelled, SendStats

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

T = TypeVar("T")

__all__ = [
    "InitCalls",
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

#: The order of ``PublishReport.seconds`` (optional phases only when they ran).
_SECONDS_ORDER = (
    "init",
    "pause",
    "start",
    "pack",
    "transfer",
    "finish",
    "reset_prefix_cache",
    "verify",
    "resume",
)

#: What the worker thread runs for a round: the backend's send through the client.
SendJob = Callable[[SyncFleetClient, threading.Event], SendStats]


class Phase(StrEnum):
    """The named phases of a round (``ServerOutcome.phase`` holds one)."""

    PAUSE = "pause"
    START = "start"
    UPDATE = "update"
    FINISH = "finish"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    VERIFY = "verify"
    RESUME = "resume"

    @property
    def seconds_key(self) -> str:
        """Its key in ``PublishReport.seconds`` (the update fan-outs are "transfer")."""
        return "transfer" if self is Phase.UPDATE else self.value


def is_stale_round_error(error: object) -> bool:
    """Whether a failed ``/start_weight_update`` means the server still holds a round
    that an earlier trainer opened and never ended (it died mid-round).

    vLLM refuses a start while an update is active with a worker failure (HTTP 500)
    whose message is ``"start_weight_update called while a weight update is already
    active. Call finish_weight_update first."`` (vLLM 0.32, the worker's
    ``start_weight_update``); that message is the only signal HTTP gives.
    """
    return "already active" in str(error)


@dataclass
class ServerOutcome:
    """What happened on one server during a round."""

    url: str
    ok: bool
    phase: str | None = None
    error: BaseException | None = None
    dirty: bool = False

    def __repr__(self) -> str:
        if self.ok:
            return f"<ServerOutcome {self.url} ok>"
        return f"<ServerOutcome {self.url} failed at {self.phase}: {self.error!s}>"


@dataclass
class PublishReport:
    """The figures of one successful round."""

    version: str
    servers: list[str]
    bytes: int
    chunks: int
    params: int
    seconds: dict[str, float]
    outcomes: dict[str, ServerOutcome] = field(default_factory=dict)
    #: what ``verify=`` found on each server (empty when the round did not verify)
    verified: dict[str, Verification] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return self.seconds.get("total", 0.0)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes per second of the whole round (pack + transfer + finish)."""
        total = self.total_seconds
        return self.bytes / total / 1e9 if total > 0 else 0.0

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.seconds.items())
        return (
            f"published {self.version!r} to {len(self.servers)} server(s): "
            f"{self.bytes / 1e6:.1f} MB in {self.chunks} chunk(s), {_rate(self.gb_per_s)} "
            f"({phases})"
        )


def _rate(gb_per_s: float) -> str:
    return f"{gb_per_s:.2f} GB/s" if gb_per_s >= 0.1 else f"{gb_per_s * 1000:.1f} MB/s"


class InitCalls:
    """The fan-outs a backend may make outside a round (its init, world sizes)."""

    def __init__(self, fleet: Fleet, targets: Sequence[str]) -> None:
        self.fleet = fleet
        self.targets = list(targets)

    async def init(self, init_info: InitInfo) -> None:
        await self.fleet.init_weight_transfer_engine(init_info, targets=self.targets, require="all")

    async def world_sizes(self) -> dict[str, int]:
        result = await self.fleet.get_world_size(targets=self.targets, require="all")
        return dict(result.values_by_url)

    def update_deadline(self) -> float | None:
        """The shortest update deadline of the targets (None: some have none)."""
        limits = [self.fleet.client(url).timeouts.update for url in self.targets]
        known = [x for x in limits if x is not None]
        return min(known) if known and len(known) == len(limits) else None

    async def start(self) -> None:
        raise RuntimeError("start_weight_update is only allowed inside a publish round")

    async def update(self, update_info: UpdateInfo) -> None:
        raise RuntimeError("update_weights is only allowed inside a publish round")

    async def finish(self, weight_version: str | None) -> None:
        raise RuntimeError("finish_weight_update is only allowed inside a publish round")


class PublishRound(InitCalls):
    """One round: its phases, timings, per-server outcomes, rollback and commit.

    ``abort_info`` is the backend's update that ends an open update on a server (see
    ``TrainerBackend.abort_info``). ``published_version`` is the version every target
    holds; `commit` advances it, and only when every target finished.
    """

    def __init__(
        self,
        fleet: Fleet,
        targets: Sequence[str],
        *,
        version: str,
        pause: PauseMode | None,
        reset_prefix_cache: bool,
        abort_info: Mapping[str, Any],
        published_version: str | None,
        seconds: dict[str, float] | None = None,
        verify: Verify | None = None,
        digests: TrainerDigests | None = None,
    ) -> None:
        super().__init__(fleet, targets)
        self.version = version
        self.pause_mode = pause
        self.reset_cache = reset_prefix_cache
        self.abort_info = abort_info
        self.published_version = published_version
        self.seconds: dict[str, float] = dict(seconds or {})
        self.outcomes = {url: ServerOutcome(url, ok=True) for url in self.targets}
        #: servers holding this round's (or a stale round's) active update
        self.open: set[str] = set()
        #: servers a pause was attempted on (resumed whatever happens), from the start
        #: those an earlier round left paused (its rollback skips a server that did not
        #: answer: this round resumes it once it answers again)
        self.paused: list[str] = [url for url in self.targets if fleet.state(url).paused]
        #: whether the round reached the servers' start (bad input never does)
        self.start_attempted = False
        #: servers that finished this round, and those whose prefix cache was reset
        #: after it (a finished server whose reset is unconfirmed may reuse KV blocks of
        #: the old weights: the rollback resets it again, or leaves it dirty)
        self.finished: set[str] = set()
        self.cache_reset: set[str] = set()
        #: what to check after the finish, the trainer's digests, what was found
        self.verify = verify
        self.digests = digests
        self.verified: dict[str, Verification] = {}

    # ------------------------------------------------------------------ the round
    async def run(self, job: SendJob, executor: Executor) -> PublishReport:
        """pause? -> send (start, update(s), finish) -> reset_prefix_cache? -> commit ->
        resume?; on any failure: rollback, then the error."""
        began = time.perf_counter()
        logger.info("publishing %r to %d server(s)", self.version, len(self.targets))
        try:
            if self.pause_mode is not None:
                await self.pause()
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
            raise self.error(exc) from exc
        self.commit()
        logger.info("published %r to %s", self.version, ", ".join(self.targets))
        if self.paused:
            try:  # a cancel meanwhile is re-raised once every server answered
                await run_to_the_end(self.resume())
            except AsyncSyncError as exc:  # reported, but the version stays published
                raise self.error(exc) from exc
        return self.report(stats, time.perf_counter() - began)

    def _passes_through(self, exc: BaseException) -> bool:
        """Cancellation, and bad input refused before any server's start, are raised
        as they are; every other failure becomes a PublishError."""
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | RoundCancelled):
            return True
        return isinstance(exc, ValueError | TypeError) and not self.start_attempted

    # ------------------------------------------------------------------ phases
    async def pause(self) -> None:
        assert self.pause_mode is not None
        mode = self.pause_mode
        # resumed even if the pause fails midway
        self.paused.extend(url for url in self.targets if url not in self.paused)
        await self._phase(
            Phase.PAUSE, lambda: self.fleet.pause(mode, targets=self.targets, require="all")
        )

    async def send(self, job: SendJob, executor: Executor) -> SendStats:
        """The backend's blocking send in the worker thread. Cancelling stops it at the
        next chunk boundary; the thread is never abandoned mid-chunk."""
        cancel = threading.Event()
        client = SyncFleetClient.on_running_loop(self, cancel=cancel, version=self.version)
        future = asyncio.get_running_loop().run_in_executor(executor, job, client, cancel)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()  # the thread stops at its next chunk boundary
            with contextlib.suppress(Exception):  # its RoundCancelled, or its error
                await run_to_the_end(future)
            raise

    async def start(self) -> None:
        self.start_attempted = True
        await self._phase(Phase.START, self._start_everywhere)

    async def _start_everywhere(self) -> None:
        try:
            await self.fleet.start_weight_update(targets=self.targets, require="all")
        except FleetError as exc:
            self.open.update(exc.succeeded)
            stale = [u for u in exc.failed if is_stale_round_error(_error_of(exc, u))]
            if not stale or len(stale) != len(exc.failed):
                raise
            await self._restart_stale(stale)
        self.open.update(self.targets)

    async def _restart_stale(self, stale: list[str]) -> None:
        """End the rounds an earlier trainer left open there, then start this one."""
        self.fleet.mark_dirty(stale)
        await self._end_updates(stale)
        await self.fleet.start_weight_update(targets=stale, require="all")

    async def update(self, update_info: UpdateInfo) -> None:
        await self._phase(
            Phase.UPDATE,
            lambda: self.fleet.update_weights(update_info, targets=self.targets, require="all"),
        )

    async def finish(self, weight_version: str | None) -> None:
        try:
            await self._phase(
                Phase.FINISH,
                lambda: self.fleet.finish_weight_update(
                    weight_version, targets=self.targets, require="all"
                ),
            )
        except FleetError as exc:
            self.open.difference_update(exc.succeeded)  # those hold the new version
            self.finished.update(exc.succeeded)
            raise
        self.open.difference_update(self.targets)
        self.finished.update(self.targets)

    async def reset_prefix_cache(self) -> None:
        try:
            await self._phase(
                Phase.RESET_PREFIX_CACHE,
                lambda: self.fleet.reset_prefix_cache(targets=self.targets, require="all"),
            )
        except FleetError as exc:
            self.cache_reset.update(exc.succeeded)
            raise
        self.cache_reset.update(self.targets)

    async def verify_weights(self, executor: Executor) -> None:
        """Check every target against the trainer; a server that does not match (or
        cannot be checked) fails the round there. A probe generates, so paused servers
        are resumed first."""
        assert self.verify is not None
        verify = self.verify
        if verify.probe is not None and self.paused:
            await self.resume()
            self.paused = []  # resumed: neither the commit nor a rollback resumes again
        await self._phase(Phase.VERIFY, lambda: self._verify_everywhere(verify, executor))

    async def _verify_everywhere(self, verify: Verify, executor: Executor) -> None:
        expected = self.digests.expected() if self.digests is not None else {}
        results = await verify_servers(self.fleet, self.targets, verify, expected, executor)
        self.verified = {url: r for url, r in results.items() if isinstance(r, Verification)}
        errors: dict[str, Exception] = {}
        for url, found in results.items():
            if isinstance(found, Exception):
                errors[url] = found
            elif not found.ok:
                errors[url] = found.error()
        if errors:
            outcomes: dict[str, Outcome[None]] = {
                url: Outcome(url, error=errors.get(url)) for url in self.targets
            }
            raise FleetError(
                f"verify failed on {len(errors)} of {len(self.targets)} server(s)",
                list(errors.values()),
                operation="verify",
                outcomes=outcomes,
            )

    async def resume(self) -> None:
        await self._phase(
            Phase.RESUME, lambda: self.fleet.resume(targets=self.paused, require="all")
        )

    async def _phase(self, phase: Phase, call: Callable[[], Awaitable[Any]]) -> None:
        """Run one fan-out of ``phase``: add its seconds, record the servers it failed on."""
        began = time.perf_counter()
        try:
            await call()
        except BaseException as exc:
            self._record(phase, exc)
            raise
        finally:
            key, seconds = phase.seconds_key, time.perf_counter() - began
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            logger.debug("round %r: %s took %.4f s", self.version, phase.value, seconds)

    def _record(self, phase: Phase, exc: BaseException) -> None:
        """Mark the servers ``exc`` failed on (every target, unless it is a fleet error
        naming them) as failed at ``phase``; a server keeps its first failure."""
        if isinstance(exc, FleetError):
            failures = {url: _error_of(exc, url) or exc for url in exc.failed}
        else:
            failures = dict.fromkeys(self.targets, exc)
        for url, error in failures.items():
            if url in self.outcomes and self.outcomes[url].ok:
                self.outcomes[url] = ServerOutcome(url, ok=False, phase=phase, error=error)

    # ------------------------------------------------------------------ ends
    async def rollback(self) -> None:
        """Leave no server with an active update, reset the prefix cache of servers that
        finished (their KV blocks were computed with the old weights), mark every server
        the round reached dirty (a frozen server whose start got no answer included: it
        may run the start when it thaws; a finished one whose cache reset failed too),
        and resume the paused ones that answer."""
        # A server whose call timed out is not sent the abort: it would wait another
        # deadline for a server that is frozen or overloaded. It stays dirty (below), and
        # the next round ends whatever update it still holds (is_stale_round_error).
        answering = [url for url in sorted(self.open) if not self._timed_out(url)]
        if answering:
            await self._end_updates(answering)
        await self._reset_finished_caches()
        reached = [  # or a weight-sync call got no answer there (_state.observe)
            url
            for url, outcome in self.outcomes.items()
            if url in self.open
            or outcome.phase in (Phase.UPDATE, Phase.FINISH, Phase.VERIFY)
            or self.fleet.state(url).dirty
            or self._stale_cache(url)
        ]
        for url in reached:
            self.outcomes[url].dirty = True
        if reached:
            logger.warning("round %r left %s dirty", self.version, ", ".join(reached))
        self.fleet.mark_dirty(reached)
        # Nor is it resumed, for the same reason: it is recorded as paused (its pause may
        # still run) and dirty, so nothing is routed to it, until the next round that
        # reaches it resumes it.
        resumable = [url for url in self.paused if not self._timed_out(url)]
        for url in set(self.paused) - set(resumable):
            self.fleet.state(url).paused = True
        if resumable:
            try:
                await self.fleet.resume(targets=resumable, require="all")
            except FleetError as exc:
                self._record(Phase.RESUME, exc)

    def _timed_out(self, url: str) -> bool:
        """Whether ``url``'s failure in this round was a deadline (no answer)."""
        outcome = self.outcomes.get(url)
        return outcome is not None and isinstance(outcome.error, ServerTimeout)

    def _stale_cache(self, url: str) -> bool:
        """``url`` finished this round, but its prefix-cache reset is unconfirmed."""
        return self.reset_cache and url in self.finished and url not in self.cache_reset

    async def _reset_finished_caches(self) -> None:
        """The round failed or was cancelled after some servers finished and before
        their cache reset was confirmed: reset them now (a failure leaves them dirty)."""
        stale = [u for u in self.targets if self._stale_cache(u) and not self._timed_out(u)]
        if stale:
            result = await self.fleet.reset_prefix_cache(targets=stale, require="none")
            self.cache_reset.update(result.succeeded)

    async def _end_updates(self, urls: list[str]) -> None:
        """End the active update on ``urls`` with the backend's abort update. A rejection
        is the expected answer (the server then holds no active update); a server that
        accepted it, or did not answer, stays dirty."""
        await self.fleet.update_weights(
            self.abort_info, targets=urls, require="none", expect_failure=True
        )

    def commit(self) -> None:
        """Every target finished: the version is published, whatever resume does next."""
        self.fleet.mark_clean(self.targets)
        self.fleet.set_weight_version(self.version, self.targets)
        self.published_version = self.version

    def report(self, stats: SendStats, total: float) -> PublishReport:
        measured = {"start": 0.0, "transfer": 0.0, "finish": 0.0, **self.seconds}
        measured["pack"] = stats.pack_seconds
        seconds = {key: measured[key] for key in _SECONDS_ORDER if key in measured}
        seconds["total"] = total
        return PublishReport(
            version=self.version,
            servers=list(self.targets),
            bytes=stats.bytes,
            chunks=stats.chunks,
            params=stats.params,
            seconds=seconds,
            outcomes=self.outcomes,
            verified=self.verified,
        )

    def error(self, exc: BaseException) -> PublishError:
        failed = [o for o in self.outcomes.values() if not o.ok]
        dirty = [o.url for o in self.outcomes.values() if o.dirty]
        lines = "; ".join(f"{o.url} failed at {o.phase}: {o.error}" for o in failed) or str(exc)
        message = (
            f"publishing version {self.version!r} failed ({lines}); published version "
            f"stays {self.published_version!r}"
        )
        if isinstance(exc, WeightsModifiedError):  # the trainer's fault, typed as such
            return WeightsModifiedError(
                message,
                parameters=exc.parameters,
                version=self.version,
                outcomes=self.outcomes,
                needs_resync=dirty,
            )
        return PublishError(
            message, version=self.version, outcomes=self.outcomes, needs_resync=dirty
        )


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


def _error_of(exc: FleetError, url: str) -> BaseException | None:
    return getattr(exc.outcomes.get(url), "error", None)
