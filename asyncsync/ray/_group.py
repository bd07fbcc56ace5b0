"""`launch_servers` and the `ServerGroup` it returns: vLLM servers as Ray actors.

One actor per server, placed through a placement group (one bundle per server); each
actor runs its server as a subprocess (`asyncsync.ray._actor`). Every Ray call that
could block is awaited through Ray's asyncio support (an ``ObjectRef`` is awaitable)
or runs in a thread, and each has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Awaitable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncsync._core.errors import AsyncSyncError
from asyncsync.ray._actor import ServerActor
from asyncsync.testing import LocalVLLMServer, ServerStartError

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = [
    "Launch",
    "Placement",
    "PlacementTimeoutError",
    "RayNotInitializedError",
    "ServerGroup",
    "launch_servers",
]

logger = logging.getLogger("asyncsync.ray")

#: How a group's bundles are placed over Ray's nodes (Ray's placement strategies).
Placement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: `LocalVLLMServer` options that `launch_servers` sets itself.
_OWN_OPTIONS = frozenset({"model_dir", "watchdog", "cpu_cores", "startup_timeout"})


class RayNotInitializedError(AsyncSyncError, RuntimeError):
    """`launch_servers` was called before ``ray.init()``."""


class PlacementTimeoutError(AsyncSyncError, TimeoutError):
    """The group's placement group could not be placed within ``placement_timeout``:
    the cluster lacks the resources its bundles ask for."""


@dataclass(frozen=True)
class _Spec:
    """What `launch_servers` was asked for, checked."""

    model: str
    num_servers: int
    placement: Placement | PlacementGroup
    bundle_indices: tuple[int, ...] | None
    num_cpus: float
    num_gpus: float
    cpu_cores: tuple[str | None, ...]
    placement_timeout: float
    startup_timeout: float
    stop_timeout: float
    options: Mapping[str, Any] = field(default_factory=dict)
    max_restarts: int = 0

    def bundle(self) -> dict[str, float]:
        resources = {"CPU": self.num_cpus}
        if self.num_gpus:
            resources["GPU"] = self.num_gpus
        return resources


class ServerGroup:
    """vLLM servers running as Ray actors; an async context manager.

    Attributes:
        urls: the servers' base URLs, in launch order.
        hosts: each server's host identity (equal for servers on one machine and
            network stack, whatever Ray node they run in): what ``backend="auto"``
            compares with the trainer's.
        actors: the Ray actor handles, one per server (each answers
            ``server_info.remote()``; `asyncsync.Fleet.from_ray` takes them).
        nodes: the Ray node id each server runs on.
        infos: what each actor reported (``url``, ``host``, ``node_id``, ``pgid``,
            ``pid``, ``cpu_cores``, ``log_path``, ``ring_buffers``, ``index``).
        placement_group: the placement group the servers are placed in.

    ``urls``, ``hosts``, ``nodes`` and ``infos`` are what the actors said when last
    asked: at launch, and at each `refresh` (``fleet.watch(group)`` refreshes).
    """

    def __init__(
        self,
        actors: Sequence[Any],
        infos: Sequence[Mapping[str, Any]],
        placement_group: PlacementGroup,
        *,
        owns_placement_group: bool,
        stop_timeout: float,
        startup_timeout: float = 600.0,
    ) -> None:
        self.actors: tuple[Any, ...] = tuple(actors)
        self._members: list[dict[str, Any] | None] = [dict(i) for i in infos]
        self._set_members()
        self.placement_group = placement_group
        self._owns_placement_group = owns_placement_group
        self._stop_timeout = stop_timeout
        self._startup_timeout = startup_timeout
        #: actor index -> the start of its server again, after Ray restarted the actor
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self.closed = False

    def _set_members(self) -> None:
        infos = [i for i in self._members if i is not None]
        self.infos: tuple[dict[str, Any], ...] = tuple(infos)
        self.urls: tuple[str, ...] = tuple(str(i["url"]) for i in infos)
        self.hosts: tuple[str, ...] = tuple(str(i["host"]) for i in infos)
        self.nodes: tuple[str, ...] = tuple(str(i["node_id"]) for i in infos)

    async def refresh(self, *, timeout: float = 30.0) -> tuple[str, ...]:  # noqa: ASYNC109
        """Ask every actor for its server (at once, each within ``timeout`` seconds) and
        return the URLs of the servers running now. An actor that Ray restarted
        (``launch_servers(max_restarts=...)``) runs no server yet: it is started again
        in the background (its new URL is listed once it is healthy); a dead actor, or
        one that does not answer, is left out. ``fleet.watch(group)`` calls this."""
        if self.closed:
            return ()

        async def ask(index: int, actor: Any) -> dict[str, Any] | None:
            if index in self._restarting:
                return None
            try:
                async with asyncio.timeout(timeout):
                    info: dict[str, Any] = await actor.server_info.remote()
            except ray.exceptions.RayTaskError:
                # the actor answers but runs no server: Ray restarted it
                self._restart(index, actor)
                return None
            except (ray.exceptions.RayError, TimeoutError):
                return None  # dead, or restarting: asked again next time
            return info

        found = await asyncio.gather(*(ask(i, a) for i, a in enumerate(self.actors)))
        for index, info in enumerate(found):
            if index not in self._restarting:
                self._members[index] = info
        self._set_members()
        return self.urls

    def _restart(self, index: int, actor: Any) -> None:
        logger.warning("server %d's actor was restarted by Ray: starting its server again", index)
        self._members[index] = None

        async def start() -> None:
            try:
                async with asyncio.timeout(self._startup_timeout + 60.0):
                    self._members[index] = await actor.start.remote()
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("server %d did not start again: %s", index, exc)
            finally:
                self._restarting.pop(index, None)

        self._restarting[index] = asyncio.get_running_loop().create_task(
            start(), name=f"asyncsync:ray-restart-{index}"
        )

    def fleet(self, **options: Any) -> Fleet:
        """A `asyncsync.Fleet` (not yet opened) over these servers, with their host
        identities; ``options`` are the Fleet's (``router_url=...``, ``timeouts=...``)."""
        from asyncsync.fleet import Fleet

        return Fleet(self.urls, hosts=self.hosts, **options)

    async def aclose(self) -> None:
        """Stop every server (each within the stop deadline), kill the actors and remove
        the placement group this group created. Idempotent; a dead actor's server is
        already gone (its watchdog stopped it)."""
        if self.closed:
            return
        self.closed = True
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)
        await _teardown(
            list(self.actors),
            self.placement_group if self._owns_placement_group else None,
            self._stop_timeout,
        )

    async def __aenter__(self) -> ServerGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.aclose())

    def __len__(self) -> int:
        return len(self.urls)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<ServerGroup {list(self.urls)} {state}>"


class Launch(Awaitable[ServerGroup]):
    """What `launch_servers` returns: await it for the `ServerGroup`
    (``group = await launch_servers(...)``), or enter it
    (``async with launch_servers(...) as group:``), which closes the group on exit."""

    def __init__(self, spec: _Spec) -> None:
        self._spec = spec
        self._group: ServerGroup | None = None

    def __await__(self) -> Generator[Any, None, ServerGroup]:
        return _launch(self._spec).__await__()

    async def __aenter__(self) -> ServerGroup:
        self._group = await _launch(self._spec)
        return self._group

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._group is not None:
            await asyncio.shield(self._group.aclose())


def launch_servers(
    model: str | os.PathLike[str],
    *,
    num_servers: int,
    backend: str | None = "auto",
    placement: Placement | PlacementGroup = "PACK",
    bundle_indices: Sequence[int] | None = None,
    num_cpus: float = 0.1,
    num_gpus: float = 0,
    cpu_cores: Sequence[str | None] | None = None,
    placement_timeout: float = 60.0,
    startup_timeout: float = 600.0,
    stop_timeout: float = 30.0,
    max_restarts: int = 0,
    **server_options: Any,
) -> Launch:
    """Launch ``num_servers`` vLLM servers as Ray actors (``ray.init()`` first).

    Each server is a `asyncsync.testing.LocalVLLMServer` subprocess of its actor, with a
    watchdog: when the actor dies (``ray.kill``, a lost node), its server's processes
    and ring buffers go with it. Servers bind their node's address (``host=`` to choose).

    Args:
        model: the model directory, as the actors' nodes see it.
        num_servers: how many servers (>= 1).
        backend: the weight-transfer engine the servers run: ``"auto"`` (default: shm or
            gloo, as each round's trainer picks), ``"shm"``, ``"gloo"``, any vLLM
            backend name, or None.
        placement: Ray's strategy for the group's bundles (``"PACK"``, ``"SPREAD"``,
            ``"STRICT_PACK"``, ``"STRICT_SPREAD"``), or your own placement group.
        bundle_indices: with your own placement group, the bundle of each server
            (default: bundles 0 .. num_servers - 1).
        num_cpus: Ray CPUs per server (accounting only: vLLM's threads follow
            ``cpu_cores``); each bundle asks for it.
        num_gpus: Ray GPUs per server (its bundle asks for them; Ray sets
            ``CUDA_VISIBLE_DEVICES`` in the actor, which the server inherits).
        cpu_cores: each server's CPU cores for vLLM's threads (``"0"``, ``"0-3"``;
            default: one core per server, round robin over its node's cores).
        placement_timeout: how long the placement group may take to be placed.
        startup_timeout: how long each server may take to become healthy.
        stop_timeout: how long each server may take to stop.
        max_restarts: how many times Ray restarts a server's actor when it dies (its
            server goes with it; -1: without end). `ServerGroup.refresh` (and
            ``fleet.watch(group)``) starts the server of a restarted actor again, under a
            new URL, which the fleet catches up before it serves.
        server_options: `LocalVLLMServer`'s other options (``tokenizer``,
            ``extra_args``, ``env``, ``max_model_len``, ``dtype``, ``host``, ...).

    Raises:
        ValueError: ``num_servers < 1``, a placement group with too few bundles, an
            unknown placement, mismatched ``cpu_cores``/``bundle_indices``.
        RayNotInitializedError: ``ray.init()`` was not called.
        PlacementTimeoutError: (when awaited) the cluster cannot place the bundles.
        ServerStartError: (when awaited) a server did not become healthy.
    """
    spec = _check(
        model, num_servers, backend, placement, bundle_indices, num_cpus, num_gpus,
        cpu_cores, placement_timeout, startup_timeout, stop_timeout, server_options,
    )  # fmt: skip
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1, got {max_restarts!r}")
    spec = dataclasses.replace(spec, max_restarts=max_restarts)
    if not ray.is_initialized():
        raise RayNotInitializedError(
            "launch_servers needs a Ray cluster: call ray.init() first (ray.init() starts "
            "a local one; ray.init(address='auto') joins a running cluster)"
        )
    return Launch(spec)


def _check(
    model: str | os.PathLike[str],
    num_servers: object,
    backend: str | None,
    placement: object,
    bundle_indices: Sequence[int] | None,
    num_cpus: float,
    num_gpus: float,
    cpu_cores: Sequence[str | None] | None,
    placement_timeout: float,
    startup_timeout: float,
    stop_timeout: float,
    server_options: Mapping[str, Any],
) -> _Spec:
    if not isinstance(num_servers, int) or isinstance(num_servers, bool) or num_servers < 1:
        raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
    if not isinstance(placement, PlacementGroup) and placement not in _STRATEGIES:
        raise ValueError(
            f"placement must be one of {', '.join(_STRATEGIES)} or a PlacementGroup, "
            f"got {placement!r}"
        )
    indices = _bundle_indices(placement, bundle_indices, num_servers)
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    if not isinstance(placement, PlacementGroup) and not (num_cpus or num_gpus):
        raise ValueError("each server's bundle needs resources: num_cpus > 0 or num_gpus > 0")
    deadlines = {"placement_timeout": placement_timeout, "startup_timeout": startup_timeout,
                 "stop_timeout": stop_timeout}  # fmt: skip
    for name, value in deadlines.items():
        if not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be seconds > 0, got {value!r}")
    cores: tuple[str | None, ...] = (None,) * num_servers
    if cpu_cores is not None:
        if isinstance(cpu_cores, str) or len(cpu_cores) != num_servers:
            raise ValueError(f"cpu_cores must list one core set per server ({num_servers})")
        cores = tuple(cpu_cores)
    accepted = set(inspect.signature(LocalVLLMServer).parameters) - _OWN_OPTIONS
    unknown = sorted(set(server_options) - accepted)
    if unknown:
        raise TypeError(
            f"unknown server option(s) {', '.join(unknown)}; LocalVLLMServer takes "
            f"{', '.join(sorted(accepted))}"
        )
    return _Spec(
        model=os.fspath(model), num_servers=num_servers, placement=placement,
        bundle_indices=indices, num_cpus=float(num_cpus), num_gpus=float(num_gpus),
        cpu_cores=cores, placement_timeout=float(placement_timeout),
        startup_timeout=float(startup_timeout), stop_timeout=float(stop_timeout),
        options={"backend": backend, **server_options},
    )  # fmt: skip


def _bundle_indices(
    placement: object, bundle_indices: Sequence[int] | None, num_servers: int
) -> tuple[int, ...] | None:
    """The bundle of each server in the user's placement group (None: our own group)."""
    if not isinstance(placement, PlacementGroup):
        if bundle_indices is not None:
            raise ValueError("bundle_indices needs your own placement group (placement=pg)")
        return None
    count = placement.bundle_count
    indices = tuple(range(num_servers)) if bundle_indices is None else tuple(bundle_indices)
    if len(indices) != num_servers:
        raise ValueError(
            f"bundle_indices names {len(indices)} bundle(s) for {num_servers} server(s)"
        )
    if num_servers > count or any(not 0 <= i < count for i in indices):
        raise ValueError(
            f"the placement group is too small: it has {count} bundle(s) and "
            f"{num_servers} server(s) need bundles {list(indices)}; create it with at "
            f"least {max(num_servers, max(indices) + 1)} bundle(s) or pass bundle_indices"
        )
    return indices


async def _launch(spec: _Spec) -> ServerGroup:
    pg, owned = await _placed(spec)
    actors: list[Any] = []
    try:
        remote = ray.remote(ServerActor)
        indices = spec.bundle_indices or tuple(range(spec.num_servers))
        for i in range(spec.num_servers):
            options = {**spec.options, "cpu_cores": spec.cpu_cores[i] or _core(i),
                       "startup_timeout": spec.startup_timeout}  # fmt: skip
            actors.append(
                remote.options(
                    num_cpus=spec.num_cpus,
                    num_gpus=spec.num_gpus,
                    max_restarts=spec.max_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=indices[i]
                    ),
                ).remote(spec.model, i, options)
            )
        infos = await _started(actors, spec.startup_timeout + 60.0)
    except BaseException:
        await asyncio.shield(_teardown(actors, pg if owned else None, spec.stop_timeout))
        raise
    group = ServerGroup(
        actors, infos, pg, owns_placement_group=owned, stop_timeout=spec.stop_timeout,
        startup_timeout=spec.startup_timeout,
    )  # fmt: skip
    logger.info("launched %d vLLM server(s) on Ray: %s", len(group), ", ".join(group.urls))
    return group


def _core(index: int) -> str:
    """Server ``index``'s default core: round robin over this node's cores."""
    return str(index % (os.cpu_count() or 1))


async def _placed(spec: _Spec) -> tuple[PlacementGroup, bool]:
    """The placement group, placed: the user's, or one bundle per server of ours."""
    if isinstance(spec.placement, PlacementGroup):
        pg, owned = spec.placement, False
        bundles = pg.bundle_specs
    else:
        bundles = [spec.bundle() for _ in range(spec.num_servers)]
        pg = await asyncio.to_thread(ray.util.placement_group, bundles, strategy=spec.placement)
        owned = True
    try:
        async with asyncio.timeout(spec.placement_timeout):
            await pg.ready()
    except TimeoutError:
        available = await asyncio.to_thread(ray.available_resources)
        if owned:
            await asyncio.to_thread(ray.util.remove_placement_group, pg)
        strategy = spec.placement if owned else "your placement group"
        raise PlacementTimeoutError(
            f"{len(bundles)} bundle(s) {bundles} ({strategy}) could not be placed within "
            f"{spec.placement_timeout:g} s; the cluster has {available} available: add "
            "nodes, lower num_cpus/num_gpus or choose a looser placement"
        ) from None
    except BaseException:
        if owned:
            await asyncio.to_thread(ray.util.remove_placement_group, pg)
        raise
    return pg, owned


async def _started(actors: list[Any], deadline: float) -> list[dict[str, Any]]:
    """Every actor's server started (all at once), or the first failure, named."""

    async def one(i: int, actor: Any) -> dict[str, Any]:
        try:
            info: dict[str, Any] = await actor.start.remote()
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise ServerStartError(
                f"server {i} of {len(actors)} did not start on Ray: {cause}"
            ) from exc
        return info

    async with asyncio.timeout(deadline):
        return list(await asyncio.gather(*(one(i, a) for i, a in enumerate(actors))))


async def _teardown(actors: list[Any], pg: PlacementGroup | None, stop_timeout: float) -> None:
    """Stop every server (bounded), kill the actors, remove the placement group."""

    async def stop(actor: Any) -> None:
        with contextlib.suppress(Exception):  # a dead actor: its watchdog stopped its server
            async with asyncio.timeout(stop_timeout + 10.0):
                await actor.stop.remote()

    await asyncio.gather(*(stop(a) for a in actors))
    for actor in actors:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, actor, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.util.remove_placement_group, pg)
