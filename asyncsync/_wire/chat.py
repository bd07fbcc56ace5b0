"""vLLM's chat routes on the wire: render, derender, plain chat completions, models.

Pure functions and small records, no I/O:

- ``POST /v1/chat/completions/render`` (vLLM >= 0.27; 0.30+ with ``--enable-scale-out``,
  else 403): a chat request -> the prompt ids the server's own template renders, and
  the sampling parameters the server would use (`Rendered`).
- ``POST /v1/chat/completions/derender``: exact output ids -> an OpenAI chat message,
  tool calls parsed by the server's ``--tool-call-parser`` (the chat request given to
  render must come along when a parser is configured).
- ``POST /v1/chat/completions`` with ``return_token_ids``: the fallback for servers
  without scale-out (`ChatAnswer`: prompt ids, sampled ids, logprobs, the message).
- ``GET /v1/models``: the served model names and their context length (`ModelEntry`).

`check_chat_request` validates what a caller (or an HTTP client of the gateway) sends,
naming the offending field the way OpenAI's errors do (``messages[2].role``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError
from asyncsync._wire.control import Call, Malformed, ModelEntry, parse_model_entries

__all__ = [
    "CHAT_ROUTE",
    "DERENDER_ROUTE",
    "MODELS_ROUTE",
    "RENDER_ROUTE",
    "ChatAnswer",
    "ChatRequestError",
    "Rendered",
    "chat_fallback_body",
    "check_chat_request",
    "check_messages",
    "derender_body",
    "plan_chat",
    "plan_derender",
    "plan_models",
    "plan_render",
    "render_body",
]

RENDER_ROUTE = "/v1/chat/completions/render"
DERENDER_ROUTE = "/v1/chat/completions/derender"
CHAT_ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"

#: Roles a chat message may have.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Request fields asyncsync decides itself (a session is one sample, not streamed
#: from the server; logprobs of sampled tokens are always recorded).
_OWN_FIELDS = frozenset({"messages", "stream", "stream_options", "n", "tools"})


class ChatRequestError(AsyncSyncError, ValueError):
    """A chat request that cannot be sent: ``param`` names the field (OpenAI's
    ``error.param``), e.g. ``"messages[2].role"``. An `AsyncSyncError`, and a
    ``ValueError`` like every refused argument."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param))


@dataclass(frozen=True, slots=True)
class Rendered:
    """What render answered: the prompt ids and the server's sampling parameters."""

    token_ids: list[int]
    sampling_params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """A plain ``/v1/chat/completions`` answer with ``return_token_ids``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    response: dict[str, Any]


# ------------------------------------------------------------------ validation
def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of message dicts; `ChatRequestError` naming the first bad
    one. Content is a string, a list of content parts, or None (an assistant turn with
    tool calls)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatRequestError("messages must be a list of message objects", "messages")
    if not messages:
        raise ChatRequestError("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatRequestError(f"{where} is not an object", where)
        role = message.get("role")
        if role not in _ROLES:
            raise ChatRequestError(
                f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", f"{where}.role"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatRequestError(
                f"{where}.content must be a string, a list of parts or null", f"{where}.content"
            )
        if content is None and role != "assistant":
            raise ChatRequestError(f"{where}.content is required for role {role!r}", where)
        _check_tool_calls(message.get("tool_calls"), where)
        out.append(dict(message))
    return out


def _check_tool_calls(calls: Any, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatRequestError(f"{at}.function.name is missing", f"{at}.function")
        if not isinstance(function.get("arguments", ""), (str, Mapping)):
            raise ChatRequestError(f"{at}.function.arguments is not a string", at)


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list of tool objects", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatRequestError(f"tools[{i}].function.name is missing", f"tools[{i}]")
    return [dict(t) for t in tools]


def check_chat_request(
    body: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """An OpenAI chat request body -> (messages, tools, the other fields). ``n`` must
    be 1 (a session continues one sample); ``stream`` is the caller's business and is
    left out of the fields passed on."""
    if not isinstance(body, Mapping):
        raise ChatRequestError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ChatRequestError("n must be 1: a chat session continues one sample", "n")
    stream = body.get("stream", False)
    if stream not in (True, False, None):
        raise ChatRequestError("stream must be a boolean", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ChatRequestError("model must be a string", "model")
    for key in ("max_tokens", "max_completion_tokens", "top_logprobs"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ChatRequestError(f"{key} must be a non-negative integer", key)
    messages = check_messages(body.get("messages"))
    tools = _check_tools(body.get("tools"))
    options = {k: v for k, v in body.items() if k not in _OWN_FIELDS}
    return messages, tools, options


# ------------------------------------------------------------------ bodies
def chat_request(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    options: Mapping[str, Any],
    *,
    add_generation_prompt: bool = True,
) -> dict[str, Any]:
    """The chat request sent to render (and carried to derender)."""
    body: dict[str, Any] = {**options, "messages": list(messages)}
    if tools:
        body["tools"] = list(tools)
    if not add_generation_prompt:
        body["add_generation_prompt"] = False
    return body


def render_body(request: Mapping[str, Any]) -> dict[str, Any]:
    return dict(request)


def generate_response_of(completion: Completion, *, want_logprobs: bool = True) -> dict[str, Any]:
    """The ``GenerateTokensResponse`` that derender takes, from a completion (its exact
    ids; with ``want_logprobs``, the recorded logprobs, which derender decodes token by
    token into OpenAI's shape). The id a sample stopped on (end of sequence, or a
    stop id) is left out: vLLM's own chat completions leave its text out of the message
    (derender would decode it into the content); the recorded ids keep it."""
    ids, tops = list(completion.token_ids), completion.top_logprobs
    logprobs = completion.logprobs if want_logprobs else None
    stopped = completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
    if stopped and ids:
        ids = ids[:-1]
        logprobs = None if logprobs is None else logprobs[: len(ids)]
        tops = None if tops is None else tops[: len(ids)]
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": completion.finish_reason or "stop",
        "stop_reason": completion.stop_reason,
        "token_ids": ids,
    }
    if logprobs is not None:
        tops = tops or [{} for _ in logprobs]
        choice["logprobs"] = {
            "content": [
                {
                    **_logprob_entry(tok, lp),
                    "top_logprobs": [_logprob_entry(t, v) for t, v in top.items()],
                }
                for tok, lp, top in zip(ids, logprobs, tops, strict=True)
            ]
        }
    return {"request_id": completion.request_id or "chatcmpl-asyncsync", "choices": [choice]}


def _logprob_entry(token_id: int, logprob: float) -> dict[str, Any]:
    """One logprob of a derender body in both vLLM generations' shapes: 0.32 reads the
    integer ``token_id``; 0.27.1 requires ``token``, which it resolves from its
    ``"token_id:N"`` placeholder. Each ignores the other's field."""
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": logprob}


#: Prompt ids a derender gets: the tail its detokenizer is seeded from (vLLM reads the
#: last ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2`` = 7), with room to spare.
DERENDER_PROMPT_TAIL = 16


def derender_body(
    completion: Completion, request: Mapping[str, Any], model: str | None
) -> dict[str, Any]:
    """A non-streaming derender of ``completion`` (generated for ``request``).

    Of the prompt only its last `DERENDER_PROMPT_TAIL` ids go along: derender reads
    them to seed its detokenizer (the first sampled token's leading space), and vLLM
    reads the last 7 (``convert_prompt_ids_to_tokens``); the whole prompt, re-sent and
    validated on every turn, grows with the conversation. ``prompt_tokens`` keeps the
    whole count for ``usage``. The sampled tokens' logprobs go along only when the
    request asked for them (``logprobs``): derender decodes every one into OpenAI's
    shape, server CPU per token that a reply without them does not need (the session
    records them from the completion either way)."""
    prompt = completion.prompt_token_ids
    asked = bool(request.get("logprobs"))
    body: dict[str, Any] = {
        "generate_response": generate_response_of(completion, want_logprobs=asked),
        "prompt_token_ids": list(prompt[-DERENDER_PROMPT_TAIL:]),
        "prompt_tokens": len(prompt),
        "chat_request": dict(request),
    }
    if model is not None:
        body["model"] = model
    return body


def chat_fallback_body(request: Mapping[str, Any], top_logprobs: int) -> dict[str, Any]:
    """A plain chat completion asking for the exact ids and each sampled token's
    logprob (``top_logprobs`` candidates besides)."""
    return {
        **request,
        "stream": False,
        "n": 1,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": top_logprobs,
    }


# ------------------------------------------------------------------ parsers
def _ids(value: Any, what: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(type(t) is int and t >= 0 for t in value)
    ):
        raise Malformed(f"{what} is not a non-empty list of token ids")
    return value


def parse_rendered(data: Any) -> Rendered:
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    params = data.get("sampling_params")
    if not isinstance(params, dict):
        raise Malformed("sampling_params missing")
    return Rendered(_ids(data.get("token_ids"), "token_ids"), params)


def parse_chat_response(data: Any) -> dict[str, Any]:
    """A chat completion object (derender's answer): one choice with a message."""
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise Malformed("expected one choice")
    message = choices[0].get("message")
    if not isinstance(message, dict) or message.get("role") != "assistant":
        raise Malformed("the choice has no assistant message")
    return data


def parse_chat_answer(data: Any) -> ChatAnswer:
    response = parse_chat_response(data)
    choice = response["choices"][0]
    prompt = _ids(response.get("prompt_token_ids"), "prompt_token_ids")
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise Malformed("the choice has no token_ids (return_token_ids unsupported?)")
    content = (choice.get("logprobs") or {}).get("content")
    logprobs: list[float] | None = None
    if isinstance(content, list) and len(content) == len(ids):
        logprobs = [float(entry["logprob"]) for entry in content]
    return ChatAnswer(prompt, ids, logprobs, response)


@functools.cache
def plan_render() -> Call[Rendered]:
    return Call(
        "render", "POST", RENDER_ROUTE, "control", parse_rendered, "{token_ids, sampling_params}"
    )


@functools.cache
def plan_derender() -> Call[dict[str, Any]]:
    return Call(
        "derender", "POST", DERENDER_ROUTE, "control", parse_chat_response,
        "a chat completion with one choice",
    )  # fmt: skip


@functools.cache
def plan_chat() -> Call[ChatAnswer]:
    return Call(
        "chat", "POST", CHAT_ROUTE, "generate", parse_chat_answer,
        "a chat completion with prompt_token_ids and token_ids",
    )  # fmt: skip


@functools.cache
def plan_models() -> Call[list[ModelEntry]]:
    return Call(
        "models", "GET", MODELS_ROUTE, "control", parse_model_entries, "{data: [models]}",
        idempotent=True,
    )  # fmt: skip
