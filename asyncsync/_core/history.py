"""Two small records the fleet's ledger keeps: the weight versions published (in order)
and which server each session is pinned to. Plain data structures, no I/O; their one
writer is `asyncsync._core.ledger.Ledger`, everyone else reads them through the
read-only `Versions` protocol."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

__all__ = ["SessionTable", "VersionHistory", "Versions"]


class Versions(Protocol):
    """What is read of a `VersionHistory` (routing, staleness, the round's checks)."""

    @property
    def current(self) -> str | None: ...

    @property
    def versions(self) -> tuple[str, ...]: ...

    def __len__(self) -> int: ...

    def __contains__(self, version: object) -> bool: ...

    def index(self, version: str | None) -> int | None: ...

    def behind(self, version: str | None) -> int | None: ...

    def at_least(self, version: str | None, minimum: str) -> bool: ...


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
