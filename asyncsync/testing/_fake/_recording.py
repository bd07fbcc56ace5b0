"""What a fake server records of the requests it receives."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """A request the fake received (recorded before any fault or handling)."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes
    headers: dict[str, str]
    at: float

    @property
    def json(self) -> Any:
        """The body parsed as JSON, or None when empty or not JSON."""
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def recorded(request: web.Request, body: bytes) -> RecordedRequest:
    """``request`` as received now, with its already read ``body``."""
    return RecordedRequest(
        request.method,
        request.path,
        dict(request.query),
        body,
        dict(request.headers),
        time.monotonic(),
    )
