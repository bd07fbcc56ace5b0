"""The demo's parts: reward, advantages, the trainer's step, staleness, the report, the
CLI; and its loop against fake servers (the real run is ``nox -s examples``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import asyncsync as az  # noqa: E402
from asyncsync.__main__ import main  # noqa: E402
from asyncsync._demo._loop import (  # noqa: E402
    DemoConfig,
    Generated,
    Group,
    lag_of,
    to_batch,
    version_step,
)
from asyncsync._demo._report import (  # noqa: E402
    DemoResult,
    StepRecord,
    format_table,
    trend,
    write_json,
)
from asyncsync._demo._task import (  # noqa: E402
    TARGET_EVERY,
    Rollout,
    Trainer,
    group_advantages,
    make_prompts,
    reward,
)
from asyncsync.testing import FakeVLLMServer  # noqa: E402

VOCAB = 64


class ToyLM(torch.nn.Module):  # type: ignore[misc]
    """A causal LM small enough to train in a test: the next token depends on the last."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen))
        self.bias = torch.nn.Parameter(torch.zeros(VOCAB))

    def forward(self, input_ids: Any) -> Any:
        return SimpleNamespace(logits=self.table[input_ids] + self.bias)


def sample(model: ToyLM, prompts: list[list[int]], n: int, tokens: int) -> list[Rollout]:
    """On-policy groups: ``n`` samples per prompt, logprobs from the sampling model."""
    out: list[Rollout] = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt] * n)
            logps = []
            for _ in range(tokens):
                logp = torch.log_softmax(model(input_ids=ids).logits[:, -1], -1)
                nxt = torch.multinomial(logp.exp(), 1)
                logps.append(logp.gather(-1, nxt))
                ids = torch.cat([ids, nxt], 1)
            lps = torch.cat(logps, 1)
            sampled = [row[len(prompt) :] for row in ids.tolist()]
            advantages = group_advantages([reward(s) for s in sampled])
            out += [
                Rollout(prompt, s, lps[i].tolist(), ["v0"] * tokens, advantages[i])
                for i, s in enumerate(sampled)
            ]
    return out


def test_reward_is_the_share_of_target_tokens() -> None:
    assert reward([0, TARGET_EVERY, 3, 5]) == 0.5
    assert reward([TARGET_EVERY * 3]) == 1.0
    assert reward([1, 2]) == 0.0
    assert reward([]) == 0.0


def test_group_advantages_center_and_scale_and_are_zero_for_a_flat_group() -> None:
    adv = group_advantages([0.0, 0.5, 1.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert sum(a * a for a in adv) / 3 == pytest.approx(1.0, rel=1e-4)
    assert group_advantages([0.25, 0.25]) == [0.0, 0.0]


def test_prompts_are_reproducible_and_inside_the_vocabulary() -> None:
    prompts = make_prompts(16, 6, VOCAB, seed=3)
    assert prompts == make_prompts(16, 6, VOCAB, seed=3)
    assert prompts != make_prompts(16, 6, VOCAB, seed=4)
    assert all(len(p) == 6 and p[0] == 1 for p in prompts)
    assert all(3 <= t < VOCAB for p in prompts for t in p[1:])


def test_trainer_step_measures_exactness_only_on_its_own_version() -> None:
    torch.manual_seed(1)  # the sampled tokens must not depend on the tests run before
    model = ToyLM()
    rollouts = sample(model, [[1, 5], [1, 9]], n=4, tokens=3)
    old = [Rollout(r.prompt, r.tokens, [x - 0.5 for x in r.logprobs], ["v-1"] * 3, r.advantage)
           for r in rollouts[:2]]  # fmt: skip
    before = model.table.detach().clone()
    stats = Trainer(model, lr=0.1).step([*rollouts, *old], "v0")
    assert stats.exact_tokens == len(rollouts) * 3  # the v-1 rollouts are not compared
    assert stats.max_logprob_diff is not None
    assert stats.max_logprob_diff < 1e-5
    assert not torch.equal(before, model.table.detach())
    assert Trainer(ToyLM(), lr=0.1).step(old, "v0").max_logprob_diff is None


def test_policy_gradient_steps_raise_the_reward() -> None:
    torch.manual_seed(0)
    model = ToyLM()
    trainer = Trainer(model, lr=0.1)
    prompts = make_prompts(8, 2, VOCAB, seed=0)
    means = []
    for _ in range(15):
        rollouts = sample(model, prompts, n=8, tokens=4)
        means.append(sum(reward(r.tokens) for r in rollouts) / len(rollouts))
        trainer.step(rollouts, "v0")
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.2, means


def completion(prompt: list[int], tokens: list[int], spans: list[tuple[str, int]]) -> az.Completion:
    """A completion whose tokens ``[start, next start)`` came from each ``(version, start)``."""
    ends = [s for _, s in spans[1:]] + [len(tokens)]
    return az.Completion(
        prompt_token_ids=prompt,
        token_ids=tokens,
        logprobs=[-1.0] * len(tokens),
        top_logprobs=None,
        finish_reason="length",
        weight_versions=tuple(
            az.WeightVersionSpan(v, s, e) for (v, s), e in zip(spans, ends, strict=True)
        ),
        server="http://fake",
        route="/inference/v1/generate",
        latency=0.0,
    )


def test_staleness_is_counted_at_the_oldest_token() -> None:
    assert version_step("step-12") == 12
    assert version_step("other") is None
    assert version_step(None) is None
    assert lag_of(["step-3", "step-4"], 4) == 1
    assert lag_of(["step-4"], 4) == 0
    assert lag_of(["step-4", None], 4) is None


def test_a_group_with_a_too_stale_rollout_is_dropped_whole() -> None:
    cfg = DemoConfig(max_lag=1)
    fresh = Group([1], [completion([1], [8, 3], [("step-5", 0)]),
                        completion([1], [3, 3], [("step-4", 0), ("step-5", 1)])])  # fmt: skip
    stale = Group([2], [completion([2], [8, 8], [("step-3", 0)]),
                        completion([2], [8, 8], [("step-5", 0)])])  # fmt: skip
    batch = to_batch(Generated([fresh, stale], 0.0, 1.0), 5, cfg)
    assert batch.dropped == 2
    assert [r.tokens for r in batch.rollouts] == [[8, 3], [3, 3]]
    assert batch.rewards == [0.5, 0.0]
    assert batch.staleness == {0: 1, 1: 1}
    assert batch.versions == {"step-5": 2, "step-4": 1}


def record(step: int, reward_: float, diff: float | None) -> StepRecord:
    return StepRecord(
        step=step, reward=reward_, rollouts=64, versions={"step-0": 64}, staleness={0: 60, 1: 4},
        dropped=0, publish_seconds=0.05, publish_gb_per_s=0.04, tokens_per_s=900.0,
        max_logprob_diff=diff, exact_tokens=480, loss=0.1, seconds=1.0,
    )  # fmt: skip


def test_table_and_json(tmp_path: Path) -> None:
    records = [record(1, 0.1, 2e-6), record(2, 0.2, None), record(3, 0.9, 1e-6)]
    table = format_table(records).splitlines()
    assert table[0].split()[:3] == ["step", "reward", "rollouts"]
    assert table[1].split()[:3] == ["1", "0.100", "64"]
    assert "0:64" in table[1]
    assert format_table([record(4, 0.5, None)]).count("0:64") == 1
    wide = record(5, 0.5, None)
    wide.versions = {"step-10": 3, "step-9": 4}
    assert "9:4 10:3" in format_table([wide])
    assert table[2].split()[-1] == "-"
    assert trend(records, 1) == (0.1, 0.9)
    out = tmp_path / "demo.json"
    write_json(DemoResult(steps=records, greedy_matches_trainer=True), out)
    data = json.loads(out.read_text())
    assert data["greedy_matches_trainer"] is True
    assert data["steps"][0]["staleness"] == {"0": 60, "1": 4}
    assert {"step", "reward", "versions", "staleness", "publish_seconds"} <= set(data["steps"][0])


def test_cli_refuses_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.server_deps
@pytest.mark.slow
@pytest.mark.asyncio
async def test_loop_on_fake_servers_publishes_every_step_within_the_staleness_bound(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from asyncsync._demo._loop import train
    from asyncsync.testing import make_tiny_model

    cfg = DemoConfig(steps=3, groups_per_step=4, group_size=4, max_tokens=4)
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = make_prompts(8, 4, 512, seed=0)
    async with (
        FakeVLLMServer(backend="asyncsync_shm", token_delay=0.01) as a,
        FakeVLLMServer(backend="asyncsync_shm", token_delay=0.01) as b,
        az.Fleet([a.url, b.url], max_staleness=1) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        await publisher.publish(model, version="step-0")
        seen: list[int] = []
        records = await train(
            fleet, publisher, Trainer(model, lr=cfg.lr), prompts, cfg, lambda r: seen.append(r.step)
        )
        assert seen == [1, 2, 3]
        assert publisher.version == "step-3"
        assert [s.weight_version for s in fleet.servers] == ["step-3", "step-3"]
    for rec in records:
        assert rec.rollouts + rec.dropped == 16
        assert set(rec.staleness) <= {0, 1}
        assert set(rec.versions) <= {f"step-{rec.step - 2}", f"step-{rec.step - 1}"}
        assert rec.publish_seconds > 0
