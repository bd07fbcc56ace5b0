"""``Trajectory``: a multi-turn rollout kept as exact token ids, for RL trainers.

An agentic rollout alternates text the environment supplies (system prompt, user turn,
tool output, chat-template glue: token ids from the user's own renderer) with text the
policy sampled (`Completion` objects). The trajectory keeps the exact
concatenation of all of them, so the next turn's prompt is built without re-tokenizing
anything already generated, and exports what a trainer needs: ids, a loss mask (1 only on
sampled tokens), logprobs aligned with the ids, and the weight version of every token.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from asyncsync._core.completion import Completion
from asyncsync._wire.generation.options import check_prompt

if TYPE_CHECKING:
    from asyncsync.client import AsyncVLLMClient
    from asyncsync.fleet import Fleet

__all__ = ["Lineage", "LineageKind", "Segment", "Trajectory"]

SegmentKind = Literal["prompt", "tool", "completion"]

#: How a trajectory came to be: the session's first (``"root"``), split off a recorded
#: one (``"branch"``: a compaction, an edited history, a retry, a template that is not
#: prefix-stable), or opened by a subagent while a tool call was pending (``"subagent"``).
LineageKind = Literal["root", "branch", "subagent"]


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a trajectory comes from.

    Attributes:
        session_id: the session it belongs to.
        branch: its index among the session's trajectories.
        kind: ``"root"``, ``"branch"`` or ``"subagent"`` (`LineageKind`).
        parent_branch: the trajectory it split off (a branch), or whose pending tool
            call opened it (a subagent); None for a root.
        parent_session: the session of that parent (another one when a subagent came
            under its own key, named by ``x-parent-session``).
        parent_turn: the parent's turn (an index into that session's ``turns``).
        tool_call_id: the pending tool call a subagent works for.
        prefix: how many leading token ids it shares exactly with its parent branch.
        reason: why it split, in words.
    """

    session_id: str
    branch: int
    kind: LineageKind = "root"
    parent_branch: int | None = None
    parent_session: str | None = None
    parent_turn: int | None = None
    tool_call_id: str | None = None
    prefix: int = 0
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "branch": self.branch,
            "kind": self.kind,
            "parent_branch": self.parent_branch,
            "parent_session": self.parent_session,
            "parent_turn": self.parent_turn,
            "tool_call_id": self.tool_call_id,
            "prefix": self.prefix,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Segment:
    """One appended piece: tokens ``[start, end)`` of the trajectory.

    Attributes:
        kind: ``"prompt"`` (user/system/template text), ``"tool"`` (tool output) or
            ``"completion"`` (sampled by the policy).
        start, end: positions in `Trajectory.token_ids`.
        completion: the `Completion` for a completion segment.
        trainable: whether the segment's tokens are in the loss mask.
    """

    kind: SegmentKind
    start: int
    end: int
    completion: Completion | None = None
    trainable: bool = False

    def __len__(self) -> int:
        return self.end - self.start


class Trajectory:
    """A multi-turn token sequence built from prompt/tool segments and completions.

    ::

        traj = Trajectory(render(system, user))          # ids from your renderer
        c = await fleet.generate(traj.next_prompt(), session_id=traj.session_id, logprobs=0)
        traj.add_completion(c)                            # exact sampled ids, mask 1
        traj.add_tool(render_tool_result(run_tool(c)))    # mask 0
        c = await traj.generate(fleet, logprobs=0)        # the same in one call
        batch = traj.to_lists()                           # or traj.to_tensors()

    Args:
        prompt_token_ids: the first prompt segment (optional).
        session_id: used for session affinity by `generate` (default: random).
        check_prefix: `add_completion` refuses a completion whose prompt is not
            exactly the trajectory so far (it was generated for another context).
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int] = (),
        *,
        session_id: str | None = None,
        check_prefix: bool = True,
    ) -> None:
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._logprobs: list[float | None] = []
        self._versions: list[str | None] = []
        #: (adapter, its version) of each token sampled with ``lora=name``, else None
        self._lora: list[tuple[str, str] | None] = []
        self._segments: list[Segment] = []
        self.session_id = session_id if session_id is not None else uuid.uuid4().hex
        self.check_prefix = check_prefix
        #: Where the trajectory comes from, for one recorded by a chat session
        #: (`Lineage`: its session, branch, parent and the ids it shares); None else.
        self.lineage: Lineage | None = None
        if len(prompt_token_ids):
            self.add_prompt(prompt_token_ids)

    # ---------------------------------------------------------------- building
    def _append(
        self,
        kind: SegmentKind,
        ids: list[int],
        *,
        trainable: bool,
        logprobs: Sequence[float | None] | None = None,
        versions: Sequence[str | None] | None = None,
        completion: Completion | None = None,
    ) -> Trajectory:
        start = len(self._ids)
        self._ids.extend(ids)
        self._mask.extend([1 if trainable else 0] * len(ids))
        self._logprobs.extend(logprobs if logprobs is not None else [None] * len(ids))
        self._versions.extend(versions if versions is not None else [None] * len(ids))
        self._lora.extend(_adapter_versions(completion, len(ids)))
        self._segments.append(Segment(kind, start, len(self._ids), completion, trainable))
        return self

    def add_prompt(self, token_ids: Sequence[int]) -> Trajectory:
        """Append environment-side tokens (system/user text, template glue); mask 0."""
        return self._append("prompt", check_prompt(token_ids), trainable=False)

    def add_tool(self, token_ids: Sequence[int]) -> Trajectory:
        """Append a tool result's tokens (rendered by the caller); mask 0."""
        return self._append("tool", check_prompt(token_ids), trainable=False)

    def add_completion(self, completion: Completion, *, trainable: bool = True) -> Trajectory:
        """Append a completion's exact sampled ids with their logprobs and per-token
        weight versions; mask 1 (0 with ``trainable=False``).

        Raises ValueError when the completion was not generated from exactly this
        trajectory (``check_prefix``), or was re-tokenized (its ids are not the sampled
        ones, so they must not be trained on as if they were).
        """
        if not isinstance(completion, Completion):
            raise TypeError(f"expected a Completion, got {type(completion).__name__}")
        if completion.retokenized and trainable:
            raise ValueError(
                "this completion was re-tokenized from text (its ids may differ from the "
                "sampled ones); add it with trainable=False if you accept that"
            )
        if self.check_prefix and completion.prompt_token_ids != self._ids:
            raise ValueError(
                "the completion's prompt is not this trajectory's tokens "
                f"({len(completion.prompt_token_ids)} vs {len(self._ids)} tokens); generate "
                "from next_prompt(), or pass check_prefix=False to the Trajectory"
            )
        n = len(completion.token_ids)
        logprobs: list[float | None] = (
            list(completion.logprobs) if completion.logprobs is not None else [None] * n
        )
        return self._append(
            "completion",
            list(completion.token_ids),
            trainable=trainable,
            logprobs=logprobs,
            versions=completion.token_versions,
            completion=completion,
        )

    def next_prompt(self) -> list[int]:
        """The ids to send for the next turn: everything so far, exactly (a copy)."""
        return list(self._ids)

    async def generate(self, fleet_or_client: Fleet | AsyncVLLMClient, **kwargs: Any) -> Completion:
        """Generate the next turn from `next_prompt` and append it. On a fleet
        the trajectory's `session_id` keeps every turn on one server (prefix
        cache). ``kwargs`` go to ``generate`` (``n`` must be 1)."""
        from asyncsync.fleet import Fleet

        if kwargs.get("n", 1) != 1:
            raise ValueError("a trajectory continues one sample: n must be 1")
        kwargs.pop("n", None)
        if isinstance(fleet_or_client, Fleet):
            kwargs.setdefault("session_id", self.session_id)
        completion: Completion = await fleet_or_client.generate(self.next_prompt(), **kwargs)
        self.add_completion(completion)
        return completion

    # ---------------------------------------------------------------- reading
    @property
    def token_ids(self) -> list[int]:
        """All token ids, in order (a copy)."""
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 on sampled (trainable) tokens, 0 elsewhere; aligned with `token_ids`."""
        return list(self._mask)

    @property
    def logprobs(self) -> list[float | None]:
        """The sampling logprob of each token (None where not sampled or not requested)."""
        return list(self._logprobs)

    @property
    def weight_versions(self) -> list[str | None]:
        """The weight version that sampled each token (None for prompt/tool tokens or
        where unknown)."""
        return list(self._versions)

    @property
    def lora_versions(self) -> list[tuple[str, str] | None]:
        """The LoRA adapter and its version that sampled each token, as ``(name,
        version)`` (``Fleet.generate(..., lora=name)``; `Completion.lora_token_versions`),
        None for prompt/tool tokens and tokens of the base model; aligned with
        `token_ids`. A trajectory may mix adapters and versions across turns."""
        return list(self._lora)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(self._segments)

    @property
    def completions(self) -> list[Completion]:
        """The completions in order."""
        return [s.completion for s in self._segments if s.completion is not None]

    @property
    def num_turns(self) -> int:
        """Number of completion segments."""
        return sum(1 for s in self._segments if s.kind == "completion")

    @property
    def num_sampled(self) -> int:
        return sum(self._mask)

    def versions(self) -> set[str]:
        """The distinct weight versions among sampled tokens."""
        return {v for v, m in zip(self._versions, self._mask, strict=True) if m and v is not None}

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._segments)

    def __repr__(self) -> str:
        return (
            f"Trajectory({len(self._ids)} tokens, {self.num_turns} turns, "
            f"{self.num_sampled} sampled, session={self.session_id!r})"
        )

    # ---------------------------------------------------------------- export
    def _checked_logprobs(self, fill: float, require: bool) -> list[float]:
        out: list[float] = []
        for pos, (lp, m) in enumerate(zip(self._logprobs, self._mask, strict=True)):
            if lp is None:
                if require and m:
                    raise ValueError(
                        f"token {pos} is sampled (mask 1) but has no logprob: request "
                        "logprobs=0 (or more) when generating, or export with "
                        "require_logprobs=False"
                    )
                out.append(fill)
            else:
                out.append(lp)
        return out

    def to_lists(self, *, fill: float = 0.0, require_logprobs: bool = True) -> dict[str, Any]:
        """Plain lists for a trainer, aligned with each other: ``token_ids`` (ints),
        ``loss_mask`` (ints: 1 on sampled tokens, 0 on prompt and tool tokens),
        ``logprobs`` (floats: ``fill``, 0.0 by default, where there is none: prompt and
        tool tokens), ``weight_versions`` (strings; None for prompt/tool tokens and
        where a sampled token's version is unknown). ``require_logprobs``: every
        sampled token must have a logprob (ValueError otherwise; False: those get
        ``fill`` too)."""
        return {
            "token_ids": list(self._ids),
            "loss_mask": list(self._mask),
            "logprobs": self._checked_logprobs(fill, require_logprobs),
            "weight_versions": list(self._versions),
        }

    def to_tensors(
        self, *, device: Any = None, fill: float = 0.0, require_logprobs: bool = True
    ) -> dict[str, Any]:
        """Torch tensors: ``token_ids`` (long), ``loss_mask`` (long 0/1, not bool:
        ``.bool()`` to index with it), ``logprobs`` (float32, ``fill`` where there is
        none), and ``weight_versions`` as a list (strings and None are not tensors).
        Needs torch."""
        import torch

        data = self.to_lists(fill=fill, require_logprobs=require_logprobs)
        return {
            "token_ids": torch.tensor(data["token_ids"], dtype=torch.long, device=device),
            "loss_mask": torch.tensor(data["loss_mask"], dtype=torch.long, device=device),
            "logprobs": torch.tensor(data["logprobs"], dtype=torch.float32, device=device),
            "weight_versions": data["weight_versions"],
        }

    def staleness(self, fleet: Fleet) -> int | None:
        """How many published versions behind the fleet's newest the oldest sampled
        token is (None when unknown)."""
        lags = [fleet.versions_behind(v) for v in self.versions()]
        if not lags or any(lag is None for lag in lags):
            return None
        return max(lag for lag in lags if lag is not None)


def _adapter_versions(completion: Completion | None, n: int) -> list[tuple[str, str] | None]:
    """Each of a segment's ``n`` tokens' (adapter, version), None where there is none."""
    if completion is None or completion.lora is None:
        return [None] * n
    name = completion.lora
    return [None if v is None else (name, v) for v in completion.lora_token_versions]
