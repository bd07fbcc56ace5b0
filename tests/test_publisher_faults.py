"""Publishing rounds against protocol-faithful fakes that misbehave on purpose."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, Fault

pytestmark = pytest.mark.asyncio

WEIGHTS = {f"model.layers.{i}.w": torch.full((64,), float(i)) for i in range(4)}


def _like_the_shm_engine(info: Any) -> None:
    """The real engine fails an abort on purpose (vLLM then clears its active update)."""
    if isinstance(info, dict) and info.get("abort"):
        raise RuntimeError("asyncsync_shm: round 'abort' aborted by the trainer")


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(FakeVLLMServer(update_hook=_like_the_shm_engine))
            for _ in range(2)
        ]


async def test_a_hung_server_fails_the_round_within_its_deadline(
    fakes: list[FakeVLLMServer],
) -> None:
    healthy, hung = fakes
    hung.inject("/update_weights", Fault.hang())
    # The other deadlines are far from update's, so that which one ended the round is
    # beyond doubt on a loaded machine.
    timeouts = az.Timeouts(connect=60, control=60, update=0.5, generate=60)
    async with (
        az.Fleet([f.url for f in fakes], timeouts=timeouts) as fleet,
        az.AsyncWeightPublisher(fleet, buffer_bytes=1 << 20) as publisher,
    ):
        started = time.monotonic()
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1", pause="wait")
        assert time.monotonic() - started < 60  # ended by update's 0.5 s, not by a 60 s one
        err = info.value
        assert isinstance(err.outcomes[hung.url].error, az.ServerTimeout)
        assert err.outcomes[hung.url].phase == "update"
        assert "no response within 0.5 s (update deadline)" in str(err)
        assert publisher.version is None
        assert set(err.needs_resync) == {healthy.url, hung.url}
        assert fleet.state(healthy.url).dirty
        # Nobody is left mid-update, and the pause was undone on both servers.
        assert not healthy.update_active
        assert not healthy.paused
        assert not hung.paused
        # The next round goes through and clears the dirty marks.
        report = await publisher.publish(WEIGHTS, version="v2")
        assert report.version == publisher.version == "v2"
        assert not any(s.dirty for s in fleet.servers)
        assert [s.weight_version for s in fleet.servers] == ["v2", "v2"]


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
        az.AsyncWeightPublisher(fleet, buffer_bytes=1 << 20) as publisher,
    ):
        report = await publisher.publish(WEIGHTS, version="v1")
    assert report.version == "v1"
    aborts = [u for u in stale.updates if isinstance(u, dict) and u.get("abort")]
    assert aborts == []  # the abort was rejected, as the real engine does: not recorded
    assert not stale.update_active
    assert len([u for u in fresh.updates if not u.get("abort")]) == report.chunks


async def test_finish_failing_on_one_server_keeps_the_others_outcome(
    fakes: list[FakeVLLMServer],
) -> None:
    good, bad = fakes
    bad.inject("/finish_weight_update", Fault.error(500, "disk on fire", shape="openai"))
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, buffer_bytes=1 << 20) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v1")
        err = info.value
        assert err.outcomes[good.url].ok
        assert not err.outcomes[bad.url].ok
        assert err.outcomes[bad.url].phase == "finish"
        assert "disk on fire" in str(err)
        assert publisher.version is None  # not every server finished
        assert fleet.state(good.url).weight_version == "v1"  # but this one did
        assert not fleet.state(good.url).dirty
        assert fleet.state(bad.url).dirty
        assert err.needs_resync == (bad.url,)
