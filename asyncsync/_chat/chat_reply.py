"""What a chat turn returns: an OpenAI-shaped chat completion with the exact tokens.

`ChatReply` reads like the ``openai`` SDK's ``ChatCompletion`` (``reply.choices[0].
message.content``, ``.tool_calls[0].function.arguments``, ``.finish_reason``,
``.usage``) and carries what a trainer needs besides: the exact ``token_ids`` sampled,
their ``logprobs`` and ``weight_versions``, the prompt ids, and the turn's
`PrefixReport`. `ChatReply.to_dict` is the OpenAI chat completion the gateway sends,
`ChatReply.to_anthropic` the Anthropic Messages answer, `ChatReply.to_responses` the
OpenAI Responses one; each carries asyncsync's record of the turn under
``"asyncsync"`` (`ChatReply.record`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from asyncsync._chat.prefix import PrefixReport
from asyncsync._core.completion import Completion, WeightVersionSpan
from asyncsync._wire import anthropic as _anthropic
from asyncsync._wire import responses as _responses
from asyncsync._wire.chat import AnswerParts

__all__ = ["ChatChoice", "ChatMessage", "ChatReply", "ChatUsage", "FunctionCall", "ToolCall"]


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """The function a tool call names, with its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant message (parsed by the server's tool parser)."""

    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        function = {"name": self.function.name, "arguments": self.function.arguments}
        return {"id": self.id, "type": self.type, "function": function}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """The assistant's message: text, tool calls, reasoning (when a reasoning parser
    split it off)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None
    role: str = "assistant"

    def to_dict(self) -> dict[str, Any]:
        """The message as an OpenAI chat message (what an agent sends back next turn)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """The one choice of a turn."""

    index: int
    message: ChatMessage
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class ChatUsage:
    """Token counts of a turn (the prompt is the session's whole sequence so far)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One chat turn's answer (see the module docstring).

    Attributes:
        id: the completion's id (the server's request id).
        model: the served model's name.
        created: Unix time of the answer.
        choices: one `ChatChoice`.
        usage: `ChatUsage`.
        completion: the generation behind it (`Completion`: exact ids, logprobs,
            versions, server, latency).
        prefix: how the turn's prompt was built (`PrefixReport`).
        logprobs_response: the OpenAI ``choices[0].logprobs`` object, when the request
            asked for ``logprobs``.
    """

    id: str
    model: str
    created: int
    choices: tuple[ChatChoice, ...]
    usage: ChatUsage
    completion: Completion
    prefix: PrefixReport
    logprobs_response: Mapping[str, Any] | None = None

    @property
    def message(self) -> ChatMessage:
        """``choices[0].message``."""
        return self.choices[0].message

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def token_ids(self) -> list[int]:
        """The sampled ids, exactly (end-of-turn token included)."""
        return self.completion.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        """The ids the policy saw before sampling: the session's sequence so far."""
        return self.completion.prompt_token_ids

    @property
    def logprobs(self) -> list[float]:
        """The logprob of each sampled id (always recorded)."""
        return list(self.completion.logprobs or [])

    @property
    def weight_versions(self) -> tuple[WeightVersionSpan, ...]:
        """Which weights sampled which ids (`WeightVersionSpan` over `token_ids`)."""
        return self.completion.weight_versions

    def record(self) -> dict[str, Any]:
        """asyncsync's record of the turn, as every dialect's answer carries it under
        ``"asyncsync"``: the sampled ids' ``logprobs`` and ``weight_versions``, the
        ``server``, the ``prefix`` report."""
        return {
            "logprobs": self.logprobs,
            "weight_versions": [
                {"version": s.version, "start": s.start, "end": s.end, "source": s.source}
                for s in self.weight_versions
            ],
            "server": self.completion.server,
            "prefix": {
                "status": self.prefix.status,
                "position": self.prefix.position,
                "message": self.prefix.message,
                "reason": self.prefix.reason,
                "bridge_tokens": len(self.prefix.bridge),
            },
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_token_ids),
        }

    def parts(self, *, extra: bool = False) -> AnswerParts:
        """The answer's parts, as the dialects' shapes are built from them."""
        message = self.message
        return AnswerParts(
            id=self.id,
            model=self.model,
            created=self.created,
            content=message.content,
            reasoning=message.reasoning_content,
            tool_calls=[(c.id, c.function.name, c.function.arguments) for c in message.tool_calls],
            finish_reason=self.finish_reason,
            stop_reason=self.completion.stop_reason,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
            extra=self.record() if extra else None,
        )

    def to_anthropic(self) -> dict[str, Any]:
        """The Anthropic Messages answer (vLLM's shape: content blocks ``thinking``,
        ``text``, ``tool_use``; ``stop_reason``; ``usage``), with ``"asyncsync"``."""
        return _anthropic.message(self.parts(extra=True))

    def to_responses(self, request: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The OpenAI Responses answer (vLLM's shape: ``output`` items, ``output_text``,
        ``status``, ``usage``; the request's settings echoed), with ``"asyncsync"``."""
        return _responses.response(self.id, self.parts(extra=True), request or {})

    def with_call_ids(self, ids: Sequence[str | None]) -> ChatReply:
        """The same reply with its tool calls renamed ``ids`` (a streamed turn's, in
        order; None keeps a call's own)."""
        calls = tuple(
            replace(c, id=str(ids[i])) if i < len(ids) and ids[i] else c
            for i, c in enumerate(self.message.tool_calls)
        )
        message = replace(self.message, tool_calls=calls)
        return replace(self, choices=(replace(self.choices[0], message=message),))

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI chat completion JSON, with vLLM's ``prompt_token_ids`` and
        ``choices[0].token_ids``, and asyncsync's extras under ``"asyncsync"``."""
        choice: dict[str, Any] = {
            "index": 0,
            "message": self.message.to_dict(),
            "finish_reason": self.finish_reason,
            "logprobs": dict(self.logprobs_response) if self.logprobs_response else None,
            "token_ids": self.token_ids,
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "total_tokens": self.usage.total_tokens,
            },
            "prompt_token_ids": self.prompt_token_ids,
            "asyncsync": {k: v for k, v in self.record().items() if k != "token_ids"},
        }


def _tool_calls(raw: Any) -> tuple[ToolCall, ...]:
    calls = []
    for i, call in enumerate(raw or ()):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        calls.append(
            ToolCall(
                id=str(call.get("id") or f"call_{i}"),
                function=FunctionCall(
                    str(function.get("name", "")), arguments if isinstance(arguments, str) else "{}"
                ),
                type=str(call.get("type") or "function"),
            )
        )
    return tuple(calls)


def reply_from(
    response: Mapping[str, Any],
    completion: Completion,
    prefix: PrefixReport,
    model: str,
    reply_id: str | None = None,
) -> ChatReply:
    """A `ChatReply` from a chat completion object (derender's, or a plain chat
    answer's) and the completion that produced it."""
    choice = response["choices"][0]
    raw = choice["message"]
    content = raw.get("content")
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    message = ChatMessage(
        content=content if isinstance(content, str) else None,
        tool_calls=_tool_calls(raw.get("tool_calls")),
        reasoning_content=reasoning if isinstance(reasoning, str) else None,
    )
    finish = completion.finish_reason
    if message.tool_calls and finish == "stop":
        finish = "tool_calls"
    logprobs = choice.get("logprobs")
    return ChatReply(
        id=reply_id or str(response.get("id") or completion.request_id or "chatcmpl-asyncsync"),
        model=model,
        created=int(response.get("created") or time.time()),
        choices=(ChatChoice(0, message, finish),),
        usage=ChatUsage(len(completion.prompt_token_ids), len(completion.token_ids)),
        completion=completion,
        prefix=prefix,
        logprobs_response=logprobs if isinstance(logprobs, Mapping) else None,
    )
