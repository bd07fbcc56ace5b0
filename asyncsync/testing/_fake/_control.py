"""The fake's control routes: health, version, pausing, aborts, world size."""

from __future__ import annotations

import json

from aiohttp import web

from asyncsync.testing._fake._responses import openai_error, validation_error
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._state import PAUSE_MODES, FakeState


def _serves_abort(state: FakeState) -> bool:
    return state.protocol == "0.32" or state.tokens_only


class ControlRoutes(RouteGroup):
    """The routes that neither change weights nor generate. ``/abort_requests`` exists
    on 0.32, and on 0.23 with ``--tokens-only``."""

    @route("GET", "/health")
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    @route("GET", "/version")
    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.state.version})

    @route("GET", "/get_world_size")
    async def _get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.state.world_size})

    @route("POST", "/reset_prefix_cache")
    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    @route("POST", "/pause")
    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return validation_error(
                "query.mode",
                "literal_error",
                "Input should be 'abort', 'wait' or 'keep'",
                mode,
                "'abort', 'wait' or 'keep'",
            )
        self.state._pause(mode)
        return web.json_response({"status": "paused"})

    @route("POST", "/resume")
    async def _resume(self, request: web.Request) -> web.Response:
        self.state._resume()
        return web.json_response({"status": "resumed"})

    @route("GET", "/is_paused")
    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.state.paused})

    @route("POST", "/abort_requests", served=_serves_abort)
    async def _abort_requests(self, request: web.Request) -> web.Response:
        # vLLM parses this body itself (json.loads), with its own error messages.
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return openai_error(400, "Invalid JSON format", "Bad Request")
        if not isinstance(body, dict):
            return openai_error(400, "Request body must be a JSON object", "Bad Request")
        ids = body.get("request_ids")
        return web.json_response({"status": "aborted", "aborted": len(ids) if ids else 0})
