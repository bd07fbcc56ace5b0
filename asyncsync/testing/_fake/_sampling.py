"""Sampling for the fake's generation routes: checked parameters, and the token loop that
follows the server's pausing and weight updates."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncsync.testing._fake._state import FakeState


def check_token_ids(ids: Any, where: str, vocab_size: int) -> str | None:
    """Why ``ids`` is not a prompt of token ids (a 400 message), or None."""
    if not isinstance(ids, list) or not ids:
        return f"{where} must be a non-empty list of token ids"
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return f"{where} must contain non-negative integers"
        if t >= vocab_size:
            return f"Token id {t} is out of vocabulary"
    return None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters the fake honours."""

    n: int
    max_tokens: int
    temperature: Any  # 0 (or None): greedy
    seed: Any
    logprobs: int | None
    prompt_logprobs: Any
    stop_token_ids: frozenset[int]
    ignore_eos: bool = False

    @classmethod
    def parse(cls, raw: Any, prompt: list[int], max_model_len: int) -> SamplingParams | str:
        """Checked parameters for ``prompt``, or why vLLM would refuse them (a 400 message)."""
        if not isinstance(raw, dict):
            return "sampling parameters must be an object"
        n = raw.get("n", 1)
        max_tokens = raw.get("max_tokens")
        logprobs = raw.get("logprobs")
        for name, value in (("n", n), ("max_tokens", max_tokens), ("logprobs", logprobs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                return f"{name} must be an integer"
        if n < 1:
            return "n must be at least 1, got 0."
        if max_tokens is None:
            max_tokens = max(1, max_model_len - len(prompt))
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}."
        if len(prompt) + max_tokens > max_model_len:
            return (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {len(prompt)} input tokens and requested {max_tokens} "
                "output tokens."
            )
        stop = raw.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
            return "stop_token_ids must be a list of integers"
        return cls(
            n=n,
            max_tokens=max_tokens,
            temperature=raw.get("temperature", 1.0),
            seed=raw.get("seed"),
            logprobs=logprobs,
            prompt_logprobs=raw.get("prompt_logprobs"),
            stop_token_ids=frozenset(stop),
            ignore_eos=bool(raw.get("ignore_eos")),
        )

    def stops(self, token: int, eos: int | None) -> bool:
        """Whether sampling ``token`` ends the sample (a stop id, or the model's EOS)."""
        return token in self.stop_token_ids or (token == eos and not self.ignore_eos)


@dataclass(slots=True)
class Sample:
    """A generated sequence, with the context, weights generation and weight version
    each token was generated with (what its logprobs and spans are computed from)."""

    token_ids: list[int] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    stop_reason: int | None = None

    def window(self, start: int, stop: int) -> Sample:
        """Tokens ``start:stop`` as a sample of their own (for a streamed event)."""
        return Sample(
            self.token_ids[start:stop],
            self.contexts[start:stop],
            self.generations[start:stop],
            self.versions[start:stop],
        )

    def weight_versions(self) -> list[dict[str, Any]]:
        """vLLM 0.32's ``weight_versions``: ``{"version", "start", "end"}`` spans of
        output tokens generated with the same weight version."""
        spans: list[dict[str, Any]] = []
        for i, version in enumerate(self.versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        return spans


#: Called after each new token: the sample so far and the new token's position.
OnToken = Callable[[Sample, int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Job:
    """A generation request the server admitted (while ``epoch`` was its abort epoch)."""

    state: FakeState
    prompt: list[int]
    params: SamplingParams
    request_id: str
    epoch: int

    async def sample(self, index: int, on_token: OnToken | None = None) -> Sample:
        """Choice ``index``: token by token, pausing, aborting and changing weights as the
        server does meanwhile (see ``FakeState._gate``)."""
        state, params = self.state, self.params
        seed = params.seed
        rng = random.Random(f"{seed}:{index}" if seed is not None else f"{self.request_id}:{index}")
        greedy = not params.temperature
        context = list(self.prompt)
        sample = Sample()
        for _ in range(params.max_tokens):
            if not await state._gate(self.epoch):
                sample.finish_reason = "abort"
                break
            gen = state._generation
            token = state.lm.greedy(context, gen) if greedy else state.lm.sample(context, rng, gen)
            sample.contexts.append(context)  # never mutated: each step builds a new list
            sample.token_ids.append(token)
            sample.generations.append(gen)
            sample.versions.append(state.weight_version)
            state.tokens_generated += 1
            context = [*context, token]
            if on_token is not None:
                await on_token(sample, len(sample.token_ids) - 1)
            if state.token_delay:
                await asyncio.sleep(state.token_delay)
            if params.stops(token, state.eos_token_id):
                sample.finish_reason = "stop"
                # vLLM reports a stop id it was asked for, and None for its EOS
                sample.stop_reason = token if token in params.stop_token_ids else None
                break
        return sample
