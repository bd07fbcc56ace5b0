"""The publish fault matrix for the shm backend (issues 12 and 18), against fakes that
speak vLLM's protocol: one of eight servers meets each fault (a 5xx worker failure, a
malformed 200, a dropped connection, a server slower than the deadline, a server that
dies) in each phase of a round (pause, start, update, finish, the prefix-cache reset,
resume).

- With the default ``min_servers=1`` the round runs to the end on the seven others and
  is published there: ``report.lost`` names the eighth, which is dirty and never routed
  to while it is; as soon as it answers again the publisher catches it up to the new
  version from the round it kept (no publish), and the next full round includes it.
- With ``min_servers=8`` (or ``"all"``) the same fault fails the round: `PublishError`,
  the version unchanged everywhere, no server left with an active update; every server
  the round reached is dirty, and caught up to the previous version from the kept
  round, serving it exactly, without a publish.

Each server's recorded version is asserted after every fault: the last version
committed on it (a failed round never records its own), dirty where its weights changed
since.

docs/fault-matrix.md lists every cell and its outcome; the faults real servers can
produce (SIGSTOP, SIGKILL) are in tests/test_faults_vllm.py and
tests/test_fault_cells_vllm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal

import pytest
import torch

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, Fault
from tests.calls import PROBES, CallLog, recording
from tests.publish_fakes import shm_fakes
from tests.waiting import HANG

pytestmark = pytest.mark.asyncio

WEIGHTS = {f"model.layers.{i}.w": torch.full((512,), float(i)) for i in range(6)}
ROUTES = {
    "pause": "/pause",
    "start": "/start_weight_update",
    "update": "/update_weights",
    "finish": "/finish_weight_update",
    "reset_prefix_cache": "/reset_prefix_cache",
    "resume": "/resume",
}
SLOW = "slow (past the deadline)"

FAULTS = {
    "5xx": lambda: Fault.error(500),
    "malformed 200": Fault.malformed,
    "connection reset": Fault.drop,
    SLOW: Fault.hang,
    "server dies (then refused)": Fault.die,
}
SERVERS = 8
FAULTY = 3  # a server in the middle of the fleet's order
#: The call each phase sends.
CALLS = {
    "pause": "pause",
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
    "reset_prefix_cache": "reset_prefix_cache",
    "resume": "resume",
}
#: Deadlines that only catch a hang: no answer races them on a loaded machine.
GENEROUS = az.Timeouts.uniform(HANG)
#: The slow server's own (its client's): a hung call ends by them. Its other calls are
#: answered in milliseconds, far inside 3 s (0.5 s was passed once under CI load, when
#: every server of the round had it).
SLOW_TIMEOUTS = az.Timeouts(connect=HANG, control=3, update=3, generate=HANG)


@asynccontextmanager
async def eight(
    fault: str,
) -> AsyncIterator[tuple[list[FakeVLLMServer], az.Fleet, az.AsyncWeightPublisher, CallLog]]:
    """Eight fakes, a fleet and a publisher over them, with v1 published everywhere,
    and the log of the calls sent from then on. The faulty server has short deadlines
    for the slow fault only, through its own client."""
    async with shm_fakes(SERVERS) as fakes, AsyncExitStack() as stack:
        members: list[str | az.AsyncVLLMClient] = [f.url for f in fakes]
        if fault == SLOW:
            members[FAULTY] = await stack.enter_async_context(
                az.AsyncVLLMClient(fakes[FAULTY].url, timeouts=SLOW_TIMEOUTS)
            )
        async with (
            az.Fleet(members, timeouts=GENEROUS, admission_timeout=0.2) as fleet,
            az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
        ):
            await publisher.publish(WEIGHTS, version="v1", pause="keep")
            with recording(fleet.client(url) for url in fleet.urls) as log:
                yield fakes, fleet, publisher, log


def _one_deadline_at_most(log: CallLog, faulty: FakeVLLMServer, fault: str, phase: str) -> None:
    """The round waited one deadline, the slow server's call in ``phase`` (the last
    thing sent to it), or none: never twice for a server (the calls that timed out say
    so, whatever the machine's speed)."""
    # The fleet's own probes of a suspect server (health, identity) run beside the
    # round and hold none of it: left out.
    timed_out = [(s.url, s.op) for s in log.timed_out() if s.op not in PROBES]
    if fault != SLOW:
        assert timed_out == []
        return
    assert timed_out == [(faulty.url, CALLS[phase])]
    assert log.round_calls(faulty.url)[-1].timed_out, log.to(faulty.url)


def _no_active_update_but(fakes: list[FakeVLLMServer], fault: str) -> None:
    """No server holds an active update; a server whose call hangs may (it never
    answered: the next round ends it), and a dead one holds nothing."""
    for i, fake in enumerate(fakes):
        if fake.alive and not (i == FAULTY and fault == SLOW):
            assert not fake.update_active, fake.url


def _hold_catch_ups(fakes: list[FakeVLLMServer]) -> asyncio.Event:
    """Hold every catch-up round at its start (set the event to let them go). Called
    right after ``publish`` returned, before anything else awaits: the catch-up the
    round's outcome wakes cannot have started yet (it waits for the publisher's lock,
    which ``publish`` held until it returned)."""
    hold = asyncio.Event()
    for fake in fakes:
        fake.inject("/start_weight_update", Fault.until(hold))
    return hold


def _versions(fleet: az.Fleet, fakes: list[FakeVLLMServer]) -> list[tuple[str | None, bool]]:
    """Each server's recorded version and dirty flag, fleet order."""
    return [(fleet.state(f.url).weight_version, fleet.state(f.url).dirty) for f in fakes]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("phase", list(ROUTES))
async def test_one_server_lost_in_a_phase_leaves_a_published_round(phase: str, fault: str) -> None:
    async with eight(fault) as (fakes, fleet, publisher, log):
        faulty = fakes[FAULTY]
        others = [f for f in fakes if f is not faulty]
        faulty.inject(ROUTES[phase], FAULTS[fault]())
        report = await publisher.publish(WEIGHTS, version="v2", pause="keep")
        hold = _hold_catch_ups([faulty])
        _one_deadline_at_most(log, faulty, fault, phase)
        assert report.version == publisher.version == fleet.current_version == "v2"
        assert report.lost == [faulty.url]
        assert report.servers == [f.url for f in others]
        outcome = report.outcomes[faulty.url]
        assert (outcome.ok, outcome.phase, outcome.dirty) == (False, phase, True)
        assert isinstance(outcome.error, az.AsyncSyncError)
        # Every server's record: the seven hold v2, clean, routable (none was aborted
        # because of the eighth); the eighth keeps the last version committed on it (v1;
        # v2 when it was lost after the commit, at resume), dirty.
        lost_at = "v2" if phase == "resume" else "v1"
        expected = [(lost_at, True) if f is faulty else ("v2", False) for f in fakes]
        assert _versions(fleet, fakes) == expected
        for fake in others:
            assert fake.weight_version == "v2", fake.url
            assert fleet.routing_reasons()[fake.url] is None
            assert fleet.state(fake.url).health == "healthy"
        _no_active_update_but(fakes, fault)
        # The eighth is dirty: generation never goes there while it is.
        assert fleet.state(faulty.url).health in ("stale", "suspect", "dead")
        assert fleet.routing_reasons()[faulty.url] in ("dirty", "unhealthy", "suspect")
        served = {(await fleet.generate([1, 2, 3], max_tokens=2)).server for _ in range(16)}
        assert faulty.url not in served
        # Caught up without a publish as soon as it answers again: from the round the
        # publisher kept, to v2, and served again.
        faulty.clear_faults()
        hold.set()
        if fault == "server dies (then refused)":
            assert not faulty.alive
            assert fleet.state(faulty.url).health in ("suspect", "dead")
        else:
            await fleet.ready(faulty.url, timeout=60)
            assert (faulty.weight_version, fleet.state(faulty.url).weight_version) == ("v2", "v2")
            assert _versions(fleet, fakes) == [("v2", False)] * SERVERS
            assert publisher.version == fleet.current_version == "v2"
        # The next full round includes it by default, as soon as it answers again.
        report = await publisher.publish(WEIGHTS, version="v3", pause="keep")
        assert report.version == publisher.version == fleet.current_version == "v3"
        if fault == "server dies (then refused)":
            assert not faulty.alive
            assert report.lost == [faulty.url]
            assert _versions(fleet, fakes) == [
                (lost_at, True) if f is faulty else ("v3", False) for f in fakes
            ]
            return
        assert report.lost == []
        assert report.servers == list(fleet.urls)
        assert faulty.weight_version == "v3"
        assert _versions(fleet, fakes) == [("v3", False)] * SERVERS
        assert not any(f.update_active for f in fakes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("phase", list(ROUTES))
async def test_a_round_that_needs_all_eight_fails_and_keeps_the_version(
    phase: str, fault: str
) -> None:
    need: int | Literal["all"] = "all" if phase == "update" else SERVERS
    async with eight(fault) as (fakes, fleet, publisher, log):
        faulty = fakes[FAULTY]
        faulty.inject(ROUTES[phase], FAULTS[fault]())
        if phase == "resume":  # after the commit: published, the eighth lost
            report = await publisher.publish(WEIGHTS, version="v2", pause="keep", min_servers=need)
            _one_deadline_at_most(log, faulty, fault, phase)
            assert (report.version, report.lost) == ("v2", [faulty.url])
            assert publisher.version == fleet.current_version == "v2"
            return
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(WEIGHTS, version="v2", pause="keep", min_servers=need)
        hold = _hold_catch_ups(fakes)
        _one_deadline_at_most(log, faulty, fault, phase)
        err = info.value
        assert publisher.version == fleet.current_version == "v1"
        assert "published version stays 'v1'" in str(err)
        assert err.outcomes[faulty.url].phase == phase
        assert all(err.outcomes[f.url].ok for f in fakes if f is not faulty)
        _no_active_update_but(fakes, fault)
        # Every server the round started holds weights of no published version: dirty,
        # its recorded version the last one committed on it (v1), never v2.
        started = phase != "pause"
        for fake in fakes:
            assert fleet.state(fake.url).dirty is (started or fake is faulty), fake.url
            assert (fake.url in err.needs_resync) is (started or fake is faulty)
            assert fleet.state(fake.url).weight_version == "v1", fake.url
            if fake is not faulty:
                assert not fleet.state(fake.url).paused  # resumed by the rollback
        # Caught up to v1 from the kept round, without a publish: a failed round never
        # leaves the fleet serving nothing.
        faulty.clear_faults()
        hold.set()
        answering = [f for f in fakes if f.alive]
        for fake in answering:
            await fleet.ready(fake.url, timeout=60)
            assert (fake.weight_version, fleet.state(fake.url).weight_version) == ("v1", "v1")
        # A server is admitted once its catch-up is committed, before that round resumes
        # it: a generation may wait for the resume, longer than the fixture's 0.2 s on a
        # loaded machine (a fleet serving nothing would still fail here).
        assert {(await fleet.generate([1, 2, 3], max_tokens=2, admission_timeout=30))
                .weight_versions[0].version for _ in range(8)} == {"v1"}  # fmt: skip
        # The next round reaches every server that answers.
        report = await publisher.publish(WEIGHTS, version="v3", min_servers=1)
        assert report.version == publisher.version == fleet.current_version == "v3"
        lost = [faulty.url] if fault == "server dies (then refused)" else []
        assert report.lost == lost
        assert [s.dirty for s in fleet.servers] == [s.url in lost for s in fleet.servers]
        assert _versions(fleet, fakes) == [
            ("v1", True) if f.url in lost else ("v3", False) for f in fakes
        ]


async def test_min_servers_is_checked_before_anything_is_sent() -> None:
    async with eight("5xx") as (fakes, _fleet, publisher, _log):
        before = [len(f.requests) for f in fakes]
        for bad in (0, -1, 9, "most", 2.5, True):
            with pytest.raises(ValueError, match="min_servers"):
                await publisher.publish(WEIGHTS, version="v2", min_servers=bad)  # type: ignore[arg-type]
        assert [len(f.requests) for f in fakes] == before
