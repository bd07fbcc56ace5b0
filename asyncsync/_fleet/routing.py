"""Routing of generations across a fleet, as small pure functions and records.

- `VersionHistory`: the order in which weight versions were published through a
  fleet, so "how many versions behind" has a meaning.
- `ineligibility`: why a server cannot take a generation now (or None).
- `choose`: least outstanding requests among eligible servers, with session
  affinity.
- `StalenessStats` and `staleness_of`: how many versions behind
  completions were, fleet-wide.

Nothing here touches the network; `asyncsync.Fleet` applies these decisions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

from asyncsync._core.completion import Completion
from asyncsync._core.state import Reason, ServerState

__all__ = [
    "TRANSIENT",
    "SessionTable",
    "StalenessStats",
    "VersionHistory",
    "choose",
    "ineligibility",
    "staleness_of",
]

#: Skip reasons that pass by themselves (a round ends, a request finishes); a session
#: pinned to a server waits through them instead of moving, to keep its prefix cache.
TRANSIENT: frozenset[Reason] = frozenset({"updating", "paused", "busy", "below_min"})


class VersionHistory:
    """Weight versions in publication order (oldest first), deduplicated."""

    __slots__ = ("_index", "_order")

    def __init__(self, versions: Iterable[str] = ()) -> None:
        self._order: list[str] = []
        self._index: dict[str, int] = {}
        for version in versions:
            self.record(version)

    def record(self, version: str | None) -> bool:
        """Append ``version`` as the newest, unless already known. True if new."""
        if version is None or version in self._index:
            return False
        self._index[version] = len(self._order)
        self._order.append(version)
        return True

    @property
    def current(self) -> str | None:
        """The newest version, or None before anything was published."""
        return self._order[-1] if self._order else None

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, version: object) -> bool:
        return version in self._index

    def index(self, version: str | None) -> int | None:
        return None if version is None else self._index.get(version)

    def behind(self, version: str | None) -> int | None:
        """How many versions ``version`` is behind the newest (0 = current); None when
        the version is unknown or nothing was published."""
        idx = self.index(version)
        return None if idx is None else len(self._order) - 1 - idx

    def at_least(self, version: str | None, minimum: str) -> bool:
        """``version`` is ``minimum`` or newer (False when either is unknown)."""
        have, want = self.index(version), self.index(minimum)
        return have is not None and want is not None and have >= want


def ineligibility(
    state: ServerState,
    history: VersionHistory,
    *,
    max_staleness: int | None,
    min_version: str | None = None,
) -> Reason | None:
    """Why ``state``'s server cannot take a generation now, or None if it can.

    Checks, in order: fit to serve (`ServerState.unfit`: healthy, not dirty, not
    updating, not paused), version (at most ``max_staleness`` versions behind the
    newest, when anything was published; ``None`` disables the check), at least
    ``min_version``, and below its concurrency limit.
    """
    unfit = state.unfit()
    if unfit is not None:
        return unfit
    if max_staleness is not None and len(history):
        lag = history.behind(state.weight_version)
        if lag is None:
            return "unknown_version"
        if lag > max_staleness:
            return "stale"
    if min_version is not None and not history.at_least(state.weight_version, min_version):
        return "below_min"
    if state.max_concurrency is not None and state.outstanding >= state.max_concurrency:
        return "busy"
    return None


def choose(
    states: Iterable[ServerState],
    history: VersionHistory,
    *,
    max_staleness: int | None,
    min_version: str | None = None,
    pinned: str | None = None,
    exclude: Set[str] = frozenset(),
) -> tuple[ServerState | None, dict[str, Reason]]:
    """Pick a server: the ``pinned`` one when it is eligible (or only transiently not:
    then nobody, so the caller waits for it), else the eligible server with the fewest
    outstanding requests (ties: the one that was routed fewest generations).

    Returns (the server or None, the reason each skipped server was skipped).
    """
    skipped: dict[str, Reason] = {}
    best: ServerState | None = None
    pinned_state: ServerState | None = None
    for state in states:
        if state.url in exclude:
            continue
        reason = ineligibility(state, history, max_staleness=max_staleness, min_version=min_version)
        if state.url == pinned:
            pinned_state = state
        if reason is not None:
            skipped[state.url] = reason
            continue
        if best is None or (state.outstanding, state.routed) < (best.outstanding, best.routed):
            best = state
    if pinned_state is not None:
        reason = skipped.get(pinned_state.url)
        if reason is None:
            return pinned_state, skipped
        if reason in TRANSIENT:
            return None, skipped
    return best, skipped


def staleness_of(history: VersionHistory, c: Completion) -> int | None:
    """Versions behind the newest of the oldest version among ``c``'s tokens: from the
    spans when every span with tokens names its version, else from the version at
    admission (client-side spans of a version that changed in flight), and from the
    version at completion when there are no tokens. None when a version is unknown."""
    worst = -1
    unknown = False
    for span in c.weight_versions:
        if span.end > span.start:
            if span.version is None:
                return history.behind(c.admitted_version)
            lag = history.behind(span.version)
            if lag is None:
                unknown = True
            elif lag > worst:
                worst = lag
    if unknown:
        return None
    if worst < 0:
        return history.behind(c.completed_version)
    return worst


class SessionTable:
    """Session id -> server URL, least recently used dropped beyond ``capacity``."""

    __slots__ = ("_map", "capacity")

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, session_id: str) -> str | None:
        url = self._map.get(session_id)
        if url is not None:
            self._map.move_to_end(session_id)
        return url

    def pin(self, session_id: str, url: str) -> None:
        self._map[session_id] = url
        self._map.move_to_end(session_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def drop(self, session_id: str) -> str | None:
        return self._map.pop(session_id, None)

    def drop_server(self, url: str) -> None:
        for sid in [s for s, u in self._map.items() if u == url]:
            del self._map[sid]

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._map


@dataclass(slots=True)
class StalenessStats:
    """How many versions behind the fleet's newest version completions were.

    A completion's staleness is measured when it completes, for its oldest token
    version: 0 means every token came from the newest published weights. Completions
    whose version is unknown (nothing published through the fleet yet, or a version
    change the fleet could not place) are counted in ``unknown``.

    Attributes:
        histogram: staleness -> number of completions.
        unknown: completions whose staleness is unknown.
        per_server: server URL -> staleness histogram.
    """

    histogram: Counter[int] = field(default_factory=Counter)
    unknown: int = 0
    per_server: dict[str, Counter[int]] = field(default_factory=dict)

    def record(self, server: str, staleness: int | None) -> None:
        if staleness is None:
            self.unknown += 1
            return
        self.histogram[staleness] += 1
        per = self.per_server.get(server)
        if per is None:
            per = self.per_server[server] = Counter()
        per[staleness] += 1

    @property
    def count(self) -> int:
        """Completions with a known staleness."""
        return sum(self.histogram.values())

    @property
    def mean(self) -> float:
        count = self.count
        return sum(k * v for k, v in self.histogram.items()) / count if count else 0.0

    @property
    def max(self) -> int:
        return max(self.histogram) if self.histogram else 0

    def fraction_at_most(self, versions: int) -> float:
        """Share of (known-staleness) completions at most ``versions`` behind."""
        count = self.count
        within = sum(v for k, v in self.histogram.items() if k <= versions)
        return within / count if count else 1.0

    def as_dict(self) -> Mapping[str, object]:
        return {
            "count": self.count,
            "unknown": self.unknown,
            "mean": self.mean,
            "max": self.max,
            "histogram": dict(sorted(self.histogram.items())),
        }

    def reset(self) -> None:
        self.histogram.clear()
        self.per_server.clear()
        self.unknown = 0
