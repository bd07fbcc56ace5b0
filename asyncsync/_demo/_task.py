"""The demo's RL problem and its trainer: a verifiable reward and GRPO-style steps.

The task: continue a prompt of random token ids with tokens from a target set (every
token id that is a multiple of `TARGET_EVERY`). The reward of a rollout is the
share of its generated tokens that are in the set, in [0, 1]; a freshly initialised
tiny model scores about ``1 / TARGET_EVERY`` by chance. Nothing here does I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TARGET_EVERY",
    "Rollout",
    "TrainStats",
    "Trainer",
    "group_advantages",
    "make_prompts",
    "reward",
]

#: Token ids that are a multiple of this are the target set.
TARGET_EVERY = 8
#: The first token id a prompt may use (0-2 are pad, BOS and EOS).
_FIRST_ID = 3


def reward(token_ids: Sequence[int]) -> float:
    """The share of ``token_ids`` in the target set (0.0 for no tokens)."""
    if not token_ids:
        return 0.0
    return sum(1 for t in token_ids if t % TARGET_EVERY == 0) / len(token_ids)


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (BOS first), reproducible."""
    rng = random.Random(seed)
    return [
        [1, *(rng.randrange(_FIRST_ID, vocab_size) for _ in range(length - 1))]
        for _ in range(count)
    ]


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's group baseline: each reward minus the group's mean, over the group's
    standard deviation (all zeros when every rollout scored the same)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < 1e-6:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sampled continuation, as the trainer needs it.

    Attributes:
        prompt: the prompt's token ids.
        tokens: the sampled token ids.
        logprobs: the sampling logprob of each token (the behaviour policy's).
        versions: the weight version that sampled each token.
        advantage: the group-baselined reward.
    """

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[str | None]
    advantage: float


@dataclass(frozen=True, slots=True)
class TrainStats:
    """What one optimizer step saw.

    Attributes:
        loss: the clipped policy-gradient loss.
        max_logprob_diff: the largest |trainer logprob - sampling logprob| over the
            rollouts sampled entirely by the weights the trainer held (None: no such
            rollout in the batch).
        exact_tokens: how many tokens that maximum was taken over.
    """

    loss: float
    max_logprob_diff: float | None
    exact_tokens: int


class Trainer:
    """A plain torch copy of the policy taking clipped policy-gradient steps.

    Each token's loss is PPO's clipped surrogate with the sampling logprob as the old
    policy: tokens sampled by older weights (staleness) are importance-weighted, and
    the ratio is clipped to ``[1 - clip, 1 + clip]``.
    """

    def __init__(self, model: Any, *, lr: float, clip: float = 0.2) -> None:
        self.model = model
        self.clip = clip
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def token_logprobs(self, rollouts: Sequence[Rollout]) -> torch.Tensor:
        """The model's logprob of every sampled token, ``[len(rollouts), tokens]``
        (every rollout must have the same prompt and output lengths)."""
        ids = torch.tensor([[*r.prompt, *r.tokens] for r in rollouts], dtype=torch.long)
        start = len(rollouts[0].prompt)
        logits = self.model(input_ids=ids).logits[:, start - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1)

    def step(self, rollouts: Sequence[Rollout], version: str | None) -> TrainStats:
        """One optimizer step on ``rollouts``; ``version`` names the weights the model
        holds now (the exactness check compares rollouts sampled by exactly these)."""
        self.model.train()
        logp = self.token_logprobs(rollouts)
        old = torch.tensor([r.logprobs for r in rollouts], dtype=torch.float32)
        adv = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32).unsqueeze(-1)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1.0 - self.clip, 1.0 + self.clip)
        loss = -torch.minimum(ratio * adv, clipped * adv).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        exact = [i for i, r in enumerate(rollouts) if set(r.versions) == {version}]
        diff = (logp.detach()[exact] - old[exact]).abs() if exact else None
        return TrainStats(
            loss=float(loss.detach()),
            max_logprob_diff=float(diff.max()) if diff is not None else None,
            exact_tokens=int(diff.numel()) if diff is not None else 0,
        )
