"""Routing of generations across a fleet: pure decisions, then fleets of fakes."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import replace

import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync import ServerState
from asyncsync._fleet.routing import (
    SessionTable,
    StalenessStats,
    VersionHistory,
    choose,
    ineligibility,
)
from asyncsync.testing import FakeVLLMServer, Fault, free_port
from tests.waiting import HANG, arrived, wait_until

PROMPT = [1, 2, 3]


# ---------------------------------------------------------------- pure functions
def test_version_history_orders_versions() -> None:
    h = VersionHistory(["v1", "v2"])
    assert h.record("v3") is True
    assert h.record("v2") is False
    assert h.current == "v3"
    assert h.behind("v1") == 2
    assert h.behind("v3") == 0
    assert h.behind("nope") is None
    assert h.at_least("v2", "v2")
    assert not h.at_least("v1", "v2")


def test_ineligibility_reasons_in_order() -> None:
    h = VersionHistory(["v1", "v2"])
    s = ServerState("http://a", weight_version="v2")
    assert ineligibility(s, h, max_staleness=0) is None
    s = replace(s, weight_version="v1")
    assert ineligibility(s, h, max_staleness=0) == "stale"
    assert ineligibility(s, h, max_staleness=1) is None
    assert ineligibility(s, h, max_staleness=None) is None
    assert ineligibility(s, h, max_staleness=1, min_version="v2") == "below_min"
    s = replace(s, weight_version=None)
    assert ineligibility(s, h, max_staleness=3) == "unknown_version"
    # no bound on staleness still means a published version
    assert ineligibility(s, h, max_staleness=None) == "unknown_version"
    assert ineligibility(s, VersionHistory(), max_staleness=0) is None  # nothing published
    s = replace(s, max_concurrency=2, outstanding=2)
    assert ineligibility(s, VersionHistory(), max_staleness=0) == "busy"
    s = replace(s, paused=True)
    assert ineligibility(s, h, max_staleness=0) == "paused"
    s = replace(s, updating=True)
    assert ineligibility(s, h, max_staleness=0) == "updating"
    s = replace(s, dirty=True)
    assert ineligibility(s, h, max_staleness=0) == "dirty"
    s = replace(s, health="suspect")
    assert ineligibility(s, h, max_staleness=0) == "suspect"
    s = replace(s, healthy=False)
    assert ineligibility(s, h, max_staleness=0) == "unhealthy"
    for gone in ("dead", "retired"):
        assert ineligibility(replace(s, health=gone), h, max_staleness=0) == gone


def test_choose_least_outstanding_ties_by_routed_and_affinity() -> None:
    h = VersionHistory()
    a = ServerState("a", outstanding=3)
    b = ServerState("b", outstanding=1, routed=2)
    c = ServerState("c", outstanding=1, routed=5)
    best, _ = choose([a, b, c], h, max_staleness=0)
    assert best is b
    best, _ = choose([a, b, c], h, max_staleness=0, pinned="a")
    assert best is a  # pinned and eligible wins over load
    a = replace(a, paused=True)
    best, skipped = choose([a, b, c], h, max_staleness=0, pinned="a")
    assert best is None  # transient: wait for the pinned server
    assert skipped == {"a": "paused"}
    a = replace(a, paused=False, dirty=True)
    best, _ = choose([a, b, c], h, max_staleness=0, pinned="a")
    assert best is b  # dirty: the session moves
    best, _ = choose([a, b, c], h, max_staleness=0, exclude={"b"})
    assert best is c


def test_session_table_is_bounded_lru() -> None:
    t = SessionTable(capacity=2)
    t.pin("s1", "a")
    t.pin("s2", "b")
    assert t.get("s1") == "a"  # s1 now most recent
    t.pin("s3", "c")
    assert "s2" not in t
    assert len(t) == 2
    t.drop_server("a")
    assert "s1" not in t


def test_staleness_stats() -> None:
    stats = StalenessStats()
    for server, lag in [("a", 0), ("a", 0), ("b", 1), ("b", 2), ("a", None)]:
        stats.record(server, lag)
    assert stats.count == 4
    assert stats.unknown == 1
    assert stats.mean == pytest.approx(0.75)
    assert stats.max == 2
    assert stats.fraction_at_most(1) == pytest.approx(0.75)
    assert stats.per_server["b"] == Counter({1: 1, 2: 1})
    assert stats.as_dict()["histogram"] == {0: 2, 1: 1, 2: 1}
    stats.reset()
    assert stats.count == 0


# ---------------------------------------------------------------- fleets of fakes
@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeVLLMServer(token_delay=0.002)) for _ in range(3)]


@pytest.mark.asyncio
async def test_load_spreads_over_the_fleet(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([f.url for f in fakes]) as fleet:
        out = await fleet.generate_batch([PROMPT] * 60, max_tokens=4, temperature=0)
        counts = Counter(c[0].server for c in out)
        assert sum(counts.values()) == 60
        # least outstanding: each server got close to a third
        assert min(counts.values()) >= 15, counts
        assert all(s.outstanding == 0 for s in fleet.servers)
        assert sum(s.routed for s in fleet.servers) == 60


@pytest.mark.asyncio
async def test_session_affinity_holds_and_moves_when_its_server_goes_bad(
    fakes: list[FakeVLLMServer],
) -> None:
    async with az.Fleet([f.url for f in fakes]) as fleet:
        first = await fleet.generate(PROMPT, max_tokens=2, session_id="s1")
        # load the other servers' counters so that least-outstanding alone would move
        await fleet.generate_batch([PROMPT] * 10, max_tokens=2)
        for _ in range(5):
            c = await fleet.generate(PROMPT, max_tokens=2, session_id="s1")
            assert c.server == first.server
        assert fleet.session_server("s1") == first.server
        fleet.mark_dirty([first.server])
        moved = await fleet.generate(PROMPT, max_tokens=2, session_id="s1")
        assert moved.server != first.server
        assert fleet.session_server("s1") == moved.server
        fleet.end_session("s1")
        assert fleet.session_server("s1") is None


@pytest.mark.asyncio
async def test_session_waits_for_its_paused_server(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([f.url for f in fakes]) as fleet:
        first = await fleet.generate(PROMPT, max_tokens=2, session_id="s")
        await fleet.pause("keep", targets=[first.server])
        routed = sum(s.routed for s in fleet.servers)
        task = asyncio.create_task(fleet.generate(PROMPT, max_tokens=2, session_id="s"))
        # Another generation, start to end: meanwhile the task asked for its server (an
        # admission never waits for I/O) and was sent nowhere.
        other = await fleet.generate(PROMPT, max_tokens=2)
        assert other.server != first.server
        assert not task.done()
        assert sum(s.routed for s in fleet.servers) == routed + 1
        await fleet.resume(targets=[first.server])
        assert (await task).server == first.server


@pytest.mark.asyncio
async def test_dirty_paused_updating_and_stale_servers_are_avoided(
    fakes: list[FakeVLLMServer],
) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        fleet.mark_dirty([urls[0]])
        await fleet.pause("abort", targets=[urls[1]])
        out = await fleet.generate_batch([PROMPT] * 10, max_tokens=1)
        assert {c[0].server for c in out} == {urls[2]}
        assert fakes[0].generation_requests == fakes[1].generation_requests == 0
        assert fleet.routing_reasons() == {urls[0]: "dirty", urls[1]: "paused", urls[2]: None}
        fleet.mark_clean([urls[0]])
        await fleet.resume(targets=[urls[1]])
        # a round that reached only urls[0] and urls[1]: urls[2] is now one version behind
        await fleet.start_weight_update(targets=urls[:2])
        assert fleet.routing_reasons()[urls[0]] == "updating"
        await fleet.update_weights({"names": []}, targets=urls[:2])
        await fleet.finish_weight_update("v1", targets=urls[:2])
        assert fleet.current_version == "v1"
        assert fleet.routing_reasons()[urls[2]] == "unknown_version"
        out = await fleet.generate_batch([PROMPT] * 10, max_tokens=1)
        assert {c[0].server for c in out} <= set(urls[:2])
        assert all(c[0].version == "v1" and c[0].staleness == 0 for c in out)
        # no bound on staleness: any published version, never one the fleet cannot
        # place (urls[2] reports "default")
        fleet.max_staleness = None
        assert fleet.routing_reasons()[urls[2]] == "unknown_version"
        out = await fleet.generate_batch([PROMPT] * 30, max_tokens=1)
        assert urls[2] not in {c[0].server for c in out}


@pytest.mark.asyncio
async def test_max_staleness_allows_servers_a_version_behind(
    fakes: list[FakeVLLMServer],
) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls, max_staleness=1) as fleet:
        for version, targets in (("v1", urls), ("v2", urls[:1])):
            await fleet.start_weight_update(targets=targets)
            await fleet.update_weights({"names": []}, targets=targets)
            await fleet.finish_weight_update(version, targets=targets)
        out = await fleet.generate_batch([PROMPT] * 30, max_tokens=1)
        assert {c[0].server for c in out} == set(urls)
        lags = Counter(c[0].staleness for c in out)
        assert set(lags) == {0, 1}
        assert fleet.staleness.count == 30
        assert fleet.staleness.max == 1
        fresh = await fleet.generate(PROMPT, max_tokens=1, min_version="v2")
        assert fresh.server == urls[0]


@pytest.mark.asyncio
async def test_version_gate_waits_for_the_version(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        with pytest.raises(az.GenerationError, match="reached version 'v1'"):
            await fleet.wait_for_version("v1", timeout=0.1)

        gate = asyncio.create_task(fleet.wait_for_version("v1", timeout=HANG))
        gen = asyncio.create_task(
            fleet.generate(PROMPT, max_tokens=1, min_version="v1", admission_timeout=HANG)
        )
        await fleet.health()  # a round trip: both tasks reached their wait meanwhile
        assert not gate.done()
        assert not gen.done()
        await fleet.start_weight_update()
        await fleet.update_weights({"names": []})
        await fleet.finish_weight_update("v1")
        assert sorted(await gate) == sorted(urls)
        assert (await gen).version == "v1"


@pytest.mark.asyncio
async def test_concurrency_limit_per_server(fakes: list[FakeVLLMServer]) -> None:
    fake = fakes[0]
    release = asyncio.Event()
    fake.inject("/inference/v1/generate", Fault.until(release), times=None)
    async with az.Fleet([fake.url], max_concurrency_per_server=2) as fleet:
        batch = asyncio.create_task(fleet.generate_batch([PROMPT] * 8, max_tokens=5))
        # All eight were admitted or made to wait before the first one arrived (admission
        # never waits for I/O): with two held at the server, two are outstanding.
        await arrived(fake, "/inference/v1/generate", 2)
        assert fleet.state(fake.url).outstanding == 2
        release.set()
        assert len(await batch) == 8
        assert len(fake.requests_to("/inference/v1/generate")) == 8
        fleet.set_concurrency_limit(None)
        assert fleet.state(fake.url).max_concurrency is None


@pytest.mark.asyncio
async def test_retried_elsewhere_only_when_the_request_never_arrived(
    fakes: list[FakeVLLMServer],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with az.Fleet([dead, fakes[0].url]) as fleet:  # the dead one: first on ties
        c = await fleet.generate(PROMPT, max_tokens=2)
        assert c.server == fakes[0].url
        assert not fleet.state(dead).healthy
        assert isinstance(fleet.state(dead).last_error, az.ServerUnavailableError)
    # a request that reached its server and failed there is not resent
    fakes[1].token_delay = 0.05
    async with az.Fleet([fakes[1].url, fakes[2].url]) as fleet:  # fakes[1]: first on ties
        task = asyncio.create_task(fleet.generate(PROMPT, max_tokens=100))
        await wait_until(lambda: fakes[1].generation_requests > 0)  # it reached the server
        assert fakes[1].generation_requests == 1
        await fakes[1].stop()
        with pytest.raises(az.AsyncSyncError):
            await task
        assert fakes[2].generation_requests == 0


@pytest.mark.asyncio
async def test_no_eligible_server_times_out_with_reasons(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([fakes[0].url], admission_timeout=0.2) as fleet:
        fleet.mark_dirty()
        with pytest.raises(az.GenerationError, match=r"no eligible server .*\(dirty\)"):
            await fleet.generate(PROMPT)
    async with az.Fleet([]) as fleet:
        with pytest.raises(az.GenerationError, match="empty"):
            await fleet.generate(PROMPT)
