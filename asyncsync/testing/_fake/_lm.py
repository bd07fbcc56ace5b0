"""``FakeLM``: the fake server's language model, with logprobs known in closed form."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

_LOG_HALF = math.log(0.5)


def token_text(token: int) -> str:
    """How the fake's tokenizer decodes ``token`` (every token is a word and a space)."""
    return f"t{token} "


class FakeLM:
    """A deterministic stand-in for a language model over ``vocab_size`` tokens.

    Given a context, the most likely next token ``g`` has probability ``greedy_prob``
    (1/2 by default) and every other token shares the rest equally, so every logprob is
    known in closed form (tests can check what the fake returns). ``g`` depends on the
    last token, the context length and the weights' generation (the number of finished
    weight updates), so publishing new weights changes the output, as it would on a real
    server.
    """

    def __init__(self, vocab_size: int = 512, *, greedy_prob: float = 0.5) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if not 0.0 < greedy_prob < 1.0:
            raise ValueError(f"greedy_prob must be in (0, 1), got {greedy_prob}")
        self.vocab_size = vocab_size
        self.greedy_prob = greedy_prob
        self.greedy_logprob = math.log(greedy_prob) if greedy_prob != 0.5 else _LOG_HALF
        self.rest_logprob = math.log((1.0 - greedy_prob) / (vocab_size - 1))

    def greedy(self, context: Sequence[int], generation: int = 0) -> int:
        return (context[-1] * 131 + len(context) * 17 + 5 + 97 * generation) % self.vocab_size

    def logprob(self, context: Sequence[int], token: int, generation: int = 0) -> float:
        if token == self.greedy(context, generation):
            return self.greedy_logprob
        return self.rest_logprob

    def rank(self, context: Sequence[int], token: int, generation: int = 0) -> int:
        g = self.greedy(context, generation)
        return 1 if token == g else 2 + (token - g - 1) % self.vocab_size

    def top(self, context: Sequence[int], k: int, generation: int = 0) -> list[int]:
        """The ``k`` most likely next tokens, in rank order."""
        g = self.greedy(context, generation)
        return [(g + i) % self.vocab_size for i in range(min(k, self.vocab_size))]

    def sample(self, context: Sequence[int], rng: random.Random, generation: int = 0) -> int:
        g = self.greedy(context, generation)
        if rng.random() < self.greedy_prob:
            return g
        return (g + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
