"""What a fleet's servers serve for chat, and where a session's turns render.

- `FleetChat` (`chat_servers`): per fleet, what each server's chat routes were found to
  do (probed once, remembered): render, the dialects' render routes, a streamed
  derender; and the sessions `Fleet.openai` hands out.
- `SessionRenders`: a session's choice between rendering on the server and a
  `ChatRenderer` in this process, and the checks of the latter against the server (a
  session's first turn and every ``check_every``-th: the render's ids and sampling
  parameters, the derender's message), with `ChatRenderWarning` and server rendering
  from the first difference on.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncsync._chat.prefix import first_difference
from asyncsync._chat.render import ChatRenderer, ChatRenderWarning, Rendering, ServerRendering
from asyncsync._core.errors import AsyncSyncError
from asyncsync._wire.chat import DERENDER_ROUTE, RENDER_ROUTE, Rendered, TurnRequest
from asyncsync._wire.control import ModelEntry

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = ["LIMITS", "FleetChat", "ServerChat", "SessionRenders", "chat_form", "chat_servers"]

logger = logging.getLogger("asyncsync.generate")

#: A chat request's fields asking for room in the context.
LIMITS = frozenset({"max_tokens", "max_completion_tokens"})


@dataclass(slots=True)
class ServerChat:
    """What is known about one server's chat routes (None: not tried yet)."""

    models: list[ModelEntry] | None = None
    render: bool | None = None  # serves render and generate (scale-out)
    dialects: bool | None = None  # serves /v1/messages/render and /v1/responses/render
    streamed_derender: bool | None = None  # parses a streamed sample chunk by chunk
    warned: bool = False  # the fallback's warning was given


@dataclass(slots=True)
class FleetChat:
    """Per-fleet chat state shared by its sessions: each server's chat routes (probed
    once) and the sessions `Fleet.openai` hands out (`ChatSession.of`)."""

    servers: dict[str, ServerChat] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)

    def of(self, url: str) -> ServerChat:
        found = self.servers.get(url)
        if found is None:
            found = self.servers[url] = ServerChat()
        return found


def chat_servers(fleet: Fleet) -> FleetChat:
    """The chat state of ``fleet``, kept in its ledger (created on first use)."""
    return fleet.ledger.cache("chat", FleetChat)


def chat_form(turn: TurnRequest, body: Mapping[str, Any]) -> dict[str, Any]:
    """A turn's render request in OpenAI chat form (its dialect converted)."""
    form = {**{k: v for k, v in turn.chat.items() if k not in LIMITS}, "model": body["model"]}
    limit = body.get("max_tokens", body.get("max_output_tokens"))
    if isinstance(limit, int):
        form["max_completion_tokens"] = limit
    return form


class SessionRenders:
    """Where one session's turns render and parse, and the checks of a `ChatRenderer`."""

    def __init__(
        self, fleet: Fleet, renderer: ChatRenderer | None, session_id: str, chat: FleetChat
    ) -> None:
        self.fleet = fleet
        self.renderer = renderer
        self.session_id = session_id
        self.chat = chat
        self.local = renderer is not None  # False once the renderer disagreed

    def rendering(self, url: str) -> Rendering:
        """The renderer in this process while it agrees with the servers; ``url``'s own
        routes otherwise."""
        if self.local and self.renderer is not None:
            return self.renderer
        return ServerRendering(self.fleet, url)

    async def full(
        self, turn: TurnRequest, body: dict[str, Any], url: str, turns_done: int
    ) -> tuple[Rendered, Rendering, bool]:
        """The full render of the turn's request, the rendering that made it, and
        whether its derender is checked too (a checked turn of a `ChatRenderer`)."""
        rendering = self.rendering(url)
        if not isinstance(rendering, ChatRenderer):
            return await self.server_render(url, turn, body), rendering, False
        if turns_done % rendering.check_every:
            return await rendering.render(turn.render_route, body), rendering, False
        if rendering.checked(url, turn.render_route, body):
            return await rendering.render(turn.render_route, body), rendering, True
        local, theirs = await asyncio.gather(
            rendering.render(turn.render_route, body), self.server_render(url, turn, body)
        )
        if local.token_ids == theirs.token_ids and local.sampling_params == theirs.sampling_params:
            rendering.mark_checked(url, turn.render_route, body)
            return local, rendering, True
        where = first_difference(theirs.token_ids, local.token_ids)
        self.disagreed(
            f"the in-process render of turn {turns_done + 1} differs from {url}'s "
            + (f"at token {where}" if where is not None else "in its sampling parameters")
        )
        return theirs, ServerRendering(self.fleet, url), False

    async def server_render(self, url: str, turn: TurnRequest, body: dict[str, Any]) -> Rendered:
        """The server's render of the turn by its dialect's route; a server without that
        route (vLLM 0.27.1 has only the chat one: probed once, remembered; it answers 404
        or 405) renders the request's chat form."""
        server, state = ServerRendering(self.fleet, url), self.chat.of(url)
        if turn.render_route != RENDER_ROUTE and state.dialects is not False:
            try:
                rendered = await server.render(turn.render_route, body)
            except AsyncSyncError as err:
                # 404, or 405 where another route owns the path (0.27.1's
                # /v1/responses/{response_id} answers POST /v1/responses/render)
                if err.status not in (404, 405) or err.route != turn.render_route:
                    raise
                state.dialects = False
                logger.info("%s has no %s: rendering the chat form", url, turn.render_route)
            else:
                state.dialects = True
                return rendered
        if turn.render_route == RENDER_ROUTE:
            return await server.render(RENDER_ROUTE, body)
        return await server.render(RENDER_ROUTE, chat_form(turn, body))

    async def check_derender(
        self, response: dict[str, Any], body: dict[str, Any], url: str, turns_done: int
    ) -> dict[str, Any]:
        """The in-process derender's ``response`` checked against the server's derender
        of the same ``body`` (once per distinct sample); the server's on a difference."""
        renderer = self.renderer
        assert renderer is not None
        key = {**body, "generate_response": {**body["generate_response"], "request_id": ""}}
        if renderer.checked(url, DERENDER_ROUTE, key):
            return response
        theirs = await ServerRendering(self.fleet, url).derender(body)
        if message_key(theirs) != message_key(response):
            self.disagreed(
                f"the in-process parse of turn {turns_done + 1} differs from {url}'s derender"
            )
            return theirs
        renderer.mark_checked(url, DERENDER_ROUTE, key)
        return response

    def disagreed(self, what: str) -> None:
        self.local = False
        warnings.warn(
            f"session {self.session_id!r}: {what}; the session renders on the server from "
            "now on (are the ChatRenderer's model and flags the servers'?)",
            ChatRenderWarning,
            stacklevel=6,
        )


def message_key(response: Mapping[str, Any]) -> tuple[Any, ...]:
    """What two derenders of one sample must agree on (tool-call ids are random)."""
    message = response["choices"][0]["message"]
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append((function.get("name"), function.get("arguments")))
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    return message.get("content"), reasoning, tuple(calls)
