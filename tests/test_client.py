"""AsyncVLLMClient against FakeVLLMServer: payloads per vLLM generation, errors, faults."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, Fault
from tests.waiting import arrived, wait_until

pytestmark = pytest.mark.asyncio

#: The client page of the docs: what it says a user sees is checked against the code.
CLIENT_DOCS = Path(__file__).resolve().parents[1] / "docs" / "client.md"
FAST = az.Timeouts(connect=2.0, control=2.0, update=2.0, generate=2.0)
UPDATE_INFO = {
    "names": ["model.embed_tokens.weight", "lm_head.weight"],
    "dtype_names": ["float32", "bfloat16"],
    "shapes": [[512, 128], [512, 128]],
}


@pytest_asyncio.fixture
async def fake32() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(version="0.32.0") as server:
        yield server


@pytest_asyncio.fixture
async def fake23() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(version="0.23.0") as server:
        yield server


async def test_lifecycle_state_machine(fake32: FakeVLLMServer) -> None:
    client = az.AsyncVLLMClient(fake32.url + "/", retry=None)
    assert client.state == "unopened"
    assert client.base_url == fake32.url
    async with client:
        assert client.state == "open"
        await client.health()
    assert client.state == "closed"
    with pytest.raises(az.ClosedError, match="closed") as info:
        await client.health()
    assert info.value.server == fake32.url
    # What docs/client.md says a closed client raises, word for word.
    documented = re.search(r"A closed client raises\s+`([^`]+)`", CLIENT_DOCS.read_text())
    assert documented is not None
    assert " ".join(documented[1].split()) == (f"asyncsync.ClosedError: {info.value.message}")
    assert f"{type(info.value).__module__}.{type(info.value).__name__}" == "asyncsync.ClosedError"
    with pytest.raises(RuntimeError, match="closed"):
        async with client:
            pass
    await client.aclose()  # idempotent


async def test_lazy_session_without_context_manager(fake32: FakeVLLMServer) -> None:
    client = az.AsyncVLLMClient(fake32.url)
    assert client.state == "unopened"
    assert await client.vllm_version(refresh=True) == "0.32.0"
    assert client.state == "open"
    await client.aclose()
    assert client.state == "closed"


async def test_borrowed_session_is_not_closed(fake32: FakeVLLMServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with az.AsyncVLLMClient(fake32.url, session=session) as client:
            await client.health()
        assert not session.closed
        async with session.get(fake32.url + "/health") as resp:
            assert resp.status == 200


async def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        az.AsyncVLLMClient("localhost:8000")
    with pytest.raises(TypeError, match="Timeouts"):
        az.AsyncVLLMClient("http://x", timeouts=5)  # type: ignore[arg-type]


async def test_version_is_read_once_and_cached(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        versions = await asyncio.gather(*(client.vllm_version() for _ in range(5)))
        assert versions == ["0.32.0"] * 5
        assert await client.protocol() == "0.32"
        await client.start_weight_update()
    assert len(fake32.requests_to("/version")) == 1


async def test_vllm_version_override_skips_probe(fake23: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake23.url, vllm_version="0.23.1") as client:
        await client.start_weight_update()
    assert fake23.requests_to("/version") == []


async def test_bearer_token_on_every_request(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url, api_key="sekret") as client:
        await client.health()
        await client.pause("wait")
        await client.start_weight_update()
    assert fake32.requests
    assert all(r.headers.get("Authorization") == "Bearer sekret" for r in fake32.requests)


async def test_control_routes_032(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        assert await client.is_paused() is False
        for mode in ("abort", "wait", "keep"):
            await client.pause(mode)  # type: ignore[arg-type]
            assert await client.is_paused() is True
            await client.resume()
            assert await client.is_paused() is False
        await client.pause("keep", clear_cache=False)
        await client.resume()
        assert await client.abort_requests() == 0
        assert await client.abort_requests(["a", "b"]) == 2
        assert await client.weight_info() == "default"
        await client.update_weight_version("v7")
        assert await client.weight_info() == "v7"
        assert client.weight_version == "v7"
        assert await client.get_world_size() == 1
        assert await client.get_world_size(include_dp=False) == 1
        assert await client.reset_prefix_cache() is True
        checksums = await client.weight_checksums()
        assert checksums == fake32.checksums()
        same = await client.compare_weights(checksums)
        assert same == az.WeightComparison(match=True, mismatches=())
        diff = await client.compare_weights({"extra": "0"})
        assert diff.match is False
        assert "extra" in diff.mismatches
        await client.shutdown_weight_transfer_engine()
    pauses = fake32.requests_to("/pause")
    assert [p.query for p in pauses] == [
        {"mode": "abort"},
        {"mode": "wait"},
        {"mode": "keep"},
        {"mode": "keep", "clear_cache": "false"},
    ]
    assert [r.json for r in fake32.requests_to("/abort_requests")] == [
        {},
        {"request_ids": ["a", "b"]},
    ]
    assert fake32.requests_to("/get_world_size")[1].query == {"include_dp": "false"}


async def test_weight_round_payloads_032(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        await client.init_weight_transfer_engine({"segment": "x"})
        await client.start_weight_update()
        await client.update_weights(UPDATE_INFO)
        await client.update_weights([UPDATE_INFO])  # one dict per worker rank
        await client.finish_weight_update("step-1")
        assert client.weight_version == "step-1"
        assert await client.weight_info() == "step-1"
        await client.start_weight_update()
        await client.finish_weight_update()  # no version: the server keeps its own
        assert await client.weight_info() == "step-1"
    assert fake32.requests_to("/init_weight_transfer_engine")[0].json == {
        "init_info": {"segment": "x"}
    }
    assert [r.body for r in fake32.requests_to("/start_weight_update")] == [b"", b""]
    assert [r.json for r in fake32.requests_to("/update_weights")] == [
        {"update_info": UPDATE_INFO},
        {"update_info": [UPDATE_INFO]},
    ]
    finishes = fake32.requests_to("/finish_weight_update")
    assert finishes[0].json == {"weight_version": "step-1"}
    assert finishes[1].body == b""


async def test_weight_round_payloads_023(fake23: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake23.url) as client:
        assert await client.protocol() == "0.23"
        await client.init_weight_transfer_engine({"master_address": "127.0.0.1"})
        await client.start_weight_update()
        await client.update_weights(UPDATE_INFO, packed=True)
        await client.finish_weight_update("step-1")
        assert client.weight_version == "step-1"
        await client.start_weight_update(is_checkpoint_format=False)
        await client.update_weights(UPDATE_INFO)
        await client.finish_weight_update()
        assert client.weight_version == "step-1"
    starts = [r.json for r in fake23.requests_to("/start_weight_update")]
    assert starts == [{"is_checkpoint_format": True}, {"is_checkpoint_format": False}]
    updates = [r.json for r in fake23.requests_to("/update_weights")]
    assert updates == [
        {"update_info": {**UPDATE_INFO, "packed": True}},
        {"update_info": UPDATE_INFO},
    ]
    # 0.23 ignores the finish body: no version goes over the wire.
    assert [r.body for r in fake23.requests_to("/finish_weight_update")] == [b"", b""]
    assert fake23.weight_version == "default"
    assert fake23.finished == 2


async def test_routes_missing_on_023_raise_protocol_error(fake23: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake23.url) as client:
        for call in (
            client.weight_info(),
            client.update_weight_version("v"),
            client.weight_checksums(),
            client.compare_weights({}),
            client.shutdown_weight_transfer_engine(),
        ):
            with pytest.raises(az.ProtocolError, match=r"needs vLLM >= 0\.32") as info:
                await call
            assert info.value.server == fake23.url
        with pytest.raises(az.ProtocolError, match="per-rank update_info list"):
            await client.update_weights([UPDATE_INFO])
        # Without --tokens-only, 0.23 has no /abort_requests: a 404 becomes ProtocolError.
        with pytest.raises(az.ProtocolError, match="--tokens-only") as nf:
            await client.abort_requests()
        assert nf.value.status == 404
    # Only /version and /abort_requests reached the server; the rest failed client-side.
    assert [r.path for r in fake23.requests] == ["/version", "/abort_requests"]


async def test_abort_requests_on_023_tokens_only() -> None:
    fake = FakeVLLMServer(version="0.23.0", tokens_only=True)
    async with fake, az.AsyncVLLMClient(fake.url) as client:
        assert await client.abort_requests(["r1"]) == 1


async def test_version_specific_options_are_rejected(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.ProtocolError, match="is_checkpoint_format"):
            await client.start_weight_update(is_checkpoint_format=True)
        with pytest.raises(az.ProtocolError, match="packed belongs in init_info"):
            await client.update_weights(UPDATE_INFO, packed=True)
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause("later")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="update_info"):
            await client.update_weights("names")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="request_ids"):
            await client.abort_requests("r1")
        with pytest.raises(TypeError, match="weight version"):
            await client.finish_weight_update("")
    assert [r.path for r in fake32.requests] == ["/version"]


def documented_error(pattern: str) -> str:
    """The error docs/client.md quotes after ``pattern`` (a regex ending where the quoted
    text's backtick opens), its line breaks undone."""
    found = re.search(pattern + r"\s*`([^`]+)`", CLIENT_DOCS.read_text())
    assert found is not None, f"docs/client.md no longer quotes an error after {pattern!r}"
    return " ".join(found[1].split())


def as_documented(err: BaseException, server: str) -> str:
    """What a user sees of ``err`` (``Class: str(err)``), with the docs' example address in
    place of the test server's."""
    return f"{type(err).__name__}: {err}".replace(server, "http://127.0.0.1:8003")


async def test_unsupported_version() -> None:
    async with FakeVLLMServer(version="0.10.2") as fake, az.AsyncVLLMClient(fake.url) as client:
        with pytest.raises(az.UnsupportedVLLMError) as info:
            await client.start_weight_update()
    err = info.value
    assert isinstance(err, az.ProtocolError)
    assert (err.version, err.server) == ("0.10.2", fake.url)
    assert fake.requests_to("/start_weight_update") == []  # refused before it was sent
    # What docs/client.md says an older server raises, word for word.
    assert as_documented(err, fake.url) == documented_error(r"Older servers raise")


#: What may differ between the docs' example and a run: the ports, a deadline's seconds.
_PORTS = re.compile(r"(127\.0\.0\.1(?:', |:))\d+")
_SECONDS = re.compile(r"within [\d.]+ s")


def _comparable(text: str) -> str:
    return _SECONDS.sub("within N s", _PORTS.sub(r"\1PORT", " ".join(text.split())))


async def _raised(call: Awaitable[object]) -> BaseException:
    with pytest.raises(az.AsyncSyncError) as info:
        await call
    return info.value


async def _route_lacking(fake: FakeVLLMServer) -> BaseException:
    async with FakeVLLMServer(version="0.23.0") as old, az.AsyncVLLMClient(old.url) as client:
        return await _raised(client.weight_info())


async def _malformed_200(fake: FakeVLLMServer) -> BaseException:
    fake.inject("/pause", Fault.malformed())
    async with az.AsyncVLLMClient(fake.url, retry=None) as client:
        return await _raised(client.pause("abort"))


async def _hang(fake: FakeVLLMServer) -> BaseException:
    fake.inject("/update_weights", Fault.hang())
    await _started(fake)
    async with _short_update_deadline(fake) as client:
        return await _raised(client.update_weights(UPDATE_INFO))


async def _started(fake: FakeVLLMServer) -> None:
    """An update started on ``fake`` by a client with the default deadlines (an answer
    never races a short one on a loaded machine)."""
    async with az.AsyncVLLMClient(fake.url) as client:
        await client.start_weight_update()


def _short_update_deadline(fake: FakeVLLMServer) -> az.AsyncVLLMClient:
    """A client whose update deadline is 0.3 s, the others far from it (so that which
    one fired is beyond doubt), and which knows the server's version: the call a test
    makes with it is the only one it sends."""
    timeouts = az.Timeouts(connect=60.0, control=60.0, update=0.3)
    return az.AsyncVLLMClient(fake.url, timeouts=timeouts, vllm_version=fake.version)


async def _nothing_listens(fake: FakeVLLMServer) -> BaseException:
    await fake.stop()
    async with az.AsyncVLLMClient(fake.url, retry=None) as client:
        return await _raised(client.health())


async def _connection_drops(fake: FakeVLLMServer) -> BaseException:
    fake.inject("/finish_weight_update", Fault.die())
    async with az.AsyncVLLMClient(fake.url, retry=None) as client:
        await client.start_weight_update()
        return await _raised(client.finish_weight_update("v1"))


async def _one_of_a_fleet(fake: FakeVLLMServer) -> BaseException:
    async with FakeVLLMServer() as first, FakeVLLMServer() as dead:
        await dead.stop()
        urls = [first.url, dead.url, fake.url]
        async with az.Fleet(urls, retry=None) as fleet:
            return await _raised(fleet.pause("abort"))


#: Rows of docs/client.md's error table that fakes reproduce, by their first cell.
DOCUMENTED_ERRORS = {
    "a route this vLLM lacks": _route_lacking,
    "a 200 that is not the promised JSON": _malformed_200,
    "the server hangs": _hang,
    "nothing listens": _nothing_listens,
    "the connection drops mid-call": _connection_drops,
    "one server of a fleet failed": _one_of_a_fleet,
}


@pytest.mark.parametrize("row", DOCUMENTED_ERRORS)
async def test_errors_read_as_the_docs_quote_them(fake32: FakeVLLMServer, row: str) -> None:
    """What docs/client.md's error table says a user sees, word for word (the ports and
    a deadline's seconds aside)."""
    err = await DOCUMENTED_ERRORS[row](fake32)
    documented = documented_error(rf"\| {re.escape(row)} \|")
    assert _comparable(f"{type(err).__name__}: {err}") == _comparable(documented)


async def test_worker_failure_becomes_server_error(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.ServerError) as info:
            await client.update_weights(UPDATE_INFO)  # no start first
    err = info.value
    assert err.status == 500
    assert err.server == fake32.url
    assert err.route == "/update_weights"
    assert "start_weight_update must be called before update_weights" in err.message
    assert err.message.startswith("InternalServerError: Call to collective_rpc method failed")
    assert err.body is not None
    assert "collective_rpc" in err.body
    text = str(err)
    assert fake32.url in text
    assert "(HTTP 500)" in text


async def test_request_after_a_worker_failure_is_not_lost(fake32: FakeVLLMServer) -> None:
    """vLLM (uvicorn) closes the connection right after a worker-failure 500; the next
    request must not die on that pooled connection."""
    async with az.AsyncVLLMClient(fake32.url) as client:
        for _ in range(5):
            with pytest.raises(az.ServerError, match="without a matching start"):
                await client.finish_weight_update("v")
            await client.start_weight_update()  # a POST right after: no "connection reset"
            with pytest.raises(az.ServerError, match="already active"):
                await client.start_weight_update()
            await client.finish_weight_update("v")
    assert fake32.finished == 5


async def test_no_backend_and_validation_errors() -> None:
    async with FakeVLLMServer(backend=None) as fake, az.AsyncVLLMClient(fake.url) as client:
        with pytest.raises(az.ServerError, match="Weight transfer not configured") as info:
            await client.start_weight_update()
        assert info.value.status == 500
        # The client must not reuse the connection the 500 came on (vLLM closes it).
        await client.resume()


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault.error(500, "boom", shape="collective"), "Call to collective_rpc method failed"),
        (Fault.error(400, "bad thing", shape="openai"), "Bad Request: bad thing"),
        (Fault.error(500, "Failed to pause generation: x", shape="string"), "Failed to pause"),
        (Fault.error(409, "conflict here", shape="detail"), "conflict here"),
        (Fault.error(502, "<html>bad gateway</html>", shape="text"), "HTTP 502 Bad Gateway"),
    ],
)
async def test_all_error_shapes_are_parsed(
    fake32: FakeVLLMServer, fault: Fault, expected: str
) -> None:
    fake32.inject("/pause", fault)
    async with az.AsyncVLLMClient(fake32.url, retry=None) as client:
        with pytest.raises(az.ServerError, match=expected) as info:
            await client.pause("abort")
    assert info.value.status == fault.status
    assert info.value.route == "/pause"


@pytest.mark.parametrize(
    "body",
    [b"<html>oops</html>", b"", b'{"status": "resting"}', b"[1, 2]", b'{"is_paused": "no"}'],
)
async def test_malformed_200_is_an_error(fake32: FakeVLLMServer, body: bytes) -> None:
    fake32.inject("/pause", Fault.malformed(body))
    fake32.inject("/is_paused", Fault.malformed(body), times=None)
    async with az.AsyncVLLMClient(fake32.url, retry=None) as client:
        with pytest.raises(az.ServerError, match="malformed 200 response") as info:
            await client.pause("abort")
        assert info.value.status == 200
        with pytest.raises(az.ServerError, match=r"expected \{\"is_paused\": bool\}"):
            await client.is_paused()


async def test_hang_times_out_within_the_deadline(fake32: FakeVLLMServer) -> None:
    fake32.inject("/update_weights", Fault.hang())
    await _started(fake32)
    async with _short_update_deadline(fake32) as client:
        started = time.monotonic()
        with pytest.raises(
            az.ServerTimeout, match=r"no response within 0\.3 s \(update deadline\)"
        ) as info:
            await client.update_weights(UPDATE_INFO)
        elapsed = time.monotonic() - started
    assert isinstance(info.value, TimeoutError)
    assert info.value.route == "/update_weights"
    assert 0.3 <= elapsed < 60  # not before the update deadline; long before control's
    # The hung handler saw its client go away: the connection was closed.
    await wait_until(lambda: bool(fake32.cancelled))
    assert fake32.cancelled == ["/update_weights"]


async def test_connection_refused_is_unavailable() -> None:
    async with FakeVLLMServer() as fake:
        url = fake.url
    async with az.AsyncVLLMClient(url, retry=None) as client:
        with pytest.raises(az.ServerUnavailableError, match="cannot connect") as info:
            await client.pause("abort")
    assert info.value.server == url
    assert isinstance(info.value.__cause__, aiohttp.ClientConnectorError)


async def test_connection_drop_is_unavailable(fake32: FakeVLLMServer) -> None:
    fake32.inject("/start_weight_update", Fault.drop())
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.ServerUnavailableError, match="may or may not have applied"):
            await client.start_weight_update()
        await client.start_weight_update()  # the server is still there


async def test_server_dying_mid_request(fake32: FakeVLLMServer) -> None:
    fake32.inject("/finish_weight_update", Fault.die())
    async with az.AsyncVLLMClient(fake32.url, retry=None) as client:
        await client.start_weight_update()
        with pytest.raises(az.ServerUnavailableError, match="connection lost"):
            await client.finish_weight_update("v1")
        with pytest.raises(az.ServerUnavailableError, match="cannot connect"):
            await client.health()
    assert not fake32.alive


async def test_idempotent_calls_are_retried(fake32: FakeVLLMServer) -> None:
    fake32.inject("/weight_info", Fault.error(503, "busy", shape="openai"), times=2)
    policy = az.RetryPolicy(attempts=3, base_delay=0.01)
    async with az.AsyncVLLMClient(fake32.url, retry=policy) as client:
        assert await client.weight_info() == "default"
    assert len(fake32.requests_to("/weight_info")) == 3


async def test_retry_gives_up_after_attempts_and_honours_off(fake32: FakeVLLMServer) -> None:
    fake32.inject("/is_paused", Fault.error(503, "busy", shape="string"), times=None)
    async with az.AsyncVLLMClient(
        fake32.url, retry=az.RetryPolicy(attempts=2, base_delay=0.0)
    ) as client:
        with pytest.raises(az.ServerError, match="busy"):
            await client.is_paused()
    assert len(fake32.requests_to("/is_paused")) == 2
    async with az.AsyncVLLMClient(fake32.url, retry=az.RetryPolicy.off()) as client:
        with pytest.raises(az.ServerError):
            await client.is_paused()
    assert len(fake32.requests_to("/is_paused")) == 3


async def test_retry_after_header_is_honoured(fake32: FakeVLLMServer) -> None:
    from aiohttp import web

    calls: list[float] = []

    @web.middleware
    async def busy_once(request: web.Request, handler: object) -> web.StreamResponse:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "0.2"})
        return web.json_response({"version": "0.32.0"})

    app = web.Application(middlewares=[busy_once])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        policy = az.RetryPolicy(attempts=2, base_delay=0.0)
        async with az.AsyncVLLMClient(f"http://127.0.0.1:{port}", retry=policy) as client:
            assert await client.vllm_version(refresh=True) == "0.32.0"
    finally:
        await runner.cleanup()
    assert calls[1] - calls[0] >= 0.19


async def test_non_idempotent_calls_are_never_retried(fake32: FakeVLLMServer) -> None:
    fake32.inject("/pause", Fault.error(503, "busy", shape="string"))
    async with az.AsyncVLLMClient(fake32.url, retry=az.RetryPolicy(base_delay=0.0)) as client:
        with pytest.raises(az.ServerError, match="busy"):
            await client.pause("abort")
    assert len(fake32.requests_to("/pause")) == 1


async def test_unknown_route_404_names_dev_mode(fake32: FakeVLLMServer) -> None:
    fake32.inject("/resume", Fault.error(404, "Not Found", shape="detail"))
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.ProtocolError, match="VLLM_SERVER_DEV_MODE=1") as info:
            await client.resume()
    assert info.value.status == 404


async def test_tensor_metadata_is_made_json_safe(fake32: FakeVLLMServer) -> None:
    torch = pytest.importorskip("torch")
    info = {
        "names": ["w"],
        "dtype_names": [torch.bfloat16],
        "shapes": [torch.Size([4, 8])],
        "numel": torch.tensor(32).item(),
    }
    async with az.AsyncVLLMClient(fake32.url) as client:
        await client.start_weight_update()
        await client.update_weights(info)
    sent = fake32.requests_to("/update_weights")[0].json
    assert sent == {
        "update_info": {
            "names": ["w"],
            "dtype_names": ["bfloat16"],
            "shapes": [[4, 8]],
            "numel": 32,
        }
    }


async def test_cancelled_call_closes_its_connection(fake32: FakeVLLMServer) -> None:
    fake32.inject("/pause", Fault.hang())
    async with az.AsyncVLLMClient(fake32.url) as client:
        task = asyncio.create_task(client.pause("abort"))
        await arrived(fake32, "/pause")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: bool(fake32.cancelled))
        assert fake32.cancelled == ["/pause"]
        await client.resume()  # the client is still usable


async def test_a_generation_whose_connection_closed_unanswered_is_sent_once_more(
    fake32: FakeVLLMServer,
) -> None:
    """uvicorn may close a pooled keep-alive connection with the next request already
    written on it (tests/test_load_vllm.py found it under load): a plain generation that
    got no answer at all is sent again (several pooled connections may be closed at
    once: up to four more tries); a close on every try is the caller's error."""
    fake32.inject("/inference/v1/generate", Fault.drop(), times=1)
    async with az.AsyncVLLMClient(fake32.url, retry=None) as client:
        done = await client.generate([1, 2, 3], max_tokens=2, request_id="once")
        assert done.request_id == "generate-tokens-once"
        assert len(done.token_ids) == 2
        sent = [r for r in fake32.requests if r.path == "/inference/v1/generate"]
        assert len(sent) == 2
        fake32.inject("/inference/v1/generate", Fault.drop(), times=2)
        twice = await client.generate([1, 2, 3], max_tokens=2, request_id="twice")
        assert twice.request_id == "generate-tokens-twice"
        fake32.inject("/inference/v1/generate", Fault.drop(), times=5)
        with pytest.raises(az.ServerUnavailableError, match="may or may not have applied"):
            await client.generate([1, 2, 3], max_tokens=2)
        sent = [r for r in fake32.requests if r.path == "/inference/v1/generate"]
        assert len(sent) == 2 + 3 + 5  # once + 1 resend, 2 + 1, then all five tries
        # Control calls keep their rule: no answer, no resend (the call may have run).
        fake32.inject("/pause", Fault.drop(), times=1)
        with pytest.raises(az.ServerUnavailableError, match="may or may not have applied"):
            await client.pause("abort")


async def test_a_stream_whose_connection_closed_before_its_headers_is_sent_once_more(
    fake32: FakeVLLMServer,
) -> None:
    """The same rule for a streamed generation: a pooled connection closed before the
    response headers came means the server never read the request; it is sent again (up
    to four more tries) and streams as usual; a close on every try is the caller's
    error, and a failed stream is never resent once its headers came."""
    route = "/inference/v1/generate"
    fake32.inject(route, Fault.drop(), times=2)
    async with az.AsyncVLLMClient(fake32.url, retry=None) as client:
        async with client.stream([1, 2, 3], max_tokens=3, request_id="s") as stream:
            deltas = [delta async for delta in stream]
        assert stream.completion.request_id == "generate-tokens-s"
        assert len(stream.completion.token_ids) == 3
        assert sum(len(d.token_ids) for d in deltas) == 3
        assert len(fake32.requests_to(route)) == 3  # two closed, then answered
        fake32.inject(route, Fault.drop(), times=5)
        with pytest.raises(az.ServerUnavailableError, match="may or may not have applied"):
            async with client.stream([1, 2, 3], max_tokens=3) as stream:
                [delta async for delta in stream]
        assert len(fake32.requests_to(route)) == 3 + 5
        # Answered with a 5xx: an answer, not a closed connection; not sent again.
        fake32.inject(route, Fault.error(500), times=1)
        with pytest.raises(az.ServerError):
            async with client.stream([1, 2, 3], max_tokens=3) as stream:
                [delta async for delta in stream]
        assert len(fake32.requests_to(route)) == 3 + 5 + 1


async def test_the_weight_checker_runs_under_the_update_deadline(
    fake32: FakeVLLMServer,
) -> None:
    """/weight_checker hashes every parameter on every worker, like a weight-sync call:
    a big model's checksum outlasts the light routes' deadline, so it has update's."""
    # Each client knows the server's version: the checker is the one call it sends (the
    # /version a 0.3 s control deadline would race is never asked). The fake's 0.6 s and
    # the client's 0.3 s are timers of the one event loop: they fire in that order
    # however late the loop runs.
    version = fake32.version
    fake32.inject("/weight_checker", Fault.delay(0.6), times=1)
    quick_control = az.Timeouts(connect=5, control=0.3, update=10, generate=10)
    async with az.AsyncVLLMClient(
        fake32.url, timeouts=quick_control, retry=None, vllm_version=version
    ) as client:
        assert await client.weight_checksums() == fake32.checksums()
    fake32.inject("/weight_checker", Fault.delay(0.6), times=1)
    quick_update = az.Timeouts(connect=5, control=10, update=0.3, generate=10)
    async with az.AsyncVLLMClient(
        fake32.url, timeouts=quick_update, retry=None, vllm_version=version
    ) as client:
        with pytest.raises(az.ServerTimeout, match="update deadline"):
            await client.weight_checksums()


async def test_a_weight_sync_call_to_an_engine_that_died_fails_when_health_says_so(
    fake32: FakeVLLMServer,
) -> None:
    """`Timeouts.liveness`: while a weight-sync call is out, /health is asked; its 503
    (vLLM's engine died; the call itself is never answered) fails the call then, a
    `ServerUnavailableError` naming the call's route and what /health said."""
    timeouts = az.Timeouts(update=60, liveness=0.05)
    fake32.inject("/update_weights", Fault.engine_dies())
    async with az.AsyncVLLMClient(fake32.url, timeouts=timeouts) as client:
        await client.start_weight_update()
        began = time.monotonic()
        with pytest.raises(az.ServerUnavailableError) as info:
            await client.update_weights({"names": ["w"]})
        assert time.monotonic() - began < 30
        assert info.value.route == "/update_weights"
        assert info.value.server == fake32.url
        assert "failed its /health (HTTP 503" in str(info.value)
        assert client.server_state.dirty
        assert not client.server_state.healthy
        # The engine's other routes answer its death too (as vLLM's do).
        with pytest.raises(az.ServerError, match="EngineCore encountered an issue"):
            await client.generate([1, 2], max_tokens=1)


async def test_a_health_probe_without_an_answer_leaves_the_call_to_its_deadline(
    fake32: FakeVLLMServer,
) -> None:
    """A frozen server answers neither: the probes time out (each under the control
    deadline) and change nothing; the call's own update deadline ends it."""
    timeouts = az.Timeouts(control=0.2, update=1.5, liveness=0.05)
    fake32.inject("/update_weights", Fault.hang())
    fake32.inject("/health", Fault.hang(), times=None)
    async with az.AsyncVLLMClient(fake32.url, timeouts=timeouts) as client:
        await client.start_weight_update()
        with pytest.raises(az.ServerTimeout, match="update deadline"):
            await client.update_weights({"names": ["w"]})
    assert len(fake32.requests_to("/health")) >= 2  # asked again after each timed-out probe


async def test_a_weight_sync_call_that_ends_in_time_asks_nothing_more(
    fake32: FakeVLLMServer,
) -> None:
    """A call that ends before `Timeouts.liveness` costs one timer, no /health; a slow
    call to a healthy server is asked about and goes on."""
    async with az.AsyncVLLMClient(fake32.url, timeouts=az.Timeouts(liveness=0.05)) as client:
        await client.start_weight_update()
        await client.update_weights({"names": ["w"]})
        assert fake32.requests_to("/health") == []
        fake32.inject("/update_weights", Fault.delay(0.4))
        await client.update_weights({"names": ["w"]})
        assert len(fake32.requests_to("/health")) >= 2
        await client.finish_weight_update()
    assert fake32.finished == 1


async def test_liveness_is_checked_like_every_deadline() -> None:
    with pytest.raises(ValueError, match=r"Timeouts.liveness must be > 0"):
        az.Timeouts(liveness=0)
    with pytest.raises(TypeError, match=r"Timeouts.liveness must be a number"):
        az.Timeouts(liveness="5")  # type: ignore[arg-type]
    assert az.Timeouts(liveness=None).liveness is None
