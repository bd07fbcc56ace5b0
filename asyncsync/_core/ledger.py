"""The fleet's ledger: the one owner, and the one writer, of what a fleet knows.

A `Ledger` holds, privately:

- one `ServerRecord` per server (its versions, flags, identity, load, health);
- the published version history of each target (``"main"``: the served model,
  ``"draft"``: its speculative draft model);
- the LoRA adapters (each adapter's published versions, the versions each server
  loaded, the generations in flight with each);
- the session table (session id -> server) and the caches of the layers above (the
  chat layer's per-server routes and sessions);
- the change signal that everything waiting on a server's state (admission, version
  gates, the background probes, the catch-up) wakes on; `Ledger.wait_until` is the one
  loop that waits on it for a condition until a deadline.

Everyone else reads: frozen `ServerState` snapshots (``snapshot``), the records
themselves inside the package (routing reads them on its hot path, never writes), the
histories through the read-only `Versions` protocol. Writes happen only through the
named transitions below, each of which settles the health of the servers it touched
and signals the change:

- calls: `observed` (a call's outcome: health, pause, update flags, dirty), `cancelled`,
  `learned` (vLLM version), `identified` (the process identity; a new one is a
  restart: `restarted`), `probe_failed`, `contradicted` (an answer's versions the fleet
  never accepted), `call_began`/`call_ended`, `admitted`/`released` (generations);
- rounds: `round_started`, `server_lost`, `round_committed`, `rolled_back`,
  `caught_up`; by hand: `marked`, `versions_set`, `version_recorded`,
  `published_by_hand`;
- membership: `join`, `retire`, `host_known`, `concurrency_limited`,
  `staleness_bound`; adapters: `adapter_loaded`, `adapter_unloaded`,
  `adapter_published`, `adapter_use_began`/`adapter_use_ended`; sessions:
  `session_ended`.

A server's health (docs/concepts.md has the diagram) follows from its facts:
``retired`` once removed; ``dead`` after `DEAD_AFTER` failed probes in a row (it comes
back only through ``stale``: a probe that reaches it again marks it dirty); ``suspect``
while its last call failed, an answer contradicted the record, its identity was not read
since, or it is held out after flapping (`FLAP_LIMIT` departures from ``healthy`` within
`FLAP_WINDOW` seconds, a mark by hand (`Fleet.mark_dirty`) counting none: held out for a
back-off that doubles, up to `FLAP_MAX_HOLD`);
``stale`` while it holds no version the fleet accepts (dirty, restarted, a joiner, too
far behind: ``max_staleness``) or its process is not the one that loaded it; else
``healthy``. Each change of health is logged (``asyncsync.fleet``) and reported to the
metrics hooks (`asyncsync.metrics.MetricsHook.on_server_health`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from asyncsync._core import hooks as _hooks
from asyncsync._core.errors import ServerError, ServerTimeout, ServerUnavailableError
from asyncsync._core.history import SessionTable, VersionHistory, Versions
from asyncsync._core.state import (
    LOOKUP_OPS,
    UPDATE_OPS,
    Health,
    Reason,
    ServerState,
    unfit,
    unreachable,
)
from asyncsync._core.types import Phase, ProtocolGeneration

__all__ = [
    "DEAD_AFTER",
    "FLAP_LIMIT",
    "FLAP_MAX_HOLD",
    "FLAP_WINDOW",
    "Ledger",
    "ServerRecord",
    "Target",
]

logger = logging.getLogger("asyncsync.fleet")

T = TypeVar("T")

#: What a round loads into: the served model, or its speculative draft model.
Target = Literal["main", "draft"]

#: Failed probes in a row after which a suspect server is dead.
DEAD_AFTER = 4
#: Departures from ``healthy`` within `FLAP_WINDOW` seconds that hold a server out.
FLAP_LIMIT = 3
FLAP_WINDOW = 120.0
#: The first hold of a flapping server (seconds); each further flap doubles it.
FLAP_FIRST_HOLD = 10.0
FLAP_MAX_HOLD = 300.0

#: The two starts: of a round into the served model, and into its draft model.
_STARTS = frozenset({"start_weight_update", "start_draft_weight_update"})


class ServerRecord:
    """One server's facts, as the ledger keeps them (mutable; written by `Ledger`
    alone). The same names as `ServerState`, plus the ledger's bookkeeping."""

    __slots__ = (
        "contradicted",
        "dead",
        "dirty",
        "dirty_draft",
        "draft_version",
        "failures",
        "flaps",
        "health",
        "healthy",
        "held_until",
        "host",
        "identity",
        "last_error",
        "loaded_by",
        "loaded_in_round",
        "marked_after_finish",
        "max_concurrency",
        "outstanding",
        "paused",
        "protocol",
        "reported_version",
        "restarts",
        "retired",
        "routed",
        "suspect",
        "update_target",
        "updating",
        "url",
        "vllm_version",
        "weight_version",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.vllm_version: str | None = None
        self.protocol: ProtocolGeneration | None = None
        self.weight_version: str | None = None
        self.paused = False
        self.updating = False
        self.dirty = False
        self.healthy = True
        self.outstanding = 0
        self.last_error: BaseException | None = None
        self.max_concurrency: int | None = None
        self.routed = 0
        self.host: str | None = None
        self.update_target: Target = "main"
        self.dirty_draft = False
        self.draft_version: str | None = None
        self.health: Health = "healthy"
        self.identity: str | None = None
        #: the identity of the process that loaded ``weight_version``
        self.loaded_by: str | None = None
        #: the version the server itself last reported (``/weight_info``)
        self.reported_version: str | None = None
        #: its identity must be read again before it is routed
        self.suspect = False
        #: an answer of it carried versions the fleet does not accept
        self.contradicted = False
        #: failed probes in a row, and whether that made it dead
        self.failures = 0
        self.dead = False
        self.retired = False
        #: when it last left ``healthy`` (monotonic seconds), for flap detection
        self.flaps: deque[float] = deque(maxlen=FLAP_LIMIT + 8)
        #: held out after flapping until then (monotonic seconds)
        self.held_until = 0.0
        #: restarts seen (identity changes)
        self.restarts = 0
        #: its finish answered in the main round that holds it (until that round ends)
        self.loaded_in_round = False
        #: a mark by hand came after that finish: the round's commit leaves it dirty
        #: (what the round loaded came before what the mark says)
        self.marked_after_finish = False

    def unfit(self) -> Reason | None:
        """Why this server cannot serve now, by its own state (`asyncsync._core.state.unfit`,
        and ``flapping`` while held out)."""
        reason = unfit(self)
        if reason == "suspect" and self.healthy and not self.suspect and self.held_out():
            return "flapping"
        return reason

    def held_out(self, now: float | None = None) -> bool:
        return self.held_until > (time.monotonic() if now is None else now)

    def __repr__(self) -> str:
        return f"<ServerRecord {self.url} {self.health} version={self.weight_version!r}>"


#: The fields a `ServerState` snapshot copies.
_SNAPSHOT = (
    "url", "vllm_version", "protocol", "weight_version", "paused", "updating", "dirty",
    "healthy", "outstanding", "last_error", "max_concurrency", "routed", "host",
    "update_target", "dirty_draft", "draft_version", "health", "identity",
)  # fmt: skip


class _Adapters:
    """LoRA adapters: published versions, what each server loaded, uses in flight."""

    __slots__ = ("histories", "loaded", "uses")

    def __init__(self) -> None:
        self.histories: dict[str, VersionHistory] = {}
        #: (url, name) -> versions loaded there (vLLM knows their served names)
        self.loaded: dict[tuple[str, str], set[str]] = {}
        #: (url, name, version) -> generations in flight with it
        self.uses: Counter[tuple[str, str, str]] = Counter()

    def forget(self, url: str) -> None:
        for key in [k for k in self.loaded if k[0] == url]:
            del self.loaded[key]


class Ledger:
    """What a fleet (or one client) knows; the one writer of it (see the module)."""

    def __init__(self, *, max_staleness: int | None = 0) -> None:
        self._records: dict[str, ServerRecord] = {}
        self._order: tuple[ServerRecord, ...] = ()
        self._histories: dict[Target, VersionHistory] = {
            "main": VersionHistory(),
            "draft": VersionHistory(),
        }
        self._adapters = _Adapters()
        self._sessions = SessionTable()
        self._caches: dict[str, Any] = {}
        self._max_staleness = max_staleness
        #: url -> (version, target) of the open round holding it
        self._rounds: dict[str, tuple[str, Target]] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        self._listeners: list[Callable[[], None]] = []
        #: the servers whose health is not "healthy" (kept as health settles: what the
        #: background probes and the catch-up look at, without a pass over every server)
        self._unwell: set[str] = set()
        self._ref = weakref.ref(self)

    # ================================================================== reads
    def records(self) -> tuple[ServerRecord, ...]:
        """The servers' records in fleet order (routing reads them; never write)."""
        return self._order

    def record(self, url: str) -> ServerRecord:
        """The record of ``url`` (KeyError when it is not in the ledger)."""
        return self._records[url]

    def __contains__(self, url: object) -> bool:
        return url in self._records

    def __len__(self) -> int:
        return len(self._order)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(r.url for r in self._order)

    def snapshot(self, url: str) -> ServerState:
        """A frozen copy of ``url``'s record (any thread may read it)."""
        return self.snapshot_of(self._records[url])

    def snapshot_of(self, rec: ServerRecord) -> ServerState:
        state = ServerState(**{name: getattr(rec, name) for name in _SNAPSHOT})
        object.__setattr__(state, "_owner", None if rec.retired else self._ref)
        return state

    def snapshots(self) -> tuple[ServerState, ...]:
        return tuple(self.snapshot_of(r) for r in self._order)

    def history(self, target: Target = "main") -> Versions:
        """The versions published into ``target``, oldest first (read-only)."""
        return self._histories[target]

    def current(self, target: Target = "main") -> str | None:
        """The newest version published into ``target`` (None before any)."""
        return self._histories[target].current

    @property
    def max_staleness(self) -> int | None:
        """How many published versions behind a server may be and still serve."""
        return self._max_staleness

    def accepts(self, version: str | None) -> bool:
        """Whether a server holding ``version`` may serve: anything before the first
        publish; after it, a published version at most ``max_staleness`` behind."""
        history = self._histories["main"]
        if not len(history):
            return True
        lag = history.behind(version)
        if lag is None:
            return False
        return self._max_staleness is None or lag <= self._max_staleness

    def holds_accepted(self, rec: ServerRecord) -> bool:
        """``rec``'s server holds an accepted version, loaded by the process it is now."""
        if not len(self._histories["main"]):
            return True
        return rec.loaded_by == rec.identity and self.accepts(rec.weight_version)

    @property
    def unwell(self) -> frozenset[str]:
        """The servers whose health is not ``healthy``."""
        return frozenset(self._unwell)

    def in_round(self, url: str) -> bool:
        """Whether an open round holds ``url`` (it then records versions itself)."""
        return url in self._rounds

    def session_server(self, session_id: str) -> str | None:
        """The server a session is pinned to (None: none)."""
        return self._sessions.get(session_id)

    def cache(self, key: str, factory: Callable[[], T]) -> T:
        """The cache of a layer above the fleet (``"chat"``: each server's chat routes
        and the fleet's chat sessions), created on first use and kept with the fleet."""
        found = self._caches.get(key)
        if found is None:
            found = self._caches[key] = factory()
        return found

    # ---------------------------------------------------------------- adapters (reads)
    def adapter_names(self) -> list[str]:
        return list(self._adapters.histories)

    def adapter_history(self, name: str) -> Versions:
        found = self._adapters.histories.get(name)
        return found if found is not None else VersionHistory()

    def adapter_current(self, name: str) -> str | None:
        """The newest published version of adapter ``name``."""
        found = self._adapters.histories.get(name)
        return None if found is None else found.current

    def adapter_versions_on(self, url: str, name: str) -> set[str]:
        return set(self._adapters.loaded.get((url, name), ()))

    def adapter_servers_with(self, name: str, version: str) -> list[str]:
        return [u for (u, n), vs in self._adapters.loaded.items() if n == name and version in vs]

    def adapter_in_use(self, name: str, version: str) -> bool:
        return any(k[1:] == (name, version) and c > 0 for k, c in self._adapters.uses.items())

    def adapter_held(self, url: str, name: str) -> str | None:
        """The newest published version of ``name`` loaded on ``url``."""
        history = self._adapters.histories.get(name)
        loaded = self._adapters.loaded.get((url, name))
        if history is None or not loaded:
            return None
        known = [v for v in loaded if v in history]
        return max(known, key=lambda v: history.index(v) or 0) if known else None

    # ================================================================== the signal
    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (quick, non-blocking) after every change."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def changed(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Return at the next change, or after ``timeout`` seconds (None: no limit)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            if timeout is None:
                await fut
            else:
                async with asyncio.timeout(timeout):
                    await fut
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)

    async def wait_until(self, predicate: Callable[[], T], deadline: float | None) -> T:
        """``predicate()``, asked now and again after each change, until it answers
        something true, which is returned; once ``deadline`` (a `time.monotonic` time;
        None: no limit) has passed, its last answer (false: ``None``, ``False``, ...)
        is returned instead, for the caller to raise its own error. What ``predicate``
        raises propagates, and so does cancellation. The answer is returned in the
        step that asked for it (no await between), so the caller can act on what the
        predicate saw: admission counts a request on the server it chose.

        The one waiting loop of the package: admission (`Dispatcher.admit`, a router's
        admission), `Fleet.ready` and `Fleet.wait_for_version` wait through it.
        """
        while True:
            answer = predicate()
            if answer:
                return answer
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return answer
            await self.changed(remaining)

    def _signal(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, set()
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        for listener in tuple(self._listeners):
            listener()

    def _changed(self, recs: Iterable[ServerRecord] = (), *, by_hand: bool = False) -> None:
        """Settle the health of ``recs`` and signal the change (``by_hand``: the user's
        doing, not the server's: no flap counted)."""
        now = time.monotonic()
        for rec in recs:
            self._settle(rec, now, by_hand=by_hand)
        self._signal()

    def _changed_all(self) -> None:
        self._changed(self._order)

    # ================================================================== health
    def _health(self, rec: ServerRecord, now: float) -> Health:
        if rec.retired:
            return "retired"
        if rec.dead:
            return "dead"
        if not rec.healthy or rec.suspect or rec.held_until > now:
            return "suspect"
        if rec.dirty or rec.dirty_draft or not self.holds_accepted(rec):
            return "stale"
        return "healthy"

    def _settle(self, rec: ServerRecord, now: float, *, by_hand: bool = False) -> None:
        old, new = rec.health, self._health(rec, now)
        if new == old:
            return
        rec.health = new
        if old == "healthy" and new != "retired" and not by_hand:
            self._flapped(rec, now)
            new = rec.health = self._health(rec, now)
        if new in ("healthy", "retired"):
            self._unwell.discard(rec.url)
        else:
            self._unwell.add(rec.url)
        level = logging.INFO if new in ("healthy", "retired", "stale") else logging.WARNING
        logger.log(level, "server %s: %s -> %s%s", rec.url, old, new, _why(rec))
        _hooks.health_changed(rec.url, old, new)

    def _flapped(self, rec: ServerRecord, now: float) -> None:
        """``rec`` left ``healthy``: held out when it keeps doing so."""
        rec.flaps.append(now)
        recent = [t for t in rec.flaps if now - t <= FLAP_WINDOW]
        if len(recent) >= FLAP_LIMIT:
            hold = min(FLAP_FIRST_HOLD * 2 ** (len(recent) - FLAP_LIMIT), FLAP_MAX_HOLD)
            rec.held_until = max(rec.held_until, now + hold)
            logger.warning(
                "server %s left healthy %d times in %.0f s: held out for %.0f s",
                rec.url, len(recent), FLAP_WINDOW, hold,
            )  # fmt: skip

    def next_hold_end(self) -> float | None:
        """The earliest end of a flapping server's hold (monotonic), if any."""
        now = time.monotonic()
        ends = [r.held_until for r in self._order if r.held_until > now]
        return min(ends) if ends else None

    def tick(self) -> None:
        """Time passed (a hold ended): settle every server again."""
        self._changed_all()

    # ================================================================== membership
    def join(self, rec: ServerRecord | str, *, verify: bool = False) -> ServerRecord:
        """A server joins: a new record, or one adopted (a client's own, when a fleet
        takes the client). ``verify``: suspect until a probe has read its identity (a
        server added at runtime). A joiner after a publish holds no accepted version
        (stale) until a round or a catch-up reaches it."""
        if isinstance(rec, str):
            rec = ServerRecord(rec)
        if rec.url in self._records:
            raise ValueError(f"server {rec.url} is already in the fleet")
        rec.retired = False
        if verify:
            rec.suspect = True
        self._records[rec.url] = rec
        self._order += (rec,)
        self._changed([rec])
        return rec

    def retire(self, url: str) -> ServerRecord:
        """``url`` leaves: out of routing for good; its calls in flight finish."""
        rec = self._records.pop(url)
        self._order = tuple(r for r in self._order if r is not rec)
        self._sessions.drop_server(url)
        self._adapters.forget(url)
        # (a round that holds it still does, until it ends: added again meanwhile, its
        # answers are the round's to record)
        rec.retired = True
        self._changed([rec])
        return rec

    def host_known(self, url: str, host: str) -> None:
        self._records[url].host = host
        self._changed()

    def concurrency_limited(self, urls: Iterable[str], limit: int | None) -> None:
        for url in urls:
            self._records[url].max_concurrency = limit
        self._changed()

    def staleness_bound(self, value: int | None) -> None:
        """``Fleet.max_staleness`` changed: which versions are accepted changed."""
        self._max_staleness = value
        self._changed_all()

    # ================================================================== calls
    def learned(self, rec: ServerRecord, vllm_version: str, protocol: ProtocolGeneration) -> None:
        """The server's vLLM version (and so its protocol generation) is known."""
        rec.vllm_version, rec.protocol = vllm_version, protocol
        self._changed()

    def call_began(self, rec: ServerRecord) -> None:
        rec.outstanding += 1

    def call_ended(self, rec: ServerRecord) -> None:
        rec.outstanding -= 1
        self._changed()

    def admitted(self, rec: ServerRecord, session_id: str | None = None) -> None:
        """A generation (or a chat call) was admitted on ``rec``'s server."""
        rec.outstanding += 1
        rec.routed += 1
        if session_id is not None:
            self._sessions.pin(session_id, rec.url)

    def released(self, rec: ServerRecord) -> None:
        rec.outstanding -= 1
        self._changed()

    def session_ended(self, session_id: str) -> None:
        """Forget a session's server (a session moved, or it ended)."""
        self._sessions.drop(session_id)

    def observed(
        self,
        rec: ServerRecord,
        op: str,
        phase: Phase,
        error: BaseException | None,
        value: Any = None,
        *,
        connected: bool = True,
    ) -> None:
        """Call ``op`` to ``rec``'s server ended with ``value`` or ``error``.

        A success proves the server answers (healthy; still suspect until its identity is
        read again); pause, resume, is_paused, weight_info, the starts and finish change
        more (`_succeeded`). A failure that means the server did not answer makes it
        unhealthy (and suspect); a failed weight-sync call may leave it dirty. No call
        records a weight version: rounds do, when they decide (`round_committed`).
        ``connected``: whether a failed request got as far as a connection.
        """
        if op in LOOKUP_OPS:
            return  # a side question: what the calls it serves find out is what counts
        if error is None:
            rec.healthy = True
            rec.last_error = None
            if op in _STATEFUL_OPS:
                self._succeeded(rec, op, value)
            if rec.health != "healthy" or op in _STATEFUL_OPS:
                self._changed([rec])
            return
        rec.last_error = error
        if unreachable(error, phase, connected=connected) or (
            op == "health" and isinstance(error, ServerError)
        ):
            if rec.healthy:
                logger.warning("server %s unhealthy after %s: %s", rec.url, op, error)
            rec.healthy = False  # /health answers 503 when vLLM's engine is dead
            rec.suspect = True
        if op in UPDATE_OPS:
            self._weight_call_failed(rec, op, error)
        self._changed([rec])

    def cancelled(self, rec: ServerRecord, op: str) -> None:
        """A call was cancelled while in flight: a weight-sync call may still run there."""
        if op in UPDATE_OPS and (rec.updating or op in _STARTS):
            self._dirty(rec, f"{op} was cancelled in flight", draft=_of_draft(rec, op))
            self._changed([rec])

    def _succeeded(self, rec: ServerRecord, op: str, value: Any) -> None:
        match op:
            case "pause":
                rec.paused = True
            case "resume":
                rec.paused = False
            case "is_paused":
                rec.paused = bool(value)
            case "weight_info" if isinstance(value, str):
                self._reported(rec, value)
            case "start_weight_update" | "start_draft_weight_update":
                rec.updating = True
                rec.update_target = "draft" if op == "start_draft_weight_update" else "main"
            case "finish_weight_update":
                # a finished draft round cleans the draft only: the served model's weights
                # (and its dirty flag) are not what it changed
                self._clean(rec, draft=rec.update_target == "draft")
                if rec.update_target == "main" and rec.url in self._rounds:
                    rec.loaded_in_round, rec.marked_after_finish = True, False
                rec.update_target = "main"
            case _:
                pass

    def _reported(self, rec: ServerRecord, version: str) -> None:
        """The server says it holds ``version`` (``/weight_info``). Nothing recorded yet
        and nothing published: taken as is. A version that contradicts the record (a
        restarted process reports its checkpoint's ``"default"``; a server that lies, or
        that someone else loaded) is not: the server is suspect until its identity is
        read, and stale unless it holds what the record says."""
        rec.reported_version = version
        if rec.weight_version is None and not len(self._histories["main"]):
            rec.weight_version, rec.loaded_by = version, rec.identity
        elif rec.weight_version not in (None, version) and not rec.updating:
            self.contradicted(rec, [version], signal=False)

    def _weight_call_failed(self, rec: ServerRecord, op: str, error: BaseException) -> None:
        """A weight-sync call failed. vLLM drops its active update when an update fails,
        so the server is no longer updating, but its weights are of no known version. A
        call that got no answer may still run when the server thaws: dirty as well. A
        failure in a round into the draft model makes the draft dirty."""
        no_answer = isinstance(error, (ServerTimeout, ServerUnavailableError))
        draft = _of_draft(rec, op)
        if op in _STARTS:
            if no_answer:
                self._dirty(rec, f"{op} got no answer: {error}", draft=draft)
            return
        if rec.updating or (rec.dirty_draft if draft else rec.dirty) or no_answer:
            rec.updating = False
            self._dirty(rec, f"{op} failed: {error}", draft=draft)

    def _dirty(self, rec: ServerRecord, why: str, *, draft: bool = False) -> None:
        if not (rec.dirty_draft if draft else rec.dirty):
            what = "'s draft model" if draft else ""
            logger.warning("server %s%s marked dirty (needs a resync): %s", rec.url, what, why)
        if draft:
            rec.dirty_draft = True
        else:
            rec.dirty = True

    def _clean(self, rec: ServerRecord, *, draft: bool = False) -> None:
        was = rec.dirty_draft if draft else rec.dirty
        if was:
            what = "'s draft model" if draft else ""
            logger.info("server %s%s marked clean", rec.url, what)
        if draft:
            rec.dirty_draft = False
        else:
            rec.dirty = False
        rec.updating = False

    # ---------------------------------------------------------------- identity
    def identified(self, rec: ServerRecord, identity: str | None) -> bool:
        """A probe read the server's process identity (vLLM's ``instance_id``; None: the
        server does not tell). A new identity is a restart (`restarted`). A server that
        was dead comes back dirty: whatever it still had queued may have run. Returns
        whether it restarted."""
        restarted = False
        if identity is not None and rec.identity is not None and identity != rec.identity:
            restarted = True
            self._restarted(rec, identity)
        elif identity is not None and rec.identity is None:
            rec.identity = identity
            if rec.weight_version is not None and rec.loaded_by is None:
                rec.loaded_by = identity  # recorded before the first read: the same process
        if rec.dead:
            rec.dead = False
            if not restarted:
                self._dirty(rec, f"it answers again after {rec.failures} failed probes")
        if rec.contradicted and not restarted:
            # the same process answered with versions the record does not hold: whatever
            # it holds, it is not known to be what the fleet published
            self._dirty(rec, "it reported a version it was not recorded to hold")
        rec.contradicted = False
        rec.suspect = False
        rec.failures = 0
        rec.healthy = True
        self._changed([rec])
        return restarted

    def _restarted(self, rec: ServerRecord, identity: str) -> None:
        """A new process answers at ``rec``'s URL: it holds its checkpoint's weights, no
        update, no pause, no adapter and no prefix cache of ours."""
        logger.warning(
            "server %s restarted (identity %s -> %s): it holds its checkpoint again, "
            "not %r; out of routing until caught up",
            rec.url, rec.identity, identity, rec.weight_version,
        )  # fmt: skip
        rec.identity = identity
        rec.restarts += 1
        rec.weight_version = rec.loaded_by = rec.reported_version = None
        rec.dirty = rec.updating = rec.paused = rec.dirty_draft = False
        rec.update_target = "main"
        rec.draft_version = None
        self._adapters.forget(rec.url)
        self._sessions.drop_server(rec.url)

    def probe_failed(self, rec: ServerRecord, error: BaseException) -> None:
        """A probe of a suspect server failed: after `DEAD_AFTER` in a row it is dead."""
        rec.failures += 1
        rec.healthy = False
        rec.suspect = True
        rec.last_error = error
        if rec.failures >= DEAD_AFTER and not rec.dead:
            rec.dead = True
            logger.warning("server %s: no answer to %d probes: dead", rec.url, rec.failures)
        self._changed([rec])

    def contradicted(self, rec: ServerRecord, versions: Iterable[str | None], *,
                     signal: bool = True) -> None:  # fmt: skip
        """An answer of ``rec``'s server carried versions the fleet does not accept for
        it (a restarted process, a server that lies): suspect until a probe reads its
        identity (a restart then clears its version)."""
        if not rec.suspect:
            logger.warning(
                "server %s answered with version(s) %s, not %r as recorded: suspect until "
                "its identity is read again",
                rec.url, ", ".join(repr(v) for v in versions), rec.weight_version,
            )  # fmt: skip
        rec.suspect = True
        rec.contradicted = True
        if signal:
            self._changed([rec])

    # ================================================================== rounds
    def round_started(self, version: str, urls: Iterable[str], target: Target = "main") -> None:
        """A round of ``version`` holds ``urls``: until it ends, what their calls answer
        (a finish, an update of the version) is recorded by the round, not by hand."""
        for url in urls:
            self._rounds[url] = (version, target)
        self._changed()

    def server_lost(self, url: str, target: Target = "main") -> None:
        """``url`` dropped out of a round: what it loaded is of no published version."""
        rec = self._records.get(url)
        if rec is not None:
            self._dirty(rec, "it dropped out of a round", draft=target == "draft")
            self._changed([rec])

    def round_committed(
        self, version: str, urls: Iterable[str], targets: Iterable[str], target: Target = "main"
    ) -> None:
        """A round is published: ``urls`` (those that went through it) hold ``version``,
        which becomes ``target``'s newest; the round no longer holds ``targets``."""
        self._histories[target].record(version)
        for url in urls:
            rec = self._records.get(url)
            if rec is None:
                continue
            if target == "draft":
                rec.draft_version = version
                self._clean(rec, draft=True)
            else:
                self._hold(rec, version)
        self._end_round(targets)
        self._changed_all()

    def caught_up(self, version: str, urls: Iterable[str], targets: Iterable[str] = ()) -> None:
        """A catch-up round brought ``urls`` to the published ``version``; the round no
        longer holds ``targets``."""
        for url in urls:
            rec = self._records.get(url)
            if rec is not None and self._hold(rec, version):
                logger.info("server %s caught up to %r", url, version)
        self._end_round(targets)
        self._changed_all()

    def rolled_back(
        self,
        dirty: Iterable[str],
        targets: Iterable[str],
        target: Target = "main",
        paused: Iterable[str] = (),
    ) -> None:
        """A round failed: ``dirty`` hold weights of no published version (their recorded
        version is the last one committed on them), ``paused`` may still run a pause that
        got no answer; the version history is unchanged."""
        for url in dirty:
            rec = self._records.get(url)
            if rec is not None:
                self._dirty(rec, "a round that reached it failed", draft=target == "draft")
        for url in paused:
            rec = self._records.get(url)
            if rec is not None:
                rec.paused = True
        self._end_round(targets)
        self._changed_all()

    def _end_round(self, urls: Iterable[str]) -> None:
        for url in urls:
            self._rounds.pop(url, None)
            rec = self._records.get(url)
            if rec is not None:
                rec.loaded_in_round = rec.marked_after_finish = False

    def _hold(self, rec: ServerRecord, version: str) -> bool:
        """``rec``'s server (the process it is now) holds ``version``: clean, unless
        marked by hand after its finish (False)."""
        rec.weight_version = version
        rec.loaded_by = rec.identity
        rec.reported_version = None
        if rec.marked_after_finish:  # the mark is newer than what the round loaded
            rec.updating = False
            logger.info("server %s stays dirty: marked by hand after its finish", rec.url)
            return False
        self._clean(rec)
        return True

    # ---------------------------------------------------------------- by hand
    def published_by_hand(self, version: str, urls: Iterable[str]) -> None:
        """Every targeted server finished ``version`` through the control routes called
        directly (or it was set by hand): it becomes the newest, they hold it. Servers
        that a round holds are left to the round."""
        free = [u for u in urls if u not in self._rounds and u in self._records]
        if not free:
            return
        self._histories["main"].record(version)
        for url in free:
            self._hold(self._records[url], version)
        self._changed_all()

    def version_recorded(self, rec: ServerRecord, version: str | None) -> None:
        """One server's version recorded by its own client (``client.weight_version =``,
        its finish or version update called directly); the history is unchanged. A
        server that a round holds is left to the round."""
        if rec.url in self._rounds:
            return
        if version is None:
            rec.weight_version = rec.loaded_by = None
        else:
            self._hold(rec, version)
        self._changed([rec])

    def versions_set(self, urls: Iterable[str], version: str | None) -> None:
        """``Fleet.set_weight_version``: a version is recorded (None: forgotten) by
        hand; a new one becomes the newest."""
        if version is not None:
            self.published_by_hand(version, urls)
            return
        recs = [self._records[u] for u in urls if u in self._records]
        for rec in recs:
            rec.weight_version = rec.loaded_by = None
        self._changed(recs)

    def marked(self, urls: Iterable[str], *, dirty: bool) -> None:
        """``Fleet.mark_dirty`` and ``mark_clean``: dirty is the served model's weights;
        clean is both models (the served one and its draft), and no update active."""
        recs = [self._records[u] for u in urls]
        for rec in recs:
            if dirty:
                self._dirty(rec, "marked by hand")
                # after its finish in the main round that still holds it
                rec.marked_after_finish = rec.loaded_in_round
            else:
                rec.marked_after_finish = False
                self._clean(rec)
                self._clean(rec, draft=True)
        self._changed(recs, by_hand=True)  # a mark by hand is no flap of the server

    def error_restored(self, url: str, error: BaseException | None) -> None:
        """A rejection that was asked for (an update sent to end an open one) is not a
        failure: ``url``'s last error stays what it was before it."""
        rec = self._records.get(url)
        if rec is not None:
            rec.last_error = error

    def written_by_hand(self, url: str, name: str, value: Any) -> None:
        """A deprecated write to a `ServerState` snapshot, applied through the transition
        it names (or, for the ledger's own counts, as written)."""
        rec = self._records.get(url)
        if rec is None:
            return
        match name:
            case "weight_version":
                self.versions_set([url], value)
            case "dirty":
                self.marked([url], dirty=bool(value))
            case "max_concurrency":
                self.concurrency_limited([url], value)
            case "host":
                rec.host = value
                self._changed()
            case "healthy":
                rec.healthy = bool(value)
                rec.suspect = rec.suspect or not value
                self._changed([rec])
            case "health":
                pass  # follows from the other facts
            case _:
                setattr(rec, name, value)
                self._changed([rec])

    # ================================================================== adapters
    def adapter_loaded(self, url: str, name: str, version: str) -> None:
        self._adapters.loaded.setdefault((url, name), set()).add(version)
        self._changed()

    def adapter_unloaded(self, url: str, name: str, version: str) -> None:
        versions = self._adapters.loaded.get((url, name))
        if versions is not None:
            versions.discard(version)
            if not versions:
                del self._adapters.loaded[(url, name)]
        self._changed()

    def adapter_forgotten(self, url: str) -> None:
        """``url`` holds no adapter we know of (it restarted, or left the fleet)."""
        self._adapters.forget(url)
        self._changed()

    def adapter_published(self, name: str, version: str) -> None:
        self._adapters.histories.setdefault(name, VersionHistory()).record(version)
        self._changed()

    def adapter_use_began(self, url: str, name: str, version: str) -> None:
        self._adapters.uses[(url, name, version)] += 1

    def adapter_use_ended(self, url: str, name: str, version: str) -> None:
        key = (url, name, version)
        self._adapters.uses[key] -= 1
        if self._adapters.uses[key] <= 0:
            del self._adapters.uses[key]
        self._changed()


#: Operations whose success changes more than health (see Ledger._succeeded).
_STATEFUL_OPS = frozenset(
    {"pause", "resume", "is_paused", "weight_info", "start_weight_update",
     "start_draft_weight_update", "finish_weight_update"}
)  # fmt: skip


def _of_draft(rec: ServerRecord, op: str) -> bool:
    """Whether weight call ``op`` concerns the draft model: a draft start, or an update
    or finish of an update started into the draft."""
    if op in _STARTS:
        return op == "start_draft_weight_update"
    return rec.update_target == "draft"


def _why(rec: ServerRecord) -> str:
    """What made a server's health what it is, for the log line."""
    if rec.health == "dead":
        return f" ({rec.failures} failed probes)"
    if rec.health == "suspect":
        if not rec.healthy:
            return f" ({rec.last_error})" if rec.last_error is not None else ""
        return " (held out: flapping)" if not rec.suspect else " (identity to be read)"
    if rec.health == "stale":
        if rec.dirty:
            return " (dirty)"
        if rec.weight_version is None:
            return " (holds no published version)"
        return f" (holds {rec.weight_version!r})"
    return ""
