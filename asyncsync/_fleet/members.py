"""A fleet's servers: their clients and states in order, and a signal when any changes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asyncsync._core.state import ServerState
from asyncsync._generation.engine import GenerationEngine
from asyncsync._wire.control import normalize_url
from asyncsync.client import AsyncVLLMClient

__all__ = ["Members"]


class Members:
    """The servers of a fleet, in the order they were added.

    Each server has one client (whose `ServerState` is the server's
    one record) and is either owned (built and closed by the fleet) or borrowed.
    `notify` wakes everything waiting in `changed` (routing waits for an
    eligible server this way).
    """

    def __init__(self) -> None:
        self._clients: dict[str, AsyncVLLMClient] = {}
        self._states: tuple[ServerState, ...] = ()
        self._owned: set[str] = set()
        self._waiters: set[asyncio.Future[None]] = set()

    def add(self, client: AsyncVLLMClient, *, owned: bool) -> ServerState:
        url = client.base_url
        if url in self._clients:
            raise ValueError(f"server {url} is already in the fleet")
        self._clients[url] = client
        self._states += (client.server_state,)
        if owned:
            self._owned.add(url)
        self.notify()
        return client.server_state

    def remove(self, url: str) -> tuple[AsyncVLLMClient, bool]:
        """Drop ``url``; returns its client and whether the fleet owned it."""
        client = self._clients.pop(url)
        self._states = tuple(c.server_state for c in self._clients.values())
        owned = url in self._owned
        self._owned.discard(url)
        self.notify()
        return client, owned

    def owned(self) -> list[AsyncVLLMClient]:
        return [self._clients[url] for url in self._clients if url in self._owned]

    def client(self, url: str) -> AsyncVLLMClient:
        """The client of ``url`` (any spelling of it: normalized first)."""
        client = self._clients.get(url)  # a member's own spelling needs no parsing
        return client if client is not None else self._clients[normalize_url(url)]

    def generator(self, state: ServerState) -> GenerationEngine:
        """The generation engine of the server ``state`` describes."""
        return self._clients[state.url].generator

    def state(self, url: str) -> ServerState:
        return self.client(url).server_state

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._clients)

    def states(self) -> tuple[ServerState, ...]:
        return self._states

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, url: str) -> bool:
        return url in self._clients

    def resolve(self, targets: Iterable[str] | None) -> list[str]:
        """The URLs ``targets`` names (all when None), checked and deduplicated."""
        if targets is None:
            return list(self._clients)
        if isinstance(targets, str):
            raise TypeError("targets must be an iterable of URLs, not one string")
        urls: list[str] = []
        for target in targets:
            # A member's own spelling is already normalized: the rounds pass the fleet's
            # URLs for every phase, and parsing each again cost ~8% of a fan-out's CPU.
            known = isinstance(target, str) and target in self._clients
            url = target if known else normalize_url(target)
            if url not in self._clients:
                raise KeyError(f"server {url} is not in the fleet")
            if url not in urls:
                urls.append(url)
        return urls

    # --------------------------------------------------------------- change signal
    def notify(self) -> None:
        """Wake everything waiting in `changed` (a server's state changed)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def changed(self, within: float) -> None:
        """Return at the next `notify`, or after ``within`` seconds."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            async with asyncio.timeout(within):
                await fut
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)
