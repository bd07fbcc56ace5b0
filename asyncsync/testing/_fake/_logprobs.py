"""Logprobs in vLLM's shapes, in closed form from `FakeLM`: the ``content`` list
of ``/inference/v1/generate`` (0.23 keys tokens as ``"token_id:N"``, 0.32 by id with
ranks), the legacy shape of ``/v1/completions``, and ``prompt_logprobs``."""

from __future__ import annotations

from typing import Any

from asyncsync.testing._fake._lm import FakeLM, token_text
from asyncsync.testing._fake._sampling import Sample
from asyncsync.testing._fake._state import FakeState, ProtocolVersion


def _top_ids(lm: FakeLM, context: list[int], token: int, k: int, gen: int) -> list[int]:
    """vLLM's order: the sampled token first, then the top-k others, cut to max(k, 1)."""
    ids = [token] + [t for t in lm.top(context, k, gen) if t != token]
    return ids[: max(k, 1)]


def content_logprobs(
    lm: FakeLM, sample: Sample, k: int, protocol: ProtocolVersion
) -> dict[str, Any]:
    """``{"content": [...]}``, one entry per token of ``sample`` with its top ``k``."""
    entry = _entry_023 if protocol == "0.23" else _entry_032
    return {
        "content": [
            entry(lm, sample.contexts[i], token, sample.generations[i], k)
            for i, token in enumerate(sample.token_ids)
        ]
    }


def _entry_023(lm: FakeLM, ctx: list[int], token: int, gen: int, k: int) -> dict[str, Any]:
    def one(t: int) -> dict[str, Any]:
        return {"token": f"token_id:{t}", "logprob": lm.logprob(ctx, t, gen), "bytes": None}

    return {**one(token), "top_logprobs": [one(t) for t in _top_ids(lm, ctx, token, k, gen)]}


def _entry_032(lm: FakeLM, ctx: list[int], token: int, gen: int, k: int) -> dict[str, Any]:
    def one(t: int) -> dict[str, Any]:
        return {"token_id": t, "logprob": lm.logprob(ctx, t, gen), "rank": lm.rank(ctx, t, gen)}

    return {**one(token), "top_logprobs": [one(t) for t in _top_ids(lm, ctx, token, k, gen)]}


def legacy_logprobs(lm: FakeLM, sample: Sample, k: int, as_ids: bool) -> dict[str, Any]:
    """``/v1/completions``' ``{"text_offset", "token_logprobs", "tokens",
    "top_logprobs"}``, keyed by decoded text (or ``"token_id:N"`` with ``as_ids``)."""

    def key(t: int) -> str:
        return f"token_id:{t}" if as_ids else token_text(t).strip()

    tokens, lps, tops, offsets = [], [], [], []
    for i, token in enumerate(sample.token_ids):
        ctx, gen = sample.contexts[i], sample.generations[i]
        tokens.append(key(token))
        lps.append(lm.logprob(ctx, token, gen))
        tops.append({key(t): lm.logprob(ctx, t, gen) for t in _top_ids(lm, ctx, token, k, gen)})
        offsets.append(sum(len(token_text(t)) for t in sample.token_ids[:i]))
    return {
        "text_offset": offsets,
        "token_logprobs": lps,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def prompt_logprobs(state: FakeState, prompt: list[int], k: int) -> list[Any]:
    """``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``: each prompt token
    after the first, with the top ``k`` others, under the server's current weights."""
    lm, gen = state.lm, state._generation
    out: list[Any] = [None]
    for pos in range(1, len(prompt)):
        ctx, tok = prompt[:pos], prompt[pos]
        entry: dict[str, Any] = {}
        for t in [tok, *[t for t in lm.top(ctx, k, gen) if t != tok][:k]]:
            entry[str(t)] = {
                "logprob": lm.logprob(ctx, t, gen),
                "rank": lm.rank(ctx, t, gen),
                "decoded_token": token_text(t).strip() if state.tokenizer else None,
            }
        out.append(entry)
    return out
