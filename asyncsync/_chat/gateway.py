"""``ChatGateway``: an OpenAI-compatible HTTP API over chat sessions, on loopback.

Agent code that runs its own OpenAI client (or its own process) points the client at
``gateway.base_url(session_id)``; every request under that base URL is a turn of that
session (`ChatSession`). `ChatAPI` is the API itself, free of any transport: the
gateway serves it with aiohttp's web server, and `Fleet.openai` hands it to an
``openai.AsyncOpenAI`` through an in-process httpx transport (no socket).

Routes under ``/sessions/<session_id>/v1``: ``POST /chat/completions`` (``stream``
too: the finished turn as server-sent chunks) and ``GET /models``. Errors are
OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``). An SDK retry of a
request (the same body, ``x-stainless-retry-count`` > 0) gets the answer of the first
try, or waits for it: it never records a second turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from asyncsync._chat.chat import ChatSession
from asyncsync._chat.prefix import OnUnstable, UnstablePrefixError
from asyncsync._core import encoding as _json
from asyncsync._core.errors import AsyncSyncError, ClosedError, ServerError
from asyncsync._wire.chat import ChatRequestError, check_chat_request

if TYPE_CHECKING:
    from aiohttp import web

    from asyncsync.fleet import Fleet

__all__ = ["ApiResponse", "ChatAPI", "ChatGateway"]

logger = logging.getLogger("asyncsync.generate")

_JSON = "application/json"
_SSE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class ApiResponse:
    """An answer of `ChatAPI`: status, content type and the whole body."""

    status: int
    body: bytes
    content_type: str = _JSON


def _error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> ApiResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ApiResponse(status, _json.dumps(body))


def error_for(exc: BaseException) -> ApiResponse:
    """The OpenAI-shaped error answer for a failed turn."""
    if isinstance(exc, ChatRequestError):
        code = "model_not_found" if exc.param == "model" else None
        return _error(404 if code else 400, exc.message, "invalid_request_error", exc.param, code)
    if isinstance(exc, UnstablePrefixError):
        return _error(400, exc.message, "invalid_request_error", "messages", "unstable_prefix")
    if isinstance(exc, ServerError) and exc.status is not None and 400 <= exc.status < 500:
        return _error(400, str(exc), "invalid_request_error")  # vLLM refused the request
    if isinstance(exc, AsyncSyncError):
        return _error(502, str(exc), "server_error", code=type(exc).__name__)
    return _error(500, f"{type(exc).__name__}: {exc}", "server_error")


@dataclass(slots=True)
class _LastRequest:
    digest: str
    answer: asyncio.Future[ApiResponse]


class ChatAPI:
    """The OpenAI-compatible chat API over a fleet's chat sessions (no transport).

    Args:
        session: the `ChatSession` of a session id (created on first use by the caller).
    """

    def __init__(self, session: Callable[[str], ChatSession]) -> None:
        self._session = session
        self._last: dict[str, _LastRequest] = {}

    async def handle(
        self, session_id: str, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> ApiResponse:
        """Answer ``method path`` (relative to the session's ``/v1``)."""
        path = "/" + path.strip("/")
        if path == "/models" and method == "GET":
            return await self._models(session_id)
        if path == "/chat/completions" and method == "POST":
            return await self._chat(session_id, headers, body)
        if path in ("/models", "/chat/completions"):
            return _error(405, f"{method} is not allowed on {path}", "invalid_request_error")
        return _error(
            404, f"no route {path} (served: /chat/completions, /models)", "invalid_request_error"
        )

    async def _models(self, session_id: str) -> ApiResponse:
        session = self._session(session_id)
        try:
            name = await session.served_model()
        except (AsyncSyncError, ChatRequestError) as exc:
            return error_for(exc)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "asyncsync"}]
        return ApiResponse(200, _json.dumps({"object": "list", "data": data}))

    async def _chat(self, session_id: str, headers: Mapping[str, str], body: bytes) -> ApiResponse:
        digest = hashlib.sha256(body).hexdigest()
        last = self._last.get(session_id)
        if last is not None and last.digest == digest and _is_retry(headers):
            with contextlib.suppress(Exception):
                answer = await asyncio.shield(last.answer)
                if answer.status == 200:
                    logger.info("session %s: an SDK retry answered from its first try", session_id)
                    return answer
        future: asyncio.Future[ApiResponse] = asyncio.get_running_loop().create_future()
        self._last[session_id] = _LastRequest(digest, future)
        try:
            answer = await self._turn(session_id, body)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a retry may never come
            raise
        future.set_result(answer)
        return answer

    async def _turn(self, session_id: str, body: bytes) -> ApiResponse:
        try:
            request = _json.loads(body)
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        try:
            messages, tools, options = check_chat_request(request)
            stream = bool(request.get("stream"))
            usage = stream and bool((request.get("stream_options") or {}).get("include_usage"))
            reply = await self._session(session_id).create(messages, tools=tools, **options)
        except (AsyncSyncError, ChatRequestError) as exc:
            logger.info("session %s: turn failed: %s", session_id, exc)
            return error_for(exc)
        data = reply.to_dict()
        if not request.get("logprobs"):
            data["choices"][0]["logprobs"] = None
        if stream:
            return ApiResponse(200, sse_chunks(data, usage), _SSE)
        return ApiResponse(200, _json.dumps(data))


def _is_retry(headers: Mapping[str, str]) -> bool:
    value = next((v for k, v in headers.items() if k.lower() == "x-stainless-retry-count"), "0")
    return value.strip() not in ("", "0")


def sse_chunks(data: Mapping[str, Any], usage: bool) -> bytes:
    """A finished chat completion as ``chat.completion.chunk`` server-sent events: the
    message in one delta (tool calls with their whole arguments), the finish reason,
    the usage when asked for, ``[DONE]``."""
    choice = data["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    head = {k: data[k] for k in ("id", "created", "model")}
    base = {**head, "object": "chat.completion.chunk"}
    events = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
         "asyncsync": data.get("asyncsync"), "prompt_token_ids": data.get("prompt_token_ids")},
    ]  # fmt: skip
    if usage:
        events.append({**base, "choices": [], "usage": data["usage"]})
    parts = [b"data: " + _json.dumps(e) + b"\n\n" for e in events]
    return b"".join(parts) + b"data: [DONE]\n\n"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ChatGateway:
    """An OpenAI-compatible HTTP server over a fleet's chat sessions; an async context
    manager.

    ::

        async with az.ChatGateway(fleet) as gateway:
            client = openai.AsyncOpenAI(base_url=gateway.base_url("e1"), api_key="none")
            await client.chat.completions.create(model="any", messages=..., tools=...)
            gateway.session("e1").trajectory.to_lists()

    Binds ``127.0.0.1`` by default: anyone who reaches the port can run turns on the
    fleet and read every session's conversation (docs/security.md). A non-loopback
    ``host`` warns; pass ``api_key`` to require ``Authorization: Bearer <key>``.

    Args:
        fleet: the open `Fleet` the sessions generate on.
        host: the address to listen on (loopback by default).
        port: the port (``0``: a free one; the chosen one is `port` once started).
        tools: the default ``tools`` of the sessions the gateway creates.
        on_unstable: ``on_unstable`` of the sessions the gateway creates (see
            `ChatSession`).
        api_key: when set, every request must carry it as a bearer token (401 else).
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tools: Sequence[Mapping[str, Any]] | None = None,
        on_unstable: OnUnstable = "fork",
        api_key: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        """The port listened on (None until started)."""
        self._tools = tools
        self._on_unstable: OnUnstable = on_unstable
        self._api_key = api_key
        self._sessions: dict[str, ChatSession] = {}
        self.api = ChatAPI(self.session)
        self._runner: web.AppRunner | None = None
        self._closed = False

    def session(self, session_id: str) -> ChatSession:
        """The `ChatSession` of ``session_id`` (created on first use)."""
        found = self._sessions.get(session_id)
        if found is None:
            found = self._sessions[session_id] = ChatSession(
                self.fleet, session_id=session_id, tools=self._tools, on_unstable=self._on_unstable
            )
        return found

    @property
    def sessions(self) -> dict[str, ChatSession]:
        """Every session the gateway has served, by id (a copy)."""
        return dict(self._sessions)

    def base_url(self, session_id: str) -> str:
        """The base URL of session ``session_id``'s API, for ``AsyncOpenAI(base_url=...)``."""
        if self.port is None:
            raise RuntimeError(
                "the gateway is not started: use it as `async with ChatGateway(...)`"
            )
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/sessions/{quote(session_id, safe='')}/v1"

    async def __aenter__(self) -> ChatGateway:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start listening (`__aenter__` does)."""
        from aiohttp import web

        if self._closed:
            raise ClosedError("this ChatGateway is closed; create a new one")
        if self._runner is not None:
            raise RuntimeError("the gateway is already started")
        if not _loopback(self.host):
            warnings.warn(
                f"ChatGateway listens on {self.host}, not loopback: whoever reaches it runs "
                "turns on the fleet and reads the sessions (docs/security.md)",
                UserWarning,
                stacklevel=3,
            )
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/sessions/{session_id}/v1/{tail:.*}", self._serve)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._requested_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        if self._api_key is not None and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {self._api_key}".encode()
        ):
            answer = _error(
                401, "missing or wrong API key", "invalid_request_error", code="invalid_api_key"
            )
        else:
            body = await request.read()
            answer = await self.api.handle(
                request.match_info["session_id"], request.method, request.match_info["tail"],
                request.headers, body,
            )  # fmt: skip
        return web.Response(
            status=answer.status, body=answer.body, content_type=answer.content_type
        )

    async def aclose(self) -> None:
        """Stop listening. Idempotent."""
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.shield(runner.cleanup())

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port}" if self.port is not None else "not started"
        return f"ChatGateway({where}, {len(self._sessions)} sessions)"
