"""Anthropic's Messages API on the wire: requests checked and converted, answers shaped.

Pure functions, no I/O. A Messages request (``POST /v1/messages``: ``system``,
``messages`` of content blocks ``text``, ``tool_use``, ``tool_result``, ``thinking``,
``tools`` with an ``input_schema``, ``max_tokens``...) becomes a `TurnRequest`:

- its render goes to the server's own ``/v1/messages/render`` (vLLM converts it to a chat
  request with its own rules, then renders that);
- its chat form (`to_chat`) follows the same rules as vLLM 0.32's
  ``AnthropicServingMessages.to_chat_completion_request`` (the system blocks joined, a
  ``tool_use`` block a tool call with its input as JSON, a ``tool_result`` a tool
  message, thinking as ``reasoning``); the session matches turns and renders the
  history in that form (`tests/test_chat_dialects.py` checks it against vLLM's own
  converter).

Answers (`message`) and streams (`MessageStream`) have the shapes of vLLM's own
``/v1/messages``; errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}``, the message naming the field.
"""

from __future__ import annotations

import json
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
    "ANTHROPIC_NOOP_FIELDS",
    "ANTHROPIC_PASSED_FIELDS",
    "ANTHROPIC_REFUSED_FIELDS",
    "COUNT_TOKENS_ROUTE",
    "MESSAGES_RENDER_ROUTE",
    "MESSAGES_ROUTE",
    "MessageStream",
    "anthropic_error",
    "anthropic_turn",
    "count_tokens_answer",
    "message",
    "stop_reason",
    "to_chat",
]

MESSAGES_ROUTE = "/v1/messages"
COUNT_TOKENS_ROUTE = "/v1/messages/count_tokens"
MESSAGES_RENDER_ROUTE = "/v1/messages/render"

_OWN = frozenset({"model", "messages", "system", "tools", "stream", "max_tokens"})
#: Fields vLLM's ``AnthropicMessagesRequest`` renders or samples with, passed on.
ANTHROPIC_PASSED_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "tool_choice",
        "thinking",
        "output_config",
        "chat_template_kwargs",
        "cache_salt",
        "watermarking",
        "vllm_xargs",
        "mm_payload",
        "return_mm_kwargs",
    }
)
#: Fields accepted and recorded that change nothing for a locally served policy.
ANTHROPIC_NOOP_FIELDS = frozenset(
    {"metadata", "context_management", "service_tier", "cache_control", "inference_geo"}
)
#: Fields refused, with the reason named in the error.
ANTHROPIC_REFUSED_FIELDS: dict[str, str] = {
    "container": "code-execution containers are not served",
    "mcp_servers": "remote MCP servers are not served",
    "kv_transfer_params": "disaggregated serving is not served through a session",
    "ec_transfer_params": "disaggregated serving is not served through a session",
}
#: Content block types vLLM's converter takes (``tool_reference``, ``tool_addition``
#: and ``tool_removal`` included); any other type is refused, naming the block.
_BLOCKS = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
_ROLES = ("user", "assistant", "system")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        529: "overloaded_error",
    }.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ------------------------------------------------------------------ requests
def _check_block(block: Any, where: str, role: str, tool_ids: set[str]) -> None:
    if not isinstance(block, Mapping):
        raise ChatRequestError(f"{where} must be a content block object", where)
    kind = block.get("type")
    if kind not in _BLOCKS:
        raise ChatRequestError(
            f"{where}.type {kind!r} is not a content block this server renders "
            f"(served: {sorted(_BLOCKS)})",
            f"{where}.type",
        )
    if kind == "text" and not isinstance(block.get("text"), str):
        raise ChatRequestError(f"{where}.text must be a string", f"{where}.text")
    if kind == "thinking" and not isinstance(block.get("thinking"), str):
        raise ChatRequestError(f"{where}.thinking must be a string", f"{where}.thinking")
    if kind == "tool_use":
        if role != "assistant":
            raise ChatRequestError(f"{where}: tool_use blocks belong to assistant turns", where)
        for key in ("id", "name"):
            if not isinstance(block.get(key), str) or not block[key]:
                raise ChatRequestError(
                    f"{where}.{key} must be a non-empty string", f"{where}.{key}"
                )
        if not isinstance(block.get("input", {}), Mapping):
            raise ChatRequestError(f"{where}.input must be an object", f"{where}.input")
        tool_ids.add(block["id"])
    if kind == "tool_result":
        if role != "user":
            raise ChatRequestError(f"{where}: tool_result blocks belong to user turns", where)
        use_id = block.get("tool_use_id")
        if not isinstance(use_id, str):
            raise ChatRequestError(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
        if use_id not in tool_ids:
            raise ChatRequestError(
                f"{where}.tool_use_id {use_id!r} names no tool_use block of an earlier "
                f"assistant turn (known: {sorted(tool_ids)})",
                f"{where}.tool_use_id",
            )
        content = block.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatRequestError(
                f"{where}.content must be a string or a list of blocks", f"{where}.content"
            )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list of messages", "messages")
    tool_ids: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatRequestError(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise ChatRequestError(
                f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role"
            )
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ChatRequestError(
                f"{where}.content must be a string or a list of content blocks, got "
                f"{type(content).__name__}",
                f"{where}.content",
            )
        for j, block in enumerate(content):
            _check_block(block, f"{where}.content[{j}]", str(role), tool_ids)
    return [dict(m) for m in messages]


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    shape = '{"name": str, "description": str, "input_schema": <JSON schema object>}'
    if not isinstance(tools, list):
        raise ChatRequestError(f"tools must be a list of tools: {shape}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatRequestError(f"{where} must be a tool object: {shape}", where)
        if tool.get("type") not in (None, "custom"):
            raise ChatRequestError(
                f"{where}.type {tool.get('type')!r} is a server tool, which this server "
                f"does not run; client tools are {shape}",
                f"{where}.type",
            )
        if not isinstance(tool.get("name"), str) or not isinstance(
            tool.get("input_schema"), Mapping
        ):
            raise ChatRequestError(f"{where} must be {shape}", where)
    return [dict(t) for t in tools]


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise ChatRequestError("system must be a string or a list of text blocks", "system")
    for j, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise ChatRequestError(f"system[{j}] must be a text block", f"system[{j}]")
        if not isinstance(block.get("text"), str):
            raise ChatRequestError(f"system[{j}].text must be a string", f"system[{j}].text")


def anthropic_turn(body: Any, *, count_tokens: bool = False) -> TurnRequest:
    """An Anthropic Messages request (or a ``count_tokens`` one) as a `TurnRequest`.
    Refused and unknown fields raise `ChatRequestError` naming them."""
    if not isinstance(body, Mapping):
        raise ChatRequestError("the request body must be a JSON object")
    model = check_model(body, required=True)
    limit = check_count(body, "max_tokens", least=1)
    if limit is None and not count_tokens:
        raise ChatRequestError("max_tokens is required", "max_tokens")
    stream = body.get("stream", False)
    if stream not in (True, False, None):
        raise ChatRequestError("stream must be a boolean", "stream")
    passed, recorded = check_fields(
        body,
        ANTHROPIC_PASSED_FIELDS,
        ANTHROPIC_NOOP_FIELDS,
        ANTHROPIC_REFUSED_FIELDS,
        _OWN,
        "Anthropic messages",
    )
    stops = passed.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
    ):
        raise ChatRequestError("stop_sequences must be a list of strings", "stop_sequences")
    _check_system(body.get("system"))
    messages = _check_messages(body.get("messages"))
    tools = _check_tools(body.get("tools"))
    render: dict[str, Any] = {
        **passed,
        "model": model,
        "messages": messages,
        "max_tokens": limit or 1,
    }
    if body.get("system") is not None:
        render["system"] = body["system"]
    if tools is not None:
        render["tools"] = tools
    chat_messages, chat_tools, options = to_chat(render)
    return TurnRequest(
        "anthropic",
        MESSAGES_RENDER_ROUTE,
        render,
        chat_messages,
        chat_tools,
        options,
        limit,
        bool(stream),
        recorded,
        dict(body),
        model,
    )


# ------------------------------------------------------------------ to chat form
_BILLING = "x-anthropic-billing-header"


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    parts = [
        b["text"]
        for b in content
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(_BILLING)
    ]
    return "".join(parts) if parts else None


def _tool_result(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = block.get("content")
    text, images, refs = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image":
                images.append(_image_url(item.get("source") or {}))
            elif item.get("type") == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    use_id = block.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": use_id, "content": text}]
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images if u],
            }
        )
    if refs:
        out.append({"role": "tool", "tool_call_id": use_id, "content": refs})
    return out


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _convert(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """vLLM's ``_convert_messages`` for one message (its ``tool_result`` blocks append
    tool messages to ``out`` before the message itself)."""
    role = msg["role"]
    content = msg["content"]
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_tool_result(block))
            else:
                text = str(block.get("content")) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        if len(parts) == 1 and parts[0]["type"] == "text":
            converted["content"] = parts[0]["text"]
        else:
            converted["content"] = parts
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def _tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        schema = dict(tool["input_schema"])
        schema.setdefault("type", "object")
        function: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": schema,
        }
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def to_chat(
    request: Mapping[str, Any], *, merge_inline_system: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """The chat form of a (checked) Messages request: messages, tools and the fields
    that shape the template and the parsing, by vLLM 0.32's rules. ``merge_inline_system``:
    the server's template wants the system prompt first only (vLLM then merges system
    messages inside ``messages`` into it)."""
    messages: list[dict[str, Any]] = []
    system: list[str] = []
    if isinstance(request.get("system"), str) and request["system"]:
        system.append(request["system"])
    elif isinstance(request.get("system"), list):
        system.extend(
            b["text"]
            for b in request["system"]
            if b.get("type") == "text" and b.get("text") and not b["text"].startswith(_BILLING)
        )
    inline = [m for m in request["messages"] if m["role"] == "system"]
    if merge_inline_system:
        system.extend(t for t in (_system_text(m["content"]) for m in inline) if t)
    if system:
        messages.append({"role": "system", "content": "".join(system)})
    for msg in request["messages"]:
        if msg["role"] == "system":
            text = None if merge_inline_system else _system_text(msg["content"])
            if text:
                messages.append({"role": "system", "content": text})
            continue
        _convert(msg, messages)
    options: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "chat_template_kwargs", "cache_salt",
                "vllm_xargs", "watermarking"):  # fmt: skip
        if request.get(key) is not None:
            options[key] = request[key]
    if request.get("stop_sequences"):
        options["stop"] = list(request["stop_sequences"])
    if request.get("max_tokens") is not None:
        options["max_completion_tokens"] = request["max_tokens"]
    thinking = request.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        options["reasoning_effort"] = "none"
    output = request.get("output_config")
    if isinstance(output, Mapping) and output.get("effort") is not None:
        options["reasoning_effort"] = output["effort"]
    choice = request.get("tool_choice")
    tools = _tools(request["tools"]) if request.get("tools") is not None else None
    if isinstance(choice, Mapping):
        options["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        kind = choice.get("type")
        mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        options["tool_choice"] = mapped
    elif tools is not None:
        options["tool_choice"] = "auto"
    return messages, tools, options


# ------------------------------------------------------------------ answers
def stop_reason(
    finish_reason: str | None, stop: int | str | None, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """vLLM's mapping of a finish reason to Anthropic's ``(stop_reason, stop_sequence)``."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message(parts: AnswerParts) -> dict[str, Any]:
    """A Messages answer (vLLM's shape: ``exclude_none``), asyncsync's record under
    ``"asyncsync"``."""
    reason, sequence = stop_reason(
        parts.finish_reason, parts.stop_reason, bool(parts.tool_calls), bool(parts.tool_calls)
    )
    content: list[dict[str, Any]] = []
    if parts.reasoning:
        content.append(
            {"type": "thinking", "thinking": parts.reasoning, "signature": uuid.uuid4().hex}
        )
    if parts.content:
        content.append({"type": "text", "text": parts.content})
    for call_id, name, arguments in parts.tool_calls:
        content.append(
            {"type": "tool_use", "id": call_id, "name": name, "input": _input(arguments)}
        )
    if not content:
        content.append({"type": "text", "text": ""})
    out: dict[str, Any] = {
        "id": parts.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": parts.model,
        "stop_reason": reason,
        "usage": {"input_tokens": parts.prompt_tokens, "output_tokens": parts.completion_tokens},
    }
    if sequence is not None:
        out["stop_sequence"] = sequence
    if parts.extra is not None:
        out["asyncsync"] = parts.extra
    return out


def count_tokens_answer(tokens: int) -> dict[str, Any]:
    return {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}


class MessageStream:
    """A Messages answer streamed as Anthropic's events, in vLLM's shapes:
    ``message_start``; per content block ``content_block_start``, its deltas
    (``text_delta``, ``thinking_delta`` then ``signature_delta``, ``input_json_delta``),
    ``content_block_stop``; ``message_delta`` with the stop reason and usage;
    ``message_stop``."""

    def __init__(self, id: str, model: str) -> None:
        self.id, self.model = id, model
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type
        self._tool = False
        self._arguments: list[str] = []

    def start(self, prompt_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}, "message_start")

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            out += sse(
                {"type": "content_block_delta", "delta": delta, "index": self._index},
                "content_block_delta",
            )
        self._open = None
        return out + sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")

    def _block(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + sse(
            {"type": "content_block_start", "content_block": block, "index": self._index},
            "content_block_start",
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            {"type": "content_block_delta", "delta": delta, "index": self._index},
            "content_block_delta",
        )

    def text(self, text: str) -> bytes:
        out = b"" if self._open == "text" else self._block({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def thinking(self, text: str) -> bytes:
        out = b"" if self._open == "thinking" else self._block({"type": "thinking", "thinking": ""})
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def tool_start(self, call_id: str, name: str) -> bytes:
        self._tool = True
        self._arguments = []
        return self._block({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_arguments(self, text: str) -> bytes:
        self._arguments.append(text)
        return self._delta({"type": "input_json_delta", "partial_json": text})

    def finish(self, parts: AnswerParts, extra: Mapping[str, Any] | None) -> bytes:
        complete = self._tool and _is_json("".join(self._arguments))
        reason, sequence = stop_reason(
            parts.finish_reason or "stop", parts.stop_reason, self._tool, complete
        )
        usage = {"input_tokens": parts.prompt_tokens, "output_tokens": parts.completion_tokens}
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        if extra is not None:
            delta["asyncsync"] = dict(extra)
        return (
            self._close()
            + sse(delta, "message_delta")
            + sse({"type": "message_stop"}, "message_stop")
        )

    def error(self, status: int, message: str) -> bytes:
        return sse(anthropic_error(status, message), "error")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
