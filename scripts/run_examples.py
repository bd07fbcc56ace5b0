"""Run every example, and the demo, against two shared local vLLM-CPU servers.

``nox -s examples`` runs this. Two servers (tiny model, shm plugin, one core each) are
started once; each example runs as its own process with ``--servers`` (the same code a
user runs without it starts its own servers), with a deadline. The demo then runs a
short training with ``--json``, and the file is checked: the reward rose, staleness
stayed within its bound, the trainer's logprobs equal the servers' on the trainer's own
version, and both servers' greedy tokens equal the trainer's.

    python scripts/run_examples.py [--demo-steps 16] [--keep-json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncsync.testing import LocalVLLMServer, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent

#: (command, needs the servers, deadline in seconds)
EXAMPLES: list[tuple[list[str], bool, float]] = [
    (["examples/fleet_control.py"], False, 60),
    (["examples/publish_weights.py"], True, 120),
    (["examples/agentic_rollout.py"], True, 120),
    (["examples/publish_from_fsdp.py"], True, 240),
    (["examples/async_grpo_loop.py", "--steps", "10"], True, 240),
]


def run(cmd: list[str], deadline: float) -> None:
    print(f"\n=== {' '.join(cmd)}", flush=True)
    began = time.perf_counter()
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True, timeout=deadline)
    print(f"=== ok in {time.perf_counter() - began:.1f} s", flush=True)


def check_demo(data: dict[str, Any], steps: int) -> list[str]:
    """What must hold in the demo's JSON; the failures, named."""
    problems = []
    records = data["steps"]
    if len(records) != steps:
        problems.append(f"{len(records)} steps recorded, expected {steps}")
    first = sum(r["reward"] for r in records[:3]) / 3
    last = sum(r["reward"] for r in records[-3:]) / 3
    if not last > first + 0.05:
        problems.append(f"reward did not rise: {first:.3f} -> {last:.3f}")
    bound = data["config"]["max_lag"]
    lags = {int(k) for r in records for k in r["staleness"]}
    if not lags or max(lags) > bound:
        problems.append(f"staleness {sorted(lags)} outside [0, {bound}]")
    diffs = [r["max_logprob_diff"] for r in records if r["max_logprob_diff"] is not None]
    if not diffs or max(diffs) > 1e-3:
        problems.append(f"trainer vs server logprobs on the same version: {diffs}")
    if data["greedy_matches_trainer"] is not True:
        problems.append("greedy tokens differ from the trainer's")
    return problems


#: Examples that launch servers of their own (on Ray): run before the shared servers
#: start, so that at most two servers share the cores.
OWN_SERVERS: list[tuple[list[str], float]] = [(["examples/ray_fleet.py", "--steps", "3"], 600)]


async def main(demo_steps: int, keep_json: Path | None) -> int:
    for cmd, deadline in OWN_SERVERS:
        await asyncio.to_thread(run, cmd, deadline)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, tokenizer=False)
        servers = [
            LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2))
            for i in range(2)
        ]
        print("starting two vLLM-CPU servers...", flush=True)
        try:
            await asyncio.gather(*(s.astart() for s in servers))
            urls = [s.url for s in servers]
            for cmd, shared, deadline in EXAMPLES:
                args = [*cmd, "--servers", *urls] if shared else cmd
                await asyncio.to_thread(run, args, deadline)
            out = keep_json or Path(tmp) / "demo.json"
            demo = ["-m", "asyncsync", "demo", "--steps", str(demo_steps), "--json", str(out)]
            await asyncio.to_thread(run, [*demo, "--servers", *urls], 300)
        finally:
            await asyncio.gather(*(s.astop() for s in servers))
        problems = check_demo(json.loads(out.read_text()), demo_steps)
    for problem in problems:
        print(f"demo check failed: {problem}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-steps", type=int, default=16)
    parser.add_argument("--keep-json", type=Path, default=None)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.demo_steps, args.keep_json)))
