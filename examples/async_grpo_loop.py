"""Asynchronous GRPO against a vLLM fleet: the next batch generates while the trainer
steps and publishes. Copy this file and swap in your model, prompts and reward.

Each step (``python -m asyncsync demo`` runs this same loop, with a table and checks):

1. start generating half of the next batch on the fleet, token-in-token-out, at
   temperature 1; every token comes back with its logprob and the weight version that
   sampled it;
2. meanwhile take one clipped policy-gradient step (GRPO: a group baseline) on the
   batch already generated, with the servers' logprobs as the old policy;
3. start the other half and publish the new weights with ``pause="keep"``: requests
   running at that moment are frozen for the round and finish on the new weights (two
   versions in one rollout), requests admitted after it run on the new weights.

A rollout is therefore at most one version behind the trainer (``MAX_LAG``); the
fleet's ``max_staleness`` routes only to servers within that bound, and older rollouts
would be dropped. Runs on a CPU-only machine (tiny model, two local vLLM-CPU servers):

    python examples/async_grpo_loop.py [--steps 20] [--servers URL URL]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, make_tiny_model

PROMPTS, GROUP_SIZE, MAX_TOKENS = 8, 8, 8  # a batch: 8 prompts x 8 samples x 8 tokens
MAX_LAG, LR, CLIP = 1, 5e-3, 0.2


def reward(token_ids: list[int]) -> float:
    """Verifiable reward in [0, 1]: the share of tokens whose id is a multiple of 8."""
    return sum(t % 8 == 0 for t in token_ids) / len(token_ids)


def lag(completion: az.Completion, step: int) -> int:
    """Versions between the trainer's weights ("step-N") and the oldest token's."""
    versions = [v or "step--1" for v in completion.token_versions]  # None: unknown
    return step - min(int(v.removeprefix("step-")) for v in versions)


async def rollouts(
    fleet: az.Fleet, prompts: list[list[int]], count: int
) -> list[list[az.Completion]]:
    """GROUP_SIZE samples for each of ``count`` random prompts, all at once."""
    return await fleet.generate_batch(
        random.sample(prompts, count), n=GROUP_SIZE, max_tokens=MAX_TOKENS,
        temperature=1.0, logprobs=0, ignore_eos=True,
    )  # fmt: skip


def train_step(model: Any, optimizer: Any, groups: list[list[az.Completion]]) -> float:
    """One clipped policy-gradient step with a group baseline; returns the mean reward."""
    batch = [c for group in groups for c in group]
    rewards = torch.tensor([[reward(c.token_ids) for c in group] for group in groups])
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True, unbiased=False)
    advantages = ((rewards - mean) / (std + 1e-6)).view(-1, 1)
    ids = torch.tensor([c.prompt_token_ids + c.token_ids for c in batch])
    start = len(batch[0].prompt_token_ids)
    logits = model(input_ids=ids).logits[:, start - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, start:, None])[..., 0]
    ratio = torch.exp(logp - torch.tensor([c.logprobs for c in batch]))  # new / sampling
    clipped = ratio.clamp(1 - CLIP, 1 + CLIP)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


async def train(fleet: az.Fleet, model: Any, steps: int) -> None:
    vocab = model.config.vocab_size
    prompts = [[1, *random.sample(range(3, vocab), 5)] for _ in range(64)]
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    async with az.AsyncWeightPublisher(fleet, backend="shm") as publisher:
        await publisher.publish(model, version="step-0")  # the servers start as the trainer
        groups = await rollouts(fleet, prompts, PROMPTS)
        half = PROMPTS // 2
        for step in range(1, steps + 1):
            # Keep only groups whose every rollout is within the staleness bound.
            groups = [g for g in groups if all(lag(c, step - 1) <= MAX_LAG for c in g)]
            first = asyncio.create_task(rollouts(fleet, prompts, half))  # overlaps the step
            mean_reward = await asyncio.to_thread(train_step, model, optimizer, groups)
            second = asyncio.create_task(rollouts(fleet, prompts, PROMPTS - half))
            report = await publisher.publish(model, version=f"step-{step}", pause="keep")
            versions = sorted({v for g in groups for c in g for v in c.token_versions})
            print(
                f"step {step:3d}  reward {mean_reward:.3f}  trained on {versions}  "
                f"published in {report.total_seconds * 1000:.0f} ms"
            )
            groups = await first + await second
    print("staleness of every completion:", dict(fleet.staleness.as_dict()))


async def main(steps: int, urls: list[str] | None) -> None:
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, tokenizer=False)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        servers = []
        if urls is None:  # two local servers with the shm plugin, one core each
            servers = [
                LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2))
                for i in range(2)
            ]
            print("starting two vLLM-CPU servers (about a minute on 2 cores)...")
            await asyncio.gather(*(s.astart() for s in servers))
            urls = [s.url for s in servers]
        try:
            vocab = model.config.vocab_size
            async with az.Fleet(urls, vocab_size=vocab, max_staleness=MAX_LAG) as fleet:
                await train(fleet, model, steps)
        finally:
            await asyncio.gather(*(s.astop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--servers", nargs="+", metavar="URL", help="use running servers")
    args = parser.parse_args()
    az.run(main(args.steps, args.servers))
