"""A fleet's versions and routing settings: what was published, how stale a server may
be, the gate that waits for a version, why a server is skipped (mixed into
`asyncsync.Fleet`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asyncsync._core.errors import GenerationError
from asyncsync._core.state import Reason, ServerState
from asyncsync._fleet.dispatch import Dispatcher, RoutingPolicy
from asyncsync._fleet.members import Members
from asyncsync._fleet.routing import VersionHistory, choose

__all__ = ["FleetVersions", "check_limit"]

_Targets = Iterable[str] | None


class FleetVersions:
    """Versions and routing of a fleet (mixed into `Fleet`)."""

    _members: Members
    _history: VersionHistory
    _policy: RoutingPolicy
    _dispatch: Dispatcher

    @property
    def servers(self) -> tuple[ServerState, ...]:
        """Every server's state, in fleet order."""
        return tuple(self._members.states())

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' URLs, in the order they were added."""
        return self._members.urls

    @property
    def current_version(self) -> str | None:
        """The newest weight version published through this fleet (every targeted
        server finished it), or None before any."""
        return self._history.current

    @property
    def versions(self) -> tuple[str, ...]:
        """Weight versions published through this fleet, oldest first."""
        return self._history.versions

    def versions_behind(self, version: str | None) -> int | None:
        """How many published versions ``version`` is behind `current_version`
        (None when unknown)."""
        return self._history.behind(version)

    @property
    def max_staleness(self) -> int | None:
        """Generations go only to servers at most this many published versions behind
        the newest (0: current only; None: any version)."""
        return self._policy.max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int | None) -> None:
        self._policy.max_staleness = value
        self._members.notify()

    @property
    def admission_timeout(self) -> float | None:
        """How long a generation waits for an eligible server before failing."""
        return self._policy.admission_timeout

    @admission_timeout.setter
    def admission_timeout(self, value: float | None) -> None:
        self._policy.admission_timeout = value

    def set_concurrency_limit(self, limit: int | None, urls: _Targets = None) -> None:
        """At most ``limit`` generations in flight at once on each of ``urls`` (all
        when None; ``limit=None`` removes the limit). Requests beyond it wait."""
        check_limit(limit)
        for url in self._members.resolve(urls):
            self._members.state(url).max_concurrency = limit
        self._members.notify()

    def session_server(self, session_id: str) -> str | None:
        """The server a session is pinned to, if any."""
        return self._dispatch.sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a session's server (a new turn may then go anywhere)."""
        self._dispatch.sessions.drop(session_id)

    def routing_reasons(
        self, *, min_version: str | None = None, lora: str | None = None
    ) -> dict[str, Reason | None]:
        """Why each server would be skipped by a generation now (None: eligible);
        ``lora=name``: by a generation with that adapter (``no_adapter``,
        ``stale_adapter`` before the base reasons, as routing decides)."""
        _, skipped = choose(
            self.servers, self._history, max_staleness=self.max_staleness, min_version=min_version
        )
        if lora is not None:
            skipped.update(self._dispatch.adapters.skipped(lora, self.servers, self.max_staleness))
        return {url: skipped.get(url) for url in self.urls}

    def _mark_draft_dirty(self, urls: Iterable[str]) -> None:
        """A draft round left these servers' draft models of no known version."""
        for url in urls:
            self._members.state(url).mark(dirty=True, draft=True)
        self._members.notify()

    def _published_draft(self, version: str, urls: Iterable[str]) -> None:
        """A draft round committed ``version`` on ``urls``: their draft models hold it.
        Their served versions, and the fleet's, are unchanged (speculative decoding does
        not change what the served model samples)."""
        for url in urls:
            self._members.state(url).record_draft_version(version)
        self._members.notify()

    async def wait_for_version(
        self,
        version: str,
        *,
        targets: _Targets = None,
        count: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a gate with a deadline
    ) -> list[str]:
        """Wait until ``count`` of ``targets`` (default: all of them) hold ``version``
        or a newer published one, and are fit to serve (healthy, clean, not mid-update,
        not paused). Returns those servers' URLs. Raises
        `GenerationError` after ``timeout`` seconds. A version gate
        for async RL: e.g. generate the next batch only once the servers run weights at
        most k steps old."""
        urls = self._members.resolve(targets)
        need = len(urls) if count is None else count
        if not 1 <= need <= max(len(urls), 1):
            raise ValueError(f"count must be between 1 and {len(urls)}, got {count!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            ready = [u for u in urls if u in self._members and self._holds(u, version)]
            if len(ready) >= need:
                return ready
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise GenerationError(
                    f"only {len(ready)} of {need} server(s) reached version {version!r} "
                    f"within {timeout:g} s"
                )
            await self._members.changed(0.5 if remaining is None else min(0.5, remaining))

    def _holds(self, url: str, version: str) -> bool:
        state = self._members.state(url)
        return state.available and self._history.at_least(state.weight_version, version)


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"a concurrency limit must be an int >= 1 or None, got {limit!r}")
