"""The demo's asynchronous RL loop: the next batch generates while the trainer steps
and publishes.

Each step generates the next batch in two halves (``fleet.generate_batch``, ``n``
samples per prompt, temperature 1, logprobs on): the first half starts before the
trainer's step on the batch it has, the second half starts with the publish of the new
weights (``pause="keep"``). Requests that finished before the round are one version
behind; requests running when it starts are frozen for the round and finish on the new
weights (their tokens carry both versions); requests admitted after it run entirely on
the new weights, the trainer's own, on which its logprobs must equal the servers'.
Every token comes back with the weight version that sampled it; a rollout's staleness is
how many versions its oldest token is behind the trainer's weights when it trains on it
(at most ``max_lag``: older ones are dropped, and the fleet routes only to servers at
most that far behind).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncsync as az
from asyncsync._demo._report import StepRecord
from asyncsync._demo._task import Rollout, Trainer, group_advantages, reward

__all__ = ["Batch", "DemoConfig", "Group", "greedy_check", "train"]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's knobs (the defaults are tuned to learn visibly in a few minutes)."""

    steps: int = 40
    groups_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 8
    prompt_length: int = 6
    prompts: int = 64
    lr: float = 5e-3
    max_lag: int = 1
    seed: int = 0
    greedy_prompts: int = 4
    greedy_tokens: int = 16


def version_name(step: int) -> str:
    return f"step-{step}"


def version_step(version: str | None) -> int | None:
    """The step a version name stands for (None when it is not one of ours)."""
    if version is None or not version.startswith("step-"):
        return None
    tail = version.removeprefix("step-")
    return int(tail) if tail.isdigit() else None


def lag_of(versions: Sequence[str | None], trainer_step: int) -> int | None:
    """Versions behind ``trainer_step`` of the oldest of ``versions`` (None: unknown)."""
    steps = [version_step(v) for v in versions]
    known = [s for s in steps if s is not None]
    if not steps or len(known) < len(steps):
        return None
    return trainer_step - min(known)


@dataclass(frozen=True, slots=True)
class Group:
    """``group_size`` completions of one prompt."""

    prompt: list[int]
    completions: list[az.Completion]

    def lags(self, trainer_step: int) -> list[int | None]:
        """Each completion's staleness when the trainer holds ``trainer_step``."""
        return [lag_of(c.token_versions, trainer_step) for c in self.completions]


@dataclass(frozen=True, slots=True)
class Generated:
    """Groups as generated, and when their generation began and ended."""

    groups: list[Group]
    began: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.began

    def __add__(self, other: Generated) -> Generated:
        return Generated(
            self.groups + other.groups, min(self.began, other.began), max(self.ended, other.ended)
        )

    @property
    def tokens(self) -> int:
        return sum(len(c) for g in self.groups for c in g.completions)


async def generate(
    fleet: az.Fleet, prompts: Sequence[list[int]], count: int, rng: random.Random, cfg: DemoConfig
) -> Generated:
    """``count`` groups: random prompts, ``group_size`` samples each."""
    chosen = [rng.choice(prompts) for _ in range(count)]
    began = time.perf_counter()
    results = await fleet.generate_batch(
        chosen,
        n=cfg.group_size,
        max_tokens=cfg.max_tokens,
        temperature=1.0,
        logprobs=0,
        ignore_eos=True,
    )
    groups = [Group(p, list(c)) for p, c in zip(chosen, results, strict=True)]
    return Generated(groups, began, time.perf_counter())


@dataclass(slots=True)
class Batch:
    """The groups of one step, as trainer rollouts and the table's counts."""

    rollouts: list[Rollout]
    rewards: list[float]
    versions: Counter[str]
    staleness: Counter[int]
    dropped: int


def to_batch(generated: Generated, trainer_step: int, cfg: DemoConfig) -> Batch:
    """The groups whose rollouts are all at most ``max_lag`` versions behind, as
    trainer rollouts (a group is kept or dropped whole: its rewards are its baseline)."""
    batch = Batch([], [], Counter(), Counter(), 0)
    for group in generated.groups:
        lags = group.lags(trainer_step)
        if any(lag is None or lag > cfg.max_lag for lag in lags):
            batch.dropped += len(group.completions)
            continue
        rewards = [reward(c.token_ids) for c in group.completions]
        advantages = group_advantages(rewards)
        for completion, advantage, lag in zip(group.completions, advantages, lags, strict=True):
            versions = completion.token_versions
            batch.rollouts.append(
                Rollout(group.prompt, completion.token_ids, completion.logprobs or [],
                        versions, advantage)
            )  # fmt: skip
            batch.versions.update({v for v in versions if v is not None})
            batch.staleness[lag or 0] += 1
        batch.rewards += rewards
    return batch


async def train(
    fleet: az.Fleet,
    publisher: az.AsyncWeightPublisher,
    trainer: Trainer,
    prompts: Sequence[list[int]],
    cfg: DemoConfig,
    on_step: Callable[[StepRecord], None],
) -> list[StepRecord]:
    """``cfg.steps`` steps: train on a batch and publish while the next one generates."""
    rng = random.Random(cfg.seed)
    first = cfg.groups_per_step // 2
    generated = await generate(fleet, prompts, cfg.groups_per_step, rng, cfg)
    records: list[StepRecord] = []
    for step in range(1, cfg.steps + 1):
        began = time.perf_counter()
        batch = to_batch(generated, step - 1, cfg)
        if not batch.rollouts:
            raise RuntimeError(f"step {step}: every rollout was too stale to train on")
        # Half of the next batch overlaps the trainer's step, half the publish.
        halves = [asyncio.create_task(generate(fleet, prompts, first, rng, cfg))]
        try:
            stats = await asyncio.to_thread(trainer.step, batch.rollouts, version_name(step - 1))
            rest = cfg.groups_per_step - first
            halves.append(asyncio.create_task(generate(fleet, prompts, rest, rng, cfg)))
            report = await publisher.publish(
                trainer.model, version=version_name(step), pause="keep"
            )
        except BaseException:
            for task in halves:
                task.cancel()
            await asyncio.gather(*halves, return_exceptions=True)
            raise
        records.append(
            StepRecord(
                step=step,
                reward=sum(batch.rewards) / len(batch.rewards),
                rollouts=len(batch.rollouts),
                versions=dict(batch.versions),
                staleness=dict(sorted(batch.staleness.items())),
                dropped=batch.dropped,
                publish_seconds=report.total_seconds,
                publish_gb_per_s=report.gb_per_s,
                tokens_per_s=generated.tokens / generated.seconds,
                max_logprob_diff=stats.max_logprob_diff,
                exact_tokens=stats.exact_tokens,
                loss=stats.loss,
                seconds=time.perf_counter() - began,
            )
        )
        on_step(records[-1])
        generated = await halves[0] + await halves[1]
    return records


async def greedy_check(
    fleet: az.Fleet, model: Any, prompts: Sequence[list[int]], tokens: int
) -> list[dict[str, Any]]:
    """Greedy tokens of every server for each prompt beside the trainer model's. A
    server's tokens match when the trainer model, teacher-forced with them, ranks each
    one first (or within float32 rounding of first: `asyncsync.testing.check_greedy`),
    which holds on any CPU."""
    from asyncsync.testing import greedy_mismatch, reference_greedy

    checks: list[dict[str, Any]] = []
    for prompt in prompts:
        expected = await asyncio.to_thread(reference_greedy, model, prompt, tokens)
        for url in fleet.urls:
            got = await fleet.client(url).generate(
                prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True
            )
            problem = await asyncio.to_thread(
                greedy_mismatch, model, prompt, got.token_ids, max_new_tokens=tokens
            )
            checks.append(
                {"server": url, "prompt": prompt, "version": got.version,
                 "server_tokens": got.token_ids, "trainer_tokens": expected,
                 "match": problem is None, "mismatch": problem}
            )  # fmt: skip
    return checks
