"""What asyncsync knows about one server, and the rules that change it.

`ServerState` is the one record per server: the client writes it for its own
calls and a `Fleet` shares the same object, so a server's weight
version has one source of truth. The rules live here and nowhere else:

- *fit to serve* (`ServerState.unfit`): healthy, not dirty, not mid-update, not
  paused;
- *unreachable* (`unreachable`): what makes a server unhealthy;
- the transition after each call's outcome (`observe`), including *dirty*: a
  weight-sync call that failed, was cancelled or got no answer leaves the server's
  weights in an unknown state until a later round finishes there (a frozen server runs
  its queued requests when it thaws).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from asyncsync._core.errors import ServerError, ServerTimeout, ServerUnavailableError
from asyncsync._core.types import Phase, ProtocolGeneration

logger = logging.getLogger("asyncsync.fleet")

__all__ = ["LOOKUP_OPS", "UPDATE_OPS", "Reason", "ServerState", "observe", "unreachable"]

#: Why a server is skipped by routing; the first four and ``dirty_draft`` are the
#: server's own state (`ServerState.unfit`), the others depend on the fleet and the
#: request (``no_adapter``, ``stale_adapter``: a generation with ``lora=name`` and a server
#: without that adapter's recent versions).
Reason = Literal[
    "unhealthy",
    "dirty",
    "updating",
    "paused",
    "stale",
    "unknown_version",
    "below_min",
    "busy",
    "no_adapter",
    "stale_adapter",
    "dirty_draft",
]

#: Operations that change a server's weights (``start_draft_weight_update``: a round
#: into the speculative draft model).
UPDATE_OPS = frozenset(
    {"start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update"}
)
#: The two starts: of a round into the served model, and into its draft model.
_STARTS = frozenset({"start_weight_update", "start_draft_weight_update"})
#: Questions asked about the served model (its limits, its checkpoint) on the side of
#: other calls: their outcomes change nothing here (last_error keeps the cause of the
#: last real failure; health is what the calls they serve find out).
LOOKUP_OPS = frozenset({"describe", "models"})


@dataclass(slots=True)
class ServerState:
    """What is known about one server, as last observed. Mutable; read it freely.

    Attributes:
        url: the server's base URL.
        vllm_version: from ``GET /version`` once known.
        protocol: ``"0.23"`` or ``"0.32"`` once known.
        weight_version: the last version finished (or read with ``weight_info``) here.
        paused: paused by this fleet (or observed paused) and not resumed since.
        updating: ``start_weight_update`` succeeded and no finish has yet.
        dirty: left mid-update (a weight-sync call failed, was cancelled or got no
            answer after or during a start); holds weights of no known version until a
            later round finishes here.
        healthy: False after the server could not be reached or did not answer, True
            after any success.
        update_target: what the open (or last started) update loads into: ``"main"``
            (the served model) or ``"draft"`` (its speculative draft model).
        dirty_draft: the draft model was left mid-update (a draft round failed here);
            unfit to serve (speculative decoding runs the draft) until a draft round
            finishes here. ``dirty`` is about the served model's weights.
        draft_version: the version of the last draft round finished here (None: none).
        outstanding: requests in flight to this server.
        last_error: the most recent failure, None after a success.
        max_concurrency: the most generations routed here at once (None: no limit).
        routed: generations routed here so far (load spread).
        host: the server's host identity (``Fleet(..., hosts=...)``, a Ray server
            group's, or probed from its address by ``Fleet.resolve_hosts``); None
            while unknown.
    """

    url: str
    vllm_version: str | None = None
    protocol: ProtocolGeneration | None = None
    weight_version: str | None = None
    paused: bool = False
    updating: bool = False
    dirty: bool = False
    healthy: bool = True
    outstanding: int = 0
    last_error: BaseException | None = None
    max_concurrency: int | None = None
    routed: int = 0
    host: str | None = None
    update_target: Literal["main", "draft"] = "main"
    dirty_draft: bool = False
    draft_version: str | None = None

    def unfit(self) -> Reason | None:
        """Why this server cannot serve generations now, by its own state (None: fit).
        The one rule for "fit to serve"; routing adds version and load checks."""
        if not self.healthy:
            return "unhealthy"
        if self.dirty:
            return "dirty"
        if self.dirty_draft:
            return "dirty_draft"
        if self.updating:
            return "updating"
        if self.paused:
            return "paused"
        return None

    @property
    def available(self) -> bool:
        """Fit to serve generations: healthy, not dirty (nor its draft), not updating,
        not paused."""
        return self.unfit() is None

    def record_version(self, version: str | None) -> None:
        """The server now holds weights ``version`` (the one writer of it)."""
        self.weight_version = version

    def mark(self, *, dirty: bool, draft: bool = False) -> None:
        """Mark dirty, or clean again (in sync, no update active); ``draft``: the flag of
        the draft model (`dirty_draft`) instead of the served model's."""
        was = self.dirty_draft if draft else self.dirty
        if dirty != was:
            what = "'s draft model" if draft else ""
            logger.info("server %s%s marked %s", self.url, what, "dirty" if dirty else "clean")
        if draft:
            self.dirty_draft = dirty
        else:
            self.dirty = dirty
        if not dirty:
            self.updating = False

    def mark_by_hand(self, *, dirty: bool) -> None:
        """``Fleet.mark_dirty``: dirty is the served model's weights; clean is both
        models (the served one and its draft)."""
        self.mark(dirty=dirty)
        if not dirty:
            self.mark(dirty=False, draft=True)

    def record_draft_version(self, version: str) -> None:
        """A draft round finished here: the draft model holds ``version`` (the one
        writer of it); its served model and weight version are unchanged."""
        self.draft_version = version
        self.mark(dirty=False, draft=True)


def unreachable(error: BaseException, phase: Phase, *, connected: bool = True) -> bool:
    """The server could not be reached or did not answer: it is unhealthy.

    A connection failure always counts. A deadline counts on control and update calls;
    a generation that outlived its (caller-chosen) deadline only counts when the
    connection itself was never established (``connected=False``).
    """
    if isinstance(error, ServerUnavailableError):
        return True
    if isinstance(error, ServerTimeout):
        return phase != "generate" or not connected
    return False


def observe(
    state: ServerState,
    op: str,
    phase: Phase,
    error: BaseException | None,
    value: Any = None,
    *,
    version: str | None = None,
    connected: bool = True,
) -> None:
    """Update ``state`` after operation ``op`` ended with ``value`` or ``error``.

    ``version``: the weight version the call sets when it succeeds (finish, update of
    the version). ``connected``: whether a failed request got as far as a connection.
    """
    if op in LOOKUP_OPS:
        return  # a side question: what the calls it serves find out is what counts
    if error is None:
        state.healthy = True
        state.last_error = None
        if op in _STATEFUL_OPS:
            _succeeded(state, op, value)
        if version is not None:
            state.record_version(version)
        return
    state.last_error = error
    if unreachable(error, phase, connected=connected) or (
        op == "health" and isinstance(error, ServerError)
    ):
        if state.healthy:
            logger.warning("server %s unhealthy after %s: %s", state.url, op, error)
        state.healthy = False  # /health answers 503 when vLLM's engine is dead
    if op in UPDATE_OPS:
        _weight_call_failed(state, op, error)


def observe_cancelled(state: ServerState, op: str) -> None:
    """A call was cancelled while in flight: a weight-sync call may still run there."""
    if op in UPDATE_OPS and (state.updating or op in _STARTS):
        _dirty(state, f"{op} was cancelled in flight", draft=_of_draft(state, op))


#: Operations whose success changes more than health (see _succeeded).
_STATEFUL_OPS = frozenset(
    {"pause", "resume", "is_paused", "weight_info", "start_weight_update",
     "start_draft_weight_update", "finish_weight_update"}
)  # fmt: skip


def _succeeded(state: ServerState, op: str, value: Any) -> None:
    match op:
        case "pause":
            state.paused = True
        case "resume":
            state.paused = False
        case "is_paused":
            state.paused = bool(value)
        case "weight_info" if isinstance(value, str):
            state.record_version(value)
        case "start_weight_update" | "start_draft_weight_update":
            state.updating = True
            state.update_target = "draft" if op == "start_draft_weight_update" else "main"
        case "finish_weight_update":
            # a finished draft round cleans the draft only: the served model's weights
            # (and its dirty flag) are not what it changed
            state.mark(dirty=False, draft=state.update_target == "draft")
            state.update_target = "main"
        case _:
            pass


def _weight_call_failed(state: ServerState, op: str, error: BaseException) -> None:
    """A weight-sync call failed. vLLM drops its active update when an update fails, so
    the server is no longer updating, but its weights are of no known version. A call
    that got no answer may still run when the server thaws: dirty as well. A failure in
    a round into the draft model makes the draft dirty (`ServerState.dirty_draft`)."""
    no_answer = isinstance(error, (ServerTimeout, ServerUnavailableError))
    draft = _of_draft(state, op)
    if op in _STARTS:
        if no_answer:
            _dirty(state, f"{op} got no answer: {error}", draft=draft)
        return
    if state.updating or (state.dirty_draft if draft else state.dirty) or no_answer:
        state.updating = False
        _dirty(state, f"{op} failed: {error}", draft=draft)


def _of_draft(state: ServerState, op: str) -> bool:
    """Whether weight call ``op`` concerns the draft model: a draft start, or an update
    or finish of an update started into the draft."""
    if op in _STARTS:
        return op == "start_draft_weight_update"
    return state.update_target == "draft"


def _dirty(state: ServerState, why: str, *, draft: bool = False) -> None:
    if not (state.dirty_draft if draft else state.dirty):
        what = "'s draft model" if draft else ""
        logger.warning("server %s%s marked dirty (needs a resync): %s", state.url, what, why)
    if draft:
        state.dirty_draft = True
    else:
        state.dirty = True
