"""The HTTP boundary: one request with a deadline, aiohttp errors mapped to asyncsync's tree.

Everything here is private; :mod:`asyncsync.client` and :mod:`asyncsync.fleet` build on it.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import aiohttp
import yarl

from asyncsync import _json
from asyncsync._errors import (
    AsyncSyncError,
    ProtocolError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._retry import parse_retry_after
from asyncsync._timeouts import Deadline, Phase, Timeouts

__all__ = ["NO_BODY", "Call", "Malformed", "describe_error_body", "send"]

T = TypeVar("T")

#: Marker for "this request has no body" (distinct from a JSON ``null``).
NO_BODY: Any = object()


class Malformed(Exception):
    """Raised by a response parser: the 2xx body is not what the route promises."""


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One planned request: everything but the server and the encoded body.

    A call is planned once per vLLM protocol generation and sent to many servers; its
    payload is encoded once by the caller and the bytes are shared.
    """

    op: str
    method: Literal["GET", "POST"]
    route: str
    phase: Phase
    parse: Callable[[Any], T]
    expect: str
    payload: Any = NO_BODY
    params: tuple[tuple[str, str], ...] = ()
    idempotent: bool = False
    json_response: bool = True
    #: Weight version the client records when the call succeeds.
    record_version: str | None = None
    #: A hint added to the message when the server answers 404.
    not_found_hint: str | None = None
    extra_headers: Mapping[str, str] = field(default_factory=dict)

    def encode(self) -> bytes | None:
        """The request body as JSON bytes, or ``None`` when the call has no body."""
        if self.payload is NO_BODY:
            return None
        return _json.dumps(self.payload)


def describe_error_body(body: bytes) -> str | None:
    """The human message inside a vLLM error body, for all shapes vLLM uses.

    1. ``{"error": "<string>"}`` (pause, resume, is_paused, abort_requests);
    2. OpenAI style ``{"error": {"message", "type", "param", "code"}}`` (validation
       errors, HTTPException, worker failures "Call to collective_rpc method failed: ...");
    3. FastAPI's own ``{"detail": "..."}`` for unknown routes and methods (404, 405).

    Returns ``None`` when the body is none of these (e.g. a proxy's HTML page).
    """
    try:
        data = _json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if not isinstance(message, str):
            return None
        kind = error.get("type")
        param = error.get("param")
        text = f"{kind}: {message}" if isinstance(kind, str) and kind else message
        if isinstance(param, str) and param:
            text = f"{text} (param {param})"
        return text
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
    return None


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")


def _status_error(
    call: Call[Any], server: str, status: int, reason: str | None, body: bytes, headers: Any
) -> AsyncSyncError:
    message = describe_error_body(body)
    if status == 404:
        hint = call.not_found_hint or (
            "the RL routes exist only when vLLM runs with VLLM_SERVER_DEV_MODE=1"
        )
        detail = f" ({message})" if message else ""
        return ProtocolError(
            f"{call.method} {call.route} is not served by this server{detail}: {hint}",
            server=server,
            route=call.route,
            status=status,
            body=_text(body),
        )
    if message is None:
        excerpt = _text(body).strip()
        message = f"HTTP {status} {reason or ''}".strip()
        if excerpt:
            message = f"{message}: {excerpt[:200]}"
    err = ServerError(message, server=server, route=call.route, status=status, body=_text(body))
    retry_after = parse_retry_after(headers.get("Retry-After"))
    if retry_after is not None:
        err.retry_after = retry_after  # type: ignore[attr-defined]
    return err


def _transport_error(
    exc: BaseException, call: Call[Any], server: str, timeouts: Timeouts
) -> AsyncSyncError:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ServerTimeout(
            f"could not connect within {timeouts.connect:g} s (connect deadline)",
            server=server,
            route=call.route,
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ServerUnavailable(f"cannot connect: {exc.os_error}", server=server, route=call.route)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) or (
        isinstance(exc, aiohttp.ClientOSError)
        and exc.errno in {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}
    ):
        return ServerUnavailable(
            "connection lost before the response was complete "
            f"({type(exc).__name__}: {exc}); the server may or may not have applied "
            f"{call.route}",
            server=server,
            route=call.route,
        )
    return ServerUnavailable(
        f"request failed: {type(exc).__name__}: {exc}", server=server, route=call.route
    )


def send(
    session: aiohttp.ClientSession,
    server: str,
    call: Call[T],
    body: bytes | None,
    *,
    headers: Mapping[str, str],
    timeouts: Timeouts,
    after_server_error: bool = False,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Coroutine[Any, Any, T]:
    """Send ``call`` to ``server`` once and return the parsed response.

    The whole exchange (connect, send, wait, read) runs under the phase's deadline.
    Every failure is an :class:`~asyncsync.AsyncSyncError` naming the server and route,
    raised ``from`` the aiohttp error; a 2xx whose body does not parse is a
    :class:`~asyncsync.ServerError`, never a success. Cancellation propagates untouched
    and aiohttp closes the connection of an unfinished request.

    ``after_server_error``: the previous answer from this server was a 5xx. When vLLM
    fails with an exception its handlers do not catch (every worker failure,
    "Call to collective_rpc method failed: ..."), uvicorn sends the 500 and then closes
    the connection; aiohttp has already put that connection back in its pool, and the
    next request written on it fails at once with "Server disconnected" or "Connection
    reset", unread by the server. In that one situation the request is sent once more,
    on a fresh connection; it is safe because the server never read the first copy.

    ``loop``: the running loop, when the caller holds it (saves a lookup per request).
    """
    if loop is None:
        loop = asyncio.get_running_loop()
    if after_server_error:
        return _send_resending(session, server, call, body, headers, timeouts, loop)
    return _send_once(session, server, call, body, headers, timeouts, loop)


async def _send_resending(
    session: aiohttp.ClientSession,
    server: str,
    call: Call[T],
    body: bytes | None,
    headers: Mapping[str, str],
    timeouts: Timeouts,
    loop: asyncio.AbstractEventLoop,
) -> T:
    try:
        return await _send_once(session, server, call, body, headers, timeouts, loop)
    except ServerUnavailable as err:
        if not _is_stale_connection(err.__cause__):
            raise
    return await _send_once(session, server, call, body, headers, timeouts, loop)


def _is_stale_connection(exc: BaseException | None) -> bool:
    """An error aiohttp raises when a pooled connection was closed by the server."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in {errno.ECONNRESET, errno.EPIPE}


_JSON_HEADERS = {"Content-Type": "application/json"}


@functools.lru_cache(maxsize=64)
def _client_timeout(connect: float | None) -> aiohttp.ClientTimeout:
    # The whole exchange runs under Deadline(loop, deadline); aiohttp only bounds the
    # connect. One immutable object per connect deadline, not one per request.
    return aiohttp.ClientTimeout(total=None, sock_connect=connect)


@functools.lru_cache(maxsize=8192)
def _url(server: str, route: str) -> yarl.URL:
    # Parsed once per server and route; aiohttp otherwise parses the string on every
    # request (a few percent of a fan-out's CPU).
    return yarl.URL(server + route)


async def _send_once(
    session: aiohttp.ClientSession,
    server: str,
    call: Call[T],
    body: bytes | None,
    headers: Mapping[str, str],
    timeouts: Timeouts,
    loop: asyncio.AbstractEventLoop,
) -> T:
    deadline = timeouts.for_phase(call.phase)
    if body is None and not call.extra_headers:
        request_headers: Mapping[str, str] = headers
    else:
        request_headers = {**headers, **_JSON_HEADERS} if body is not None else dict(headers)
        if call.extra_headers:
            request_headers.update(call.extra_headers)
    client_timeout = _client_timeout(timeouts.connect)
    try:
        async with (
            Deadline(loop, deadline),
            session.request(
                call.method,
                _url(server, call.route),
                params=call.params or None,
                data=body,
                headers=request_headers,
                timeout=client_timeout,
                allow_redirects=False,
            ) as resp,
        ):
            payload = await resp.read()
            status, reason, resp_headers = resp.status, resp.reason, resp.headers
    except TimeoutError as exc:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            raise _transport_error(exc, call, server, timeouts) from exc
        raise ServerTimeout(
            f"no response within {deadline:g} s ({call.phase} deadline)",
            server=server,
            route=call.route,
        ) from exc
    except aiohttp.ClientError as exc:
        raise _transport_error(exc, call, server, timeouts) from exc
    except OSError as exc:  # socket errors aiohttp does not wrap
        raise _transport_error(exc, call, server, timeouts) from exc

    if not 200 <= status < 300:
        raise _status_error(call, server, status, reason, payload, resp_headers)
    if not call.json_response:
        try:
            return call.parse(payload)
        except Malformed as exc:
            raise _malformed(call, server, status, payload, exc) from exc
    try:
        data = _json.loads(payload)
    except ValueError as exc:
        raise _malformed(call, server, status, payload, exc) from exc
    try:
        return call.parse(data)
    except Malformed as exc:
        raise _malformed(call, server, status, payload, exc) from exc


def _malformed(
    call: Call[Any], server: str, status: int, payload: bytes, exc: Exception
) -> ServerError:
    excerpt = _text(payload).strip()
    if excerpt:
        shown = repr(excerpt[:120] + ("..." if len(excerpt) > 120 else ""))
    else:
        shown = "an empty body"
    return ServerError(
        f"malformed {status} response: expected {call.expect}, got {shown}",
        server=server,
        route=call.route,
        status=status,
        body=_text(payload),
    )
