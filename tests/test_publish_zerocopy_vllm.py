"""Zero-copy shm publishing against the session's real vLLM-CPU servers: the servers
read the trainer's own parameters in shared memory, and generate exactly what
transformers does with them."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync.backends._segments import open_segments
from asyncsync.testing import check_greedy

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
MAX_TOKENS = 10


def _perturb(model: Any, seed: int, scale: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


async def _greedy(fleet: az.Fleet, url: str) -> list[int]:
    completion = await fleet.client(url).generate(
        PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    return list(completion.token_ids)


@pytest.mark.usefixtures("original_weights_restored")
@pytest.mark.parametrize(
    ("how", "api"), [("share_weights", "engine"), ("share_memory", "callback")]
)
async def test_zero_copy_publish_generates_exactly_round_after_round(
    fleet: az.Fleet, tiny_model_dir: Path, how: str, api: str
) -> None:
    """Two rounds in place (the servers keep their mappings of the trainer's memory
    between rounds, and read the values it holds now): after each, every server's
    greedy tokens are transformers' with the trainer's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    held = set(open_segments())
    if how == "share_weights":
        az.share_weights(model)
    else:
        model.share_memory()
    async with az.AsyncWeightPublisher(
        fleet, _api=api, backend=az.backends.Shm(zero_copy=True)
    ) as publisher:  # type: ignore[arg-type]
        for step in (1, 2):
            _perturb(model, seed=10 * step + len(how))  # the trainer's step, before publish
            report = await publisher.publish(model, version=f"zc-{how}-{step}")
            assert report.params == len(list(model.parameters()))
            assert report.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
            for url in fleet.urls:
                state = fleet.state(url)
                assert (state.weight_version, state.dirty) == (f"zc-{how}-{step}", False)
                check_greedy(model, PROMPT, await _greedy(fleet, url), max_new_tokens=MAX_TOKENS)
        # No pack buffers: the model's own segment (share_weights) is all there is.
        assert len(set(open_segments()) - held) == (1 if how == "share_weights" else 0)
    del model
    gc.collect()
    assert set(open_segments()) == held  # the model's segment went with it
