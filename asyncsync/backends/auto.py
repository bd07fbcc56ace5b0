"""Trainer side of ``backend="auto"``: each server on the transport its host allows, in
one round.

Servers on the trainer's host (`asyncsync._fleet.hosts.same_host` of their host
identity: given, a Ray group's, or probed from the address) get ``shm``; the others
get ``gloo``. The round stays one round with one version: this backend composes the
`ShmBackend` and the `GlooBackend`, each sending its share through a lane of the
round's client (`SyncFleetClient.lane`), both at once (the gloo share on a helper
thread). Every phase lands in the one round, so a server that fails drops out like in
any round; only a lost gloo server makes the round regroup (the gloo servers form a
new group without it, `collective_servers`). The servers run ``asyncsync_auto``, the
worker engine that takes whichever transport its init names.

With servers of one kind only, the round is exactly that transport's round. A mixed
round reads the weights once per transport, so they must be readable twice (a module,
a mapping, a list, a ``WeightSource``): a one-shot stream is refused before any server
is touched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from asyncsync._fleet.hosts import same_host
from asyncsync._transport.gloo_wire import AUTO_BACKEND_NAME
from asyncsync.backends._options import DEFAULT_BUFFER_BYTES, Auto, ZeroCopyMode
from asyncsync.backends.contract import Ceiling, SendControl, SendStats, TrainerApi, TrainerBackend
from asyncsync.backends.gloo import GlooBackend
from asyncsync.backends.shm import ShmBackend

if TYPE_CHECKING:
    from asyncsync.backends.contract import SyncFleetClient, WeightSource
    from asyncsync.fleet import Fleet

__all__ = ["AutoBackend", "Transport"]

logger = logging.getLogger("asyncsync.publish")

#: What ``"auto"`` picked for a server.
Transport = Literal["shm", "gloo"]


class AutoBackend(TrainerBackend):
    """``"auto"``: shm for the servers on the trainer's host, gloo for the others.

    `transports` says what the last round (or init) picked for each server.
    """

    name = "auto"
    server_backend = AUTO_BACKEND_NAME
    options_class = Auto
    keeps_last_round = True

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        zero_copy: ZeroCopyMode = False,
        master_address: str | None = None,
        master_port: int | None = None,
        create_timeout_s: float = 60.0,
        op_timeout_s: float | None = None,
    ) -> None:
        if api != "engine":
            raise ValueError("backend 'auto' drives rounds in vLLM 0.3x's engine style")
        super().__init__(rank=rank, world_size=world_size, api=api)
        common: dict[str, Any] = {"rank": rank, "world_size": world_size, "api": api}
        self.shm = ShmBackend(buffer_bytes=buffer_bytes, zero_copy=zero_copy, **common)
        self.gloo = GlooBackend(
            buffer_bytes=buffer_bytes, master_address=master_address,
            master_port=master_port, create_timeout_s=create_timeout_s,
            op_timeout_s=op_timeout_s, **common,
        )  # fmt: skip
        #: server URL -> the transport chosen for it (set before each round)
        self.transports: dict[str, Transport] = {}
        #: servers new since the init (restarted, or joined): a server of the ``auto``
        #: engine reads gloo until an init names shm, so its first shm round inits it
        self._shm_init_due: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None

    async def prepare(self, fleet: Fleet, targets: Sequence[str]) -> None:
        hosts = await fleet.resolve_hosts(targets)
        self.transports = {url: "shm" if same_host(h) else "gloo" for url, h in hosts.items()}
        logger.info(
            "backend 'auto': %s",
            ", ".join(f"{url} {t}" for url, t in self.transports.items()) or "no servers",
        )

    def servers_restarted(self, urls: Sequence[str]) -> None:
        """New processes (restarted, or servers this publisher never reached): a gloo one
        is in no group (the next send forms one with it); an shm one has had no init,
        which its next shm round sends first."""
        self.gloo.servers_restarted([u for u in urls if self.transports.get(u) == "gloo"])
        self._shm_init_due.update(urls)

    def collective_servers(self, urls: Iterable[str]) -> frozenset[str]:
        return frozenset(url for url in urls if self.transports.get(url) == "gloo")

    def delta_servers(self, urls: Iterable[str]) -> frozenset[str]:
        """The gloo servers (other hosts): the shm ones take a ``delta=True`` round
        whole, which costs less on the trainer's host than comparing the model."""
        return self.gloo.delta_servers(self.collective_servers(urls))

    def _split(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        urls = list(urls)
        unknown = [url for url in urls if url not in self.transports]
        if unknown:
            raise RuntimeError(f"backend 'auto' has no transport for {', '.join(unknown)}")
        return (
            [url for url in urls if self.transports[url] == "shm"],
            [url for url in urls if self.transports[url] == "gloo"],
        )

    def init_info(self) -> Mapping[str, Any]:
        return self.shm.init_info()

    def init(self, client: SyncFleetClient) -> None:
        shm, gloo = self._split(client.servers())
        self._shm_init_due.difference_update(shm)
        if shm:
            client.lane(shm).init_weight_transfer_engine(self.shm.init_info())
        if gloo:
            self.gloo.init(client.lane(gloo))

    def check(self, source: WeightSource) -> None:
        self.shm.check(source)
        mixed = len(set(self.transports.values())) > 1
        if mixed and self.is_sender and not source.reiterable:
            raise ValueError(
                "backend 'auto' sends this round over shm and gloo, which read the weights "
                "once each: pass weights that can be read twice (a module, a mapping, a "
                "list, a WeightSource), not a one-shot stream"
            )

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        if client is None:  # another rank: iterate in lockstep, send nothing
            return self.shm.send(source, None, control)
        shm, gloo = self._split(client.servers())
        due = [url for url in shm if url in self._shm_init_due]
        if due:  # before anything else reaches them (a lane's calls keep their order)
            client.lane(due).init_weight_transfer_engine(self.shm.init_info())
            self._shm_init_due.difference_update(due)
        if not gloo:
            return self.shm.send(source, client, control)
        if not shm:
            return self.gloo.send(source, client, control)
        whole = source.whole()  # a delta round's patches go to the gloo servers only
        self.check(whole)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncsync-auto")
        shm_lane, gloo_lane = client.lane(shm), client.lane(gloo)
        over_gloo: Future[SendStats] = self._pool.submit(self.gloo.send, source, gloo_lane, control)
        try:
            try:
                over_shm = self.shm.send(whole, shm_lane, control)
            except BaseException:
                control.cancel.set()  # the gloo share stops at its next chunk boundary
                _wait_quietly(over_gloo)
                raise
            return _merged(over_shm, over_gloo.result())
        finally:  # no fan-out of either share outlives the send
            shm_lane.settle()
            gloo_lane.settle()

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """The slower of the two transports' ceilings (a round ends when both shares
        did); None when a transport in use has none."""
        shm, gloo = self._split(urls)
        found = [self.shm.ceiling(shm) if shm else None, self.gloo.ceiling(gloo) if gloo else None]
        used = [c for c, urls_ in zip(found, (shm, gloo), strict=True) if urls_]
        if not used or any(c is None for c in used):
            return None
        return min((c for c in used if c is not None), key=lambda c: c.gb_per_s)

    def abort_info(self) -> Mapping[str, Any]:
        return self.shm.abort_info()

    def close(self) -> None:
        self.shm.close()
        self.gloo.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _wait_quietly(future: Future[SendStats]) -> None:
    """Wait for the other share to end (never leave it sending); its error, if any, is
    the round's already (its servers' outcomes)."""
    with contextlib.suppress(BaseException):  # the first share's error is raised instead
        future.result()


def _merged(a: SendStats, b: SendStats) -> SendStats:
    """One round's figures over two transports: the payload once, packing time both."""
    return SendStats(
        chunks=max(a.chunks, b.chunks),
        bytes=max(a.bytes, b.bytes),
        params=max(a.params, b.params),
        pack_seconds=a.pack_seconds + b.pack_seconds,
    )
