"""Routing of generations across a fleet, as small pure functions and records.

- `ineligibility`: why a server cannot take a generation now (or None): the one
  admission rule.
- `choose`: least outstanding requests among eligible servers, with session
  affinity.
- `contradicts`: whether an answer's weight versions are ones the fleet accepts.
- `StalenessStats` and `staleness_of`: how many versions behind
  completions were, fleet-wide.

`VersionHistory` and `SessionTable` (the ledger's records of published versions and
pinned sessions) are `asyncsync._core.history`'s. Nothing here touches the network;
`asyncsync.Fleet` applies these decisions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from asyncsync._core.completion import Completion
from asyncsync._core.history import SessionTable, VersionHistory, Versions
from asyncsync._core.state import Facts, Reason

__all__ = [
    "TRANSIENT",
    "SessionTable",
    "StalenessStats",
    "VersionHistory",
    "choose",
    "contradicts",
    "ineligibility",
    "staleness_of",
]

#: Skip reasons that pass by themselves (a round ends, a request finishes); a session
#: pinned to a server waits through them instead of moving, to keep its prefix cache.
TRANSIENT: frozenset[Reason] = frozenset({"updating", "paused", "busy", "below_min"})


class Routed(Facts, Protocol):
    """What routing reads of a server: a `ServerState` or the ledger's record."""

    @property
    def url(self) -> str: ...
    @property
    def weight_version(self) -> str | None: ...
    @property
    def outstanding(self) -> int: ...
    @property
    def routed(self) -> int: ...
    @property
    def max_concurrency(self) -> int | None: ...

    def unfit(self) -> Reason | None: ...


def ineligibility(
    state: Routed,
    history: Versions,
    *,
    max_staleness: int | None,
    min_version: str | None = None,
) -> Reason | None:
    """Why ``state``'s server cannot take a generation now, or None if it can: the one
    admission rule, which every request a fleet sends to a server passes.

    Checks, in order: fit to serve (`asyncsync._core.state.unfit`: in the fleet,
    answering, its identity read since it last failed, not held out, clean, not
    updating, not paused); its version: once anything was published, a published one
    (any, with ``max_staleness=None``) at most ``max_staleness`` versions behind the
    newest, loaded by the process it is now (the ledger's health says ``stale``
    otherwise); at least ``min_version``; below its concurrency limit.
    """
    unfit = state.unfit()
    if unfit is not None:
        return unfit
    if len(history):
        lag = history.behind(state.weight_version)
        if lag is None:
            return "unknown_version"
        if max_staleness is not None and lag > max_staleness:
            return "stale"
    if state.health == "stale":
        return "stale"  # its process is not the one that loaded its version
    if min_version is not None and not history.at_least(state.weight_version, min_version):
        return "below_min"
    if state.max_concurrency is not None and state.outstanding >= state.max_concurrency:
        return "busy"
    return None


R = TypeVar("R", bound=Routed)


def choose(
    states: Iterable[R],
    history: Versions,
    *,
    max_staleness: int | None,
    min_version: str | None = None,
    pinned: str | None = None,
    exclude: Set[str] = frozenset(),
) -> tuple[R | None, dict[str, Reason]]:
    """Pick a server: the ``pinned`` one when it is eligible (or only transiently not:
    then nobody, so the caller waits for it), else the eligible server with the fewest
    outstanding requests (ties: the one that was routed fewest generations).

    Returns (the server or None, the reason each skipped server was skipped).
    """
    skipped: dict[str, Reason] = {}
    best: R | None = None
    pinned_state: R | None = None
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


def contradicts(
    history: Versions, max_staleness: int | None, completion: Completion, *, published: int
) -> list[str | None]:
    """The versions the server itself reported for ``completion``'s tokens that the
    fleet did not accept when the request was admitted, with ``published`` versions in
    its history then: never published, or older than ``max_staleness`` versions behind
    the newest then (a version published since is fine: the request ran across a
    round). Empty when every one was accepted, when nothing was published at admission
    (every server served its checkpoint), or when the server reported none (only
    ``/inference/v1/generate`` of vLLM >= 0.32 does)."""
    if published <= 0:
        return []
    floor = 0 if max_staleness is None else published - 1 - max_staleness
    bad: list[str | None] = []
    for span in completion.weight_versions:
        if span.source != "server" or span.end <= span.start:
            continue
        index = history.index(span.version)
        if (index is None or index < floor) and span.version not in bad:
            bad.append(span.version)
    return bad


def staleness_of(history: Versions, c: Completion) -> int | None:
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
