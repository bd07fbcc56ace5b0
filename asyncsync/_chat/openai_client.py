"""``Fleet.openai``: an ``openai.AsyncOpenAI`` whose requests reach a chat session
in-process.

The client's httpx transport hands each request to `ChatAPI` (the same API the
`ChatGateway` serves over HTTP) and returns its answer: no socket, no port, the same
retry rule (an SDK retry of a turn does not record a second one). Needs the ``openai``
package (the ``asyncsync[openai]`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncsync._chat.chat import ChatSession
from asyncsync._chat.gateway import ChatAPI
from asyncsync.fleet import register_chat_client

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from asyncsync.fleet import Fleet

__all__ = ["openai_client"]

#: The base URL of an in-process client (never resolved: the transport answers).
IN_PROCESS_BASE_URL = "http://asyncsync.in-process/v1"


def _httpx() -> Any:
    """The HTTP client package the installed ``openai`` uses: ``httpx2`` from openai 3
    on, ``httpx`` before."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _transport(api: ChatAPI, session_id: str) -> Any:
    httpx = _httpx()

    class Events(httpx.AsyncByteStream):  # type: ignore[misc,name-defined]
        """A streamed answer's events, as `ChatAPI` produces them."""

        def __init__(self, chunks: Any) -> None:
            self._chunks = chunks

        async def __aiter__(self) -> Any:
            async for chunk in self._chunks:
                yield chunk

        async def aclose(self) -> None:
            await self._chunks.aclose()

    class SessionTransport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        """Answers every request with `ChatAPI.handle` for one session."""

        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            path = request.url.path
            tail = path[path.index("/v1") + 3 :] if "/v1" in path else path
            answer = await api.handle(session_id, request.method, tail, request.headers, body)
            headers = {"content-type": answer.content_type}
            if answer.stream is not None:
                return httpx.Response(
                    answer.status, headers=headers, stream=Events(answer.stream), request=request
                )
            return httpx.Response(
                answer.status, headers=headers, content=answer.body, request=request
            )

    return SessionTransport()


def openai_client(fleet: Fleet, session: str | ChatSession, **options: Any) -> AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` talking to ``session`` (a `ChatSession`, or the id of
    the fleet's own session of that id, created on first use: `ChatSession.of`).
    ``options`` go to ``AsyncOpenAI`` (``max_retries``, ``timeout``...)."""
    try:
        import openai

        httpx = _httpx()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fleet.openai() needs the openai package: pip install 'asyncsync[openai]'"
        ) from exc
    if isinstance(session, str):
        session = ChatSession.of(fleet, session)
    elif not isinstance(session, ChatSession):
        raise TypeError(
            f"session must be a ChatSession or a session id, got {type(session).__name__}"
        )
    elif session.fleet is not fleet:
        raise ValueError("this ChatSession belongs to another fleet")
    chosen = session
    api = ChatAPI(lambda _: chosen)
    http = httpx.AsyncClient(transport=_transport(api, chosen.session_id), timeout=None)
    options.setdefault("api_key", "asyncsync-in-process")
    return openai.AsyncOpenAI(base_url=IN_PROCESS_BASE_URL, http_client=http, **options)


register_chat_client(openai_client)
