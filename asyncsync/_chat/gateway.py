"""``ChatGateway``: OpenAI Chat, OpenAI Responses and Anthropic Messages over chat
sessions, on loopback.

Agent code that runs its own client (or its own process) points it at the gateway; every
request is a turn of one session (`ChatSession`). `ChatAPI` is the API itself, free of
any transport: the gateway serves it with aiohttp's web server, and `Fleet.openai`
hands it to an ``openai.AsyncOpenAI`` through an in-process transport (no socket).

Routes, under ``/sessions/<session_id>/v1`` (the session in the URL) or under ``/v1``
(the session from a header: ``x-session-id``, ``X-Claude-Code-Session-Id`` or ones
configured; else the request's ``metadata.user_id`` or ``user``):

- ``POST /chat/completions`` (OpenAI Chat), ``POST /responses`` (OpenAI Responses),
  ``POST /messages`` and ``POST /messages/count_tokens`` (Anthropic Messages);
  ``stream: true`` streams the dialect's own events as the tokens are sampled;
- ``GET /models``.

Errors come in the dialect's own shape, naming the field. An SDK retry of a request (the
same body, ``x-stainless-retry-count`` > 0) gets the answer of the first try, or waits
for it: it never records a second turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

from asyncsync._chat.chat import ChatSession, ChatStats, new_reply_id
from asyncsync._chat.chat_reply import ChatReply
from asyncsync._chat.export import session_rows, write_rows
from asyncsync._chat.prefix import OnUnstable, UnstablePrefixError
from asyncsync._chat.render import ChatDelta, ChatRenderer
from asyncsync._core import encoding as _json
from asyncsync._core.errors import AsyncSyncError, ClosedError, ServerError
from asyncsync._wire import anthropic as _anthropic
from asyncsync._wire import responses as _responses
from asyncsync._wire.chat import (
    Api,
    ChatRequestError,
    ChunkStream,
    TurnRequest,
    chat_turn,
)

if TYPE_CHECKING:
    from aiohttp import web

    from asyncsync.fleet import Fleet

__all__ = ["DEFAULT_SESSION_HEADERS", "ApiResponse", "ChatAPI", "ChatGateway", "sse_chunks"]

logger = logging.getLogger("asyncsync.generate")

_JSON = "application/json"
_SSE = "text/event-stream"

#: The headers a request under ``/v1`` names its session with, first found wins.
DEFAULT_SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id")
#: The header naming the session a new conversation is a subagent of.
PARENT_HEADER = "x-parent-session"
#: Recent requests kept per session to answer SDK retries from.
_RECENT = 32


@dataclass(frozen=True, slots=True)
class ApiResponse:
    """An answer of `ChatAPI`: status, content type, and the whole body or a stream of
    its chunks (``stream``: the events, sent as they are produced)."""

    status: int
    body: bytes
    content_type: str = _JSON
    stream: AsyncIterator[bytes] | None = None


def _dialect_error(
    api: Api, status: int, message: str, param: str | None = None, code: str | None = None
) -> ApiResponse:
    if api == "anthropic":
        return ApiResponse(status, _json.dumps(_anthropic.anthropic_error(status, message)))
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ApiResponse(status, _json.dumps(body))


def error_for(exc: BaseException, api: Api = "chat") -> ApiResponse:
    """The dialect's error answer for a failed turn."""
    if isinstance(exc, ChatRequestError):
        code = "model_not_found" if exc.status == 404 else None
        return _dialect_error(api, exc.status or 400, exc.message, exc.param, code)
    if isinstance(exc, UnstablePrefixError):
        return _dialect_error(api, 400, exc.message, "messages", "unstable_prefix")
    if isinstance(exc, ServerError) and exc.status is not None and 400 <= exc.status < 500:
        return _dialect_error(api, 400, str(exc))  # vLLM refused the request
    if isinstance(exc, AsyncSyncError):
        return _dialect_error(api, 502, str(exc), code=type(exc).__name__)
    return _dialect_error(api, 500, f"{type(exc).__name__}: {exc}")


@dataclass(slots=True)
class _Recent:
    answer: asyncio.Future[ApiResponse]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    name = name.lower()
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _is_retry(headers: Mapping[str, str]) -> bool:
    value = _header(headers, "x-stainless-retry-count") or "0"
    return value.strip() not in ("", "0")


def _session_of_body(body: Any) -> str | None:
    """A session key a request carries itself: Anthropic's ``metadata.user_id`` (Claude
    Code's is JSON with a ``session_id``), else ``user``."""
    if not isinstance(body, Mapping):
        return None
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user_id, str) and user_id:
        with contextlib.suppress(ValueError):
            parsed = json.loads(user_id)
            if isinstance(parsed, Mapping) and isinstance(parsed.get("session_id"), str):
                return str(parsed["session_id"])
        return user_id
    user = body.get("user")
    return user if isinstance(user, str) and user else None


_ROUTES: dict[str, tuple[str, Api]] = {
    "/chat/completions": ("POST", "chat"),
    "/responses": ("POST", "responses"),
    "/messages": ("POST", "anthropic"),
    "/messages/count_tokens": ("POST", "anthropic"),
    "/models": ("GET", "chat"),
}


class ChatAPI:
    """The three dialects over chat sessions (no transport).

    Args:
        session: the `ChatSession` of a session id (created on first use by the caller).
        session_headers: the headers a request under ``/v1`` names its session with.
        known: whether a session id is one already served (for ``x-parent-session``).
    """

    def __init__(
        self,
        session: Callable[[str], ChatSession],
        *,
        session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self._session = session
        self._headers = tuple(h.lower() for h in session_headers)
        self._known = known or (lambda _: False)
        self._recent: dict[str, OrderedDict[str, _Recent]] = {}

    async def handle(
        self,
        session_id: str | None,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
    ) -> ApiResponse:
        """Answer ``method path`` (relative to ``/v1``), for ``session_id`` (None: the
        session the request names)."""
        path = "/" + path.strip("/")
        route = _ROUTES.get(path)
        api: Api = route[1] if route else ("anthropic" if path.startswith("/messages") else "chat")
        if route is None:
            served = ", ".join(_ROUTES)
            return _dialect_error(api, 404, f"no route {path} (served: {served})")
        if method != route[0]:
            return _dialect_error(api, 405, f"{method} is not allowed on {path}")
        if path == "/models":
            return await self._models(session_id)
        try:
            request = _json.loads(body)
        except ValueError:
            return _dialect_error(api, 400, "the request body is not JSON")
        if session_id is None:
            session_id = self._session_id(headers, request)
            if session_id is None:
                names = " or ".join(self._headers) or "a session header"
                return _dialect_error(
                    api,
                    400,
                    f"no session: send {names}, metadata.user_id or user, or use "
                    "the gateway's base_url(session_id)",
                    None,
                    "no_session",
                )
        if path == "/messages/count_tokens":
            return await self._count_tokens(session_id, request)
        return await self._turn(session_id, api, path, headers, body, request)

    def _session_id(self, headers: Mapping[str, str], request: Any) -> str | None:
        for name in self._headers:
            value = _header(headers, name)
            if value:
                return value
        return _session_of_body(request)

    async def _models(self, session_id: str | None) -> ApiResponse:
        session = self._session(session_id or "_models")
        try:
            name = await session.served_model()
        except AsyncSyncError as exc:
            return error_for(exc)
        data = [
            {
                "id": name,
                "object": "model",
                "type": "model",
                "created": 0,
                "owned_by": "asyncsync",
                "display_name": name,
                "created_at": "1970-01-01T00:00:00Z",
            }
        ]
        body = {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": name,
            "last_id": name,
        }
        return ApiResponse(200, _json.dumps(body))

    async def _count_tokens(self, session_id: str, request: Any) -> ApiResponse:
        try:
            tokens = await self._session(session_id).count_tokens(request)
        except (AsyncSyncError, ChatRequestError) as exc:
            return error_for(exc, "anthropic")
        return ApiResponse(200, _json.dumps(_anthropic.count_tokens_answer(tokens)))

    async def _turn(
        self,
        session_id: str,
        api: Api,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        request: Any,
    ) -> ApiResponse:
        digest = hashlib.sha256(path.encode() + b"\0" + body).hexdigest()
        recent = self._recent.setdefault(session_id, OrderedDict())
        last = recent.get(digest)
        session = self._session(session_id)
        if last is not None and _is_retry(headers):
            with contextlib.suppress(Exception):
                answer = await asyncio.shield(last.answer)
                if answer.status == 200:
                    logger.info("session %s: an SDK retry answered from its first try", session_id)
                    session.retries += 1
                    return answer
        future: asyncio.Future[ApiResponse] = asyncio.get_running_loop().create_future()
        recent[digest] = _Recent(future)
        recent.move_to_end(digest)
        while len(recent) > _RECENT:
            recent.popitem(last=False)
        try:
            turn = self._parse(session, api, request, headers)
        except ChatRequestError as exc:
            answer = error_for(exc, api)
            future.set_result(answer)
            return answer
        parent_id = _header(headers, PARENT_HEADER)
        parent = self._session(parent_id) if parent_id and self._known(parent_id) else None
        if turn.stream:
            try:
                model = await session.served_model(turn.model)
            except (AsyncSyncError, ChatRequestError) as exc:
                answer = error_for(exc, api)
                future.set_result(answer)
                return answer
            return ApiResponse(200, b"", _SSE, _events(session, turn, model, parent, future))
        try:
            reply = await session.run(turn, parent=parent)
        except (AsyncSyncError, ChatRequestError) as exc:
            logger.info("session %s: turn failed: %s", session_id, exc)
            answer = error_for(exc, api)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a retry may never come
            raise
        else:
            answer = ApiResponse(200, _json.dumps(_answer(api, reply, turn)))
        future.set_result(answer)
        return answer

    @staticmethod
    def _parse(
        session: ChatSession, api: Api, request: Any, headers: Mapping[str, str]
    ) -> TurnRequest:
        if api == "chat":
            turn = chat_turn(request)
        elif api == "responses":
            turn = session.responses_turn(request)
        else:
            turn = _anthropic.anthropic_turn(request)
            extra = {h: _header(headers, h) for h in ("anthropic-version", "anthropic-beta")}
            recorded = {**turn.recorded, **{k: v for k, v in extra.items() if v is not None}}
            turn = dataclasses.replace(turn, recorded=recorded)
        if turn.api == "chat" and not turn.tools and session.tools:
            turn = chat_turn({**request, "tools": session.tools})
        return turn


def _answer(api: Api, reply: ChatReply, turn: TurnRequest) -> dict[str, Any]:
    if api == "anthropic":
        return reply.to_anthropic()
    if api == "responses":
        return reply.to_responses(turn.body)
    data = reply.to_dict()
    if not turn.options.get("logprobs"):
        data["choices"][0]["logprobs"] = None
    return data


class _Encoder:
    """A dialect's streamed events for a turn's pieces."""

    def __init__(self, api: Api, turn: TurnRequest, reply_id: str, model: str) -> None:
        self.api = api
        self.turn = turn
        created = int(time.time())
        usage = bool((turn.recorded.get("stream_options") or {}).get("include_usage"))
        self.chat = ChunkStream(reply_id, model, created, usage=usage)
        self.anthropic = _anthropic.MessageStream(reply_id, model)
        self.responses = _responses.ResponseStream(reply_id, {**turn.body, "model": model})

    def start(self, prompt: list[int]) -> bytes:
        if self.api == "anthropic":
            return self.anthropic.start(len(prompt))
        if self.api == "responses":
            return self.responses.start()
        return self.chat.start(prompt)

    def delta(self, delta: ChatDelta) -> bytes:
        call_id, name = delta.call_id or "", delta.name or ""
        if self.api == "anthropic":
            stream = self.anthropic
            if delta.type == "text":
                return stream.text(delta.text)
            if delta.type == "reasoning":
                return stream.thinking(delta.text)
            if delta.type == "tool_call":
                return stream.tool_start(call_id, name)
            return stream.tool_arguments(delta.text)
        if self.api == "responses":
            answer = self.responses
            if delta.type == "text":
                return answer.text(delta.text)
            if delta.type == "reasoning":
                return answer.reasoning(delta.text)
            if delta.type == "tool_call":
                return answer.tool_start(call_id, name)
            return answer.tool_arguments(delta.text)
        if delta.type == "text":
            return self.chat.content(delta.text)
        if delta.type == "reasoning":
            return self.chat.reasoning(delta.text)
        if delta.type == "tool_call":
            return self.chat.tool_start(delta.index, call_id, name)
        return self.chat.tool_arguments(delta.index, delta.text)

    def finish(self, reply: ChatReply) -> bytes:
        if self.api == "anthropic":
            return self.anthropic.finish(reply.parts(), reply.record())
        if self.api == "responses":
            return self.responses.finish(reply.parts(extra=True))
        return self.chat.finish(reply.parts(), reply.token_ids, reply.record())

    def error(self, exc: BaseException) -> bytes:
        answer = error_for(exc, self.api)
        message = str(_json.loads(answer.body).get("error", {}).get("message", str(exc)))
        if self.api == "anthropic":
            return self.anthropic.error(answer.status, message)
        if self.api == "responses":
            return self.responses.error(answer.status, message)
        return self.chat.error(answer.status, message, "server_error")


class _StreamSink:
    """A `TurnSink` encoding a turn's pieces into the dialect's events."""

    def __init__(self, encoder: _Encoder) -> None:
        self.encoder = encoder
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def started(self, prompt_token_ids: list[int]) -> None:
        self.queue.put_nowait(self.encoder.start(prompt_token_ids))

    async def delta(self, delta: ChatDelta) -> None:
        self.queue.put_nowait(self.encoder.delta(delta))


async def _events(
    session: ChatSession,
    turn: TurnRequest,
    model: str,
    parent: ChatSession | None,
    future: asyncio.Future[ApiResponse],
) -> AsyncIterator[bytes]:
    """A streamed turn's events as they are produced; the whole stream, once it ended
    well, answers a retry of the request."""
    sent: list[bytes] = []
    reply_id = new_reply_id(turn.api)
    encoder = _Encoder(turn.api, turn, reply_id, model)
    sink = _StreamSink(encoder)

    async def run() -> ChatReply:
        try:
            return await session.run(turn, sink=sink, parent=parent, reply_id=reply_id)
        finally:
            sink.queue.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (chunk := await sink.queue.get()) is not None:
            sent.append(chunk)
            yield chunk
        try:
            reply = await task
        except (AsyncSyncError, ChatRequestError) as exc:
            logger.info("session %s: streamed turn failed: %s", session.session_id, exc)
            failed = encoder.error(exc)
            if not sent:  # nothing sent yet: the error is the answer, in the dialect's shape
                future.set_result(error_for(exc, turn.api))
            else:
                future.set_result(ApiResponse(502, b""))
            yield failed
            return
        last = encoder.finish(reply)
        sent.append(last)
        future.set_result(ApiResponse(200, b"".join(sent), _SSE))
        yield last
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if not future.done():
            future.set_result(ApiResponse(499, b""))


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
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
            "asyncsync": data.get("asyncsync"),
            "prompt_token_ids": data.get("prompt_token_ids"),
        },
    ]
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
    """OpenAI Chat, OpenAI Responses and Anthropic Messages over a fleet's chat
    sessions, served over HTTP; an async context manager.

    ::

        async with az.ChatGateway(fleet) as gateway:
            client = openai.AsyncOpenAI(base_url=gateway.base_url("e1"), api_key="none")
            await client.chat.completions.create(model="any", messages=..., tools=...)
            await client.responses.create(model="any", input="...", tools=...)
            anthropic.AsyncAnthropic(base_url=gateway.base_url("e2", api="anthropic"),
                                     api_key="none")
            # Claude Code: ANTHROPIC_BASE_URL=gateway.url; its X-Claude-Code-Session-Id
            # header names the session
            gateway.session("e1").trajectories()
            await gateway.export("rollouts.jsonl")

    Binds ``127.0.0.1`` by default: anyone who reaches the port can run turns on the
    fleet and read every session's conversation (docs/security.md). A non-loopback
    ``host`` warns; pass ``api_key`` to require it (``Authorization: Bearer <key>`` or
    ``x-api-key``).

    Args:
        fleet: the open `Fleet` the sessions generate on.
        host: the address to listen on (loopback by default).
        port: the port (``0``: a free one; the chosen one is `port` once started).
        tools: the default ``tools`` of the OpenAI chat turns of the sessions it creates.
        on_unstable: ``on_unstable`` of the sessions it creates (see `ChatSession`).
        api_key: when set, every request must carry it (401 else).
        renderer: a `ChatRenderer` the sessions render and parse with in this process.
        session_headers: the headers a request under ``/v1`` names its session with
            (first found wins; then the body's ``metadata.user_id`` or ``user``).
        record_logprobs: ``record_logprobs`` of the sessions it creates (see
            `ChatSession`; False: the servers compute logprobs only for a request that
            asks, as vLLM's own endpoints do).
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
        renderer: ChatRenderer | None = None,
        session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
        record_logprobs: bool = True,
    ) -> None:
        if not isinstance(record_logprobs, bool):
            raise TypeError(
                f"record_logprobs must be True or False, got {type(record_logprobs).__name__}"
            )
        if isinstance(session_headers, str) or not all(
            isinstance(h, str) and h for h in session_headers
        ):
            raise ValueError("session_headers must be a sequence of header names")
        self.fleet = fleet
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        """The port listened on (None until started)."""
        self._tools = tools
        self._on_unstable: OnUnstable = on_unstable
        self._api_key = api_key
        self._renderer = renderer
        self._record_logprobs = record_logprobs
        self._sessions: dict[str, ChatSession] = {}
        self.api = ChatAPI(
            self.session, session_headers=session_headers, known=self._sessions.__contains__
        )
        self._runner: web.AppRunner | None = None
        self._closed = False

    def session(self, session_id: str) -> ChatSession:
        """The `ChatSession` of ``session_id`` (created on first use)."""
        found = self._sessions.get(session_id)
        if found is None:
            found = self._sessions[session_id] = ChatSession(
                self.fleet,
                session_id=session_id,
                tools=self._tools,
                on_unstable=self._on_unstable,
                renderer=self._renderer,
                record_logprobs=self._record_logprobs,
            )
        return found

    @property
    def sessions(self) -> dict[str, ChatSession]:
        """Every session the gateway has served, by id (a copy)."""
        return dict(self._sessions)

    @property
    def url(self) -> str:
        """The gateway's root URL: ``ANTHROPIC_BASE_URL`` for a client that names its
        session in a header (Claude Code); OpenAI clients append ``/v1``."""
        if self.port is None:
            raise RuntimeError(
                "the gateway is not started: use it as `async with ChatGateway(...)`"
            )
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session_id: str, *, api: Literal["openai", "anthropic"] = "openai") -> str:
        """The base URL of session ``session_id``'s API: for ``AsyncOpenAI(base_url=...)``
        (``api="openai"``: it ends in ``/v1``), or for ``AsyncAnthropic(base_url=...)``
        (``api="anthropic"``: that SDK appends ``/v1/messages`` itself)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {api!r}")
        base = f"{self.url}/sessions/{quote(session_id, safe='')}"
        return base + "/v1" if api == "openai" else base

    def stats(self) -> ChatStats:
        """Every session's turns, trajectories, branches, subagents and retries, added up
        (``forks_per_turn``: the bridge-break rate; ``turns_per_trajectory``)."""
        total = ChatStats(0, 0, 0, 0, 0)
        for session in self._sessions.values():
            total = total + session.stats()
        return total

    async def export(self, path: str | os.PathLike[str]) -> int:
        """Write every session's trajectories to ``path`` as JSON lines (one per
        trajectory: ids, loss mask, logprobs, per-token versions, lineage, turns with
        their prefix reports); returns how many lines. Written in a worker thread."""
        rows = [row for s in list(self._sessions.values()) for row in session_rows(s)]
        return await asyncio.to_thread(write_rows, path, rows)

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
        app.router.add_route("*", "/v1/{tail:.*}", self._serve)
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

    def _authorized(self, request: web.Request) -> bool:
        if self._api_key is None:
            return True
        expected = self._api_key.encode()
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").encode()
        key = request.headers.get("x-api-key", "").encode()
        return hmac.compare_digest(bearer, expected) or hmac.compare_digest(key, expected)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        tail = request.match_info["tail"]
        if not self._authorized(request):
            api: Api = "anthropic" if tail.startswith("messages") else "chat"
            answer = _dialect_error(api, 401, "missing or wrong API key", None, "invalid_api_key")
        else:
            body = await request.read()
            answer = await self.api.handle(
                request.match_info.get("session_id"),
                request.method,
                tail,
                request.headers,
                body,
            )
        if answer.stream is None:
            return web.Response(
                status=answer.status, body=answer.body, content_type=answer.content_type
            )
        response = web.StreamResponse(
            status=answer.status,
            headers={"Content-Type": answer.content_type, "Cache-Control": "no-cache"},
        )
        await response.prepare(request)
        events = answer.stream
        try:
            async for chunk in events:
                await response.write(chunk)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        await response.write_eof()
        return response

    async def aclose(self) -> None:
        """Stop listening. Idempotent."""
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.shield(runner.cleanup())

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port}" if self.port is not None else "not started"
        return f"ChatGateway({where}, {len(self._sessions)} sessions)"
