"""A lean HTTP/1.1 client for the plain requests of asyncsync's own sessions.

Why: a weight round is three requests per server (start, update, finish) and a fleet
sends each phase to every server at once, so the trainer's CPU per request is what a
large fleet costs it. Measured side by side on one 2-core machine (uvloop, keep-alive
connections, 128 servers), aiohttp's client spends 125-150 µs of CPU per small JSON
request; this one 30-35 µs. At 1,024 servers that is the difference between about
1.2 s and about 0.1 s of the trainer's CPU per round (docs/performance.md).

What it does, and only that:

- one request at a time per connection (no pipelining), keep-alive connections pooled
  per (host, port) and reused newest first; an idle connection is closed after
  ``keepalive`` seconds (a timer, like aiohttp's), and never reused once the server
  closed it, answered ``Connection: close``, or an exchange on it did not finish
  (a deadline, a cancellation, an error);
- request bodies are bytes sent with ``Content-Length``; answers are read by
  ``Content-Length``, chunked, or to the close, with 1xx interim answers skipped;
- failures raise aiohttp's exception types for the same events (refused / timed-out
  connects, a server that closed or reset the connection, a body cut short), so that
  `asyncsync._http.transport.map_error` stays the one place where they become
  asyncsync errors, and the resend rules read them unchanged.

What it leaves to the aiohttp session (`Transport` decides): https, URLs with user
info, streamed answers, a session the user lent, and a fleet with a connection cap.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import types
import zlib
from typing import Any, NamedTuple, cast

import aiohttp

__all__ = ["Answer", "H1Pool"]

#: The most bytes an answer's status line and headers may take.
_MAX_HEAD = 64 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})
#: A request larger than this is written one slice per turn of the event loop. Over
#: loopback TCP the kernel runs the receiving side of a send in the sender's call, so
#: one write of an unpacked ``ipc`` update of 10,000 handles (1.3 MB) held the loop
#: for 2.5-5 ms of CPU; a slice of 256 KiB holds it for about a fifth of that.
_WRITE_SLICE = 256 * 1024


class Answer(NamedTuple):
    """A complete HTTP answer (header names in lower case)."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


class _Head(NamedTuple):
    status: int
    reason: str
    headers: dict[str, str]
    length: int | None  # Content-Length (None: chunked, or read to the close)
    chunked: bool
    keep_alive: bool


class _BadAnswer(Exception):
    """The server's bytes are not an HTTP/1.x answer."""


def _parse_head(raw: bytes) -> _Head:
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise _BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:].isspace():
            raise _BadAnswer(f"malformed header line: {line[:80]!r}")
        key = name.lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    status = int(code)
    keep_alive = version == b"HTTP/1.1"
    connection = headers.get("connection")
    if connection is not None:
        tokens = {t.strip().lower() for t in connection.split(",")}
        keep_alive = "keep-alive" in tokens if version == b"HTTP/1.0" else "close" not in tokens
    encoding = headers.get("transfer-encoding")
    chunked = encoding is not None and encoding.lower().endswith("chunked")
    length: int | None = None
    if not chunked and "content-length" in headers:
        raw_length = headers["content-length"]
        if not raw_length.isdigit():
            raise _BadAnswer(f"malformed Content-Length: {raw_length[:40]!r}")
        length = int(raw_length)
    return _Head(status, reason.decode("latin-1"), headers, length, chunked, keep_alive)


def _decoded(head: _Head, body: bytes) -> bytes:
    """``body`` without a Content-Encoding (asyncsync asks for none; a server may
    still send gzip or deflate)."""
    encoding = head.headers.get("content-encoding", "identity").lower()
    if encoding in ("identity", ""):
        return body
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:
            return zlib.decompress(body, -zlib.MAX_WBITS)
    raise _BadAnswer(f"unsupported Content-Encoding {encoding!r}")


class _Connection(asyncio.Protocol):
    """One keep-alive connection; reads the answer to the request written on it."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._scan = 0  # where the search for the end of the head resumes
        self._head: _Head | None = None
        self._chunks: list[bytes] = []
        self._chunk_size: int | None = None  # the chunk being read (its size line read)
        self._in_trailer = False
        self._waiter: asyncio.Future[Answer] | None = None
        self._writing = False  # slices of a large request still to write

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._buf += data
        try:
            answer = self._parse()
        except (_BadAnswer, ValueError, zlib.error) as exc:
            self._finish(aiohttp.ClientConnectionError(f"malformed HTTP answer: {exc}"))
            return
        if answer is not None:
            self._waiter = None
            if not self._buf:  # let a large answer's buffer go with it
                self._buf = bytearray()
            waiter.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        head = self._head
        if head is not None and head.length is None and not head.chunked and exc is None:
            try:  # an answer read to the close: complete now
                body = _decoded(head, bytes(self._buf))
            except (_BadAnswer, zlib.error) as bad:
                self._finish(aiohttp.ClientConnectionError(f"malformed HTTP answer: {bad}"))
                return
            self._waiter = None
            waiter.set_result(Answer(head.status, head.reason, head.headers, body))
            return
        err: aiohttp.ClientError
        if head is not None:
            err = aiohttp.ClientPayloadError(f"Response payload is not completed: {exc!r}")
        elif isinstance(exc, OSError) and exc.errno:
            err = aiohttp.ClientOSError(exc.errno, exc.strerror or str(exc))
        else:
            err = aiohttp.ServerDisconnectedError()
        err.__cause__ = exc
        self._finish(err)

    # -- the exchange
    def send(self, data: list[bytes]) -> asyncio.Future[Answer]:
        """Write one request and return the future of its answer."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise aiohttp.ClientOSError(errno.ECONNRESET, "Cannot write to closing transport")
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        body = data[-1]
        if len(body) <= _WRITE_SLICE:
            transport.write(b"".join(data))  # one send, not one per piece
        else:  # the head, then the body as it is (no copy of it)
            transport.write(b"".join(data[:-1]))
            self._writing = True
            self._write_from(memoryview(body), 0)
        return waiter

    def _write_from(self, payload: memoryview, at: int) -> None:
        """Write ``payload[at:]`` a slice per turn of the loop (`_WRITE_SLICE`); stop
        when the connection closed meanwhile (the exchange has failed then)."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            self._writing = False
            return
        end = at + _WRITE_SLICE
        transport.write(payload[at:end])
        if end < len(payload):
            asyncio.get_running_loop().call_soon(self._write_from, payload, end)
        else:
            self._writing = False

    @property
    def reusable(self) -> bool:
        """Whether the last exchange left the connection ready for the next one."""
        return (
            not self.closed
            and not self._writing  # a server that answered before the whole request
            and self._waiter is None
            and self._head is None
            and not self._buf
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _finish(self, err: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)

    def _parse(self) -> Answer | None:
        buf = self._buf
        head = self._head
        while head is None:
            end = buf.find(b"\r\n\r\n", self._scan)
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise _BadAnswer(f"status line and headers over {_MAX_HEAD} bytes")
                self._scan = max(0, len(buf) - 3)
                return None
            head = _parse_head(bytes(buf[:end]))
            del buf[: end + 4]
            self._scan = 0
            if 100 <= head.status < 200:
                head = None  # an interim answer (100 Continue, 103 Early Hints): skip it
        self._head = head
        if head.status in _NO_BODY_STATUSES:
            body = b""
        elif head.chunked:
            dechunked = self._dechunk()
            if dechunked is None:
                return None
            body = dechunked
        elif head.length is not None:
            if len(buf) < head.length:
                return None
            body = bytes(buf[: head.length])
            del buf[: head.length]
        else:
            return None  # read to the close (connection_lost completes it)
        self._head = None
        if not head.keep_alive:
            self.close()
        return Answer(head.status, head.reason, head.headers, _decoded(head, body))

    def _dechunk(self) -> bytes | None:
        buf = self._buf
        while True:
            if self._in_trailer:
                if buf[:2] == b"\r\n":
                    del buf[:2]
                else:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        return None
                    del buf[: end + 4]
                body = b"".join(self._chunks)
                self._chunks, self._in_trailer = [], False
                return body
            size = self._chunk_size
            if size is None:  # a chunk's size line (read once, not again per read)
                line_end = buf.find(b"\r\n")
                if line_end < 0:
                    return None
                size = int(bytes(buf[:line_end]).split(b";", 1)[0].strip(), 16)
                del buf[: line_end + 2]
                if size == 0:
                    self._in_trailer = True
                    continue
                self._chunk_size = size
            if len(buf) < size + 2:
                return None
            if buf[size : size + 2] != b"\r\n":
                raise _BadAnswer("a chunk not followed by CRLF")
            self._chunks.append(bytes(buf[:size]))
            del buf[: size + 2]
            self._chunk_size = None


def _time_out(waiter: asyncio.Future[Answer]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer within the deadline"))


class H1Pool:
    """Keep-alive HTTP/1.1 connections per (host, port), for one event loop.

    Args:
        keepalive: seconds an idle connection is kept before it is closed.
    """

    def __init__(self, *, keepalive: float) -> None:
        self._keepalive = keepalive
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def in_use(self) -> int:
        """Connections with an exchange in progress."""
        return len(self._busy)

    @property
    def idle(self) -> int:
        """Idle connections kept for reuse."""
        return sum(len(conns) for conns in self._idle.values())

    async def request(
        self,
        host: str,
        port: int,
        data: list[bytes],
        *,
        total: float | None,
        connect: float | None,
    ) -> Answer:
        """Send the request ``data`` (head and body, written as they are) to
        ``host:port`` and return its answer. ``total``: seconds for the whole exchange
        (TimeoutError); ``connect``: for a new connection (ConnectionTimeoutError).
        No HEAD requests: an answer's body is read by its headers."""
        if self.closed:
            raise aiohttp.ClientConnectionError("the connection pool is closed")
        loop = asyncio.get_running_loop()
        deadline = None if total is None else loop.time() + total
        key = (host, port)
        conn = self._reuse(key, loop)
        if conn is None:  # the whole exchange's deadline covers connecting too
            async with asyncio.timeout_at(deadline):
                conn = await self._connect(key, connect)
        self._busy.add(conn)
        answer: Answer | None = None
        expiry: asyncio.TimerHandle | None = None
        try:
            waiter = conn.send(data)
            if deadline is not None:  # a timer on the answer: cheaper than asyncio.timeout
                expiry = loop.call_at(deadline, _time_out, waiter)
            answer = await waiter
        finally:
            if expiry is not None:
                expiry.cancel()
            self._busy.discard(conn)
            if answer is not None and conn.reusable and not self.closed:
                self._park(conn, loop)
            else:
                conn.close()
        return answer

    def close(self) -> None:
        """Close every connection, idle or busy (a busy exchange fails)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in list(self._busy):
            conn.close()

    # -- the pool
    def _reuse(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        horizon = loop.time() - self._keepalive
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > horizon:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], deadline: float | None) -> _Connection:
        host, port = key
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(deadline):
                _, conn = await loop.create_connection(lambda: _Connection(key), host, port)
        except TimeoutError as exc:
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to host http://{host}:{port}"
            ) from exc
        except OSError as exc:
            where = cast(Any, types.SimpleNamespace(host=host, port=port, ssl=False))
            raise aiohttp.ClientConnectorError(where, exc) from exc
        if self.closed:
            conn.close()
            raise aiohttp.ClientConnectionError("the connection pool is closed")
        return conn

    def _park(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        conn.idle_since = now = loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._timer is None:
            self._timer = loop.call_at(now + self._keepalive, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for ``keepalive`` seconds; come back for the rest."""
        self._timer = None
        loop = asyncio.get_running_loop()
        horizon = loop.time() - self._keepalive
        oldest: float | None = None
        for key in list(self._idle):
            kept = []
            for conn in self._idle[key]:
                if conn.closed or conn.idle_since <= horizon:
                    conn.close()
                else:
                    kept.append(conn)
                    oldest = conn.idle_since if oldest is None else min(oldest, conn.idle_since)
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if oldest is not None and not self.closed:
            self._timer = loop.call_at(oldest + self._keepalive, self._expire)
