"""``Fleet.watch``: a fleet's membership kept in step with a source of server URLs.

A source is one of:

- an `asyncsync.ray.ServerGroup` (anything with an awaitable ``refresh()`` that returns
  its current URLs, and ``urls``/``hosts``): servers of actors that Ray restarted
  (``max_restarts``) come back under their new URL, started again by the group;
- a vllm-router's URL (a string): its worker list (``GET /list_workers``);
- any async callable that returns URLs (a DNS name behind a Kubernetes headless
  service, a config file...).

Each tick lists the source (within the fleet's control deadline), adds the servers it
names that the fleet lacks (`asyncsync.Fleet.add_server`: out of routing until caught
up), removes the ones it no longer names (`asyncsync.Fleet.remove_server`: their
requests in flight finish), and probes every member (`asyncsync.Fleet.health`: health
and identity, so a server that restarted between two ticks is seen). A source that
fails or lists no server at all changes nothing (logged): an empty list is far more
often a source's hiccup than a fleet that lost every server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from asyncsync._wire.control import normalize_url, plan_list_workers
from asyncsync.client import AsyncVLLMClient

__all__ = ["Lister", "lister", "watch"]

logger = logging.getLogger("asyncsync.fleet")

#: What a tick reads from its source: the URLs, and the hosts of those it knows.
Lister = Callable[[], Awaitable[tuple[list[str], Mapping[str, str]]]]


class Fleet(Protocol):
    """What a watch uses of `asyncsync.Fleet` (its public methods)."""

    @property
    def urls(self) -> tuple[str, ...]: ...

    def __contains__(self, url: object) -> bool: ...

    def __len__(self) -> int: ...

    async def add_server(self, server: str, *, host: str | None = None) -> object: ...

    async def remove_server(self, url: str) -> object: ...

    async def health(self, *, require: Any = None) -> object: ...


def lister(source: object, router: Callable[[str], AsyncVLLMClient]) -> Lister:
    """How to read ``source`` (see the module docstring); ``router(url)`` makes the
    client of a vllm-router. TypeError for anything else."""
    refresh = getattr(source, "refresh", None)
    if callable(refresh) and hasattr(source, "hosts") and hasattr(source, "urls"):

        async def group() -> tuple[list[str], Mapping[str, str]]:
            urls = list(await refresh())
            hosts = dict(zip(source.urls, source.hosts, strict=True))
            return urls, {u: hosts[u] for u in urls if u in hosts}

        return group
    if isinstance(source, str):
        client = router(source)

        async def workers() -> tuple[list[str], Mapping[str, str]]:
            return await client._endpoint.request(plan_list_workers(), None), {}

        return workers
    if callable(source):
        call: Callable[[], Any] = source

        async def listed() -> tuple[list[str], Mapping[str, str]]:
            found = call()
            if not isinstance(found, Awaitable):
                raise TypeError(
                    f"watch: {source!r} returned {type(found).__name__}, not an awaitable"
                )
            urls = await found
            if isinstance(urls, str) or not isinstance(urls, Iterable):
                raise TypeError(f"watch: {source!r} must return URLs, got {urls!r}")
            return [str(u) for u in urls], {}

        return listed
    raise TypeError(
        "watch takes an asyncsync.ray ServerGroup, a vllm-router's URL or an async callable "
        f"returning URLs, got {type(source).__name__}"
    )


async def watch(fleet: Fleet, source: Lister, every: float, deadline: float | None) -> None:
    """Keep ``fleet``'s membership in step with ``source``, one tick every ``every``
    seconds, until cancelled (see the module docstring)."""
    while True:
        await tick(fleet, source, deadline)
        await asyncio.sleep(every)


async def tick(fleet: Fleet, source: Lister, deadline: float | None) -> None:
    """One listing of ``source`` applied to ``fleet``, then every member probed."""
    try:
        async with asyncio.timeout(deadline):
            listed, hosts = await source()
        urls = list(dict.fromkeys(normalize_url(u) for u in listed))
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as exc:
        logger.warning("watch: the source could not be listed (%s): membership kept", exc)
    else:
        if not urls:
            logger.warning("watch: the source listed no server: membership kept")
        else:
            await _apply(fleet, urls, hosts)
    if len(fleet):
        await fleet.health(require="none")


async def _apply(fleet: Fleet, urls: list[str], hosts: Mapping[str, str]) -> None:
    for url in [u for u in fleet.urls if u not in urls]:
        logger.info("watch: %s left the source: removed", url)
        await fleet.remove_server(url)
    for url in [u for u in urls if u not in fleet]:
        logger.info("watch: %s joined the source: added (caught up before it serves)", url)
        await fleet.add_server(url, host=hosts.get(url))
