"""Token-in-token-out on the wire: requests, bodies, and every response shape.

Pure functions and small records, no I/O. Two vLLM routes are spoken:

- ``POST /inference/v1/generate`` (vLLM < 0.30 always; vLLM >= 0.30 with
  ``--enable-scale-out`` or ``--tokens-only``, else 403). vLLM 0.32 reports per-token
  weight-version spans (``choices[i].weight_versions``) and logprobs with integer token
  ids; earlier ones (0.23, 0.27.1) report logprobs as ``"token_id:N"`` strings and no
  versions, and below 0.29 answer ``n > 1`` with one choice (docs/versions.md).
- ``POST /v1/completions`` with a token-id prompt, ``return_token_ids`` and
  ``return_tokens_as_token_ids`` (legacy logprobs keyed by ``"token_id:N"``; by decoded
  strings on servers that ignore the flag). No versions.

Here: the request bodies (`request_body`) and the answers' parsers. A response choice,
whole or streamed in pieces, is read by one parser (`parse_choice`) into a `Completion`;
a plain answer is one per sample (`parse_answer`), a stream is many pieces per sample,
accumulated by `asyncsync._wire.generation.stream.StreamAssembler`. `completions_from`
completes both; `retokenize` is the fallback for servers that return no token ids. The
options a request is built from are in `asyncsync._wire.generation.options`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeGuard

from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion, WeightVersionSpan
from asyncsync._wire.control import Malformed
from asyncsync._wire.generation.options import (
    GENERATE_ROUTE,
    INT_ONLY,
    GenerationRequest,
    Tokenizer,
)

__all__ = [
    "ABSENT",
    "IdsRule",
    "client_spans",
    "completions_from",
    "int_list",
    "is_int",
    "parse_answer",
    "parse_choice",
    "parse_content_logprobs",
    "parse_legacy_logprobs",
    "parse_prompt_logprobs",
    "parse_scored",
    "parse_spans",
    "request_body",
    "retokenize",
    "token_id_of",
]

_TOKEN_ID_PREFIX = "token_id:"


# ------------------------------------------------------------------------ bodies
def request_body(
    path: str,
    prompt: list[int],
    req: GenerationRequest,
    *,
    stream: bool = False,
    prompt_logprobs: int | None = None,
) -> bytes:
    """The encoded JSON body of a generation (or, with ``prompt_logprobs``, a scoring
    request) on ``path``."""
    body: dict[str, Any]
    if path == GENERATE_ROUTE:
        sampling = req.sampling()
        if prompt_logprobs is not None:
            sampling["prompt_logprobs"] = prompt_logprobs
        body = {"token_ids": prompt, "sampling_params": sampling}
    else:
        body = req.sampling({"prompt": prompt})
        body["return_token_ids"] = True
        body["return_tokens_as_token_ids"] = True
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
    if req.cache_salt is not None or req.request_id is not None or req.model is not None:
        given = {"cache_salt": req.cache_salt, "request_id": req.request_id, "model": req.model}
        body.update({key: value for key, value in given.items() if value is not None})
    if stream:
        body["stream"] = True
    return _json.dumps(body)


# ------------------------------------------------------------------------ parsing
#: Marks token ids a response did not carry, until `completions_from` fills them
#: in (the prompt we sent; ids re-tokenized from text). Identity-checked, never mutated,
#: never left in a returned completion.
ABSENT: list[int] = []


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def int_list(value: Any, what: str) -> list[int]:
    # Exact for JSON-decoded values (never a bool) and cheap enough to check every
    # token id of every response.
    if type(value) is not list or (value and set(map(type, value)) != INT_ONLY):
        raise Malformed(f"{what} is not a list of ints")
    return value


def _float(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Malformed(f"{what} is not a number")
    return float(value)


def token_id_of(key: Any) -> int | None:
    """The token id in a logprob key: an int, ``"token_id:N"`` or a decimal string
    (JSON object keys); None for a decoded-text key."""
    if is_int(key):
        return int(key)
    if isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX):
        rest = key[len(_TOKEN_ID_PREFIX) :]
        return int(rest) if rest.isdigit() else None
    return None


_Logprobs = tuple[
    list[float], list[dict[int, float]] | None, list[dict[str, float]] | None, list[int] | None
]


def parse_content_logprobs(data: Any, n_tokens: int) -> _Logprobs:
    """``{"content": [...]}`` logprobs of ``/inference/v1/generate``, both shapes:
    vLLM >= 0.32 ``{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", ...}]}``
    and vLLM 0.23 ``{"token": "token_id:N", "logprob", "top_logprobs": [{"token", ...}]}``.
    Returns (logprobs, top logprobs by id, None, token ids named by the entries)."""
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        raise Malformed("logprobs has no 'content' list")
    content = data["content"]
    if len(content) != n_tokens:
        raise Malformed(f"{len(content)} logprob entries for {n_tokens} tokens")
    logprobs: list[float] = []
    tops: list[dict[int, float]] = []
    ids: list[int] = []
    for entry in content:
        if not isinstance(entry, dict):
            raise Malformed("a logprob entry is not an object")
        ids.append(_entry_token(entry))
        logprobs.append(_float(entry.get("logprob"), "logprob"))
        raw_top = entry.get("top_logprobs") or []
        if not isinstance(raw_top, list) or not all(isinstance(c, dict) for c in raw_top):
            raise Malformed("top_logprobs is not a list of objects")
        tops.append({_entry_token(c): _float(c.get("logprob"), "top logprob") for c in raw_top})
    return logprobs, tops, None, ids


def _entry_token(entry: dict[str, Any]) -> int:
    if "token_id" in entry:
        if not is_int(entry["token_id"]):
            raise Malformed("token_id is not an int")
        return int(entry["token_id"])
    tok = token_id_of(entry.get("token"))
    if tok is None:
        raise Malformed(f"logprob token {entry.get('token')!r} is not 'token_id:N'")
    return tok


def parse_legacy_logprobs(data: Any, n_tokens: int | None) -> _Logprobs:
    """Legacy ``/v1/completions`` logprobs ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``. Keys are ``"token_id:N"`` with ``return_tokens_as_token_ids``, else
    decoded strings (then ids cannot be recovered: the text-keyed dicts are returned).
    ``n_tokens`` None: as many as ``tokens`` lists. Returns (logprobs, top by id | None,
    top by text | None, ids named by ``tokens`` | None)."""
    if not isinstance(data, dict):
        raise Malformed("logprobs is not an object")
    raw_lps, tokens = data.get("token_logprobs"), data.get("tokens")
    if not isinstance(raw_lps, list) or not isinstance(tokens, list):
        raise Malformed("logprobs lacks 'token_logprobs'/'tokens' lists")
    n_tokens = len(tokens) if n_tokens is None else n_tokens
    if len(raw_lps) != n_tokens or len(tokens) != n_tokens:
        raise Malformed(f"{len(raw_lps)} logprobs for {n_tokens} tokens")
    logprobs = [_float(v, "token logprob") for v in raw_lps]
    named = [token_id_of(t) for t in tokens]
    ids = None if None in named else [i for i in named if i is not None]
    raw_top = data.get("top_logprobs")
    if raw_top is None:
        return logprobs, None, None, ids
    if not isinstance(raw_top, list) or len(raw_top) != n_tokens:
        raise Malformed("top_logprobs is not aligned with the tokens")
    by_text = [_text_keyed(pos) for pos in raw_top]
    by_id = [{token_id_of(k): v for k, v in pos.items()} for pos in by_text]
    if any(None in pos for pos in by_id):
        return logprobs, None, by_text, ids
    return logprobs, by_id, None, ids  # type: ignore[return-value]


def _text_keyed(pos: Any) -> dict[str, float]:
    if pos is None:
        return {}
    if not isinstance(pos, dict):
        raise Malformed("a top_logprobs entry is not an object")
    return {key: _float(value, "top logprob") for key, value in pos.items()}


def parse_spans(data: Any, n_tokens: int) -> list[WeightVersionSpan] | None:
    """``weight_versions`` spans (vLLM >= 0.32), checked to tile ``[0, n_tokens)``."""
    if data is None:
        return None
    if not isinstance(data, list):
        raise Malformed("weight_versions is not a list")
    spans: list[WeightVersionSpan] = []
    pos = 0
    for item in data:
        if not isinstance(item, dict):
            raise Malformed("a weight_versions entry is not an object")
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if not isinstance(version, str) or not is_int(start) or not is_int(end):
            raise Malformed("a weight_versions entry lacks version/start/end")
        if start != pos or end < start:
            raise Malformed("weight_versions spans do not tile the output tokens")
        spans.append(WeightVersionSpan(version, start, end, "server"))
        pos = end
    if spans and pos != n_tokens:
        raise Malformed(f"weight_versions cover {pos} of {n_tokens} tokens")
    return spans


IdsRule = Literal["required", "fallback", "delta"]


def parse_choice(
    raw: Any, want_logprobs: bool, ids_rule: IdsRule, path: str, tokens_before: int = 0
) -> Completion:
    """One choice of either route, whole or a streamed piece, as a completion that
    `completions_from` completes (server, latency, prompt, client-side versions).

    ``ids_rule``: ``"required"`` (token ids must be there), ``"fallback"`` (missing ids
    become `ABSENT`, recovered from ``"token_id:N"`` logprob keys or re-tokenized
    later), ``"delta"`` (a streamed piece: missing ids mean none, unless it has text).
    ``tokens_before``: tokens earlier pieces delivered (weight-version spans cover all).
    """
    if type(raw) is not dict and not isinstance(raw, dict):
        raise Malformed("a choice is not an object with an index")
    get = raw.get
    index = get("index", 0)
    if type(index) is not int and not is_int(index):
        raise Malformed("a choice is not an object with an index")
    reason, stop, text = get("finish_reason"), get("stop_reason"), get("text")
    if reason is not None and type(reason) is not str:
        raise Malformed("finish_reason is not a string")
    if stop is not None and not (type(stop) is int or type(stop) is str):
        raise Malformed("stop_reason is not an int or string")
    if text is not None and type(text) is not str:
        raise Malformed("text is not a string")
    prompt = get("prompt_token_ids")
    # Positional, in field order (a keyword call costs twice as much, per choice):
    # prompt_token_ids, token_ids, logprobs, top_logprobs, finish_reason,
    # weight_versions, server, route, latency, index, stop_reason, retokenized,
    # top_logprobs_text, text.
    c = Completion(
        ABSENT if prompt is None else int_list(prompt, "prompt_token_ids"),
        _choice_ids(raw, ids_rule), None, None, reason, (), "", path, 0.0, index, stop,
        False, None, text,
    )  # fmt: skip
    if want_logprobs and (c.token_ids or c.token_ids is ABSENT):
        _read_logprobs(c, get("logprobs"))
    versions = get("weight_versions")
    if versions is not None:
        spans = parse_spans(versions, tokens_before + len(c.token_ids))
        if spans:
            c.weight_versions = tuple(spans)
    return c


def _choice_ids(raw: dict[str, Any], ids_rule: IdsRule) -> list[int]:
    ids = raw.get("token_ids")
    if ids is not None or ids_rule == "required":
        return int_list(ids, "token_ids")
    if ids_rule == "fallback":
        return ABSENT
    if raw.get("text"):
        raise Malformed("a delta has text but no token_ids (return_token_ids ignored)")
    return []


def _read_logprobs(c: Completion, raw: Any) -> None:
    if raw is None:
        raise Malformed("logprobs were requested but the response has none")
    absent = c.token_ids is ABSENT
    if isinstance(raw, dict) and "content" in raw:
        read = parse_content_logprobs(raw, len(c.token_ids))
    else:
        read = parse_legacy_logprobs(raw, None if absent else len(c.token_ids))
    c.logprobs, c.top_logprobs, c.top_logprobs_text, named = read
    if named is None:
        return
    if absent:
        c.token_ids = named  # exact ids from "token_id:N" keys
    elif named != c.token_ids:
        raise Malformed("logprob entries name other tokens than token_ids")


def parse_answer(data: Any, path: str, n: int, logprobs: int | None) -> list[Completion]:
    """A plain (not streamed) generation answer on ``path``, as completions that
    `completions_from` completes (server, latency, prompt, versions)."""
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise Malformed("'choices' missing or not a list of objects")
    if len(choices) != n:
        hint = ""
        if path == GENERATE_ROUTE and len(choices) == 1:
            # vLLM < 0.29 answers one choice here without streaming (docs/versions.md)
            hint = " (vLLM < 0.29 answers n > 1 with one choice on this route: "
            hint += "use route='completions' or send n requests)"
        raise Malformed(f"{len(choices)} choices for n={n}{hint}")
    rule: IdsRule = "required" if path == GENERATE_ROUTE else "fallback"
    want_logprobs = logprobs is not None
    if n == 1:
        out = [parse_choice(choices[0], want_logprobs, rule, path)]
    else:
        out = [parse_choice(raw, want_logprobs, rule, path) for raw in choices]
        out.sort(key=lambda c: c.index)
    raw_prompt = data.get("prompt_token_ids")
    request_id = data.get("request_id" if path == GENERATE_ROUTE else "id")
    request_id = request_id if type(request_id) is str else None
    for i, c in enumerate(out):
        c.index, c.request_id = i, request_id
        if raw_prompt and c.prompt_token_ids is ABSENT:
            prompt = int_list(raw_prompt, "prompt_token_ids")
            c.prompt_token_ids = prompt if i == 0 else [*prompt]
    return out


def parse_scored(data: Any, path: str) -> Any:
    """The raw ``prompt_logprobs`` of a one-token scoring request on ``path`` (for
    `parse_prompt_logprobs`): top-level on the generate route, per choice on
    ``/v1/completions``."""
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise Malformed("expected one choice")
    if path == GENERATE_ROUTE:
        return data.get("prompt_logprobs")
    return choices[0].get("prompt_logprobs")


def parse_prompt_logprobs(
    data: Any, token_ids: Sequence[int]
) -> tuple[list[float | None], list[dict[int, float] | None], list[int | None]]:
    """vLLM's ``prompt_logprobs``: ``[null, {"<id>": {"logprob", "rank",
    "decoded_token"}}, ...]``. Keys may be strings (JSON) or ints; values may also be
    bare numbers. Position 0 is None. A position whose dict lacks the given token is an
    error (never a silent 0.0)."""
    if not isinstance(data, list):
        raise Malformed("prompt_logprobs missing or not a list")
    if len(data) != len(token_ids):
        raise Malformed(f"{len(data)} prompt logprobs for {len(token_ids)} tokens")
    if data and data[0] is not None:
        raise Malformed("prompt_logprobs[0] is not null")
    logprobs: list[float | None] = [None]
    tops: list[dict[int, float] | None] = [None]
    ranks: list[int | None] = [None]
    for pos in range(1, len(token_ids)):
        top, rank_of = _prompt_position(data[pos], pos)
        want = int(token_ids[pos])
        if want not in top:
            raise Malformed(
                f"prompt_logprobs[{pos}] has no entry for the given token {want} "
                f"(has {sorted(top)[:8]})"
            )
        logprobs.append(top[want])
        tops.append(top)
        ranks.append(rank_of.get(want))
    return logprobs, tops, ranks


def _prompt_position(entry: Any, pos: int) -> tuple[dict[int, float], dict[int, int | None]]:
    if not isinstance(entry, dict):
        raise Malformed(f"prompt_logprobs[{pos}] is not an object")
    top: dict[int, float] = {}
    rank_of: dict[int, int | None] = {}
    for key, value in entry.items():
        tok = token_id_of(key)
        if tok is None and isinstance(key, str) and key.isdigit():
            tok = int(key)
        if tok is None:
            raise Malformed(f"prompt_logprobs[{pos}] key {key!r} is not a token id")
        if isinstance(value, dict):
            top[tok] = _float(value.get("logprob"), "prompt logprob")
            rank = value.get("rank")
            rank_of[tok] = int(rank) if is_int(rank) else None
        else:
            top[tok] = _float(value, "prompt logprob")
            rank_of[tok] = None
    return top, rank_of


# ------------------------------------------------------------------- completing
@functools.lru_cache(maxsize=1024)
def client_spans(
    n_tokens: int, admitted: str | None, completed: str | None
) -> tuple[WeightVersionSpan, ...]:
    """Client-side version spans (the caller's record of the server's version at
    admission and at completion): exact only when the version did not change in flight.
    Cached: a handful of distinct tuples serve every completion."""
    if n_tokens == 0:
        return ()
    version = admitted if admitted == completed else None
    return (WeightVersionSpan(version, 0, n_tokens, "client"),)


def completions_from(
    completions: list[Completion],
    *,
    server: str,
    prompt: list[int],
    latency: float,
    admitted: str | None,
    completed: str | None,
) -> list[Completion]:
    """Fill in what a parser cannot know: server, latency, the prompt we sent, and the
    caller's version record where the server reported none. Token ids still
    `ABSENT` are left for the caller's re-tokenize fallback."""
    for c in completions:
        c.server = server
        c.latency = latency
        c.admitted_version = admitted
        c.completed_version = completed
        if c.prompt_token_ids is ABSENT:
            c.prompt_token_ids = prompt if c.index == 0 else [*prompt]
        if not c.weight_versions and c.token_ids is not ABSENT:
            c.weight_versions = client_spans(len(c.token_ids), admitted, completed)
    return completions


def retokenize(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with the caller's tokenizer (no special tokens added)."""
    encode = getattr(tokenizer, "encode", None)
    if encode is not None:
        try:
            result = encode(text, add_special_tokens=False)
        except TypeError:
            result = encode(text)
    elif callable(tokenizer):
        result = tokenizer(text)
    else:
        raise TypeError("tokenizer must have .encode(text) or be a function of text")
    ids = getattr(result, "ids", result)
    if isinstance(ids, Mapping):
        ids = ids.get("input_ids")
    return [int(t) for t in ids]
