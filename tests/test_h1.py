"""The lean HTTP/1.1 client (asyncsync/_http/h1.py) against servers that send exact bytes.

Each server here is a plain asyncio socket server written for the case: answers framed
by Content-Length, chunked or read to the close, interim 1xx answers, gzip, answers cut
short, resets, garbage, slow servers, servers that close idle connections. What the
user sees is checked through the public client (`AsyncVLLMClient`), so the errors are
asyncsync's typed ones; the pool's own bookkeeping (reuse, expiry, nothing left
checked out) through `h1_pool`.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest

import asyncsync as az
from asyncsync._http.h1 import H1Pool
from asyncsync._http.transport import h1_pool
from tests.waiting import wait_until

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]
"""Answers one request (its head and body given); returns whether to keep the
connection open for the next one."""

pytestmark = pytest.mark.asyncio

VERSION = json.dumps({"version": "0.32.0"}).encode()


class RawServer:
    """A socket server answering each request with ``reply``; counts connections."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append(head + body)
                if not await self.reply(reader, writer, head):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    def close_idle(self) -> None:
        """Close every open connection (as uvicorn does after its keep-alive timeout)."""
        for writer in list(self._writers):
            writer.close()


def answer(body: bytes, *, status: str = "200 OK", extra: bytes = b"") -> Reply:
    async def reply(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
        writer.write(
            b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n"
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body
        )  # fmt: skip
        await writer.drain()
        return True

    return reply


@asynccontextmanager
async def client_of(
    reply: Reply, **options: object
) -> AsyncIterator[tuple[RawServer, az.AsyncVLLMClient]]:
    async with RawServer(reply) as server, az.AsyncVLLMClient(server.url, **options) as client:  # type: ignore[arg-type]
        yield server, client


async def test_one_connection_carries_sequential_requests_and_the_head_is_exact() -> None:
    async with client_of(answer(VERSION), api_key="k1") as (server, client):
        for _ in range(5):
            assert await client.vllm_version(refresh=True) == "0.32.0"
        assert server.connections == 1
        pool = h1_pool(client.session)
        assert pool is not None
        assert pool.in_use == 0
        assert pool.idle == 1
    head = server.requests[0].split(b"\r\n")
    assert head[0] == b"GET /version HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}".encode() in head
    assert b"Authorization: Bearer k1" in head
    assert b"Accept: application/json" in head


async def test_post_bodies_carry_their_length() -> None:
    ok = json.dumps({"message": "ok"}).encode()
    async with client_of(answer(ok), vllm_version="0.32.0") as (server, client):
        await client.start_weight_update()
        await client.init_weight_transfer_engine({"n": 1})
    empty, full = server.requests[-2:]
    assert empty.startswith(b"POST /start_weight_update HTTP/1.1\r\n")
    assert empty.endswith(b"\r\nContent-Length: 0\r\n\r\n")
    head, _, body = full.partition(b"\r\n\r\n")
    assert json.loads(body) == {"init_info": {"n": 1}}
    assert b"Content-Length: %d" % len(body) in head.split(b"\r\n")
    assert b"Content-Type: application/json" in head.split(b"\r\n")


@pytest.mark.parametrize(
    "framing",
    [
        "chunked",
        "chunked-trailer",
        "chunked-split",
        "to-close",
        "interim-100",
        "gzip",
        "split-bytes",
    ],
)
async def test_answer_framings(framing: str) -> None:
    async def reply(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
        ok = b"HTTP/1.1 200 OK\r\n"
        if framing.startswith("chunked"):
            a, b = VERSION[:7], VERSION[7:]
            trailer = b"x-t: 1\r\n" if framing == "chunked-trailer" else b""
            whole = (
                ok + b"transfer-encoding: chunked\r\n\r\n"
                + b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\n%s\r\n" % (len(a), a, len(b), b, trailer)
            )  # fmt: skip
            pieces = (
                [whole[i : i + 1] for i in range(len(whole))] if "split" in framing else [whole]
            )
            for piece in pieces:  # one byte per read: every partial state of the parser
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
        elif framing == "to-close":
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + VERSION)
            await writer.drain()
            return False
        elif framing == "interim-100":
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\n"
                + ok
                + b"content-length: %d\r\n\r\n" % len(VERSION)
                + VERSION
            )
        elif framing == "gzip":
            packed = gzip.compress(VERSION)
            writer.write(
                ok + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(packed) + packed
            )
        else:
            whole = ok + b"content-length: %d\r\n\r\n" % len(VERSION) + VERSION
            for i in range(len(whole)):
                writer.write(whole[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)
        await writer.drain()
        return True

    async with client_of(reply) as (server, client):
        assert await client.vllm_version(refresh=True) == "0.32.0"
        assert await client.vllm_version(refresh=True) == "0.32.0"
        # Only an answer read to the close costs a connection per request.
        assert server.connections == (2 if framing == "to-close" else 1)


async def test_a_large_answer_arrives_whole() -> None:
    big = json.dumps({"version": "0.32.0", "pad": "x" * (4 << 20)}).encode()
    async with client_of(answer(big)) as (server, client):
        for _ in range(3):
            assert await client.vllm_version(refresh=True) == "0.32.0"
        assert server.connections == 1


async def test_connection_close_is_never_reused() -> None:
    async with client_of(answer(VERSION, extra=b"connection: close\r\n")) as (server, client):
        assert await client.vllm_version(refresh=True) == "0.32.0"
        assert await client.vllm_version(refresh=True) == "0.32.0"
        assert server.connections == 2
        pool = h1_pool(client.session)
        assert pool is not None
        assert pool.idle == 0


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async with client_of(answer(VERSION)) as (server, client):
        assert await client.vllm_version(refresh=True) == "0.32.0"
        server.close_idle()
        pool = h1_pool(client.session)
        assert pool is not None
        # The close reaches the client's loop; the next request opens a new connection
        # instead of writing into the closed one.
        await asyncio.sleep(0.05)
        assert await client.vllm_version(refresh=True) == "0.32.0"
        assert server.connections == 2


async def test_idle_connections_expire_after_the_keepalive() -> None:
    async with RawServer(answer(VERSION)) as server:
        pool = H1Pool(keepalive=0.05)
        head = [f"GET /version HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()]
        first = await pool.request("127.0.0.1", server.port, head, total=5, connect=5)
        assert first.status == 200
        assert json.loads(first.body) == {"version": "0.32.0"}
        assert pool.idle == 1
        await wait_until(lambda: pool.idle == 0, within=5)  # closed by the pool's timer
        await pool.request("127.0.0.1", server.port, head, total=5, connect=5)
        assert server.connections == 2
        pool.close()


def _cut(after: bytes) -> Reply:
    async def reply(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
        writer.write(after)
        await writer.drain()
        return False

    return reply


async def _reset(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
    writer.transport.abort()  # RST, no answer
    return False


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (_cut(b""), "connection lost before the response was complete"),
        (
            _cut(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"ver'),
            "connection lost before the response was complete",
        ),
        (
            _cut(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{"ver'),
            "connection lost before the response was complete",
        ),
        (_cut(b"SSH-2.0-OpenSSH\r\n\r\n"), "malformed HTTP answer"),
        (_cut(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"), "malformed Content-Length"),
        (_reset, "connection lost before the response was complete"),
    ],
    ids=[
        "closed-before-answer",
        "body-cut-short",
        "chunks-cut-short",
        "not-http",
        "bad-length",
        "reset",
    ],
)
async def test_broken_answers_are_typed_errors(reply: Reply, message: str) -> None:
    async with client_of(reply, retry=None) as (_server, client):
        with pytest.raises(az.ServerUnavailableError, match=message) as caught:
            await client.vllm_version(refresh=True)
        assert caught.value.server == client.base_url
        assert caught.value.route == "/version"
        pool = h1_pool(client.session)
        assert pool is not None
        assert pool.in_use == 0
        assert pool.idle == 0


async def test_error_statuses_keep_their_body_and_retry_after() -> None:
    body = json.dumps({"error": {"message": "busy", "type": "x", "code": 503}}).encode()
    reply = answer(body, status="503 Service Unavailable", extra=b"retry-after: 7\r\n")
    async with client_of(reply, retry=None) as (server, client):
        with pytest.raises(az.ServerError, match="busy") as caught:
            await client.vllm_version(refresh=True)
        assert caught.value.status == 503
        assert caught.value.retry_after == 7
        # An error answer with its length is a complete exchange: the connection stays.
        with pytest.raises(az.ServerError):
            await client.vllm_version(refresh=True)
        assert server.connections == 1


async def test_a_slow_answer_times_out_and_its_connection_is_dropped() -> None:
    async def slow(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
        await asyncio.sleep(30)
        return False

    timeouts = az.Timeouts(connect=5, control=0.2, update=5, generate=5)
    async with client_of(slow, retry=None, timeouts=timeouts) as (_server, client):
        with pytest.raises(az.ServerTimeout, match="control deadline"):
            await client.vllm_version(refresh=True)
        pool = h1_pool(client.session)
        assert pool is not None
        assert pool.in_use == 0
        assert pool.idle == 0


async def test_cancelling_a_request_closes_its_connection() -> None:
    arrived = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _h: bytes) -> bool:
        arrived.set()
        assert await reader.read() == b""  # no answer; the client hangs up
        return False

    async with client_of(hang) as (server, client):
        task = asyncio.create_task(client.vllm_version(refresh=True))
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pool = h1_pool(client.session)
        assert pool is not None
        assert pool.in_use == 0
        assert pool.idle == 0
        await wait_until(lambda: not server._writers, within=10)  # the server saw the close


async def test_a_refused_connection_is_never_sent() -> None:
    async with RawServer(answer(VERSION)) as server:
        url = server.url
    async with az.AsyncVLLMClient(url, retry=None) as client:
        with pytest.raises(az.ServerUnavailableError, match="cannot connect") as caught:
            await client.vllm_version(refresh=True)
    assert isinstance(caught.value.__cause__, aiohttp.ClientConnectorError)


async def test_aiohttp_serves_what_the_lean_pool_does_not() -> None:
    async with RawServer(answer(VERSION)) as server:
        async with (
            aiohttp.ClientSession() as lent,
            az.AsyncVLLMClient(server.url, session=lent) as client,
        ):
            assert await client.vllm_version(refresh=True) == "0.32.0"
            assert h1_pool(client.session) is None  # a lent session is used as it is
        async with az.Fleet([server.url], connection_limit=4) as fleet:
            assert await fleet.client(server.url).vllm_version(refresh=True) == "0.32.0"
            assert h1_pool(fleet.session) is None  # a cap is aiohttp's connector's
        async with az.Fleet([server.url]) as fleet:
            assert await fleet.client(server.url).vllm_version(refresh=True) == "0.32.0"
            pool = h1_pool(fleet.session)
            assert pool is not None
            assert pool.idle == 1
        assert pool.closed
        assert pool.idle == 0


async def test_a_large_request_body_arrives_whole_on_a_reused_connection() -> None:
    ok = json.dumps({"message": "ok"}).encode()
    infos = [{"pad": str(i) * (3 << 20)} for i in range(2)]
    async with client_of(answer(ok), vllm_version="0.32.0") as (server, client):
        for info in infos:
            await client.init_weight_transfer_engine(info)
        assert server.connections == 1
    for sent, info in zip(server.requests, infos, strict=True):
        head, _, body = sent.partition(b"\r\n\r\n")
        assert json.loads(body) == {"init_info": info}
        assert b"Content-Length: %d" % len(body) in head.split(b"\r\n")


class _Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def test_a_large_request_is_written_a_slice_per_turn_of_the_loop() -> None:
    """Over loopback TCP the kernel runs the receiver's side of a send in the sender's
    call: one write of a 1.3 MB update held the loop for 2.5-5 ms. The head goes out
    first, then the body (not copied) a slice per turn of the loop; an answer that comes
    before the whole request leaves a connection that is not reused."""
    from asyncsync._http import h1

    conn = h1._Connection(("127.0.0.1", 1))
    transport = _Recording()
    conn.connection_made(transport)
    body = bytes(range(256)) * (4 * h1._WRITE_SLICE // 256 + 3)
    length = b"Content-Length: %d\r\n\r\n" % len(body)
    waiter = conn.send([b"POST / HTTP/1.1\r\n", length, body])
    assert transport.written == [b"POST / HTTP/1.1\r\n" + length, body[: h1._WRITE_SLICE]]
    conn.data_received(b"HTTP/1.1 413 Too Large\r\ncontent-length: 0\r\n\r\n")
    assert (await waiter).status == 413
    assert not conn.reusable  # slices still to write
    for _ in range(8):
        await asyncio.sleep(0)
    slices = [len(w) for w in transport.written[1:]]
    assert slices == [*[h1._WRITE_SLICE] * 4, len(body) % h1._WRITE_SLICE]
    assert b"".join(transport.written[1:]) == body
    assert conn.reusable

    closed = h1._Connection(("127.0.0.1", 1))
    cut = _Recording()
    closed.connection_made(cut)
    closed.send([b"POST / HTTP/1.1\r\n", b"\r\n", body])
    cut.closing = True  # the exchange failed meanwhile: nothing more is written
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(cut.written) == 2
