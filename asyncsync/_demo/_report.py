"""What the demo shows: one record per step, the progress line, the table, the JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoResult", "StepRecord", "format_table", "trend", "write_json"]


@dataclass(slots=True)
class StepRecord:
    """One training step, as the table and the JSON show it.

    Attributes:
        step: 1-based step number; the trainer published ``step-<step>`` after it.
        reward: mean reward of the step's rollouts.
        rollouts: how many rollouts the step trained on.
        versions: weight version -> rollouts sampled (partly) by it.
        staleness: versions behind the trainer -> rollouts (a rollout counts at its
            oldest token).
        dropped: rollouts older than the staleness bound, not trained on.
        publish_seconds: the publish round of the step's new weights.
        publish_gb_per_s: its payload bytes per second.
        tokens_per_s: tokens the fleet generated per second during the step.
        max_logprob_diff: the largest |trainer logprob - server logprob| over tokens of
            rollouts sampled entirely by the trainer's weights (None: none this step).
        exact_tokens: how many tokens that was measured on.
        loss: the policy-gradient loss.
        seconds: the step's wall time (waiting for rollouts, training, publishing).
    """

    step: int
    reward: float
    rollouts: int
    versions: dict[str, int]
    staleness: dict[int, int]
    dropped: int
    publish_seconds: float
    publish_gb_per_s: float
    tokens_per_s: float
    max_logprob_diff: float | None
    exact_tokens: int
    loss: float
    seconds: float


@dataclass(slots=True)
class DemoResult:
    """The whole run: the steps, the final greedy check, and timings."""

    steps: list[StepRecord] = field(default_factory=list)
    greedy_matches_trainer: bool = False
    greedy_checks: list[dict[str, Any]] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    server_start_seconds: float | None = None
    wall_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)


def _versions(versions: Mapping[str, int]) -> str:
    short = {v.removeprefix("step-"): n for v, n in versions.items()}
    ordered = sorted(short.items(), key=lambda kv: (len(kv[0]), kv[0]))  # 9 before 10
    return " ".join(f"{v}:{n}" for v, n in ordered)


def _staleness(staleness: Mapping[int, int]) -> str:
    return " ".join(f"{lag}:{n}" for lag, n in sorted(staleness.items()))


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


_COLUMNS = (
    ("step", ">4"),
    ("reward", ">6"),
    ("rollouts", ">8"),
    ("dropped", ">7"),
    ("versions (v:n)", "<18"),
    ("lag (k:n)", "<11"),
    ("publish", ">8"),
    ("GB/s", ">6"),
    ("tok/s", ">6"),
    ("max|dlogp|", ">10"),
)


def _row(rec: StepRecord) -> tuple[str, ...]:
    return (
        str(rec.step),
        f"{rec.reward:.3f}",
        str(rec.rollouts),
        str(rec.dropped),
        _versions(rec.versions),
        _staleness(rec.staleness),
        f"{rec.publish_seconds * 1000:.0f} ms",
        f"{rec.publish_gb_per_s:.2f}",
        f"{rec.tokens_per_s:.0f}",
        _diff(rec.max_logprob_diff),
    )


def format_table(records: Sequence[StepRecord]) -> str:
    """The per-step table, one line per step under a header."""
    lines = [" ".join(f"{name:{spec}}" for name, spec in _COLUMNS)]
    for rec in records:
        cells = zip(_row(rec), _COLUMNS, strict=True)
        lines.append(" ".join(f"{cell:{spec}}" for cell, (_, spec) in cells))
    return "\n".join(lines)


def trend(records: Sequence[StepRecord], width: int = 3) -> tuple[float, float]:
    """Mean reward of the first and of the last ``width`` steps."""
    if not records:
        return 0.0, 0.0
    head = records[:width]
    tail = records[-width:]
    return sum(r.reward for r in head) / len(head), sum(r.reward for r in tail) / len(tail)


def write_json(result: DemoResult, path: Path) -> None:
    """Write ``result`` as JSON (staleness keys become strings, as JSON requires)."""
    data = asdict(result)
    for step in data["steps"]:
        step["staleness"] = {str(k): v for k, v in step["staleness"].items()}
    path.write_text(json.dumps(data, indent=2) + "\n")
