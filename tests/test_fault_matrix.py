"""The publish fault matrix for the shm backend (issue 12, item 2), against fakes that
speak vLLM's protocol: each round route (start, update, finish) meets each fault (a 5xx
worker failure, a malformed 200, a dropped connection, a server slower than the
deadline, a server that dies). docs/fault-matrix.md lists every cell and its outcome;
the faults real servers can produce (SIGSTOP, SIGKILL of the trainer) are in
tests/test_faults_vllm.py."""

from __future__ import annotations

import time

import pytest
import torch

import asyncsync as az
from asyncsync.testing import Fault
from tests.publish_fakes import shm_fakes

pytestmark = pytest.mark.asyncio

WEIGHTS = {f"model.layers.{i}.w": torch.full((512,), float(i)) for i in range(6)}
ROUTES = {"start": "/start_weight_update", "update": "/update_weights",
          "finish": "/finish_weight_update"}  # fmt: skip
FAULTS = {
    "5xx": lambda: Fault.error(500),
    "malformed 200": Fault.malformed,
    "connection reset": Fault.drop,
    "slow (past the deadline)": Fault.hang,
    "server dies (then refused)": Fault.die,
}
#: Cells after which the faulty server's weights are of no known version.
NO_ANSWER = {"connection reset", "slow (past the deadline)", "server dies (then refused)"}


def faulty_dirty(phase: str, fault: str) -> bool:
    """A start that was answered (refused, or a body that is not JSON) opened nothing
    there; every other failed call leaves the server's weights unknown."""
    return phase != "start" or fault in NO_ANSWER


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("phase", list(ROUTES))
async def test_fault_matrix_cell(phase: str, fault: str) -> None:
    # The update deadline also bounds the healthy server's calls: 3 s, so that a loaded
    # machine cannot push a healthy answer past it (0.5 s did, once, under CI load);
    # a hung cell then ends in about two deadlines (the call, then the abort sent to it).
    timeouts = az.Timeouts(connect=5, control=60, update=3, generate=60)
    async with (
        shm_fakes(2) as (healthy, faulty),
        az.Fleet([healthy.url, faulty.url], timeouts=timeouts, admission_timeout=0.2) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")
        faulty.inject(ROUTES[phase], FAULTS[fault]())
        began = time.monotonic()
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v2")
        elapsed = time.monotonic() - began
        err = info.value
        # Ended by the 3 s update deadline (or at once), not by a 60 s one.
        assert elapsed < 30
        assert err.outcomes[faulty.url].ok is False
        assert err.outcomes[faulty.url].phase == phase
        assert err.outcomes[healthy.url].ok is True
        assert isinstance(err.outcomes[faulty.url].error, az.AsyncSyncError)
        assert publisher.version == "v1"
        assert "published version stays 'v1'" in str(err)
        # The survivor holds no active update. Failed before finish: it was reached,
        # so it is dirty until a round succeeds on it. At finish: it finished, and
        # holds the new version (recorded as such), though the fleet's does not.
        assert not healthy.update_active
        finished = phase == "finish"
        assert healthy.weight_version == ("v2" if finished else "v1")
        assert fleet.state(healthy.url).weight_version == ("v2" if finished else "v1")
        assert fleet.state(healthy.url).dirty is not finished
        want_dirty = faulty_dirty(phase, fault)
        assert fleet.state(faulty.url).dirty is want_dirty
        assert (faulty.url in err.needs_resync) is want_dirty
        if want_dirty:
            assert fleet.routing_reasons()[faulty.url] in ("dirty", "unhealthy")
        # The next publish to the healthy server is exact.
        report = await publisher.publish(WEIGHTS, version="v3", targets=[healthy.url])
        assert report.version == "v3"
        assert healthy.weight_version == "v3"
        assert not fleet.state(healthy.url).dirty
        assert fleet.routing_reasons()[healthy.url] is None
        if fault == "server dies (then refused)":
            assert not faulty.alive
            return
        # A server that answers again rejoins through the next full round.
        faulty.clear_faults()
        report = await publisher.publish(WEIGHTS, version="v4")
        assert report.version == publisher.version == "v4"
        assert [s.dirty for s in fleet.servers] == [False, False]
        assert faulty.weight_version == "v4"
        assert not faulty.update_active
