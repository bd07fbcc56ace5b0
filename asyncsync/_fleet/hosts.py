"""Host identity: which servers run on the same machine (and network stack) as this
process.

A host identity is a string. Two processes on one machine, in one network namespace,
get the same one from `this_host` (its hostname, then a digest of the kernel's boot id
and the network namespace), whatever Ray node or container image they run in; a
process in another network namespace (a container with its own network, the tests'
namespaced server) gets another. `same_host` also takes what a user may write by hand:
this machine's hostname, or one of its addresses.

Servers whose identity is not given are probed from their URL (`probe_hosts`): an
address this process can bind (loopback, an address of one of its interfaces) is on
this host; any other address is a host of its own, named ``addr:<ip>``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import os
import socket
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncsync._fleet.members import Members

__all__ = [
    "actor_handles",
    "given_hosts",
    "is_group",
    "members_of",
    "probe_hosts",
    "resolve_hosts",
    "same_host",
    "this_host",
]

#: The longest a probe waits for one name to resolve (seconds).
_RESOLVE_DEADLINE = 5.0


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


@functools.cache
def this_host() -> str:
    """This process's host identity: ``<hostname>-<digest>``, the digest of the kernel's
    boot id and this process's network namespace (equal for every process of one
    machine and network stack; Ray's logical nodes on one machine share it)."""
    digest = hashlib.sha256(
        f"{_read('/proc/sys/kernel/random/boot_id')}|{_netns()}".encode()
    ).hexdigest()[:12]
    return f"{socket.gethostname()}-{digest}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@functools.cache
def _bindable(address: str) -> bool:
    """Whether ``address`` is one of this network stack's own addresses (it can be bound:
    a cheap, exact test that needs no interface listing)."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def same_host(host: str) -> bool:
    """Whether the host identity ``host`` is this process's host: `this_host`, this
    machine's hostname, ``localhost``, or an address of this network stack."""
    if host in (this_host(), socket.gethostname(), "localhost"):
        return True
    bare = host.removeprefix("addr:")
    return _is_ip(bare) and _bindable(bare)


async def _probe(url: str) -> str:
    host = urlsplit(url).hostname or ""
    if _is_ip(host):
        return this_host() if _bindable(host) else f"addr:{host}"
    if host == "localhost":
        return this_host()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(_RESOLVE_DEADLINE):
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return f"addr:{host}"  # unresolvable: not this host as far as anyone can tell
    addresses = sorted({str(info[4][0]) for info in infos})
    if any(_bindable(a) for a in addresses):
        return this_host()
    return f"addr:{addresses[0]}" if addresses else f"addr:{host}"


async def probe_hosts(urls: Iterable[str]) -> dict[str, str]:
    """The host identity of each URL, from its address (names resolved off the loop,
    each within a deadline)."""
    targets = list(urls)
    await asyncio.to_thread(this_host)  # read once (the kernel's files), off the loop
    found = await asyncio.gather(*(_probe(url) for url in targets))
    return dict(zip(targets, found, strict=True))


def given_hosts(urls: Sequence[str], hosts: object) -> dict[str, str]:
    """``Fleet(..., hosts=...)``: a mapping of URL to identity, or one identity (or None:
    probed) per URL in order."""
    if hosts is None:
        return {}
    if isinstance(hosts, Mapping):
        pairs = list(hosts.items())
    elif isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise TypeError("hosts must be a mapping of URL to host or a sequence, one per server")
    else:
        if len(hosts) != len(urls):
            raise ValueError(f"hosts has {len(hosts)} entries for {len(urls)} server(s)")
        pairs = list(zip(urls, hosts, strict=True))
    out: dict[str, str] = {}
    for url, host in pairs:
        if host is None:
            continue
        if not isinstance(host, str) or not host:
            raise ValueError(f"the host of {url} must be a non-empty string, got {host!r}")
        out[str(url)] = host
    return out


def is_group(servers: Any) -> bool:
    """Whether ``servers`` is a `asyncsync.ray.ServerGroup` (has ``urls`` and ``hosts``)."""
    return hasattr(servers, "urls") and hasattr(servers, "hosts")


def actor_handles(servers: Any) -> list[Any]:
    """``servers`` as a list of server actors' handles; a TypeError naming what is not."""
    if isinstance(servers, str) or not isinstance(servers, Iterable):
        raise TypeError(
            "from_ray takes a ServerGroup (asyncsync.ray.launch_servers) or server actor "
            f"handles, got {type(servers).__name__}"
        )
    handles = list(servers)
    for handle in handles:
        if not hasattr(getattr(handle, "server_info", None), "remote"):
            raise TypeError(f"{handle!r} is not a server actor (no server_info method)")
    return handles


async def members_of(servers: Any, deadline: float) -> tuple[list[str], list[str | None]]:
    """URLs and host identities of a `asyncsync.ray.ServerGroup` (anything with ``urls``
    and ``hosts``) or of server actors' handles (each answers ``server_info``), the
    actors asked at once within ``deadline`` seconds."""
    if is_group(servers):
        return list(servers.urls), list(servers.hosts)
    handles = actor_handles(servers)
    calls: list[Awaitable[Any]] = [h.server_info.remote() for h in handles]
    async with asyncio.timeout(deadline):
        infos = await asyncio.gather(*calls)
    return [str(i["url"]) for i in infos], [str(i["host"]) for i in infos]


async def resolve_hosts(members: Members, urls: Iterable[str] | None) -> dict[str, str]:
    """Each server's host identity (all when None): as given, else probed from its
    URL's address and recorded in the ledger (`asyncsync.Fleet.resolve_hosts`)."""
    ledger = members.ledger
    records = [members.record(url) for url in members.resolve(urls)]
    found = await probe_hosts(r.url for r in records if r.host is None)
    for record in records:
        if record.host is None:
            ledger.host_known(record.url, found[record.url])
    return {r.url: str(r.host) for r in records}
