"""How the fake finds its handlers: each declares its route with ``@route``, and a
`RouteGroup` lists the declared routes that its server serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from asyncsync.testing._fake._state import FakeState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: path -> (HTTP method, handler)
Routes = dict[str, tuple[str, Handler]]
#: Whether a server serves a route (a vLLM version without it answers 404).
Served = Callable[[FakeState], bool]

_H = TypeVar("_H", bound=Callable[..., Awaitable[web.StreamResponse]])


@dataclass(frozen=True, slots=True)
class _Declared:
    method: str
    path: str
    served: Served


_DECLARED: dict[Callable[..., Any], _Declared] = {}


def _always(state: FakeState) -> bool:
    return True


def route(method: str, path: str, *, served: Served = _always) -> Callable[[_H], _H]:
    """Declares the decorated method of a `RouteGroup` the handler of
    ``method path``, on the servers for which ``served(state)`` is true."""

    def declare(handler: _H) -> _H:
        _DECLARED[handler] = _Declared(method, path, served)
        return handler

    return declare


class RouteGroup:
    """The handlers of related routes, over one server's state."""

    def __init__(self, state: FakeState) -> None:
        self.state = state

    def routes(self) -> Routes:
        """The routes of this group that its server serves, with their bound handlers."""
        table: Routes = {}
        for name, attr in vars(type(self)).items():
            declared = _DECLARED.get(attr) if callable(attr) else None
            if declared is not None and declared.served(self.state):
                table[declared.path] = (declared.method, getattr(self, name))
        return table
