"""Host identity (given, probed), ``backend="auto"``'s choice per server, and generations
through a router (``Fleet(urls, router_url=...)``), against fake servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync._fleet.hosts import given_hosts, probe_hosts, same_host, this_host
from asyncsync.backends import create_backend, options_for
from asyncsync.backends.auto import AutoBackend
from asyncsync.testing import FakeVLLMServer
from asyncsync.testing._router import RoundRobinProxy


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeVLLMServer()) for _ in range(2)]


@pytest.mark.asyncio
async def test_hosts_are_probed_from_addresses() -> None:
    found = await probe_hosts(
        ["http://127.0.0.1:1", "http://localhost:2", "http://[::1]:3", "http://192.0.2.7:4"]
    )
    assert list(found.values())[:3] == [this_host()] * 3
    assert found["http://192.0.2.7:4"] == "addr:192.0.2.7"  # TEST-NET-1: nobody's here
    assert all(same_host(h) for h in (this_host(), "127.0.0.1", "localhost"))
    assert not any(same_host(h) for h in ("addr:192.0.2.7", "another-machine"))


def test_given_hosts_are_checked() -> None:
    urls = ["http://a:1", "http://b:2"]
    assert given_hosts(urls, ["h1", None]) == {"http://a:1": "h1"}
    assert given_hosts(urls, {"http://b:2": "h2"}) == {"http://b:2": "h2"}
    with pytest.raises(ValueError, match="hosts has 1 entries for 2 server"):
        given_hosts(urls, ["h1"])
    with pytest.raises(TypeError, match="mapping of URL to host or a sequence"):
        given_hosts(urls, "h1")
    with pytest.raises(ValueError, match="must be a non-empty string"):
        given_hosts(urls, ["", "h"])


@pytest.mark.asyncio
async def test_auto_picks_shm_here_and_gloo_elsewhere(fakes: list[FakeVLLMServer]) -> None:
    here, there = (f.url for f in fakes)
    async with az.Fleet([here, there], hosts={there: "gpu-node-7"}) as fleet:
        backend = create_backend("auto", options_for("auto")[1], rank=0, world_size=1, api="engine")
        try:
            await backend.prepare(fleet, list(fleet.urls))
            assert backend.transports == {here: "shm", there: "gloo"}  # type: ignore[attr-defined]
            assert backend.collective_servers(fleet.urls) == {there}
            assert await fleet.resolve_hosts() == {here: this_host(), there: "gpu-node-7"}
        finally:
            backend.close()
    with pytest.raises(ValueError, match=r"Auto\.buffer_bytes must be an int >= 1"):
        az.backends.Auto(buffer_bytes=0)


@pytest.mark.asyncio
async def test_delta_rounds_need_a_transport_that_carries_them(
    fakes: list[FakeVLLMServer],
) -> None:
    """vLLM's own engines carry no delta chain: refused before any server is touched;
    ``auto`` sends patches to its gloo servers only (`TrainerBackend.delta_servers`)."""
    weights = {"w": torch.zeros(4)}
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend="nccl") as publisher,
    ):
        with pytest.raises(ValueError, match="needs the shm, gloo or auto backend, not 'nccl'"):
            await publisher.publish(weights, version="d1", delta=True)
    assert all(f.requests == [] for f in fakes)
    backend = AutoBackend()
    try:
        backend.transports = {"http://a": "shm", "http://b": "gloo"}
        assert backend.delta_servers(["http://a", "http://b"]) == {"http://b"}
    finally:
        backend.close()


@pytest.mark.asyncio
async def test_generations_go_through_the_router(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with (
        RoundRobinProxy(urls) as router,
        az.Fleet(urls, router_url=router.url, admission_timeout=5) as fleet,
    ):
        assert fleet.router_url == router.url
        await fleet.start_weight_update()  # control calls: every server, not the router
        await fleet.update_weights({"names": [], "dtype_names": [], "shapes": []})
        await fleet.finish_weight_update("v1")
        assert router.forwarded == dict.fromkeys(urls, 0)
        out = await asyncio.gather(*(fleet.generate([1, 2, 3], max_tokens=4) for _ in range(4)))
        assert router.forwarded == dict.fromkeys(urls, 2)  # the router chose, in turn
        for c in out:
            assert c.server == router.url
            assert {s.version for s in c.weight_versions} == {"v1"}
            assert c.staleness == 0


@pytest.mark.asyncio
async def test_router_admission_waits_out_a_round(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with RoundRobinProxy(urls) as router, az.Fleet(urls, router_url=router.url) as fleet:
        await fleet.start_weight_update(targets=[urls[1]])  # a round holds server 1
        with pytest.raises(az.GenerationError, match=f"a round holds {urls[1]} mid-update"):
            await fleet.generate([1, 2, 3], max_tokens=2, admission_timeout=0.3)
        assert router.forwarded == dict.fromkeys(urls, 0)  # nothing was sent meanwhile
        waiting = asyncio.ensure_future(fleet.generate([1, 2, 3], max_tokens=2))
        await fleet.finish_weight_update("v1", targets=[urls[1]])
        assert (await waiting).server == router.url


@pytest.mark.asyncio
async def test_router_answers_staler_than_the_bound_are_sent_again(
    fakes: list[FakeVLLMServer],
) -> None:
    urls = [f.url for f in fakes]
    async with RoundRobinProxy(urls) as router, az.Fleet(urls, router_url=router.url) as fleet:
        for version, targets in (("v1", urls), ("v2", [urls[1]])):  # server 0 misses v2
            await fleet.start_weight_update(targets=targets)
            await fleet.finish_weight_update(version, targets=targets)
        fleet.set_weight_version("v2", [urls[1]])  # published: v2 is the newest
        out = [await fleet.generate([1, 2, 3], max_tokens=2) for _ in range(3)]
        assert all({s.version for s in c.weight_versions} == {"v2"} for c in out)
        assert router.forwarded[urls[0]] >= 1  # its stale answers were sent again
        fleet.max_staleness = None  # no bound: whatever the router's server holds
        mixed = [await fleet.generate([1, 2, 3], max_tokens=2) for _ in range(2)]
        assert {v.version for c in mixed for v in c.weight_versions} == {"v1", "v2"}


@pytest.mark.asyncio
async def test_prompts_through_a_router_are_checked_against_the_servers_behind_it() -> None:
    async with (
        FakeVLLMServer(backend="asyncsync_shm", vocab_size=512, max_model_len=64) as a,
        FakeVLLMServer(backend="asyncsync_shm", vocab_size=300, max_model_len=128) as b,
        RoundRobinProxy([a.url, b.url]) as router,
        az.Fleet([a.url, b.url], router_url=router.url) as fleet,
    ):
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 300 is outside"):
            await fleet.generate([1, 300], max_tokens=2)  # b's vocabulary is the smaller
        with pytest.raises(ValueError, match="the prompt has 64 tokens"):
            await fleet.generate([1] * 64, max_tokens=2)  # a's context is the shorter
        assert router.forwarded == {a.url: 0, b.url: 0}  # the router was never asked
        assert (await fleet.generate([1, 299], max_tokens=2)).server == router.url
        with pytest.raises(TypeError, match="not supported through a router"):
            await fleet.generate([1, 2], max_tokens=2, lora="policy")


def test_a_mixed_round_regroups_only_for_its_collective_servers() -> None:
    from asyncsync._core.errors import ServerTimeout
    from asyncsync._core.types import CallOutcome, FleetResult
    from asyncsync._publish.report import Phase
    from asyncsync._publish.round import PublishRound

    here, there, far = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://10.9.9.9:3"
    fleet = az.Fleet([here, there, far])
    round_ = PublishRound(
        fleet, [here, there, far], version="v", need=1, pause=None, reset_prefix_cache=False,
        abort_info={}, published_version=None, collective={far},
    )  # fmt: skip

    def failed(url: str) -> FleetResult[None]:
        outcomes = {u: CallOutcome(u, value=None) for u in round_.live}
        outcomes[url] = CallOutcome(url, error=ServerTimeout("no answer", server=url))
        return FleetResult("update_weights", outcomes)

    round_._drop(Phase.UPDATE, failed(here))  # an shm server: lost, the round goes on
    assert round_.lost() == [here]
    assert not round_.regroup
    with pytest.raises(Exception, match="the collective lost"):
        round_._drop(Phase.UPDATE, failed(far))  # the gloo server: the gloo share regroups
    assert round_.regroup
    assert round_.lost() == [here, far]
    assert round_.live == [there]


@pytest.mark.asyncio
async def test_auto_inits_a_server_that_joined_after_its_first_round() -> None:
    """A server of the ``auto`` engine reads gloo until an init names shm: one that joins
    the fleet after the publisher's init (added, or a restarted actor under a new URL)
    gets the shm init before anything else of its first round, and exactly once."""
    weights = {"w": torch.arange(8, dtype=torch.float32)}
    async with AsyncExitStack() as stack:
        first, joiner = [
            await stack.enter_async_context(FakeVLLMServer(server_info=True)) for _ in range(2)
        ]
        fleet = await stack.enter_async_context(az.Fleet([first.url]))
        publisher = await stack.enter_async_context(az.AsyncWeightPublisher(fleet, backend="auto"))
        await publisher.publish(weights, version="v1")
        assert [r.path for r in first.requests_to("/init_weight_transfer_engine")] != []
        await fleet.add_server(joiner.url)
        report = await publisher.publish(weights, version="v2")
        assert report.servers == [first.url, joiner.url]
        routes = [
            r.path
            for r in joiner.requests
            if r.path in ("/init_weight_transfer_engine", "/start_weight_update")
        ]
        assert routes == ["/init_weight_transfer_engine", "/start_weight_update"]
        init = joiner.requests_to("/init_weight_transfer_engine")[0].json["init_info"]
        assert "trainer_pid" in init  # shm's init: the engine now reads shm
        # The next round sends no init again, to either server.
        await publisher.publish(weights, version="v3")
        assert len(joiner.requests_to("/init_weight_transfer_engine")) == 1
        assert len(first.requests_to("/init_weight_transfer_engine")) == 1
