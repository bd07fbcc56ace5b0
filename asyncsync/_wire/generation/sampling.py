"""`Sampling`: what a generation samples, one frozen value checked when built, and
`SamplingFields`, the same fields as the flat keywords of ``generate(...)``.

Pure, no I/O. `asyncsync._wire.generation.options` turns a `Sampling` into the request
that is sent.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypedDict, Unpack

__all__ = ["DEFAULT_SAMPLING", "Sampling", "SamplingFields", "nearest", "unknown_keyword"]

#: Keys of a request body the SDK writes itself: never a sampling parameter.
RESERVED = frozenset({"token_ids", "prompt", "stream", "sampling_params", "n"})


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Sampling:
    """What to sample: vLLM's sampling parameters, checked when built.

    ``Sampling(max_tokens=8, temperature=0.0, logprobs=1)``; pass it as
    ``generate(prompt, sampling)`` or give the same fields as keywords
    (``generate(prompt, max_tokens=8, temperature=0.0)``). A field left None is not
    sent: the server's default applies. ``max_tokens=16`` and ``temperature=1.0`` are
    sent unless changed. Immutable and hashable; `replace` makes a changed copy.
    ``logprobs=k`` returns the sampled token's logprob and the top-k candidates by id
    (``k = 0``: only the sampled one). A bad value raises TypeError (wrong type) or
    ValueError (out of vLLM's range) naming the field.

    Attributes:
        max_tokens: most tokens to generate (>= 1), None for the server's limit.
        temperature: >= 0 (0 is greedy).
        top_p: nucleus sampling, in (0, 1].
        top_k: the k most likely tokens (>= 1; 0 or -1: all).
        min_p: in [0, 1].
        logprobs: candidates per sampled token to return (>= 0).
        stop_token_ids: token ids that end the generation.
        seed: the sampling seed of this request.
        ignore_eos: go on past the end-of-sequence token.
        min_tokens: tokens to generate before a stop applies (>= 0, <= max_tokens).
        presence_penalty: in [-2, 2].
        frequency_penalty: in [-2, 2].
        repetition_penalty: > 0 (1 is none).
        stop: a string, or strings, that end the generation (none empty).
        include_stop_str_in_output: keep the stop string in the text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces between special tokens in the text.
        logit_bias: token id to a bias added to its logit.
        allowed_token_ids: only these token ids may be sampled.
        bad_words: words never generated (none empty).
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1, -1: the
            model's limit).
        extra_args: vLLM's ``extra_args`` (for custom logits processors).
        cache_salt: isolates this request's prefix-cache entries (a non-empty str).
        extra_params: any other vLLM sampling parameter, sent as given (not a field
            above, not ``n``, ``prompt``, ``token_ids``, ``stream``, ``sampling_params``).
    """

    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logprobs: int | None = None
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    truncate_prompt_tokens: int | None = None
    extra_args: Mapping[str, Any] | None = None
    cache_salt: str | None = None
    extra_params: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            if value is not None:
                checked = check(name, value)
                if checked is not value:
                    object.__setattr__(self, name, checked)
        low, high = self.min_tokens, self.max_tokens
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_tokens must be <= max_tokens ({high}), got {low!r}")

    def replace(self, **changes: Unpack[SamplingFields]) -> Sampling:
        """A copy with ``changes`` (checked like a new `Sampling`); an unknown name is a
        TypeError naming the nearest field."""
        for name in changes:
            if name not in FIELDS:
                raise unknown_keyword(name, FIELDS, "Sampling.replace")
        return dataclasses.replace(self, **changes)

    def _changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults, by name, in field order."""
        return {
            name: getattr(self, name)
            for name, default in _DEFAULTS.items()
            if getattr(self, name) != default
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._changed().items())
        return f"Sampling({fields})"

    def __hash__(self) -> int:
        return hash(tuple(_frozen(getattr(self, name)) for name in FIELDS))


class SamplingFields(TypedDict, total=False):
    """`Sampling`'s fields as the flat keywords of ``generate(prompt, max_tokens=8, ...)``
    (``**fields: Unpack[SamplingFields]``); each is checked as `Sampling` checks it."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    logprobs: int | None
    stop_token_ids: Sequence[int] | None
    seed: int | None
    ignore_eos: bool | None
    min_tokens: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    stop: str | Sequence[str] | None
    include_stop_str_in_output: bool | None
    skip_special_tokens: bool | None
    spaces_between_special_tokens: bool | None
    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words: Sequence[str] | None
    truncate_prompt_tokens: int | None
    extra_args: Mapping[str, Any] | None
    cache_salt: str | None
    extra_params: Mapping[str, Any] | None


#: `Sampling`'s field names, in order.
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Sampling))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Sampling)}


def nearest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name closest to a misspelt ``name``, None when none is close."""
    found = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_keyword(name: str, valid: Iterable[str], where: str) -> TypeError:
    """The TypeError for an unknown keyword: its name and the nearest valid one."""
    close = nearest(name, valid)
    hint = f"; did you mean {close!r}?" if close else ""
    return TypeError(
        f"{where}() got an unexpected keyword argument {name!r}{hint} (another vLLM "
        "sampling parameter: Sampling(extra_params={...}))"
    )


# ------------------------------------------------------------------------ checks
def _frozen(value: Any) -> Any:
    """``value`` as something hashable (mappings and lists to sorted tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted(((repr(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int, what: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int {what} or None, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int {what} or None, got {value!r}")
    return int(value)


def _number(name: str, value: Any, ok: Callable[[float], bool], what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number {what} or None, got {value!r}")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a number {what} or None, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {value!r}")
    return value


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of token ids (ints) or None, got {value!r}")
    ids = tuple(value)
    for i, tok in enumerate(ids):
        if not _is_int(tok):
            raise TypeError(f"{name}[{i}] is {tok!r}, not an int token id")
        if tok < 0:
            raise ValueError(f"{name}[{i}] = {tok} is negative")
    return ids


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of strings or None, got {value!r}")
    words = tuple(value)
    for i, word in enumerate(words):
        if not isinstance(word, str):
            raise TypeError(f"{name}[{i}] is {word!r}, not a str")
        if not word:
            raise ValueError(f"{name}[{i}] is empty; vLLM refuses an empty string")
    return words


def _stop(name: str, value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} is empty; vLLM refuses an empty string")
        return value
    return _strings(name, value)


def _mapping(name: str, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping or None, got {value!r}")
    return MappingProxyType(dict(value))


def _logit_bias(name: str, value: Any) -> Mapping[int, float]:
    bias = _mapping(name, value)
    out = {}
    for tok, b in bias.items():
        # JSON object keys are strings: "42" is token 42 (as vLLM reads it)
        key = int(tok) if isinstance(tok, str) and tok.isdigit() else tok
        if not _is_int(key) or key < 0:
            raise TypeError(f"{name} key {tok!r} is not a token id (an int >= 0)")
        out[key] = _number(f"{name}[{tok}]", b, lambda _v: True, "(finite)")
    return MappingProxyType(out)


def _str_keys(name: str, value: Any) -> Mapping[str, Any]:
    out = _mapping(name, value)
    for key in out:
        if not isinstance(key, str):
            raise TypeError(f"{name} key {key!r} is not a str")
    return out


def _extra_params(name: str, value: Any) -> Mapping[str, Any]:
    out = _str_keys(name, value)
    for key in out:
        if key in RESERVED:
            raise ValueError(f"{name}: {key!r} cannot be passed as a sampling parameter")
        if key in _CHECKS:
            raise ValueError(f"{name}: {key!r} is a field of Sampling; set it there")
    return out


def _cache_salt(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {value!r}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _truncate(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= 1 or -1 or None, got {value!r}")
    if value < 1 and value != -1:
        raise ValueError(f"{name} must be an int >= 1 or -1 or None, got {value!r}")
    return int(value)


_Check = Callable[[str, Any], Any]
#: Each field's check: it returns the value to store (a read-only or tuple copy of a
#: container) or raises TypeError/ValueError naming the field.
_CHECKS: dict[str, _Check] = {
    "max_tokens": lambda n, v: _int(n, v, 1, ">= 1"),
    "temperature": lambda n, v: _number(n, v, lambda x: x >= 0, ">= 0"),
    "top_p": lambda n, v: _number(n, v, lambda x: 0 < x <= 1, "in (0, 1]"),
    "top_k": lambda n, v: _int(n, v, -1, ">= 1 (0 or -1: all tokens)"),
    "min_p": lambda n, v: _number(n, v, lambda x: 0 <= x <= 1, "in [0, 1]"),
    "logprobs": lambda n, v: _int(n, v, 0, ">= 0"),
    "stop_token_ids": _token_ids,
    "seed": lambda n, v: _int(n, v, -(2**63), "(a seed)"),
    "ignore_eos": _bool,
    "min_tokens": lambda n, v: _int(n, v, 0, ">= 0"),
    "presence_penalty": lambda n, v: _number(n, v, lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "frequency_penalty": lambda n, v: _number(n, v, lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "repetition_penalty": lambda n, v: _number(n, v, lambda x: x > 0, "> 0"),
    "stop": _stop,
    "include_stop_str_in_output": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "logit_bias": _logit_bias,
    "allowed_token_ids": _token_ids,
    "bad_words": _strings,
    "truncate_prompt_tokens": _truncate,
    "extra_args": _str_keys,
    "cache_salt": _cache_salt,
    "extra_params": _extra_params,
}


#: `Sampling()`: the defaults (``max_tokens=16``, ``temperature=1.0``).
DEFAULT_SAMPLING = Sampling()
