"""Chat sessions' trajectories as JSON lines, for a trainer.

One line per trajectory (a branch of a session): its exact ``token_ids``, ``loss_mask``
(1 on sampled ids), ``logprobs`` (null where nothing was sampled), ``weight_versions``,
its ``lineage`` (root, branch or subagent; parent; the ids it shares with its parent),
and its ``turns`` (where each sample lies, the dialect, the prefix report, the server,
the fields accepted that changed nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncsync._chat.chat import ChatSession

__all__ = ["session_rows", "write_rows"]


def session_rows(session: ChatSession) -> list[dict[str, Any]]:
    """One row per trajectory of ``session``."""
    rows: list[dict[str, Any]] = []
    for index, trajectory in enumerate(session.trajectories()):
        turns = []
        samples = [s for s in trajectory.segments if s.completion is not None]
        mine = [(i, t) for i, t in enumerate(session.turns) if t.segment == index]
        for (turn_index, turn), segment in zip(
            mine, samples[-len(mine) :] if mine else [], strict=False
        ):
            reply = turn.reply
            turns.append(
                {
                    "turn": turn_index,
                    "api": turn.api,
                    "start": segment.start,
                    "end": segment.end,
                    "finish_reason": reply.finish_reason,
                    "server": reply.completion.server,
                    "prefix": {
                        "status": reply.prefix.status,
                        "position": reply.prefix.position,
                        "message": reply.prefix.message,
                        "reason": reply.prefix.reason,
                        "bridge_tokens": len(reply.prefix.bridge),
                    },
                    "recorded": dict(turn.recorded),
                }
            )
        lineage = trajectory.lineage
        rows.append(
            {
                "session_id": session.session_id,
                "branch": index,
                "lineage": lineage.to_dict() if lineage is not None else None,
                "token_ids": trajectory.token_ids,
                "loss_mask": trajectory.loss_mask,
                "logprobs": trajectory.logprobs,
                "weight_versions": trajectory.weight_versions,
                "turns": turns,
            }
        )
    return rows


def write_rows(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` as JSON lines (blocking: call it in a worker thread); returns how
    many."""
    count = 0
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
            count += 1
    os.replace(tmp, path)
    return count
