"""OpenAI's Responses API on the wire: requests checked and converted, answers shaped.

Pure functions, no I/O. A Responses request (``POST /v1/responses``: ``input`` as a
string or a list of items, ``instructions``, function ``tools``, ``function_call`` and
``function_call_output`` items) becomes a `TurnRequest`:

- its render goes to the server's own ``/v1/responses/render``;
- its chat form (`to_chat`) follows vLLM 0.32's ``construct_input_messages`` (the
  instructions a system message, a ``function_call`` item a tool call of the assistant
  message before it, a ``function_call_output`` a tool message), which the session's
  message graph and history renders use (`tests/test_chat_dialects.py` checks it
  against vLLM's own).

``previous_response_id`` is resolved by the session (`expand_previous`): the server's
stateless render refuses it, so the earlier input and output items are put back in
front of the new input. Answers (`response`) and streams (`ResponseStream`) have the
shapes of vLLM's own ``/v1/responses``; errors are OpenAI-shaped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from asyncsync._wire.chat import (
    AnswerParts,
    ChatRequestError,
    TurnRequest,
    check_count,
    check_fields,
    check_model,
    sse,
)

__all__ = [
    "RESPONSES_NOOP_FIELDS",
    "RESPONSES_PASSED_FIELDS",
    "RESPONSES_REFUSED_FIELDS",
    "RESPONSES_RENDER_ROUTE",
    "RESPONSES_ROUTE",
    "ResponseStream",
    "expand_previous",
    "output_items",
    "response",
    "responses_turn",
    "to_chat",
]

RESPONSES_ROUTE = "/v1/responses"
RESPONSES_RENDER_ROUTE = "/v1/responses/render"

_OWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "stream",
        "previous_response_id",
        "truncation",
        "background",
    }
)
#: Fields vLLM's ``ResponsesRequest`` renders or samples with, passed on.
RESPONSES_PASSED_FIELDS = frozenset(
    {
        "tool_choice",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_output_tokens",
        "parallel_tool_calls",
        "reasoning",
        "text",
        "top_logprobs",
        "seed",
        "stop",
        "stop_token_ids",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "chat_template_kwargs",
        "include_reasoning",
        "include_stop_str_in_output",
        "ignore_eos",
        "skip_special_tokens",
        "structured_outputs",
        "cache_salt",
        "priority",
        "vllm_xargs",
        "watermarking",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "mm_payload",
        "return_mm_kwargs",
        "max_tool_calls",
    }
)
#: Fields accepted and recorded that change nothing for a locally served policy.
RESPONSES_NOOP_FIELDS = frozenset(
    {
        "metadata",
        "user",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "include",
        "stream_options",
        "prompt_cache_retention",
        "request_id",
        "session_id",
        "enable_response_messages",
    }
)
#: Fields refused, with the reason named in the error (``truncation: "auto"`` and
#: ``background: true`` too).
RESPONSES_REFUSED_FIELDS: dict[str, str] = {
    "conversation": "server-side conversations are not served: send the items, or "
    "previous_response_id within a session",
    "prompt": "stored prompt templates are not served",
    "previous_input_messages": "vLLM's internal history field is not served",
    "kv_transfer_params": "disaggregated serving is not served through a session",
    "ec_transfer_params": "disaggregated serving is not served through a session",
}
_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TOOL_SHAPE = '{"type": "function", "name": str, "description": str, "parameters": <schema>}'


# ------------------------------------------------------------------ requests
def _check_item(item: Any, where: str, calls: set[str]) -> None:
    if not isinstance(item, Mapping):
        raise ChatRequestError(f"{where} must be an input item object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in _ITEM_TYPES:
        raise ChatRequestError(
            f"{where}.type {kind!r} is not an input item this server renders "
            f"(served: {sorted(_ITEM_TYPES)})",
            f"{where}.type",
        )
    if kind == "message":
        if item.get("role") not in _MESSAGE_ROLES:
            raise ChatRequestError(
                f"{where}.role must be one of {sorted(_MESSAGE_ROLES)}, got {item.get('role')!r}",
                f"{where}.role",
            )
        content = item.get("content")
        if not isinstance(content, (str, list)):
            raise ChatRequestError(
                f"{where}.content must be a string or a list of content parts, got "
                f"{type(content).__name__}",
                f"{where}.content",
            )
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ChatRequestError(
                    f"{where}.content[{j}] must be a content part with a type",
                    f"{where}.content[{j}]",
                )
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ChatRequestError(f"{where}.{key} must be a string", f"{where}.{key}")
        calls.add(item["call_id"])
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise ChatRequestError(f"{where}.call_id must be a string", f"{where}.call_id")
        if call_id not in calls:
            raise ChatRequestError(
                f"{where}.call_id {call_id!r} names no function_call item before it "
                f"(known: {sorted(calls)})",
                f"{where}.call_id",
            )
        if not isinstance(item.get("output"), (str, list)):
            raise ChatRequestError(
                f"{where}.output must be a string or a list of content parts", f"{where}.output"
            )
    elif kind == "reasoning" and item.get("encrypted_content"):
        raise ChatRequestError(
            f"{where}.encrypted_content: encrypted reasoning is not served",
            f"{where}.encrypted_content",
        )


def _check_input(value: Any) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise ChatRequestError("input must not be empty", "input")
        return value
    if not isinstance(value, list) or not value:
        raise ChatRequestError("input must be a string or a non-empty list of items", "input")
    calls: set[str] = set()
    for i, item in enumerate(value):
        _check_item(item, f"input[{i}]", calls)
    return [dict(item) for item in value]


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError(f"tools must be a list of tools: {_TOOL_SHAPE}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatRequestError(f"{where} must be a tool object: {_TOOL_SHAPE}", where)
        if tool.get("type") != "function":
            raise ChatRequestError(
                f"{where}.type {tool.get('type')!r} is a hosted tool, which this server "
                f"does not run; function tools are {_TOOL_SHAPE}",
                f"{where}.type",
            )
        if not isinstance(tool.get("name"), str):
            raise ChatRequestError(f"{where}.name is missing: a tool is {_TOOL_SHAPE}", where)
    return [dict(t) for t in tools]


def responses_turn(body: Any) -> TurnRequest:
    """A Responses request as a `TurnRequest` (``previous_response_id`` already
    expanded by the caller: `expand_previous`). Refused and unknown fields raise
    `ChatRequestError` naming them."""
    if not isinstance(body, Mapping):
        raise ChatRequestError("the request body must be a JSON object")
    model = check_model(body)
    limit = check_count(body, "max_output_tokens", least=1)
    check_count(body, "top_logprobs")
    stream = body.get("stream", False)
    if stream not in (True, False, None):
        raise ChatRequestError("stream must be a boolean", "stream")
    if body.get("truncation") not in (None, "disabled"):
        raise ChatRequestError(
            "truncation must be 'disabled': a truncated prompt breaks the session's exact ids",
            "truncation",
        )
    if body.get("background"):
        raise ChatRequestError("background responses are not served", "background")
    passed, recorded = check_fields(
        body,
        RESPONSES_PASSED_FIELDS,
        RESPONSES_NOOP_FIELDS,
        RESPONSES_REFUSED_FIELDS,
        _OWN,
        "OpenAI responses",
    )
    for key in ("truncation", "background"):
        if key in body:
            recorded[key] = body[key]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatRequestError("instructions must be a string", "instructions")
    items = _check_input(body.get("input"))
    tools = _check_tools(body.get("tools"))
    render: dict[str, Any] = {**passed, "input": items}
    if model is not None:
        render["model"] = model
    if instructions is not None:
        render["instructions"] = instructions
    if tools is not None:
        render["tools"] = tools
    messages, chat_tools, options = to_chat(render)
    return TurnRequest(
        "responses",
        RESPONSES_RENDER_ROUTE,
        render,
        messages,
        chat_tools,
        options,
        limit,
        bool(stream),
        recorded,
        dict(body),
        model,
    )


def expand_previous(
    body: Mapping[str, Any], previous: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """``body`` with ``previous_response_id`` replaced by ``previous``, the earlier
    turn's input items and output items put in front of this input (OpenAI's rule:
    the earlier instructions do not carry over)."""
    new = body.get("input")
    items = [{"role": "user", "content": new}] if isinstance(new, str) else list(new or [])
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    out["input"] = [*[dict(i) for i in previous], *items]
    return out


# ------------------------------------------------------------------ to chat form
def _text_of(item: Mapping[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _is_output_message(item: Mapping[str, Any]) -> bool:
    """An assistant message item, as vLLM reads it (an output message, or an input
    message with the assistant role)."""
    return item.get("role") == "assistant" and item.get("type", "message") == "message"


def _message(item: Mapping[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``_construct_message_from_response_item``: a new chat message, or None
    when ``prev`` (the previous assistant message) took the item in."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {
            "id": item["call_id"],
            "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function",
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", [])
            if assistant["tool_calls"] is None:
                assistant["tool_calls"] = []
            assistant["tool_calls"].append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        content, summary = item.get("content") or [], item.get("summary") or []
        text = ""
        if content:
            text = content[0].get("text", "")
        elif summary:
            text = summary[0].get("text", "")
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if _is_output_message(item):
        said = _text_of(item)
        if said is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = said
                return None
            return {"role": "assistant", "content": said}
    return dict(item)


def to_chat(
    request: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """The chat form of a (checked, expanded) Responses request, by vLLM 0.32's rules:
    messages, function tools, and the fields that shape the template and parsing."""
    messages: list[dict[str, Any]] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": request["instructions"]})
    value = request["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    else:
        built: list[dict[str, Any]] = []
        for item in value:
            message = _message(item, built[-1] if built else None)
            if message is not None:
                built.append(message)
        messages.extend(built)
    tools = None
    if request.get("tools") is not None:
        tools = []
        for tool in request["tools"]:
            function = {
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
            }
            if tool.get("strict") is not None:
                function["strict"] = tool["strict"]
            tools.append({"type": "function", "function": function})
    options: dict[str, Any] = {}
    choice = request.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        options["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        options["tool_choice"] = choice
    for key in (
        "parallel_tool_calls", "chat_template_kwargs", "include_reasoning", "temperature",
        "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "cache_salt",
        "vllm_xargs", "structured_outputs", "skip_special_tokens", "include_stop_str_in_output",
    ):  # fmt: skip
        if request.get(key) is not None:
            options[key] = request[key]
    if request.get("max_output_tokens") is not None:
        options["max_completion_tokens"] = request["max_output_tokens"]
    if request.get("top_logprobs"):
        options["logprobs"], options["top_logprobs"] = True, request["top_logprobs"]
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        options["reasoning_effort"] = reasoning["effort"]
    return messages, tools, options


# ------------------------------------------------------------------ answers
def _hex() -> str:
    return uuid.uuid4().hex[:16]


def output_items(parts: AnswerParts, ids: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The ``output`` items of an answer (reasoning, the message, function calls), in
    vLLM's shapes; ``ids``: item ids already streamed, by kind (``"reasoning"``,
    ``"message"``, ``"call:<call id>"``)."""
    ids = ids or {}
    out: list[dict[str, Any]] = []
    if parts.reasoning:
        out.append(
            {
                "id": ids.get("reasoning", f"rs_{_hex()}"),
                "summary": [],
                "type": "reasoning",
                "status": None,
                "content": [{"text": parts.reasoning, "type": "reasoning_text"}],
            }
        )
    if parts.content:
        out.append(_message_item(ids.get("message", f"msg_{_hex()}"), parts.content, "completed"))
    for call_id, name, arguments in parts.tool_calls:
        out.append(
            _call_item(
                ids.get(f"call:{call_id}", f"fc_{_hex()}"), call_id, name, arguments, "completed"
            )
        )
    return out


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, None)]
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _text_part(text: str, logprobs: Any) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "status": status,
    }


def _usage(parts: AnswerParts) -> dict[str, Any]:
    return {
        "input_tokens": parts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": parts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": parts.prompt_tokens + parts.completion_tokens,
    }


def response(
    response_id: str,
    parts: AnswerParts | None,
    request: Mapping[str, Any],
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A Responses answer in vLLM's shape: ``output`` items (`output_items`), the
    request's settings echoed, ``status`` (``"incomplete"`` when the sample hit its
    limit), ``usage``; ``parts`` None: the object of a stream's first events."""
    finished = parts is not None
    incomplete = finished and parts is not None and parts.finish_reason == "length"
    out: dict[str, Any] = {
        "id": response_id,
        "created_at": parts.created if parts is not None else int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": parts.model if parts is not None else request.get("model"),
        "object": "response",
        "output": output if output is not None else (output_items(parts) if parts else []),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": list(request.get("tools") or []),
        "top_p": request.get("top_p"),
        "background": False,
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "reasoning": request.get("reasoning"),
        "service_tier": "auto",
        "status": ("incomplete" if incomplete else "completed") if finished else "in_progress",
        "text": request.get("text"),
        "top_logprobs": request.get("top_logprobs"),
        "truncation": "disabled",
        "usage": _usage(parts) if parts is not None else None,
        "user": request.get("user"),
    }
    if parts is not None:
        texts = [
            p["text"]
            for item in out["output"]
            if item["type"] == "message"
            for p in item["content"]
            if p.get("type") == "output_text"
        ]
        out["output_text"] = "".join(texts)
        if parts.extra is not None:
            out["asyncsync"] = parts.extra
    return out


class ResponseStream:
    """A Responses answer streamed as the Responses API's events, in vLLM's shapes:
    ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added``, its deltas (``response.output_text.delta`` inside a
    content part, ``response.function_call_arguments.delta``,
    ``response.reasoning_text.delta``) and their ``.done``, ``response.output_item.done``;
    ``response.completed``. Every event has its ``sequence_number``."""

    def __init__(self, response_id: str, request: Mapping[str, Any]) -> None:
        self.id = response_id
        self._request = request
        self._seq = 0
        self._index = -1  # the open item's output index
        self._open: dict[str, Any] | None = None  # the open item (its text so far inside)
        self._text: list[str] = []
        self.ids: dict[str, str] = {}  # item ids by kind, for the final output

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {**fields, "sequence_number": self._seq, "type": kind}
        self._seq += 1
        return sse(body, kind)

    def start(self) -> bytes:
        head = response(self.id, None, self._request)
        return self._event("response.created", response=head) + self._event(
            "response.in_progress", response=head
        )

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        text = "".join(self._text)
        at = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "message":
            part = _text_part(text, None)
            done = {**item, "status": "completed", "content": [part]}
            return (
                self._event(
                    "response.output_text.done", content_index=0, logprobs=[], text=text, **at
                )
                + self._event("response.content_part.done", content_index=0, part=part, **at)
                + self._event("response.output_item.done", item=done, output_index=self._index)
            )
        if item["type"] == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            return self._event(
                "response.function_call_arguments.done", arguments=text, name=item["name"], **at
            ) + self._event("response.output_item.done", item=done, output_index=self._index)
        content = [{"text": text, "type": "reasoning_text"}]
        done = {**item, "content": content}
        return self._event(
            "response.reasoning_text.done", content_index=0, text=text, **at
        ) + self._event("response.output_item.done", item=done, output_index=self._index)

    def _item(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open, self._text = item, []
        return out + self._event("response.output_item.added", item=item, output_index=self._index)

    def text(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open["type"] != "message":
            item_id = self.ids.setdefault("message", f"msg_{_hex()}")
            out = self._item(_message_item(item_id, None, "in_progress"))
            out += self._event(
                "response.content_part.added",
                content_index=0,
                item_id=item_id,
                output_index=self._index,
                part={**_text_part("", []), "logprobs": []},
            )
        self._text.append(text)
        assert self._open is not None
        return out + self._event(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self._open["id"],
            logprobs=[],
            output_index=self._index,
        )

    def reasoning(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open["type"] != "reasoning":
            item_id = self.ids.setdefault("reasoning", f"rs_{_hex()}")
            out = self._item(
                {"id": item_id, "summary": [], "type": "reasoning", "content": [], "status": None}
            )
        self._text.append(text)
        assert self._open is not None
        return out + self._event(
            "response.reasoning_text.delta",
            content_index=0,
            delta=text,
            item_id=self._open["id"],
            output_index=self._index,
        )

    def tool_start(self, call_id: str, name: str) -> bytes:
        item_id = self.ids.setdefault(f"call:{call_id}", f"fc_{_hex()}")
        return self._item(_call_item(item_id, call_id, name, "", "in_progress"))

    def tool_arguments(self, text: str) -> bytes:
        assert self._open is not None
        self._text.append(text)
        return self._event(
            "response.function_call_arguments.delta",
            delta=text,
            item_id=self._open["id"],
            output_index=self._index,
        )

    def finish(self, parts: AnswerParts) -> bytes:
        out = self._close()
        final = response(self.id, parts, self._request, output_items(parts, self.ids))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=final)

    def error(self, status: int, message: str) -> bytes:
        return self._event("error", code=str(status), message=message, param=None)
