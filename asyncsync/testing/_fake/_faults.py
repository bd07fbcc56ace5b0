"""Faults a test injects into a fake server: what they are, which request gets one, and
the error bodies they answer with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

from asyncsync.testing._fake._responses import collective, openai_error

ErrorShape = Literal["collective", "openai", "string", "detail", "text"]

_HTTP_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    500: "Internal Server Error",
}
_OPENAI_TYPES = {400: "Bad Request", 500: "InternalServerError", 503: "ServiceUnavailableError"}


@dataclass(frozen=True, slots=True)
class Fault:
    """A misbehaviour to inject on a route (see the constructors)."""

    kind: Literal["delay", "hang", "until", "error", "malformed", "drop", "die", "engine_dies"]
    seconds: float = 0.0
    status: int = 500
    shape: ErrorShape = "collective"
    message: str | None = None
    body: bytes = b""
    content_type: str = "application/json"
    event: asyncio.Event | None = None

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        """Answer normally after ``seconds``."""
        return cls("delay", seconds=seconds)

    @classmethod
    def hang(cls) -> Fault:
        """Never answer (until the client gives up or the server stops)."""
        return cls("hang")

    @classmethod
    def until(cls, event: asyncio.Event) -> Fault:
        """Answer normally once ``event`` is set: requests held this way are provably in
        flight at the same time (no clock involved)."""
        return cls("until", event=event)

    @classmethod
    def error(
        cls, status: int = 500, message: str | None = None, *, shape: ErrorShape = "collective"
    ) -> Fault:
        """Answer with an error body in one of vLLM's shapes: ``collective`` (500, a
        worker failure), ``openai`` (``{"error": {...}}``), ``string`` (``{"error": "..."}``),
        ``detail`` (FastAPI's ``{"detail": "..."}``) or ``text`` (not JSON). A
        ``collective`` failure of ``/update_weights`` also ends the active update, as in
        vLLM."""
        return cls("error", status=status, shape=shape, message=message)

    @classmethod
    def malformed(
        cls, body: bytes = b"<html>oops</html>", content_type: str = "text/html"
    ) -> Fault:
        """Answer 200 with ``body`` (not what the route promises)."""
        return cls("malformed", body=body, content_type=content_type)

    @classmethod
    def drop(cls) -> Fault:
        """Close the connection without answering (connection reset)."""
        return cls("drop")

    @classmethod
    def engine_dies(cls) -> Fault:
        """vLLM's engine dies while serving the request (a worker process crashed), and
        the API server stays up, as vLLM 0.32's does: this request is never answered,
        ``/health`` answers 503 from then on, and every other request that needs the
        engine 500 (``EngineDeadError``)."""
        return cls("engine_dies")

    @classmethod
    def die(cls) -> Fault:
        """The whole server dies mid-request: the request's connection and every other
        one are cut, and the port stops accepting connections."""
        return cls("die")


@dataclass(slots=True)
class _Injected:
    fault: Fault
    remaining: int | None


class FaultQueue:
    """The injected faults, per route, in injection order; ``"*"`` matches every route."""

    def __init__(self) -> None:
        self._by_route: dict[str, list[_Injected]] = {}

    def inject(self, route: str, fault: Fault, times: int | None) -> None:
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        self._by_route.setdefault(route, []).append(_Injected(fault, times))

    def clear(self) -> None:
        self._by_route.clear()

    def take(self, path: str) -> Fault | None:
        """The fault for a request on ``path`` (the route's own first, then ``"*"``),
        counted against its ``times``."""
        for key in (path, "*"):
            queue = self._by_route.get(key)
            if not queue:
                continue
            injected = queue[0]
            if injected.remaining is not None:
                injected.remaining -= 1
                if injected.remaining <= 0:
                    queue.pop(0)
            return injected.fault
        return None


def error_response(fault: Fault) -> web.Response:
    """The answer of an ``error`` fault, in its shape."""
    message = fault.message or "injected fault"
    if fault.shape == "collective":
        return openai_error(fault.status, collective(message), "InternalServerError")
    if fault.shape == "openai":
        kind = _OPENAI_TYPES.get(fault.status, _HTTP_PHRASES.get(fault.status, "Error"))
        return openai_error(fault.status, message, kind)
    if fault.shape == "string":
        return web.json_response({"error": message}, status=fault.status)
    if fault.shape == "detail":
        return web.json_response({"detail": message}, status=fault.status)
    return web.Response(status=fault.status, text=message, content_type="text/plain")
