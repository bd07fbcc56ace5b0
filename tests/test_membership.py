"""The fleet's state machine and membership, against fakes that speak vLLM's protocol
and do what real servers do on demand only with difficulty: restart at the same address
(a new process identity, the checkpoint's weights), report a version that goes
backwards, lie about their version, freeze. The real-server versions of these cells
are tests/test_membership_vllm.py.

- The ledger's transitions, one by one (no server).
- A restart is seen by the health probe, by the identity every round reads, and by an
  answer whose versions the fleet never published; the server is stale at once, no
  answer from it is returned as current, and the publisher catches it up from its last
  round, exact, without a publish.
- Joiners (``add_server`` returns at once; ``ready``), removals (in flight finish),
  dead servers coming back only through ``stale``, flapping held out, a trainer round
  superseding a catch-up, catch-up off or from a callable, ``watch`` with a callable
  and with a router's worker list, deprecated writes to a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from aiohttp import web

import asyncsync as az
from asyncsync import metrics
from asyncsync._core.ledger import DEAD_AFTER, FLAP_LIMIT, Ledger
from asyncsync.testing import FakeVLLMServer, Fault, free_port
from tests.publish_fakes import Server, receiving_fakes
from tests.waiting import wait_until

PROMPT = [1, 2, 3]
WEIGHTS = {f"model.layers.{i}.w": torch.full((256,), float(i)) for i in range(4)}
NEWER = {name: t + 1 for name, t in WEIGHTS.items()}
#: Deadlines far from anything a loaded machine reaches, short enough for a hung call.
TIMEOUTS = az.Timeouts(connect=5, control=5, update=5, generate=60)


# ---------------------------------------------------------------- the ledger alone
def test_a_new_identity_is_a_restart_that_clears_what_the_process_held() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    ledger.identified(rec, "100")
    ledger.round_committed("v1", [rec.url], [rec.url])
    ledger.adapter_published("p", "p1")
    ledger.adapter_loaded(rec.url, "p", "p1")
    ledger.admitted(rec, "session-1")
    ledger.released(rec)
    assert (rec.health, rec.weight_version, rec.loaded_by) == ("healthy", "v1", "100")
    assert ledger.identified(rec, "100") is False  # the same process
    assert rec.health == "healthy"
    assert ledger.identified(rec, "200") is True
    snap = ledger.snapshot(rec.url)
    assert (snap.health, snap.weight_version, snap.identity) == ("stale", None, "200")
    assert ledger.adapter_held(rec.url, "p") is None
    assert ledger.session_server("session-1") is None
    assert rec.restarts == 1
    ledger.caught_up("v1", [rec.url])
    assert (rec.health, rec.weight_version, rec.loaded_by) == ("healthy", "v1", "200")


def test_a_suspect_server_is_dead_after_failed_probes_and_comes_back_only_stale() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    ledger.round_committed("v1", [rec.url], [rec.url])
    ledger.observed(rec, "generate", "control", az.ServerUnavailableError("refused"))
    assert rec.health == "suspect"
    for _ in range(DEAD_AFTER - 1):
        ledger.probe_failed(rec, az.ServerTimeout("no answer"))
        assert rec.health == "suspect"
    ledger.probe_failed(rec, az.ServerTimeout("no answer"))
    assert rec.health == "dead"
    assert rec.unfit() == "dead"
    ledger.observed(rec, "health", "control", None)  # answering is not enough ...
    assert rec.health == "dead"
    ledger.identified(rec, None)  # ... a probe brings it back, through stale
    assert (rec.health, rec.dirty, rec.weight_version) == ("stale", True, "v1")
    ledger.caught_up("v1", [rec.url])
    assert rec.health == "healthy"


def test_a_suspect_server_that_answers_as_the_same_process_is_healthy_again() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    ledger.identified(rec, "1")
    ledger.round_committed("v1", [rec.url], [rec.url])
    ledger.observed(rec, "generate", "control", az.ServerUnavailableError("refused"))
    ledger.observed(rec, "health", "control", None)
    assert rec.health == "suspect"  # answering, but its identity is not read yet
    ledger.identified(rec, "1")
    assert (rec.health, rec.dirty) == ("healthy", False)


def test_a_version_that_contradicts_the_record_makes_the_same_process_stale() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    ledger.identified(rec, "1")
    ledger.round_committed("v1", [rec.url], [rec.url])
    ledger.round_committed("v2", [rec.url], [rec.url])
    ledger.observed(rec, "weight_info", "control", None, "v1")  # gone backwards
    assert rec.health == "suspect"
    ledger.identified(rec, "1")  # the same process: it does not hold what it should
    assert (rec.health, rec.dirty) == ("stale", True)


def test_a_version_reported_before_anything_was_published_is_taken() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    ledger.observed(rec, "weight_info", "control", None, "default")
    assert (rec.weight_version, rec.health) == ("default", "healthy")


def test_a_joiner_is_suspect_until_identified_then_stale_until_caught_up() -> None:
    ledger = Ledger()
    first = ledger.join("http://a")
    ledger.round_committed("v1", [first.url], [first.url])
    joiner = ledger.join("http://b", verify=True)
    assert joiner.health == "suspect"
    ledger.identified(joiner, "7")
    assert joiner.health == "stale"
    ledger.caught_up("v1", [joiner.url])
    assert joiner.health == "healthy"
    ledger.retire(joiner.url)
    assert joiner.health == "retired"
    assert joiner.url not in ledger


def test_a_server_that_keeps_leaving_healthy_is_held_out() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    for _ in range(FLAP_LIMIT):
        ledger.observed(rec, "generate", "control", az.ServerUnavailableError("refused"))
        ledger.identified(rec, None)
    assert rec.held_out()
    assert rec.health == "suspect"
    assert rec.unfit() == "flapping"
    assert ledger.next_hold_end() is not None


def test_every_move_of_health_is_reported_to_the_metrics_hooks() -> None:
    seen: list[tuple[str, str, str]] = []

    class Hook(metrics.MetricsHook):
        def on_server_health(self, server: str, old: str, new: str) -> None:
            seen.append((server, old, new))

    hook = metrics.add_hook(Hook())
    try:
        ledger = Ledger()
        rec = ledger.join("http://a")
        ledger.round_committed("v1", [rec.url], [rec.url])
        ledger.observed(rec, "generate", "control", az.ServerUnavailableError("refused"))
        ledger.identified(rec, "2")
        ledger.retire(rec.url)
    finally:
        metrics.remove_hook(hook)
    assert seen == [
        ("http://a", "healthy", "suspect"),
        ("http://a", "suspect", "healthy"),
        ("http://a", "healthy", "retired"),
    ]


def test_writing_a_snapshot_warns_with_the_transition_and_applies_it() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    state = ledger.snapshot(rec.url)
    with pytest.warns(DeprecationWarning, match=r"ServerState.dirty .*Fleet.mark_dirty"):
        state.dirty = True
    assert rec.dirty
    assert state.dirty
    with pytest.warns(DeprecationWarning, match=r"Fleet.set_weight_version"):
        state.weight_version = "v7"
    assert ledger.current() == "v7"
    assert rec.weight_version == "v7"
    with pytest.raises(AttributeError):
        state.nothing = 1  # type: ignore[attr-defined]


# ------------------------------------------------------- the ledger's one waiting loop
@pytest.mark.asyncio
async def test_wait_until_returns_a_true_answer_at_once_without_waiting() -> None:
    """A predicate already true is answered in the same step, even past the deadline
    (the caller acts on what it saw: nothing can change in between)."""
    ledger = Ledger()
    rec = ledger.join("http://a")
    asked: list[int] = []

    def holding() -> str | None:
        asked.append(1)
        return rec.url if rec.health == "healthy" else None

    assert await ledger.wait_until(holding, None) == "http://a"
    assert await ledger.wait_until(holding, time.monotonic() - 1) == "http://a"
    assert len(asked) == 2
    assert not ledger._waiters  # never waited


@pytest.mark.asyncio
async def test_wait_until_asks_again_after_each_change_until_true() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")
    asked: list[bool] = []

    def clean() -> bool:
        asked.append(not rec.dirty)
        return not rec.dirty

    ledger.marked([rec.url], dirty=True)
    waiting = asyncio.create_task(ledger.wait_until(clean, time.monotonic() + 60))
    await wait_until(lambda: len(ledger._waiters) == 1)
    ledger.host_known(rec.url, "host-1")  # a change that leaves it dirty: asked, waits on
    await wait_until(lambda: len(asked) == 2 and len(ledger._waiters) == 1)
    assert not waiting.done()
    ledger.marked([rec.url], dirty=False)
    assert await waiting is True
    assert asked == [False, False, True]
    assert not ledger._waiters


@pytest.mark.asyncio
async def test_wait_until_returns_the_last_false_answer_once_the_deadline_passed() -> None:
    """The caller raises its own error from the last answer: it is returned as it was
    (here ``0`` and ``None``) once the deadline has passed, and not before."""
    ledger = Ledger()
    ledger.join("http://a")
    asked: list[float] = []

    def never() -> int:
        asked.append(time.monotonic())
        return 0

    deadline = time.monotonic() + 0.05
    assert await ledger.wait_until(never, deadline) == 0
    assert time.monotonic() >= deadline
    assert len(asked) >= 2  # at once, and again when the wait for a change ran out
    assert await ledger.wait_until(lambda: None, time.monotonic()) is None
    assert not ledger._waiters


@pytest.mark.asyncio
async def test_wait_until_propagates_what_the_predicate_raises_and_cancellation() -> None:
    ledger = Ledger()
    rec = ledger.join("http://a")

    def present() -> bool:
        if rec.url not in ledger:
            raise KeyError(rec.url)
        return False

    gone = asyncio.create_task(ledger.wait_until(present, None))
    await wait_until(lambda: len(ledger._waiters) == 1)
    ledger.retire(rec.url)
    with pytest.raises(KeyError):
        await gone

    ledger.join("http://b")
    cancelled = asyncio.create_task(ledger.wait_until(lambda: False, None))
    await wait_until(lambda: len(ledger._waiters) == 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not ledger._waiters  # nothing left behind for the next change to wake


# ---------------------------------------------------------------- fleets of fakes
@asynccontextmanager
async def published(
    count: int = 2, **publisher: Any
) -> AsyncIterator[tuple[list[Server], az.Fleet, az.AsyncWeightPublisher]]:
    """``count`` fakes with identities and real shm receivers, a fleet and a publisher
    over them, ``WEIGHTS`` published as "v1"."""
    async with (
        receiving_fakes(count, server_info=True) as servers,
        az.Fleet([s.fake.url for s in servers], timeouts=TIMEOUTS) as fleet,
        az.AsyncWeightPublisher(fleet, **publisher) as pub,
    ):
        await pub.publish(WEIGHTS, version="v1")
        await fleet.health()  # identities read
        yield servers, fleet, pub


async def restart(server: Server) -> None:
    """The fake restarts: a new process at the same address, holding its checkpoint."""
    await server.fake.restart()
    server.worker.loaded.clear()  # (its receiver is kept: closed with the fake, unused)


@pytest.mark.asyncio
async def test_a_restart_seen_by_the_health_probe_is_stale_then_caught_up_exactly() -> None:
    async with published() as (servers, fleet, publisher):
        victim = servers[1]
        before = fleet.state(victim.fake.url).identity
        hold = asyncio.Event()
        await restart(victim)
        victim.fake.inject("/start_weight_update", Fault.until(hold))
        await fleet.health()
        state = fleet.state(victim.fake.url)
        assert state.identity not in (None, before)
        assert (state.health, state.weight_version) == ("stale", None)
        assert fleet.routing_reasons()[victim.fake.url] == "unknown_version"
        served = {(await fleet.generate(PROMPT, max_tokens=2)).server for _ in range(8)}
        assert served == {servers[0].fake.url}
        hold.set()  # the catch-up, held at its start until now
        await fleet.ready(victim.fake.url, timeout=30)
        assert victim.worker.holds(WEIGHTS)
        assert victim.fake.weight_version == "v1"
        assert publisher.version == fleet.current_version == "v1"  # nothing published
        assert len(victim.fake.requests_to("/finish_weight_update")) == 1


@pytest.mark.asyncio
async def test_a_server_held_out_for_flapping_is_caught_up_once_its_hold_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Restarted again and again, a server flaps and is held out; when the hold ends it
    settles again and is caught up. (It stayed suspect for good: the monitor saw only
    holds still running, so the end of one was never seen.) Marks by hand
    (``Fleet.mark_dirty``, what ``benchmarks/bench_membership.py`` does between its
    catch-ups) are the user's doing and count as no flap."""
    monkeypatch.setattr("asyncsync._core.ledger.FLAP_FIRST_HOLD", 0.5)
    async with published() as (servers, fleet, publisher):
        victim = servers[1].fake.url
        for _ in range(FLAP_LIMIT + 1):
            fleet.mark_dirty([victim])
            assert fleet.state(victim).health == "stale"  # never held out
            await fleet.ready(victim, timeout=30)
        assert len(fleet.ledger.record(victim).flaps) == 0
        for _ in range(FLAP_LIMIT):
            await restart(servers[1])
            await fleet.health()
            if fleet.state(victim).health != "suspect":
                await fleet.ready(victim, timeout=30)
        assert fleet.state(victim).health == "suspect"  # held out, not caught up
        assert fleet.ledger.record(victim).held_until > time.monotonic()
        await fleet.ready(victim, timeout=30)  # the hold ends, the catch-up follows
        assert fleet.state(victim).health == "healthy"
        assert servers[1].worker.holds(WEIGHTS)
        assert publisher.version == fleet.current_version == "v1"  # nothing published


@pytest.mark.asyncio
async def test_answers_of_a_restarted_server_are_never_returned_as_current() -> None:
    async with published(3) as (servers, fleet, _publisher):
        victim = servers[2]
        hold = asyncio.Event()
        await restart(victim)  # nothing told the fleet: its next answers say "default"
        victim.fake.inject("/start_weight_update", Fault.until(hold))
        out = await asyncio.gather(*(fleet.generate(PROMPT, max_tokens=4) for _ in range(24)))
        assert {s.version for c in out for s in c.weight_versions} == {"v1"}
        assert all(c.staleness == 0 and c.server != victim.fake.url for c in out)
        assert victim.fake.generation_requests >= 1  # it answered, and was not believed
        await wait_until(lambda: fleet.state(victim.fake.url).health == "stale")
        hold.set()
        await fleet.ready(victim.fake.url, timeout=30)
        assert victim.worker.holds(WEIGHTS)


@pytest.mark.asyncio
async def test_a_restart_seen_at_the_next_round_is_set_up_again_and_exact() -> None:
    async with published(2, catch_up="off") as (servers, fleet, publisher):
        victim = servers[0]
        await restart(victim)
        report = await publisher.publish(NEWER, version="v2")
        assert report.lost == []
        assert all(s.worker.holds(NEWER) for s in servers)
        assert [s.weight_version for s in fleet.servers] == ["v2", "v2"]
        assert fleet.state(victim.fake.url).identity == victim.fake.instance_id


@pytest.mark.asyncio
@pytest.mark.parametrize("lie", ["goes backwards", "a version never published"])
async def test_a_server_that_reports_what_it_does_not_hold_is_not_believed(lie: str) -> None:
    async with published(2) as (servers, fleet, publisher):
        await publisher.publish(NEWER, version="v2")
        liar = servers[1]
        hold = asyncio.Event()
        liar.fake.inject("/start_weight_update", Fault.until(hold))
        liar.fake.weight_version = "v1" if lie == "goes backwards" else "v9"
        out = await asyncio.gather(*(fleet.generate(PROMPT, max_tokens=2) for _ in range(8)))
        assert {s.version for c in out for s in c.weight_versions} == {"v2"}
        # the same process (its identity unchanged), not holding what it should: stale
        await wait_until(lambda: fleet.state(liar.fake.url).health == "stale")
        assert fleet.state(liar.fake.url).dirty
        hold.set()
        await fleet.ready(liar.fake.url, timeout=30)
        assert liar.fake.weight_version == "v2"
        assert liar.worker.holds(NEWER)


@pytest.mark.asyncio
async def test_a_joiner_returns_at_once_and_is_ready_once_caught_up() -> None:
    async with (
        published(1) as (servers, fleet, _publisher),
        receiving_fakes(1, server_info=True) as (joiner,),
    ):
        hold = asyncio.Event()
        joiner.fake.inject("/start_weight_update", Fault.until(hold))
        state = await fleet.add_server(joiner.fake.url)
        assert state.health == "suspect"  # not probed yet: never routed
        await wait_until(lambda: fleet.state(joiner.fake.url).health == "stale")
        served = {(await fleet.generate(PROMPT, max_tokens=2)).server for _ in range(8)}
        assert served == {servers[0].fake.url}
        with pytest.raises(az.GenerationError, match="not admitted within"):
            await fleet.ready(joiner.fake.url, timeout=0.05)
        hold.set()
        ready = await fleet.ready(joiner.fake.url, timeout=30)
        assert (ready.health, ready.weight_version) == ("healthy", "v1")
        assert joiner.worker.holds(WEIGHTS)
        served = {(await fleet.generate(PROMPT, max_tokens=2)).server for _ in range(16)}
        assert joiner.fake.url in served


@pytest.mark.asyncio
async def test_a_trainer_round_supersedes_a_catch_up_and_includes_its_server() -> None:
    async with (
        published(1) as (servers, fleet, publisher),
        receiving_fakes(1, server_info=True) as (joiner,),
    ):
        hold = asyncio.Event()
        joiner.fake.inject("/update_weights", Fault.until(hold))  # the catch-up's chunk
        await fleet.add_server(joiner.fake.url)
        await wait_until(lambda: len(joiner.fake.requests_to("/update_weights")) == 1)
        publishing = asyncio.create_task(publisher.publish(NEWER, version="v2"))
        await asyncio.sleep(0)  # it starts: the catch-up is cancelled first thing
        hold.set()  # (its chunk in flight is answered, not left to the update deadline)
        report = await publishing
        assert report.servers == [servers[0].fake.url, joiner.fake.url]
        assert all(s.worker.holds(NEWER) for s in (*servers, joiner))
        assert [s.weight_version for s in fleet.servers] == ["v2", "v2"]
        assert [s.health for s in fleet.servers] == ["healthy", "healthy"]


@pytest.mark.asyncio
async def test_without_catch_up_a_joiner_waits_for_the_next_round() -> None:
    async with (
        published(1, catch_up="off") as (_servers, fleet, publisher),
        receiving_fakes(1, server_info=True) as (joiner,),
    ):
        await fleet.add_server(joiner.fake.url)
        await wait_until(lambda: fleet.state(joiner.fake.url).health == "stale")
        # the fleet changes (another generation), and still nothing is sent to it
        await fleet.generate(PROMPT, max_tokens=1)
        assert joiner.fake.requests_to("/start_weight_update") == []
        await publisher.publish(NEWER, version="v2")
        assert (await fleet.ready(joiner.fake.url, timeout=30)).weight_version == "v2"


@pytest.mark.asyncio
async def test_a_callable_produces_the_weights_a_catch_up_sends() -> None:
    calls: list[int] = []

    def weights_again() -> dict[str, torch.Tensor]:
        calls.append(1)
        return WEIGHTS

    async with (
        published(1, catch_up=weights_again) as (_servers, fleet, _publisher),
        receiving_fakes(1, server_info=True) as (joiner,),
    ):
        await fleet.add_server(joiner.fake.url)
        await fleet.ready(joiner.fake.url, timeout=30)
        assert joiner.worker.holds(WEIGHTS)
        assert calls == [1]


@pytest.mark.asyncio
async def test_a_removed_server_finishes_its_requests_and_gets_no_new_ones() -> None:
    async with receiving_fakes(2, server_info=True, token_delay=0.01) as servers:
        urls = [s.fake.url for s in servers]
        async with az.Fleet(urls, timeouts=TIMEOUTS) as fleet:
            gone = servers[0].fake
            task = asyncio.create_task(fleet.generate(PROMPT, max_tokens=40))
            await wait_until(lambda: gone.tokens_generated >= 2)
            last = await fleet.remove_server(gone.url)
            assert last.health == "retired"
            assert gone.url not in fleet
            completion = await task  # it ran to its end on the removed server
            assert completion.server == gone.url
            assert len(completion.token_ids) == 40
            served = {(await fleet.generate(PROMPT, max_tokens=1)).server for _ in range(8)}
            assert served == {urls[1]}


@pytest.mark.asyncio
async def test_a_frozen_server_fails_an_all_or_nothing_round_and_nobody_serves_nothing() -> None:
    async with published(2) as (servers, fleet, publisher):
        healthy, frozen = servers
        frozen.fake.inject("/update_weights", Fault.hang(), times=None)
        frozen.fake.inject("/health", Fault.hang(), times=None)
        with pytest.raises(az.PublishError):
            await publisher.publish(NEWER, version="v2", min_servers="all")
        assert publisher.version == fleet.current_version == "v1"
        assert fleet.state(healthy.fake.url).weight_version == "v1"
        # the healthy one, aborted mid-update, is caught up to v1 and serves it
        await fleet.ready(healthy.fake.url, timeout=30)
        assert healthy.worker.holds(WEIGHTS)
        completion = await fleet.generate(PROMPT, max_tokens=2)
        assert (completion.server, completion.version) == (healthy.fake.url, "v1")
        # the frozen one thaws and rejoins, caught up as well
        frozen.fake.clear_faults()
        await fleet.ready(frozen.fake.url, timeout=60)
        assert frozen.worker.holds(WEIGHTS)


@pytest.mark.asyncio
async def test_watch_keeps_membership_in_step_with_an_async_callable() -> None:
    async with receiving_fakes(3, server_info=True) as servers:
        urls = [s.fake.url for s in servers]
        listed = [urls[0]]

        async def source() -> list[str]:
            return list(listed)

        async with az.Fleet([urls[0]], timeouts=TIMEOUTS) as fleet:
            task = fleet.watch(source, every=0.05)
            listed[:] = urls[:2]
            await wait_until(lambda: urls[1] in fleet)
            listed[:] = []  # a source's hiccup: nothing removed
            listed[:] = [urls[1], urls[2]]
            await wait_until(lambda: urls[2] in fleet and urls[0] not in fleet)
            assert fleet.urls == (urls[1], urls[2])
            task.cancel()
        assert task.cancelled()


@pytest.mark.asyncio
async def test_an_empty_listing_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async with FakeVLLMServer(server_info=True) as fake, az.Fleet([fake.url]) as fleet:

        async def nothing() -> list[str]:
            return []

        with caplog.at_level(logging.WARNING, logger="asyncsync.fleet"):
            task = fleet.watch(nothing, every=0.05)
            await wait_until(lambda: "listed no server" in caplog.text)
            task.cancel()
        assert fleet.urls == (fake.url,)


@pytest.mark.asyncio
async def test_watch_reads_a_routers_worker_list() -> None:
    async with FakeVLLMServer(server_info=True) as a, FakeVLLMServer(server_info=True) as b:
        workers = {"urls": [a.url]}

        async def list_workers(request: web.Request) -> web.Response:
            return web.json_response(workers)  # vllm-router's answer, as it gives it

        app = web.Application()
        app.router.add_get("/list_workers", list_workers)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with az.Fleet([a.url]) as fleet:
                fleet.watch(f"http://127.0.0.1:{port}", every=0.05)
                workers["urls"] = [b.url]
                await wait_until(lambda: fleet.urls == (b.url,))
        finally:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_watch_refuses_what_it_cannot_read() -> None:
    async with az.Fleet([]) as fleet:
        with pytest.raises(TypeError, match="watch takes"):
            fleet.watch(42)
        with pytest.raises(ValueError, match="every"):
            fleet.watch("http://127.0.0.1:9", every=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("back", [False, True], ids=["removed", "removed and added again"])
async def test_a_server_removed_during_a_round_drops_out_of_it(back: bool) -> None:
    async with published(2) as (servers, fleet, publisher):
        leaving, staying = servers
        hold = asyncio.Event()
        leaving.fake.inject("/update_weights", Fault.until(hold))
        sent = len(leaving.fake.requests_to("/update_weights"))  # v1's
        publishing = asyncio.create_task(publisher.publish(NEWER, version="v2"))
        await wait_until(lambda: len(leaving.fake.requests_to("/update_weights")) > sent)
        await fleet.remove_server(leaving.fake.url)  # a watch's tick, mid-round
        if back:  # the next tick lists it again: the same process, still in the round
            await fleet.add_server(leaving.fake.url)
        hold.set()
        report = await publishing
        if back:
            assert report.servers == [leaving.fake.url, staying.fake.url]
            await fleet.ready(leaving.fake.url, timeout=30)
        else:
            assert (report.servers, report.lost) == ([staying.fake.url], [leaving.fake.url])
            assert "removed from the fleet" in str(report.outcomes[leaving.fake.url].error)
            assert fleet.urls == (staying.fake.url,)
        assert staying.worker.holds(NEWER)
        assert fleet.state(staying.fake.url).weight_version == "v2"
        if back:
            assert leaving.worker.holds(NEWER)
            assert fleet.state(leaving.fake.url).weight_version == "v2"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("marked_at", "dirty_after"),
    [("/start_weight_update", False), ("/reset_prefix_cache", True)],
)
async def test_a_mark_by_hand_after_a_servers_finish_outlives_the_rounds_commit(
    marked_at: str, dirty_after: bool
) -> None:
    """A round holds a server from its probe to its commit. A mark by hand made before
    the server's finish is answered by what the round loads after it (the commit cleans
    it); one made after the finish (its cache reset, its resume still to come) says
    something the round did not load: the commit leaves the server dirty. (The
    membership benchmark met it: back-to-back catch-ups marked between a round's
    admission and its commit were erased, and returned in 2 ms.)"""
    from tests.publish_fakes import shm_fakes

    weights = {f"model.layers.{i}.w": torch.full((64,), float(i)) for i in range(2)}
    async with (
        shm_fakes() as (kept, marked),
        az.Fleet([kept.url, marked.url]) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(buffer_bytes=1 << 20), catch_up="off"
        ) as publisher,
    ):

        def mark(request: Any) -> None:
            if request.path == marked_at:
                marked.on_request = None
                fleet.mark_dirty([marked.url])

        marked.on_request = mark
        await publisher.publish(weights, version="v1")
        assert marked.on_request is None  # the mark was made
        state = fleet.state(marked.url)
        assert state.dirty is dirty_after
        assert state.weight_version == "v1"
        assert not fleet.state(kept.url).dirty
        if dirty_after:  # served nothing until a round reaches it
            assert fleet.routing_reasons()[marked.url] == "dirty"
            await publisher.publish(weights, version="v2")
            assert not fleet.state(marked.url).dirty


@pytest.mark.asyncio
async def test_a_catch_up_marked_again_after_its_finish_runs_again_without_back_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A catch-up round that reached its server is no failure, even when a mark by hand
    made after the server's finish leaves it dirty at the commit: the next catch-up
    follows at once. (Counted as a failure, each such mark doubled a back-off, 1 s up to
    60 s, and a loop of marks and waits ran out of time.)"""
    async with published() as (servers, fleet, publisher):
        victim = servers[1].fake
        state = {"marks": 0}

        def mark_during_the_catch_up(request: Any) -> None:
            if request.path == "/reset_prefix_cache" and state["marks"] == 0:
                state["marks"] += 1
                fleet.mark_dirty([victim.url])

        before = len(victim.requests_to("/reset_prefix_cache"))
        victim.on_request = mark_during_the_catch_up
        with caplog.at_level(logging.INFO, logger="asyncsync"):
            fleet.mark_dirty([victim.url])
            await wait_until(lambda: state["marks"] == 1)
            await fleet.ready(victim.url, timeout=30)
            await wait_until(lambda: not fleet.ledger.in_round(victim.url))
        caught_up = [r for r in caplog.records if "caught up to" in r.getMessage()]
        assert len(caught_up) == 1  # the second: the mark left the first's commit dirty
        assert len(victim.requests_to("/reset_prefix_cache")) == before + 2  # two rounds
        assert not [r for r in caplog.records if "tried again in" in r.getMessage()]
        assert not fleet.state(victim.url).dirty
        assert servers[1].worker.holds(WEIGHTS)
        assert publisher.version == "v1"
