"""The fake's chat model: a byte-level tokenizer with ChatML's two special tokens, the
ChatML template with hermes tool calls (the same layout as the tiny chat model's
`asyncsync.testing._chat.CHAT_TEMPLATE`), vLLM's hermes tool parser, and a language
model that follows a policy: a function from the conversation so far to the assistant's
next reply.

- `ChatTokenizer`: ids 0-255 are bytes, 256 is ``<|im_start|>``, 257 ``<|im_end|>``
  (the end of a turn and of a sample).
- `render_chat`: messages (and tools) -> ChatML text, as vLLM renders a chat request
  with a Jinja template: assistant tool calls' JSON arguments re-rendered as objects
  (``{"city": "Paris"}`` however they were sampled), content parts joined.
- `parse_hermes` / `HermesStream`: vLLM's hermes parser, whole and streamed.
- `ChatLM`: a `FakeLM` whose most likely token is the next one of the policy's reply
  (then ``<|im_end|>``), with probability ``greedy_prob``; every logprob is in closed form.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from asyncsync.testing._fake._lm import FakeLM

__all__ = [
    "CHAT_GREEDY_PROB",
    "IM_END",
    "IM_START",
    "ChatLM",
    "ChatPolicy",
    "ChatTokenizer",
    "HermesStream",
    "parse_hermes",
    "render_chat",
    "scripted",
    "tool_call",
]

IM_START, IM_END = 256, 257
_SPECIAL = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPECIAL_TEXT = {v: k for k, v in _SPECIAL.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in _SPECIAL) + ")")

#: The conversation a policy sees: ``{"role", "content"}`` per ChatML block of the
#: prompt (a tool's result is inside a user block, as the template renders it).
ChatPolicy = Callable[[list[dict[str, str]]], str]


def tool_call(name: str, /, **arguments: Any) -> str:
    """The hermes text of one tool call, as a policy's reply: ``<tool_call>\\n{"name":
    ..., "arguments": {...}}\\n</tool_call>`` (the arguments as compact JSON, as models
    often sample them)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


def scripted(*replies: str) -> ChatPolicy:
    """A policy that answers the ``k``-th assistant turn of a conversation with
    ``replies[k]`` (the last one once they run out)::

        FakeVLLMServer(chat=scripted(tool_call("get_weather", city="Paris"), "Sunny."))
    """
    if not replies:
        raise ValueError("scripted() needs at least one reply")

    def policy(conversation: list[dict[str, str]]) -> str:
        turn = sum(1 for m in conversation if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return policy


class ChatTokenizer:
    """Bytes as ids 0-255, ``<|im_start|>`` 256, ``<|im_end|>`` 257."""

    eos_token_id = IM_END

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPLIT.split(text):
            if piece in _SPECIAL:
                ids.append(_SPECIAL[piece])
            elif piece:
                ids.extend(piece.encode())
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included; an incomplete UTF-8 tail is left
        out (it is decoded once its last byte arrives)."""
        out: list[str] = []
        pending = bytearray()
        for t in ids:
            if t in _SPECIAL_TEXT:
                out.append(pending.decode(errors="replace"))
                pending.clear()
                out.append(_SPECIAL_TEXT[t])
            elif 0 <= t < 256:
                pending.append(t)
        out.append(_complete_utf8(bytes(pending)))
        return "".join(out)


def _complete_utf8(data: bytes) -> str:
    """``data`` decoded, less an incomplete multi-byte character at its end."""
    for cut in range(min(3, len(data)), 0, -1):
        try:
            return data[: len(data) - cut].decode() if _partial(data[-cut:]) else data.decode()
        except UnicodeDecodeError:
            continue
    return data.decode(errors="replace")


def _partial(tail: bytes) -> bool:
    """Whether ``tail`` is the start of a multi-byte character cut short."""
    lead = tail[0]
    need = (
        2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    )
    return need > len(tail)


# ------------------------------------------------------------------ the template
def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return str(content)


def _arguments(raw: Any) -> str:
    """How the template renders a tool call's arguments: vLLM parses JSON text into an
    object before rendering, and the template writes the object with ``tojson``."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(raw, ensure_ascii=False)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The ChatML text of a chat request (the tiny chat model's template)."""
    out: list[str] = []
    first = messages[0] if messages else {}
    if tools:
        out.append("<|im_start|>system\n")
        if first.get("role") == "system":
            out.append(_text(first.get("content")) + "\n\n")
        out.append("# Tools\n<tools>")
        out.extend("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
        out.append(
            '\n</tools>\nCall one with <tool_call>\n{"name": ..., "arguments": ...}'
            "\n</tool_call><|im_end|>\n"
        )
    elif first.get("role") == "system":
        out.append("<|im_start|>system\n" + _text(first.get("content")) + "<|im_end|>\n")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "system" and i == 0:
            continue
        if role in ("user", "system", "developer"):
            out.append(f"<|im_start|>{role}\n{_text(message.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            out.append("<|im_start|>assistant")
            if message.get("content"):
                out.append("\n" + _text(message.get("content")))
            for call in message.get("tool_calls") or ():
                f = call.get("function", call)
                out.append(
                    f'\n<tool_call>\n{{"name": "{f.get("name")}", "arguments": '
                    f"{_arguments(f.get('arguments'))}}}\n</tool_call>"
                )
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{_text(message.get('content'))}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def conversation_of(text: str) -> list[dict[str, str]]:
    """The ChatML blocks of a rendered prompt as ``{"role", "content"}``."""
    blocks = []
    for block in text.split("<|im_start|>")[1:]:
        head, _, rest = block.partition("\n")
        blocks.append({"role": head, "content": rest.split("<|im_end|>")[0]})
    return blocks


# ------------------------------------------------------------------ hermes
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def call_id() -> str:
    """vLLM's ``make_tool_call_id``: ``chatcmpl-tool-`` and 16 hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """vLLM's hermes parser on a whole output: (content, tool calls). Content is the
    text before the first ``<tool_call>`` (None when empty); a call's arguments are
    re-serialized JSON; a call that is not JSON leaves the whole text as content."""
    if "<tool_call>" not in text:
        return text, []
    try:
        raw = [json.loads(a or b) for a, b in _CALL.findall(text)]
        calls = [
            {
                "id": call_id(),
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                },
            }
            for c in raw
        ]
    except (ValueError, KeyError, TypeError):
        return text, []
    content = text[: text.find("<tool_call>")]
    return content or None, calls


def _overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HermesStream:
    """vLLM's streaming hermes parser: fed the whole text so far, it returns what is new
    since the last call: content (holding back a possible partial ``<tool_call>``), a
    tool call's name once complete, its argument text as it grows."""

    def __init__(self) -> None:
        self.sent_content = 0
        self.calls: list[dict[str, Any]] = []  # {"name", "arguments" (sent), "id"}

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta message (``content`` and/or ``tool_calls``), or None."""
        if "<tool_call>" in text:
            sendable = text.index("<tool_call>")
        else:
            sendable = len(text) - _overlap(text, "<tool_call>")
        content = None
        if sendable > self.sent_content:
            content = text[self.sent_content : sendable]
            self.sent_content = sendable
        deltas: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(_regions(text)):
            if i >= len(self.calls):
                self.calls.append({"arguments": ""})
            call = self.calls[i]
            if "name" not in call:
                match = re.search(r'"name"\s*:\s*"([^"]+)"', body)
                if not match:
                    break
                call["name"], call["id"] = match.group(1), call_id()
                deltas.append(
                    {"id": call["id"], "type": "function", "index": i,
                     "function": {"name": call["name"]}}
                )  # fmt: skip
            args = _arguments_of(body, complete)
            if args is not None and len(args) > len(call["arguments"]):
                deltas.append(
                    {"index": i, "function": {"arguments": args[len(call["arguments"]) :]}}
                )
                call["arguments"] = args
        if content or deltas:
            out: dict[str, Any] = {"content": content}
            if deltas:
                out["tool_calls"] = deltas
            return out
        return None


def _regions(text: str) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    pos = 0
    while True:
        start = text.find("<tool_call>", pos)
        if start == -1:
            return out
        body_start = start + len("<tool_call>")
        end = text.find("</tool_call>", body_start)
        if end != -1:
            out.append((text[body_start:end].strip(), True))
            pos = end + len("</tool_call>")
            continue
        raw = text[body_start:]
        cut = _overlap(raw, "</tool_call>")
        body = (raw[:-cut] if cut else raw).strip()
        out.append((body, _complete_json(body) if body else False))
        return out


def _arguments_of(body: str, complete: bool) -> str | None:
    match = re.search(r'"arguments"\s*:\s*', body)
    if not match:
        return None
    raw = body[match.end() :]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


# ------------------------------------------------------------------ the model
_ASSISTANT = [IM_START, *b"assistant\n"]
#: How likely the chat model samples its policy's next token: sampling at any
#: temperature follows the script (an agent's default temperature of 1 included).
CHAT_GREEDY_PROB = 1.0 - 1e-9


class ChatLM(FakeLM):
    """A `FakeLM` that chats: after the prompt's last ``<|im_start|>assistant\\n`` its
    most likely token is the next one of ``policy(conversation)`` followed by
    ``<|im_end|>``, and ``<|im_end|>`` once the sample left the reply."""

    def __init__(
        self, policy: ChatPolicy, vocab_size: int = 512, greedy_prob: float = CHAT_GREEDY_PROB
    ):
        if vocab_size <= IM_END:
            raise ValueError(f"a chat model needs vocab_size > {IM_END}, got {vocab_size}")
        super().__init__(vocab_size, greedy_prob=greedy_prob)
        self.policy = policy
        self.tokenizer = ChatTokenizer()
        self._replies: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def _reply(self, prompt: tuple[int, ...]) -> list[int]:
        found = self._replies.get(prompt)
        if found is None:
            conversation = conversation_of(self.tokenizer.decode(prompt))
            found = [*self.tokenizer.encode(self.policy(conversation)), IM_END]
            self._replies[prompt] = found
            while len(self._replies) > 256:
                self._replies.popitem(last=False)
        return found

    def greedy(self, context: Sequence[int], generation: int = 0) -> int:
        n = len(_ASSISTANT)
        for start in range(len(context) - n, -1, -1):
            if context[start] == IM_START and list(context[start : start + n]) == _ASSISTANT:
                break
        else:
            return IM_END
        reply = self._reply(tuple(context[:start]))
        produced = list(context[start + n :])
        if len(produced) < len(reply) and reply[: len(produced)] == produced:
            return reply[len(produced)]
        return IM_END
