"""Prefix stability of a chat session: what the next turn's prompt is, in exact ids.

Pure functions, no I/O. A chat session keeps the exact ids the policy saw and sampled.
An agent sends the whole conversation each turn, its earlier assistant turns echoed
back as parsed messages, whose re-rendering by the chat template often differs from
the sampled text (JSON spacing, key order, ``false``/``False``). The sampled ids stay;
the next prompt is the session's ids plus a *bridge*: the ids the server's own template
adds for the new messages, found by comparing the template with itself:

- ``before`` — the render of the previous turn's messages with the generation prompt
  (the prompt the template gave that turn),
- ``history`` — the render of the conversation up to and including the last assistant
  turn, as the caller sent it back, without the generation prompt,
- ``full`` — the render of the whole new request, with the generation prompt.

The template is prefix-stable at this turn when ``before`` is a prefix of ``history``
and ``history`` of ``full``. Then ``history[len(before):]`` is the template's own
rendering of the last assistant turn (its closing tokens, e.g. the newline after
``<|im_end|>``, follow what was sampled), and ``full[len(history):]`` renders the new
messages and the generation prompt. Both slices come from renders that hold the same
re-rendered assistant turns, so a re-rendering difference cannot break them.

A session renders ``history`` only where it needs it: when ``full`` already extends the
session's ids (the template writes the conversation so far exactly as it was recorded,
the sampled ids included: a plain answer, usually), ``full`` is the next prompt, the
server's own, and its rest is the bridge.

When the template is not prefix-stable there (it strips earlier thinking, or the agent
edited the history), the first differing position is reported and the session forks,
raises or bridges anyway (`align_end`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncsync._core.errors import AsyncSyncError

__all__ = [
    "ON_UNSTABLE",
    "OnUnstable",
    "PrefixReport",
    "PrefixStatus",
    "UnstablePrefixError",
    "align_end",
    "closing_after",
    "first_difference",
    "history_mismatch",
    "same_message",
    "template_closing",
]

#: What a session does when the template is not prefix-stable at a turn: start a new
#: segment rooted at the full render (``"fork"``), raise `UnstablePrefixError`
#: (``"raise"``), or bridge anyway (``"append"``).
OnUnstable = Literal["fork", "raise", "append"]
ON_UNSTABLE: tuple[OnUnstable, ...] = ("fork", "raise", "append")

#: A turn's relation to the session so far.
PrefixStatus = Literal["first", "stable", "forked", "appended"]


@dataclass(frozen=True, slots=True)
class PrefixReport:
    """How a turn's prompt was built.

    Attributes:
        status: ``"first"`` (a new segment from the full render: the session's first
            turn), ``"stable"`` (the session's ids plus the bridge), ``"forked"`` (the
            template or the history was not prefix-stable: a new segment from the full
            render), ``"appended"`` (not prefix-stable, bridged anyway).
        position: where the renders first differ (an index into the earlier render), for
            an unstable turn; None otherwise.
        message: the index of the first message that does not match the session's
            history, when that is why the turn is unstable.
        reason: why a turn is not stable, in words (None when it is).
        bridge: the ids added after the last sampled token (never sampled: loss mask 0);
            the whole prompt for a first or forked turn.
    """

    status: PrefixStatus
    position: int | None = None
    message: int | None = None
    reason: str | None = None
    bridge: tuple[int, ...] = ()

    @property
    def stable(self) -> bool:
        """The turn continued the session's ids exactly (``"first"`` or ``"stable"``)."""
        return self.status in ("first", "stable")


class UnstablePrefixError(AsyncSyncError, ValueError):
    """A chat turn whose prompt is not an extension of the session's tokens, in a
    session created with ``on_unstable="raise"``.

    Attributes:
        position: the first differing position of the renders (None when the messages
            themselves do not extend the history).
        message_index: the first message that does not match the session's history, if
            that is the cause.
    """

    def __init__(
        self, message: str, *, position: int | None = None, message_index: int | None = None
    ) -> None:
        super().__init__(message)
        self.position = position
        self.message_index = message_index


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """None when ``a`` is a prefix of ``b``, else the first position where they differ
    (``len(b)`` when ``b`` is shorter and a prefix of ``a``)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return None if len(a) <= len(b) else n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n  # pragma: no cover - unreachable: the slices differ


def closing_after(
    sampled: Sequence[int], turn: Sequence[int], ended_on: int | None, closing: Sequence[int]
) -> list[int]:
    """The template's closing ids of an assistant turn that follow what was sampled.

    ``turn``: the template's rendering of that assistant turn (``history[len(before):]``).
    ``ended_on``: the end-of-sequence id the turn stopped on, when it did (the last
    sampled id): the closing is what the template puts after that id's last occurrence
    in ``turn``. Otherwise (a truncated turn, a stop string) ``closing``, the template's
    closing of any assistant turn (`template_closing`), less the part the sampled ids
    already end with."""
    if ended_on is not None and ended_on in turn:
        last = len(turn) - 1 - list(reversed(turn)).index(ended_on)
        return list(turn[last + 1 :])
    for j in range(min(len(closing), len(sampled)), 0, -1):
        if list(sampled[-j:]) == list(closing[:j]):
            return list(closing[j:])
    return list(closing)


def template_closing(turn: Sequence[int], empty_turn: Sequence[int]) -> list[int]:
    """The closing ids of an assistant turn: the longest common suffix of a rendered
    turn and the rendering of an empty assistant turn."""
    n = 0
    while n < min(len(turn), len(empty_turn)) and turn[-1 - n] == empty_turn[-1 - n]:
        n += 1
    return list(turn[len(turn) - n :]) if n else []


def align_end(history: Sequence[int], full: Sequence[int], start: int = 0) -> int:
    """Where the last message of ``history`` ends inside ``full`` when ``history`` is not
    a prefix of it (``on_unstable="append"``): the end of the longest run of ``full``
    that ends like ``history`` does, at or after ``start``."""
    if not history:
        return start
    best, best_len, last = len(full), 0, history[-1]
    for end in range(max(start, 1), len(full) + 1):
        if full[end - 1] != last:
            continue
        n = 0
        while n < min(end, len(history)) and full[end - 1 - n] == history[-1 - n]:
            n += 1
        if n > best_len:
            best, best_len = end, n
    return best


# ------------------------------------------------------------------ messages
def _text(content: Any) -> str:
    """Message content as text: a string, or the text of its parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content
        )
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw.strip()
    return raw


def _calls(message: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        out.append((function.get("name"), _arguments(function.get("arguments"))))
    return out


def same_message(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether ``theirs`` (as the caller sent it back) is the message ``ours`` of the
    session's history: same role and text (assistant text up to surrounding
    whitespace), same tool calls by name and parsed arguments (ids, key order and JSON
    spacing aside), same tool-call id for a tool result."""
    if ours.get("role") != theirs.get("role"):
        return False
    if ours.get("role") == "assistant":
        return _text(ours.get("content")).strip() == _text(
            theirs.get("content")
        ).strip() and _calls(ours) == _calls(theirs)
    if ours.get("role") == "tool" and ours.get("tool_call_id") != theirs.get("tool_call_id"):
        return False
    return _text(ours.get("content")) == _text(theirs.get("content"))


def history_mismatch(
    history: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]]
) -> int | None:
    """None when ``messages`` extend ``history`` by at least one message, else the index
    of the first message that differs (``len(messages)`` when there is nothing new)."""
    for i, ours in enumerate(history):
        if i >= len(messages) or not same_message(ours, messages[i]):
            return i
    return None if len(messages) > len(history) else len(messages)
