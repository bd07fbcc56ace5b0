"""What a fleet knows about one server, as users read it, and the rules read from it.

`ServerState` is a frozen snapshot of one server's record in the fleet's ledger
(`asyncsync._core.ledger.Ledger`, the one writer): ``fleet.state(url)``,
``fleet.servers`` and ``client.server_state`` return copies, which any thread may read.
Writing to one is deprecated: for one release it warns, naming the transition to use
(``fleet.mark_dirty``, ``fleet.set_weight_version``...), and applies it.

The rules here read a server's facts and never change them:

- *fit to serve* (`unfit`): in the fleet and answering, its identity checked, clean, not
  mid-update, not paused;
- *unreachable* (`unreachable`): which failures make a server unhealthy.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import ServerTimeout, ServerUnavailableError
from asyncsync._core.types import Phase, ProtocolGeneration

__all__ = [
    "HEALTH",
    "LOOKUP_OPS",
    "UPDATE_OPS",
    "Facts",
    "Health",
    "Reason",
    "ServerState",
    "unfit",
    "unreachable",
]

#: A server's place in the fleet's state machine (docs/concepts.md has the diagram):
#: ``healthy`` (routed: answering, the process that loaded an accepted version),
#: ``suspect`` (a call failed or an answer contradicted the record: out of routing until
#: a probe has read its identity again; also a server held out after flapping),
#: ``stale`` (answering, but holding no version the fleet accepts: restarted, joined,
#: left mid-round, too far behind; caught up by the publisher when a fault did it),
#: ``dead`` (no answer for several probes; it comes back only through ``stale``),
#: ``retired`` (removed).
Health = Literal["healthy", "suspect", "stale", "dead", "retired"]
HEALTH: tuple[Health, ...] = ("healthy", "suspect", "stale", "dead", "retired")

#: Why a server is skipped by routing. The server's own state (`unfit`): ``retired``,
#: ``dead``, ``unhealthy`` (its last call failed), ``suspect`` (answering again, its
#: identity not yet read), ``flapping`` (held out for a back-off), ``dirty``,
#: ``dirty_draft``, ``updating``, ``paused``. Its version against the fleet's:
#: ``stale``, ``unknown_version``, ``below_min``. Its load: ``busy``. A generation with
#: ``lora=name``: ``no_adapter``, ``stale_adapter``.
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
    "suspect",
    "dead",
    "retired",
    "flapping",
]

#: Operations that change a server's weights (``start_draft_weight_update``: a round
#: into the speculative draft model).
UPDATE_OPS = frozenset(
    {"start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update"}
)
#: Questions asked about the served model (its limits, its checkpoint, its identity) on
#: the side of other calls: their outcomes change nothing by themselves (last_error keeps
#: the cause of the last real failure; health is what the calls they serve find out).
LOOKUP_OPS = frozenset({"describe", "models", "identity"})


class Facts(Protocol):
    """What `unfit` reads: a `ServerState`, or the ledger's record of a server."""

    @property
    def health(self) -> Health: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def dirty(self) -> bool: ...
    @property
    def dirty_draft(self) -> bool: ...
    @property
    def updating(self) -> bool: ...
    @property
    def paused(self) -> bool: ...


def unfit(facts: Facts) -> Reason | None:
    """Why a server cannot serve generations now, by its own state (None: fit). The one
    rule for "fit to serve"; routing adds version and load checks."""
    health = facts.health
    if health in {"retired", "dead"}:
        return health
    if not facts.healthy:
        return "unhealthy"
    if health == "suspect":
        return "suspect"
    if facts.dirty:
        return "dirty"
    if facts.dirty_draft:
        return "dirty_draft"
    if facts.updating:
        return "updating"
    if facts.paused:
        return "paused"
    return None


#: For each field a user may still write (deprecated): the transition to use instead.
_TRANSITIONS = {
    "weight_version": "Fleet.set_weight_version(version, [url])",
    "dirty": "Fleet.mark_dirty([url]) / Fleet.mark_clean([url])",
    "paused": "Fleet.pause(...) / Fleet.resume(...)",
    "healthy": "Fleet.health(targets=[url]) (answering servers are healthy)",
    "max_concurrency": "Fleet.set_concurrency_limit(limit, [url])",
    "host": "Fleet(..., hosts=...) or Fleet.resolve_hosts()",
}


@dataclass(slots=True)
class ServerState:
    """What is known about one server: a snapshot of the fleet's record, taken when it
    was read (read it again for news). Safe to read from any thread.

    Attributes:
        url: the server's base URL.
        vllm_version: from ``GET /version`` once known.
        protocol: ``"0.23"`` or ``"0.32"`` once known.
        weight_version: the published version this server holds, as recorded when a
            round finished on it (the process that loaded it: ``identity``); None while
            unknown (never published here, restarted, left mid-round).
        health: ``"healthy"``, ``"suspect"``, ``"stale"``, ``"dead"`` or ``"retired"``
            (`Health`; docs/concepts.md).
        identity: the server process's identity (vLLM's ``instance_id``, read from
            ``/server_info``), None while unread; it changes when the server restarts.
        paused: paused by this fleet (or observed paused) and not resumed since.
        updating: ``start_weight_update`` succeeded and no finish has yet.
        dirty: left mid-update (a weight-sync call failed, was cancelled or got no
            answer after or during a start); holds weights of no known version until a
            later round (or a catch-up) finishes here.
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
    health: Health = "healthy"
    identity: str | None = None
    _owner: Any = field(default=None, init=False, repr=False, compare=False)
    _sealed: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self._sealed_now() or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name not in _FIELDS:
            raise AttributeError(f"ServerState has no attribute {name!r}")
        new = _TRANSITIONS.get(name, "nothing: asyncsync keeps it (read it only)")
        warn_deprecated(f"writing ServerState.{name}", new)
        object.__setattr__(self, name, value)
        owner = self._owner() if isinstance(self._owner, weakref.ReferenceType) else None
        if owner is not None:
            owner.written_by_hand(self.url, name, value)

    def _sealed_now(self) -> bool:
        try:
            return bool(object.__getattribute__(self, "_sealed"))
        except AttributeError:  # still in __init__
            return False

    def unfit(self) -> Reason | None:
        """Why this server cannot serve generations now, by its own state (None: fit).
        The one rule for "fit to serve"; routing adds version and load checks."""
        return unfit(self)

    @property
    def available(self) -> bool:
        """Fit to serve generations: healthy, its identity checked, not dirty (nor its
        draft), not updating, not paused."""
        return unfit(self) is None

    def record_version(self, version: str | None) -> None:
        """Deprecated: ``Fleet.set_weight_version`` (the fleet's ledger records it)."""
        warn_deprecated("ServerState.record_version()", _TRANSITIONS["weight_version"])
        object.__setattr__(self, "weight_version", version)
        owner = self._owner() if isinstance(self._owner, weakref.ReferenceType) else None
        if owner is not None:
            owner.written_by_hand(self.url, "weight_version", version)


_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerState) if not f.name.startswith("_"))


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
