"""Test helpers for asyncsync users and for asyncsync's own suite.

- `make_tiny_model` writes a tiny deterministic Qwen2 model, or a Qwen3-MoE, in
  float32 or bfloat16 (no downloads).
- `LocalVLLMServer` runs a real vLLM server as a subprocess.
- `FakeVLLMServer` fakes vLLM's RL routes (0.23 or 0.32) and injects faults; with a
  chat policy (`scripted` replies, `tool_call` text) it chats too, for testing agents
  offline.
- `reference_greedy` / `reference_logprobs` compute transformers' ground truth;
  `check_greedy` compares a server's greedy output with it on any CPU.
- `describe_cpu` names the CPU features vLLM-CPU's kernels depend on.

Importing this module needs neither vLLM nor torch; they are imported when used.
"""

from asyncsync.testing._chat import ChatModelError
from asyncsync.testing._cpu import describe_cpu
from asyncsync.testing._fake import (
    ChatPolicy,
    FakeVLLMServer,
    Fault,
    RecordedRequest,
    scripted,
    tool_call,
)
from asyncsync.testing._lag import LoopLagMonitor
from asyncsync.testing._model import (
    BFLOAT16_TOLERANCE,
    FLOAT32_TOLERANCE,
    TINY_MODEL_CACHE_ENV,
    TINY_MODEL_CONFIG,
    TINY_MOE_CONFIG,
    check_greedy,
    greedy_mismatch,
    make_tiny_model,
    reference_greedy,
    reference_logprobs,
)
from asyncsync.testing._server import (
    BACKEND_NAMES,
    LocalVLLMServer,
    ServerStartError,
    free_port,
    process_group_members,
)

__all__ = [
    "BACKEND_NAMES",
    "BFLOAT16_TOLERANCE",
    "FLOAT32_TOLERANCE",
    "TINY_MODEL_CACHE_ENV",
    "TINY_MODEL_CONFIG",
    "TINY_MOE_CONFIG",
    "ChatModelError",
    "ChatPolicy",
    "FakeVLLMServer",
    "Fault",
    "LocalVLLMServer",
    "LoopLagMonitor",
    "RecordedRequest",
    "ServerStartError",
    "check_greedy",
    "describe_cpu",
    "free_port",
    "greedy_mismatch",
    "make_tiny_model",
    "process_group_members",
    "reference_greedy",
    "reference_logprobs",
    "scripted",
    "tool_call",
]

# Errors are named by this public module in tracebacks, not the private one.
ServerStartError.__module__ = __name__
ChatModelError.__module__ = __name__
