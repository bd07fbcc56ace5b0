"""A chat session's message graph: which recorded turn a new request continues.

Pure functions and records, no I/O. Every recorded turn is a `Node`: the messages it
was asked with, the message it answered (its history), where its prompt and its sample
lie in its branch's trajectory. A branch is one exact `Trajectory` from its first
prompt to its last sample, with its `Lineage`.

A new request (its messages in chat form) is located (`locate`):

- ``"extend"``: it continues the last turn of a branch (that turn's history is a
  message-prefix of it): the branch grows;
- ``"branch"``: it continues an earlier turn (an edited or retried later history): a
  new branch starts from that turn's sample, its ids shared exactly;
- ``"retry"``: it asks exactly what an earlier turn asked (a retry with other
  sampling): a new branch starts from that turn's prompt;
- ``"new"``: it continues nothing recorded: a compaction (the history replaced by a
  summary), a subagent's new conversation, a new episode under the same key; a new
  branch starts from the full render. While a turn's tool call is pending (its result
  not sent back yet), a new conversation is a subagent of that call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncsync._chat.prefix import history_mismatch, same_message
from asyncsync._chat.trajectory import Lineage, Trajectory

__all__ = [
    "Branch",
    "Location",
    "Node",
    "common_prefix",
    "copy_upto",
    "locate",
    "pending_call",
]


@dataclass(slots=True)
class Node:
    """One recorded turn."""

    turn: int  # its index in the session's turns
    branch: int
    request: list[dict[str, Any]]  # the messages asked with (chat form)
    history: list[dict[str, Any]]  # the request and the answer's message
    rendered: list[int]  # the full render of the request (the next turn's "before")
    prompt_segments: int  # trajectory segments up to its prompt's end
    segments: int  # trajectory segments up to its sample's end
    calls: list[tuple[str, str, str]]  # the answer's tool calls (id, name, arguments)


@dataclass(slots=True)
class Branch:
    """One trajectory of a session and the turns recorded on it."""

    index: int
    trajectory: Trajectory
    lineage: Lineage
    nodes: list[Node] = field(default_factory=list)
    closing: list[int] | None = None  # the template's closing of an assistant turn

    @property
    def last(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


@dataclass(frozen=True, slots=True)
class Location:
    """Where a request goes (see the module docstring)."""

    kind: Literal["extend", "branch", "retry", "new"]
    node: Node | None = None


def _same(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    return len(a) == len(b) and all(same_message(x, y) for x, y in zip(a, b, strict=True))


def locate(branches: Sequence[Branch], messages: Sequence[Mapping[str, Any]]) -> Location:
    """Where ``messages`` go among the recorded ``branches`` (the latest branch wins a
    tie)."""
    best: Node | None = None
    for branch in reversed(branches):
        for node in reversed(branch.nodes):
            if best is not None and len(node.history) <= len(best.history):
                continue
            if history_mismatch(node.history, messages) is None:
                best = node
    if best is not None:
        last = branches[best.branch].last
        return Location("extend" if last is best else "branch", best)
    for branch in reversed(branches):
        for node in reversed(branch.nodes):
            if _same(node.request, messages):
                return Location("retry", node)
    return Location("new")


def _answered(branch: Branch) -> set[str]:
    """Tool-call ids whose results a later turn of ``branch`` sent."""
    out: set[str] = set()
    for node in branch.nodes:
        out.update(str(m["tool_call_id"]) for m in node.request if m.get("tool_call_id"))
    return out


def _strings(value: Any, out: list[str]) -> list[str]:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    return out


def _text(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(_strings([m.get("content") for m in messages], []))


def pending_call(
    branches: Sequence[Branch], messages: Sequence[Mapping[str, Any]]
) -> tuple[Node, str] | None:
    """The tool call a new conversation works for: among the last turns whose tool calls
    have no result yet, the one whose arguments' strings appear in ``messages`` (a
    subagent's task), else the most recent. None when no call is pending."""
    pending: list[tuple[Node, str, str]] = []
    for branch in branches:
        last = branch.last
        if last is None or not last.calls:
            continue
        done = _answered(branch)
        pending.extend((last, cid, args) for cid, _, args in last.calls if cid not in done)
    if not pending:
        return None
    text = _text(messages)
    for node, cid, args in reversed(pending):
        try:
            values = json.loads(args)
        except ValueError:
            continue
        strings = [s for s in _strings(values, []) if len(s) >= 8]
        if strings and any(s in text for s in strings):
            return node, cid
    node, cid, _ = max(pending, key=lambda p: p[0].turn)
    return node, cid


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def copy_upto(trajectory: Trajectory, segments: int, session_id: str) -> Trajectory:
    """A new trajectory holding ``trajectory``'s first ``segments`` segments, exactly."""
    out = Trajectory(session_id=session_id)
    ids = trajectory.token_ids
    for segment in trajectory.segments[:segments]:
        if segment.completion is not None:
            out.add_completion(segment.completion, trainable=segment.trainable)
        elif segment.kind == "tool":
            out.add_tool(ids[segment.start : segment.end])
        else:
            out.add_prompt(ids[segment.start : segment.end])
    return out
