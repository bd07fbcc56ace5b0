"""vLLM servers on Ray, for real: a ``ray.cluster_utils.Cluster`` of two logical nodes on
this machine (kept on loopback), two vLLM-CPU servers launched by
`asyncsync.ray.launch_servers` (one per node) and, where the machine allows network
namespaces, a third server in a namespace of its own (another host as far as the
network goes, like tests/test_gloo_netns_vllm.py).

One cluster and one set of servers for the whole module: launching, host identity,
``backend="auto"`` (shm for both Ray servers, gloo for the namespaced one, in one round),
a router for generations, an actor restarted by Ray (``max_restarts=1``) caught up
through ``fleet.watch(group)``, bad input, an actor killed mid-round, and ``aclose``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import (
    LocalVLLMServer,
    ServerStartError,
    check_greedy,
    process_group_members,
)

ray = pytest.importorskip("ray")

import asyncsync.ray as azray  # noqa: E402 - after the importorskip
from asyncsync._fleet.hosts import this_host  # noqa: E402
from tests.test_gloo_netns_vllm import SERVER_IP, NamespacedServer, namespace  # noqa: E402, F401
from tests.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
STARTUP = float(os.environ.get("ASYNCSYNC_TEST_STARTUP_TIMEOUT", "600"))


@dataclass
class Servers:
    group: azray.ServerGroup
    remote: LocalVLLMServer | None
    remote_skip: str | None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two logical Ray nodes on this machine, on loopback, without token auth (both set
    before Ray is imported: tests/conftest.py)."""
    from ray.cluster_utils import Cluster

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # tests/conftest.py
    store = 128 * 1024 * 1024
    node_args = {"num_cpus": 1, "object_store_memory": store, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    cluster.add_node(num_cpus=1, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def servers(
    cluster: Any, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[Servers]:
    """Two Ray-launched servers (one per node) and the namespaced one, started at once."""
    remote: LocalVLLMServer | None = None
    skip: str | None = None
    try:
        ns = request.getfixturevalue("namespace")
    except pytest.skip.Exception as exc:
        skip = str(exc)
    else:
        from asyncsync.testing._server import free_port

        remote = NamespacedServer(
            ns, tiny_model_dir, backend="auto", tokenizer=False, host=SERVER_IP,
            port=free_port(), cpu_cores="0", startup_timeout=STARTUP,
        )  # fmt: skip

    async def start() -> azray.ServerGroup:
        launch = azray.launch_servers(
            tiny_model_dir, num_servers=2, placement="STRICT_SPREAD", num_cpus=0.5,
            tokenizer=False, startup_timeout=STARTUP, max_restarts=1,
        )  # fmt: skip
        if remote is None:
            return await launch
        group, _ = await asyncio.gather(launch, remote.astart())
        return group

    with start_blocking_portal() as portal:
        group = portal.call(start)
        try:
            yield Servers(group, remote, skip)
        finally:
            portal.call(group.aclose)
            if remote is not None:
                portal.call(remote.astop)


def perturbed(model_dir: Path, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


async def greedy_everywhere(fleet: az.Fleet, model: Any) -> None:
    for url in fleet.urls:
        c = await fleet.client(url).generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        check_greedy(model, PROMPT, c.token_ids, max_new_tokens=8)


def left_over(ring_buffers: list[str]) -> list[str]:
    return [name for name in ring_buffers if Path("/dev/shm", name).exists()]


def gone(pgid: int, within: float = 120.0) -> bool:
    deadline = time.monotonic() + within
    while process_group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


async def test_servers_spread_over_two_nodes_on_one_host(servers: Servers) -> None:
    group = servers.group
    assert len(group.urls) == 2
    assert all(u.startswith("http://127.0.0.1:") for u in group.urls)  # loopback only
    assert len(set(group.nodes)) == 2  # STRICT_SPREAD: one per logical node
    assert group.hosts == (this_host(), this_host())  # one machine: one host
    assert sorted(i["cpu_cores"] for i in group.infos) == ["0", "1"]  # a core each
    async with az.Fleet.from_ray(group.actors) as fleet:  # the handles alone say the same
        assert fleet.urls == group.urls
        assert [fleet.state(u).host for u in fleet.urls] == list(group.hosts)


async def test_auto_picks_shm_on_this_host_and_is_exact(
    servers: Servers, tiny_model_dir: Path
) -> None:
    async with servers.group.fleet() as fleet:
        # Plain shm first (the servers' engine takes either transport), then "auto".
        shm_model = perturbed(tiny_model_dir, 30)
        async with az.AsyncWeightPublisher(fleet, backend="shm") as shm:
            report = await shm.publish(shm_model, version="ray-shm")
            assert report.servers == list(fleet.urls)
        await greedy_everywhere(fleet, shm_model)
    model = perturbed(tiny_model_dir, 31)
    async with (
        servers.group.fleet() as fleet,
        az.AsyncWeightPublisher(fleet, backend="auto") as publisher,
    ):
        report = await publisher.publish(model, version="ray-1")
        assert publisher._backend.transports == dict.fromkeys(fleet.urls, "shm")  # type: ignore[attr-defined]
        assert report.servers == list(fleet.urls)
        assert report.lost == []
        await greedy_everywhere(fleet, model)


async def test_one_round_sends_shm_here_and_gloo_across_the_namespace(
    servers: Servers, tiny_model_dir: Path
) -> None:
    if servers.remote is None:
        pytest.skip(servers.remote_skip or "no namespaced server")
    group, remote = servers.group, servers.remote
    model = perturbed(tiny_model_dir, 32)
    urls = [*group.urls, remote.url]
    # The Ray servers' identities are known; the namespaced one's is probed from its
    # address (not one of this network stack's).
    async with (
        az.Fleet(urls, hosts=[*group.hosts, None]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Auto(buffer_bytes=256 * 1024)) as pub,
    ):
        report = await pub.publish(model, version="mixed-1")
        transports = pub._backend.transports  # type: ignore[attr-defined]
        assert transports == {group.urls[0]: "shm", group.urls[1]: "shm", remote.url: "gloo"}
        assert report.servers == urls
        assert report.lost == []
        assert report.chunks > 1
        assert fleet.state(remote.url).host == f"addr:{SERVER_IP}"
        await greedy_everywhere(fleet, model)
        # A second round reuses the gloo group and the shm buffers: exact again.
        model2 = perturbed(tiny_model_dir, 33)
        await pub.publish(model2, version="mixed-2")
        await greedy_everywhere(fleet, model2)
        # delta=True: the gloo server joins a chain (its first round full, then patches);
        # the shm servers take every round whole.
        first = await pub.publish(model2, version="mixed-3", delta=True)
        assert (first.delta.kind, first.delta.direct) == ("full", tuple(group.urls))
        with torch.no_grad():
            for p in model2.parameters():
                p.view(-1)[::97] += 0.05
        report = await pub.publish(model2, version="mixed-4", delta=True)
        assert (report.delta.kind, report.delta.base) == ("delta", "mixed-3")
        assert report.delta.direct == tuple(group.urls)
        assert report.delta.sparse > 0
        assert report.servers == urls
        await greedy_everywhere(fleet, model2)


async def test_generations_go_through_a_router_and_rounds_to_every_server(
    servers: Servers, tiny_model_dir: Path
) -> None:
    from asyncsync.testing._router import VllmRouter, router_for

    group = servers.group
    model = perturbed(tiny_model_dir, 34)
    async with router_for(group.urls) as router:
        if VllmRouter.executable() is not None:  # installed here: it must be the one tested
            assert router.kind == "vllm-router", getattr(router, "fallback_reason", None)
        async with (
            group.fleet(router_url=router.url) as fleet,
            az.AsyncWeightPublisher(fleet, backend="auto") as publisher,
        ):
            report = await publisher.publish(model, version="routed-1")
            assert report.servers == list(group.urls)  # the round went to every server
            completions = await asyncio.gather(
                *(fleet.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
                  for _ in range(4))
            )  # fmt: skip
    for c in completions:
        assert c.server == router.url
        assert {s.version for s in c.weight_versions} == {"routed-1"}  # from the servers
        assert c.staleness == 0
        check_greedy(model, PROMPT, c.token_ids, max_new_tokens=8)


async def test_an_actor_restarted_by_ray_is_caught_up(
    servers: Servers, tiny_model_dir: Path
) -> None:
    """Ray restarts a killed actor (``max_restarts=1``); ``fleet.watch(group)`` sees its
    server gone, starts the server of the restarted actor again, adds it under its new
    URL, and the publisher catches it up from its last round: exact, without a publish."""
    group = servers.group
    model = perturbed(tiny_model_dir, 36)
    survivor, victim = group.urls[0], group.infos[1]
    async with (
        group.fleet() as fleet,
        az.AsyncWeightPublisher(fleet, backend="auto") as publisher,
    ):
        await publisher.publish(model, version="before-restart")
        watch = fleet.watch(group, every=1.0)
        ray.kill(group.actors[1], no_restart=False)  # Ray restarts it
        assert await asyncio.to_thread(gone, int(victim["pgid"]))  # its server went along
        deadline = STARTUP + 120.0  # a server start under load, then its catch-up
        await wait_until(lambda: victim["url"] not in fleet, within=deadline)
        await wait_until(lambda: len(fleet) == 2, within=deadline)
        (joined,) = [u for u in fleet.urls if u not in (survivor, victim["url"])]
        began = time.monotonic()
        state = await fleet.ready(joined, timeout=deadline)
        print(f"\nrestarted by Ray: caught up {time.monotonic() - began:.1f} s after it joined")
        assert (state.weight_version, publisher.version) == ("before-restart",) * 2
        assert fleet.state(joined).identity is not None
        await greedy_everywhere(fleet, model)
        watch.cancel()
    assert group.urls[1] == joined
    assert await asyncio.to_thread(left_over, victim["ring_buffers"]) == []


async def test_bad_placements_are_refused_with_what_to_do(
    servers: Servers, tiny_model_dir: Path
) -> None:
    pg = ray.util.placement_group([{"CPU": 0.1}])
    try:
        with pytest.raises(ValueError, match="placement group is too small: it has 1 bundle"):
            azray.launch_servers(tiny_model_dir, num_servers=2, placement=pg)
    finally:
        ray.util.remove_placement_group(pg)
    # Three servers on two nodes, one per node: the cluster cannot place it.
    with pytest.raises(azray.PlacementTimeoutError, match="could not be placed within 2 s"):
        await azray.launch_servers(
            tiny_model_dir, num_servers=3, placement="STRICT_SPREAD", placement_timeout=2
        )
    # A server that cannot start: named, and nothing of the attempt is left in Ray.
    before = ray.available_resources().get("CPU")
    with pytest.raises(ServerStartError, match=r"server 0 of 1 did not start on Ray.*no model at"):
        await azray.launch_servers(tiny_model_dir / "missing", num_servers=1, num_cpus=0.25)
    deadline = time.monotonic() + 60  # Ray reports released resources a little later
    while ray.available_resources().get("CPU") != before:  # actor and bundle released
        assert time.monotonic() < deadline, (ray.available_resources(), before)
        await asyncio.sleep(0.2)


async def test_an_actor_killed_mid_round_takes_its_server_along(
    servers: Servers, tiny_model_dir: Path
) -> None:
    group = servers.group
    victim, survivor = group.urls
    info = group.infos[0]
    model = perturbed(tiny_model_dir, 35)
    killed = False

    def on_chunk(chunks: int, _bytes: int) -> None:  # as chunk 2's fan-out settles
        nonlocal killed
        if chunks == 2 and not killed:
            killed = True
            ray.kill(group.actors[0], no_restart=True)
            # ray.kill returns before the actor (and, through its reaper, the server) is
            # gone: the round is held here (this runs in the loop's thread) until the
            # victim's processes are, so that its remaining chunks meet a dead server
            # however fast the machine (a fast one finished the whole round on the
            # victim first, and nothing was lost).
            assert gone(int(info["pgid"]))

    async with (
        group.fleet() as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Auto(buffer_bytes=320 * 1024)) as pub,
    ):
        report = await pub.publish(model, version="killed-1", progress=on_chunk)
        assert killed
        assert report.chunks > 2
        assert report.lost == [victim]
        assert report.servers == [survivor]
        assert fleet.state(victim).dirty
        c = await fleet.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert c.server == survivor
        assert {s.version for s in c.weight_versions} == {"killed-1"}
        check_greedy(model, PROMPT, c.token_ids, max_new_tokens=8)
    # The dead actor's server went with it: no process, no ring buffer left.
    assert await asyncio.to_thread(gone, int(info["pgid"]))
    assert await asyncio.to_thread(left_over, info["ring_buffers"]) == []


async def test_aclose_leaves_no_process_port_or_segment(servers: Servers) -> None:
    group = servers.group
    infos = [dict(i) for i in group.infos]
    await group.aclose()
    await group.aclose()  # idempotent
    for info in infos:
        assert await asyncio.to_thread(gone, int(info["pgid"]), 60.0)
        assert await asyncio.to_thread(left_over, info["ring_buffers"]) == []
        host, port = info["url"].removeprefix("http://").split(":")
        with socket.socket() as sock:
            assert sock.connect_ex((host, int(port))) != 0  # nothing listens
    for actor in group.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            await actor.server_info.remote()
