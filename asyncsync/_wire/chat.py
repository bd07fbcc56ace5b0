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
- ``POST /v1/messages/render``, ``POST /v1/responses/render``: the same for an
  Anthropic Messages or an OpenAI Responses request, converted by the server's own rules
  (`asyncsync._wire.anthropic`, `asyncsync._wire.responses` hold those dialects).
- (``GET /v1/models``, the served model names and their context length, is planned
  once in `asyncsync._wire.control`: `plan_models`.)

`check_chat_request` validates what a caller (or an HTTP client of the gateway) sends,
naming the offending field the way OpenAI's errors do (``messages[2].role``).
`chat_turn` turns an OpenAI chat request into the dialect-neutral `TurnRequest` every
dialect becomes; `chat_chunk` and `ChunkStream` are the streamed answer's events.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError
from asyncsync._wire.control import Call, Malformed

__all__ = [
    "APIS",
    "CHAT_NOOP_FIELDS",
    "CHAT_PASSED_FIELDS",
    "CHAT_REFUSED_FIELDS",
    "CHAT_ROUTE",
    "DERENDER_ROUTE",
    "RENDER_ROUTE",
    "AnswerParts",
    "Api",
    "ChatAnswer",
    "ChatRequestError",
    "ChunkStream",
    "Rendered",
    "TurnRequest",
    "chat_fallback_body",
    "chat_turn",
    "check_chat_request",
    "check_messages",
    "derender_body",
    "derender_stream_body",
    "plan_chat",
    "plan_derender",
    "plan_derender_stream",
    "plan_render",
    "plan_render_route",
    "render_body",
]

RENDER_ROUTE = "/v1/chat/completions/render"
DERENDER_ROUTE = "/v1/chat/completions/derender"
CHAT_ROUTE = "/v1/chat/completions"

#: The dialects a chat turn can arrive in: OpenAI Chat Completions, OpenAI Responses,
#: Anthropic Messages.
Api = Literal["chat", "responses", "anthropic"]
APIS: tuple[Api, ...] = ("chat", "responses", "anthropic")

#: Roles a chat message may have.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Request fields asyncsync decides itself (a session is one sample; logprobs of
#: sampled tokens are always recorded).
_OWN_FIELDS = frozenset({"messages", "stream", "stream_options", "n", "tools", "model"})
#: Fields of vLLM's ``ChatCompletionRequest`` passed to the server's render as they are
#: (sampling, template and parser options; `tests/test_chat_dialects.py` checks the list
#: against the installed vLLM).
CHAT_PASSED_FIELDS = frozenset(
    {
        "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt",
        "chat_template", "chat_template_kwargs", "documents", "frequency_penalty",
        "ignore_eos", "include_reasoning", "include_stop_str_in_output", "length_penalty",
        "logit_bias", "logprob_token_ids", "logprobs", "max_completion_tokens", "max_tokens",
        "media_io_kwargs", "min_p", "min_tokens", "mm_payload", "mm_processor_kwargs",
        "parallel_tool_calls", "presence_penalty", "priority", "reasoning_effort",
        "repetition_detection", "repetition_penalty", "response_format", "return_mm_kwargs",
        "seed", "skip_special_tokens", "spaces_between_special_tokens", "stop",
        "stop_token_ids", "structured_outputs", "temperature", "thinking_token_budget",
        "tool_choice", "top_k", "top_logprobs", "top_p", "vllm_xargs", "watermarking",
    }
)  # fmt: skip
#: Fields accepted and recorded that change nothing for a locally served policy (the
#: answer always carries the exact ids; the session sets its own request ids).
CHAT_NOOP_FIELDS = frozenset(
    {
        "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
        "prompt_cache_retention", "verbosity", "return_token_ids",
        "return_tokens_as_token_ids", "request_id", "session_id", "stream_interval",
        "return_prompt_text", "return_token_offsets",
    }
)  # fmt: skip
#: Fields refused with the reason, named in the error.
CHAT_REFUSED_FIELDS: dict[str, str] = {
    "add_generation_prompt": "a session renders the generation prompt itself",
    "continue_final_message": "a session turn always samples a new assistant message",
    "echo": "a session turn answers with the sampled message only",
    "use_beam_search": "a session continues one sample",
    "truncate_prompt_tokens": "truncating the prompt would break the session's exact ids",
    "truncation_side": "truncating the prompt would break the session's exact ids",
    "prompt_logprobs": "a session records the sampled tokens' logprobs only",
    "routed_experts_prompt_start": "not served through a session",
    "kv_transfer_params": "disaggregated serving is not served through a session",
    "ec_transfer_params": "disaggregated serving is not served through a session",
    "audio": "audio output cannot be rendered by a text model's template",
    "modalities": "only text output is served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "hosted web search is not served",
    "functions": "the legacy functions field is not served: use tools",
    "function_call": "the legacy function_call field is not served: use tool_choice",
}


class ChatRequestError(AsyncSyncError, ValueError):
    """A chat request that cannot be sent: ``param`` names the field (OpenAI's
    ``error.param``), e.g. ``"messages[2].role"``; ``status`` is the HTTP status the
    gateway answers with (400, or 404 for an unknown model). An `AsyncSyncError`, and a
    ``ValueError`` like every refused argument."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param, self.status))


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A chat turn in whichever dialect it came, made dialect-neutral: what the
    session's renders, graph and derender need.

    Attributes:
        api: the dialect it arrived in.
        render_route: the server's own render route of that dialect.
        render_body: the request for that route (no-op fields left out).
        messages: the conversation in OpenAI chat form (`asyncsync._wire.anthropic` and
            `asyncsync._wire.responses` convert with vLLM's own rules), for the
            session's message graph and the renders of the history.
        tools: its tools in OpenAI chat form, or None.
        options: the other chat-form fields (template and parser options; the chat
            request derender gets).
        max_tokens: the most tokens the turn may sample (None: the context's room).
        stream: whether the answer is streamed.
        recorded: the accepted fields that change nothing, as sent.
        body: the request as received (a Responses answer echoes some of it).
        model: the requested model name.
    """

    api: Api
    render_route: str
    render_body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    options: dict[str, Any]
    max_tokens: int | None
    stream: bool
    recorded: dict[str, Any]
    body: dict[str, Any]
    model: str | None = None

    @property
    def chat(self) -> dict[str, Any]:
        """The chat-form request (for the renders of the history and derender)."""
        return chat_request(self.messages, self.tools, self.options)


class AnswerParts(NamedTuple):
    """What every dialect's answer is built from: the parsed message, the finish and the
    counts (`asyncsync._wire.anthropic` and `asyncsync._wire.responses` shape it)."""

    id: str
    model: str
    created: int
    content: str | None
    reasoning: str | None
    tool_calls: list[tuple[str, str, str]]  # (id, name, arguments as JSON text)
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    extra: dict[str, Any] | None = None


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
    tool calls). A tool result's ``tool_call_id``, when given, must be the id of a tool
    call of an earlier assistant message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatRequestError("messages must be a list of message objects", "messages")
    if not messages:
        raise ChatRequestError("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
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
                f"{where}.content must be a string, a list of parts or null, got "
                f"{type(content).__name__}",
                f"{where}.content",
            )
        if content is None and role != "assistant":
            raise ChatRequestError(
                f"{where}.content is required for role {role!r}", f"{where}.content"
            )
        calls.update(_check_tool_calls(message.get("tool_calls"), where))
        call_id = message.get("tool_call_id")
        if role == "tool" and call_id is not None and call_id not in calls:
            raise ChatRequestError(
                f"{where}.tool_call_id {call_id!r} names no tool call of an earlier "
                f"assistant message (known: {sorted(calls)})",
                f"{where}.tool_call_id",
            )
        out.append(dict(message))
    return out


def _check_tool_calls(calls: Any, where: str) -> list[str]:
    """The ids of the tool calls (checked)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    ids = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatRequestError(
                f'{at}.function.name is missing: a tool call is {{"id": ..., "type": '
                '"function", "function": {"name": ..., "arguments": "<JSON text>"}}',
                f"{at}.function",
            )
        if not isinstance(function.get("arguments", ""), (str, Mapping)):
            raise ChatRequestError(
                f"{at}.function.arguments must be JSON text", f"{at}.function.arguments"
            )
        if isinstance(call.get("id"), str):
            ids.append(call["id"])
    return ids


#: The shape an OpenAI chat tool must have, said in errors about one.
TOOL_SHAPE = (
    '{"type": "function", "function": {"name": str, "description": str, '
    '"parameters": <JSON schema>}}'
)


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError(f"tools must be a list of tool objects: {TOOL_SHAPE}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatRequestError(
                f"tools[{i}].function.name is missing: a tool is {TOOL_SHAPE}", f"tools[{i}]"
            )
    return [dict(t) for t in tools]


def check_fields(
    body: Mapping[str, Any], passed: frozenset[str], noop: frozenset[str],
    refused: Mapping[str, str], own: frozenset[str], api: str,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """A request's fields other than ``own`` split into (passed to the server, accepted
    and recorded); a refused or unknown field raises `ChatRequestError` naming it."""
    passed_on: dict[str, Any] = {}
    recorded: dict[str, Any] = {}
    for key, value in body.items():
        if key in own:
            continue
        if key in passed:
            if value is not None:
                passed_on[key] = value
        elif key in noop:
            recorded[key] = value
        elif key in refused:
            raise ChatRequestError(f"{key} is not served: {refused[key]}", key)
        else:
            raise ChatRequestError(
                f"unknown field {key!r} for {api} (the fields served are listed in docs/agents.md)",
                key,
            )
    return passed_on, recorded


def _check_stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream not in (True, False, None):
        raise ChatRequestError("stream must be a boolean", "stream")
    return bool(stream)


def check_model(body: Mapping[str, Any], *, required: bool = False) -> str | None:
    model = body.get("model")
    if model is None and required:
        raise ChatRequestError("model is required", "model")
    if model is not None and not isinstance(model, str):
        raise ChatRequestError("model must be a string", "model")
    return model


def check_count(body: Mapping[str, Any], key: str, *, least: int = 0) -> int | None:
    value = body.get(key)
    if value is not None and (type(value) is not int or value < least):
        word = "positive" if least == 1 else "non-negative"
        raise ChatRequestError(f"{key} must be a {word} integer, got {value!r}", key)
    return value


def chat_turn(body: Any) -> TurnRequest:
    """An OpenAI chat request body as a `TurnRequest`. ``n`` must be 1 (a session
    continues one sample); refused and unknown fields raise `ChatRequestError`."""
    if not isinstance(body, Mapping):
        raise ChatRequestError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ChatRequestError("n must be 1: a chat session continues one sample", "n")
    stream = _check_stream(body)
    model = check_model(body)
    for key in ("max_tokens", "max_completion_tokens", "top_logprobs"):
        check_count(body, key)
    if body.get("modalities") in (["text"], ("text",)):
        body = {k: v for k, v in body.items() if k != "modalities"}
    options, recorded = check_fields(
        body, CHAT_PASSED_FIELDS, CHAT_NOOP_FIELDS, CHAT_REFUSED_FIELDS, _OWN_FIELDS,
        "OpenAI chat completions",
    )  # fmt: skip
    if isinstance(body.get("stream_options"), Mapping):
        recorded["stream_options"] = body["stream_options"]
    messages = check_messages(body.get("messages"))
    tools = _check_tools(body.get("tools"))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    request = chat_request(messages, tools, {**options, **({"model": model} if model else {})})
    return TurnRequest(
        "chat", RENDER_ROUTE, request, messages, tools, options, limit, stream, recorded,
        dict(body), model,
    )  # fmt: skip


def check_chat_request(
    body: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """An OpenAI chat request body -> (messages, tools, the fields passed on)."""
    turn = chat_turn(body)
    return turn.messages, turn.tools, turn.options


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


def chat_fallback_body(request: Mapping[str, Any], top_logprobs: int | None) -> dict[str, Any]:
    """A plain chat completion asking for the exact ids and each sampled token's
    logprob (``top_logprobs`` candidates besides; None: no logprobs asked)."""
    body = {**request, "stream": False, "n": 1, "return_token_ids": True}
    if top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    return body


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
    return plan_render_route(RENDER_ROUTE)


@functools.cache
def plan_render_route(route: str) -> Call[Rendered]:
    """A render on one of the dialects' render routes (chat, messages, responses)."""
    return Call("render", "POST", route, "control", parse_rendered, "{token_ids, sampling_params}")


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


@dataclass(frozen=True, slots=True)
class DerenderedChunk:
    """A streamed derender's answer: the chat chunk and the state for the next call."""

    chunk: dict[str, Any]
    stream_state: dict[str, Any]


def parse_derendered_chunk(data: Any) -> DerenderedChunk:
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    chunk, state = data.get("chunk"), data.get("stream_state")
    if not isinstance(chunk, dict) or not isinstance(state, dict):
        raise Malformed("expected {chunk, stream_state}")
    if not isinstance(chunk.get("choices"), list):
        raise Malformed("the chunk has no choices")
    return DerenderedChunk(chunk, state)


@functools.cache
def plan_derender_stream() -> Call[DerenderedChunk]:
    return Call(
        "derender_stream", "POST", DERENDER_ROUTE, "control", parse_derendered_chunk,
        "{chunk: a chat completion chunk, stream_state}",
    )  # fmt: skip


def derender_stream_body(
    token_ids: Sequence[int], *, finished: tuple[str, int | str | None] | None,
    request_id: str, state: Mapping[str, Any] | None, request: Mapping[str, Any],
    prompt: Sequence[int], model: str | None,
) -> dict[str, Any]:  # fmt: skip
    """One call of a streamed derender: the sampled ids since the last call as one
    ``/inference/v1/generate`` chunk (``finished``: its finish and stop reasons), the
    state the previous call returned, the chat request and the prompt's tail."""
    choice: dict[str, Any] = {"index": 0, "token_ids": list(token_ids)}
    if finished is not None:
        choice["finish_reason"], choice["stop_reason"] = finished
    body: dict[str, Any] = {
        "stream": True,
        "generate_chunk": {"request_id": request_id, "choices": [choice]},
        "chat_request": dict(request),
        "prompt_token_ids": list(prompt[-DERENDER_PROMPT_TAIL:]),
        "prompt_tokens": len(prompt),
    }
    if state is not None:
        body["stream_state"] = dict(state)
    if model is not None:
        body["model"] = model
    return body


# ------------------------------------------------------------------ streamed answers
def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``event:`` line when named, as Anthropic's and the
    Responses API's streams have)."""
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + _json.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChunkStream:
    """An OpenAI chat completion streamed as ``chat.completion.chunk`` events, in vLLM's
    shapes: the role first, then content and tool-call deltas as they are parsed, the
    finish reason, the usage when asked for, ``[DONE]``."""

    def __init__(self, id: str, model: str, created: int, *, usage: bool) -> None:
        self._head = {"id": id, "object": "chat.completion.chunk", "created": created,
                      "model": model}  # fmt: skip
        self._usage = usage

    def _choice(self, delta: dict[str, Any], **more: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **more}
        return sse({**self._head, "choices": [choice]})

    def start(self, prompt_token_ids: Sequence[int] | None = None) -> bytes:
        body: dict[str, Any] = {
            **self._head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
        }  # fmt: skip
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = list(prompt_token_ids)
        return sse(body)

    def content(self, text: str) -> bytes:
        return self._choice({"content": text})

    def reasoning(self, text: str) -> bytes:
        return self._choice({"reasoning": text})

    def tool_start(self, index: int, call_id: str, name: str) -> bytes:
        call = {"id": call_id, "type": "function", "index": index, "function": {"name": name}}
        return self._choice({"content": None, "tool_calls": [call]})

    def tool_arguments(self, index: int, text: str) -> bytes:
        call = {"index": index, "function": {"arguments": text}}
        return self._choice({"content": None, "tool_calls": [call]})

    def finish(
        self, parts: AnswerParts, token_ids: Sequence[int], extra: Mapping[str, Any] | None
    ) -> bytes:
        last = self._choice(
            {}, finish_reason=parts.finish_reason, stop_reason=parts.stop_reason,
            token_ids=list(token_ids),
        )  # fmt: skip
        if extra is not None:  # asyncsync's record of the turn, on the last choice event
            body = _json.loads(last[len(b"data: ") :])
            last = sse({**body, "asyncsync": dict(extra)})
        out = [last]
        if self._usage:
            total = parts.prompt_tokens + parts.completion_tokens
            usage = {"prompt_tokens": parts.prompt_tokens, "total_tokens": total,
                     "completion_tokens": parts.completion_tokens}  # fmt: skip
            out.append(sse({**self._head, "choices": [], "usage": usage}))
        out.append(SSE_DONE)
        return b"".join(out)

    def error(self, status: int, message: str, kind: str) -> bytes:
        error = {"message": message, "type": kind, "param": None, "code": status}
        return sse({"error": error}) + SSE_DONE
