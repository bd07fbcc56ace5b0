"""Trajectory: multi-turn rollouts as exact ids, loss mask, aligned logprobs, versions."""

from __future__ import annotations

import pytest

import asyncsync as az
from asyncsync.testing import FakeVLLMServer

SYSTEM = [1, 5, 9]
TOOL_OPEN, TOOL_CLOSE = [400, 401], [402]


@pytest.mark.asyncio
async def test_three_turns_exact_ids_mask_logprobs_versions_no_retokenizing() -> None:
    async with FakeVLLMServer() as fake, az.Fleet([fake.url]) as fleet:
        traj = az.Trajectory(SYSTEM)
        parts: list[list[int]] = [SYSTEM]
        masks: list[list[int]] = [[0] * len(SYSTEM)]
        for turn in range(3):
            c = await traj.generate(
                fleet, max_tokens=4 + turn, temperature=1.0, seed=turn, logprobs=0
            )
            assert c.prompt_token_ids == [t for p in parts for t in p]  # exactly what we built
            parts.append(c.token_ids)
            masks.append([1] * len(c.token_ids))
            if turn < 2:
                tool = [*TOOL_OPEN, 10 + turn, *TOOL_CLOSE]
                traj.add_tool(tool)
                parts.append(tool)
                masks.append([0] * len(tool))
        assert fleet.session_server(traj.session_id) == fake.url
    ids = [t for p in parts for t in p]
    assert traj.token_ids == ids
    assert traj.next_prompt() == ids
    assert traj.loss_mask == [m for p in masks for m in p]
    assert traj.num_turns == 3
    assert traj.num_sampled == sum(traj.loss_mask)
    lps = traj.logprobs
    for c, seg in zip(traj.completions, [s for s in traj if s.kind == "completion"], strict=True):
        assert lps[seg.start : seg.end] == c.logprobs
        assert traj.weight_versions[seg.start : seg.end] == ["default"] * len(c.token_ids)
    assert all(lp is None for lp, m in zip(lps, traj.loss_mask, strict=True) if m == 0)
    assert not any(c.retokenized for c in traj.completions)
    assert all(len(r.json["token_ids"]) for r in fake.requests_to("/inference/v1/generate"))
    assert not fake.requests_to("/tokenize")
    data = traj.to_lists(fill=0.0)
    assert data["token_ids"] == ids
    assert len(data["logprobs"]) == len(ids)
    assert data["logprobs"][: len(SYSTEM)] == [0.0] * len(SYSTEM)
    tensors = traj.to_tensors()
    assert tensors["token_ids"].tolist() == ids
    assert tensors["loss_mask"].sum().item() == traj.num_sampled
    assert str(tensors["logprobs"].dtype) == "torch.float32"


def _completion(prompt: list[int], ids: list[int], **kw: object) -> az.Completion:
    fields: dict[str, object] = {
        "prompt_token_ids": prompt,
        "token_ids": ids,
        "logprobs": [-0.5] * len(ids),
        "top_logprobs": None,
        "finish_reason": "stop",
        "weight_versions": (az.WeightVersionSpan("v1", 0, len(ids)),),
        "server": "http://x",
        "route": "/inference/v1/generate",
        "latency": 0.01,
    }
    fields.update(kw)
    return az.Completion(**fields)  # type: ignore[arg-type]


def test_refuses_a_completion_for_another_context_or_retokenized() -> None:
    traj = az.Trajectory([1, 2])
    with pytest.raises(ValueError, match="not this trajectory's tokens"):
        traj.add_completion(_completion([1, 3], [4]))
    with pytest.raises(ValueError, match="re-tokenized"):
        traj.add_completion(_completion([1, 2], [4], retokenized=True))
    traj.add_completion(_completion([1, 2], [4], retokenized=True), trainable=False)
    assert traj.loss_mask == [0, 0, 0]
    loose = az.Trajectory([1, 2], check_prefix=False)
    loose.add_completion(_completion([9], [4, 5]))
    assert loose.token_ids == [1, 2, 4, 5]


def test_export_requires_logprobs_on_sampled_tokens() -> None:
    traj = az.Trajectory([1])
    traj.add_completion(_completion([1], [2, 3], logprobs=None))
    with pytest.raises(ValueError, match="no logprob"):
        traj.to_lists()
    assert traj.to_lists(require_logprobs=False, fill=-1.0)["logprobs"] == [-1.0, -1.0, -1.0]
    assert traj.versions() == {"v1"}


def test_per_token_versions_follow_spans() -> None:
    c = _completion(
        [1],
        [2, 3, 4],
        weight_versions=(az.WeightVersionSpan("v1", 0, 2), az.WeightVersionSpan("v2", 2, 3)),
    )
    traj = az.Trajectory([1]).add_completion(c)
    assert traj.weight_versions == [None, "v1", "v1", "v2"]
    assert traj.versions() == {"v1", "v2"}
    assert "4 tokens" in repr(traj)


def test_each_token_carries_the_adapter_version_that_sampled_it() -> None:
    traj = az.Trajectory([1, 2])
    first = _completion(
        [1, 2], [3, 4, 5], lora="policy",
        lora_versions=(az.WeightVersionSpan("l1", 0, 2), az.WeightVersionSpan("l2", 2, 3)),
    )  # fmt: skip
    traj.add_completion(first)
    traj.add_tool([6])
    traj.add_completion(_completion(traj.next_prompt(), [7]))  # the base model
    traj.add_completion(
        _completion(
            traj.next_prompt(),
            [8, 9],
            lora="critic",
            lora_versions=(az.WeightVersionSpan("c7", 0, 2),),
        )
    )
    assert traj.lora_versions == [
        None, None, ("policy", "l1"), ("policy", "l1"), ("policy", "l2"), None, None,
        ("critic", "c7"), ("critic", "c7"),
    ]  # fmt: skip
    assert len(traj.lora_versions) == len(traj.token_ids)
