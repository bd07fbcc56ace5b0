"""FakeVLLMServer's own behaviour: raw HTTP answers, faults, 0.23 mode, separate process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from asyncsync.testing import FakeVLLMServer, Fault

pytestmark = pytest.mark.asyncio


async def _raw(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def test_weight_lifecycle_errors_match_vllm() -> None:
    # Fresh connections: like vLLM, the fake closes the connection after a worker failure.
    connector = aiohttp.TCPConnector(force_close=True)
    async with FakeVLLMServer() as fake, aiohttp.ClientSession(connector=connector) as s:
        u = fake.url
        status, body = await _raw(s, "POST", u + "/finish_weight_update")
        assert status == 500
        assert body["error"]["message"] == (
            "Call to collective_rpc method failed: Worker failed with error "
            "'finish_weight_update called without a matching start_weight_update.', "
            "please check the stack trace above for the root cause"
        )
        assert body["error"]["type"] == "InternalServerError"
        assert (await _raw(s, "POST", u + "/start_weight_update"))[0] == 200
        status, body = await _raw(s, "POST", u + "/start_weight_update")
        assert status == 500
        assert "already active" in body["error"]["message"]
        status, body = await _raw(s, "POST", u + "/shutdown_weight_transfer_engine")
        assert status == 500
        status, body = await _raw(s, "POST", u + "/update_weights", {"update_info": {"packed": 1}})
        assert status == 500
        assert "unexpected keyword argument 'packed'" in body["error"]["message"]
        assert not fake.update_active  # a failed update ends the active update
        status, body = await _raw(s, "POST", u + "/update_weights", {})
        assert (status, body["error"]["param"]) == (400, "body.update_info")


async def test_connection_closes_after_a_worker_failure() -> None:
    async with FakeVLLMServer() as fake, aiohttp.ClientSession() as s:
        async with s.post(fake.url + "/finish_weight_update") as resp:
            assert resp.status == 500
            assert "Connection" not in resp.headers  # as uvicorn: no header, just a close
            await resp.read()
        for _ in range(500):
            if fake.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert fake.open_connections == 0
    async with FakeVLLMServer() as fake, aiohttp.ClientSession() as s:
        async with s.post(fake.url + "/resume") as resp:
            assert resp.status == 200
        assert fake.open_connections == 1  # other answers keep the connection alive


async def test_023_mode() -> None:
    async with FakeVLLMServer(version="0.23.0") as fake, aiohttp.ClientSession() as s:
        u = fake.url
        assert await _raw(s, "GET", u + "/version") == (200, {"version": "0.23.0"})
        for path in ("/weight_info", "/abort_requests", "/weight_checker"):
            method = "GET" if path == "/weight_info" else "POST"
            assert await _raw(s, method, u + path, {}) == (404, {"detail": "Not Found"})
        status, _ = await _raw(s, "POST", u + "/start_weight_update")
        assert status == 400  # 0.23 requires a JSON body on start
        assert (await _raw(s, "POST", u + "/start_weight_update", {}))[0] == 200
        status, _ = await _raw(s, "POST", u + "/update_weights", {"update_info": [{}]})
        assert status == 400  # one dict only
        assert (await _raw(s, "POST", u + "/update_weights", {"update_info": {"packed": True}}))[
            0
        ] == 200
        await _raw(s, "POST", u + "/finish_weight_update", {"weight_version": "ignored"})
        assert fake.weight_version == "default"
        assert fake.finished == 1


async def test_requests_are_recorded() -> None:
    async with FakeVLLMServer() as fake, aiohttp.ClientSession() as s:
        await _raw(s, "POST", fake.url + "/pause?mode=wait")
        await _raw(s, "POST", fake.url + "/abort_requests", {"request_ids": ["a"]})
    first, second = fake.requests
    assert (first.method, first.path, first.query, first.json) == (
        "POST",
        "/pause",
        {"mode": "wait"},
        None,
    )
    assert second.json == {"request_ids": ["a"]}
    assert fake.requests_to("/pause") == [first]


async def test_recorded_history_is_bounded() -> None:
    async with FakeVLLMServer(max_recorded=3) as fake, aiohttp.ClientSession() as s:
        assert fake.max_recorded == 3
        await _raw(s, "POST", fake.url + "/start_weight_update")
        for name in ("a", "b", "c", "d"):
            await _raw(s, "POST", fake.url + "/update_weights", {"update_info": {"n": name}})
        await _raw(s, "GET", fake.url + "/is_paused")
        # The oldest requests and updates are dropped first.
        assert [r.path for r in fake.requests] == ["/update_weights"] * 2 + ["/is_paused"]
        assert [r.json for r in fake.requests_to("/update_weights")] == [
            {"update_info": {"n": "c"}},
            {"update_info": {"n": "d"}},
        ]
        assert fake.updates == [{"n": "b"}, {"n": "c"}, {"n": "d"}]
        # A copy: changing it changes nothing recorded.
        fake.requests.clear()
        assert len(fake.requests) == 3
    assert FakeVLLMServer().max_recorded == 10_000
    assert FakeVLLMServer(max_recorded=None).max_recorded is None
    with pytest.raises(ValueError, match="max_recorded"):
        FakeVLLMServer(max_recorded=-1)


async def test_faults_are_consumed_in_order() -> None:
    async with FakeVLLMServer() as fake, aiohttp.ClientSession() as s:
        fake.inject("/resume", Fault.error(503, "busy", shape="string"), times=2)
        fake.inject("*", Fault.delay(0.01))
        statuses = [(await _raw(s, "POST", fake.url + "/resume"))[0] for _ in range(3)]
        assert statuses == [503, 503, 200]
        assert (await _raw(s, "GET", fake.url + "/is_paused"))[0] == 200  # the "*" delay
        fake.clear_faults()
        with pytest.raises(ValueError, match="times"):
            fake.inject("/resume", Fault.hang(), times=0)


async def test_die_stops_the_whole_server() -> None:
    async with FakeVLLMServer() as fake, aiohttp.ClientSession() as s:
        fake.inject("/pause", Fault.die())
        with pytest.raises(aiohttp.ClientError):
            await _raw(s, "POST", fake.url + "/pause")
        assert not fake.alive
        with pytest.raises(aiohttp.ClientConnectorError):
            await _raw(s, "GET", fake.url + "/health")


async def test_fake_servers_in_another_process() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncsync.testing._fake_cli",
        "--count",
        "3",
        "--delay",
        "0.01",
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        urls = json.loads(line)["urls"]
        assert len(urls) == 3
        async with aiohttp.ClientSession() as s:
            for url in urls:
                assert await _raw(s, "GET", url + "/version") == (200, {"version": "0.32.0"})
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


async def test_tokens_per_event_must_be_sizes_of_at_least_one_token() -> None:
    for bad in (0, -1, (), (2, 0)):
        with pytest.raises(ValueError, match="tokens_per_event"):
            FakeVLLMServer(tokens_per_event=bad)


async def test_an_update_of_ten_thousand_handles_is_taken_like_vllm_takes_it() -> None:
    """vLLM's server sets no limit on a request's body; an unpacked IPC update of 10,000
    tensors is about 1.5 MB of JSON (aiohttp's default limit, 1 MiB, would answer 413)."""
    import asyncsync as az
    from asyncsync.backends._ipc_handles import encode_ipc_update

    count = 10_000

    def handle(i: int) -> tuple[Any, ...]:
        """The shape of torch's CUDA handle: sizes, strides, offsets, the 64-byte IPC
        handles of the storage, its ref counter and its event (each its own)."""
        own = i.to_bytes(64, "little")
        return (
            "Tensor", (256, 1024), (1024, 1), 0, "storage", "bfloat16", 0, own,
            524288, 0, False, own[::-1], i, own + b"e", True,
        )  # fmt: skip

    info = {
        "names": [f"model.layers.{i // 128}.mlp.experts.{i % 128}.w" for i in range(count)],
        "dtype_names": ["bfloat16"] * count,
        "shapes": [[256, 1024]] * count,
        "ipc_handles": [{"GPU-0": handle(i)} for i in range(count)],
    }
    seen: list[int] = []
    async with (
        FakeVLLMServer(backend="ipc", update_hook=lambda u: seen.append(len(u["names"]))) as fake,
        az.Fleet([fake.url]) as fleet,
    ):
        await fleet.start_weight_update()
        await fleet.update_weights(encode_ipc_update(info))
        await fleet.finish_weight_update("v1")
    body = fake.requests_to("/update_weights")[0]
    assert len(body.body) > 1024 * 1024
    assert seen == [count]
    assert fake.weight_version == "v1"
