"""A fleet's servers: their clients in order, each client's record kept in the fleet's
ledger (`asyncsync._core.ledger.Ledger`, which also carries the change signal)."""

from __future__ import annotations

from collections.abc import Iterable

from asyncsync._core.ledger import Ledger, ServerRecord
from asyncsync._generation.engine import GenerationEngine
from asyncsync._wire.control import normalize_url
from asyncsync.client import AsyncVLLMClient

__all__ = ["Members"]


class Members:
    """The servers of a fleet, in the order they were added.

    Each server has one client, whose record the fleet's `ledger` adopts (the client's
    endpoint then reports to the fleet's ledger), and is either owned (built and closed
    by the fleet) or borrowed.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._clients: dict[str, AsyncVLLMClient] = {}
        self._owned: set[str] = set()

    def add(self, client: AsyncVLLMClient, *, owned: bool, verify: bool = False) -> ServerRecord:
        """Add ``client``'s server; ``verify``: out of routing until a probe has read
        its identity (a server added at runtime)."""
        url = client.base_url
        if url in self._clients:
            raise ValueError(f"server {url} is already in the fleet")
        record = self.ledger.join(client._endpoint.record, verify=verify)
        client._endpoint.ledger = self.ledger
        self._clients[url] = client
        if owned:
            self._owned.add(url)
        return record

    def remove(self, url: str) -> tuple[AsyncVLLMClient, bool]:
        """Drop ``url`` (retired in the ledger); returns its client and whether the fleet
        owned it. Its calls in flight finish and report to its retired record."""
        client = self._clients.pop(url)
        self.ledger.retire(url)
        owned = url in self._owned
        self._owned.discard(url)
        return client, owned

    def owned(self) -> list[AsyncVLLMClient]:
        return [self._clients[url] for url in self._clients if url in self._owned]

    def client(self, url: str) -> AsyncVLLMClient:
        """The client of ``url`` (any spelling of it: normalized first)."""
        client = self._clients.get(url)  # a member's own spelling needs no parsing
        return client if client is not None else self._clients[normalize_url(url)]

    def generator(self, record: ServerRecord) -> GenerationEngine:
        """The generation engine of the server ``record`` describes."""
        return self._clients[record.url]._generator

    def record(self, url: str) -> ServerRecord:
        return self.client(url)._endpoint.record

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._clients)

    def records(self) -> tuple[ServerRecord, ...]:
        return self.ledger.records()

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
