"""The fake's control routes: health, version, pausing, aborts, world size."""

from __future__ import annotations

import json

from aiohttp import web

from asyncsync.testing._fake._responses import Routes, openai_error, validation_error
from asyncsync.testing._fake._state import PAUSE_MODES, FakeState


class ControlRoutes:
    """``/health``, ``/version``, ``/pause``, ``/resume``, ``/is_paused``,
    ``/get_world_size``, ``/reset_prefix_cache`` and ``/abort_requests`` (0.32, or 0.23
    with ``--tokens-only``)."""

    def __init__(self, state: FakeState) -> None:
        self.state = state

    def routes(self) -> Routes:
        routes: Routes = {
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/get_world_size": ("GET", self._get_world_size),
            "/reset_prefix_cache": ("POST", self._reset_prefix_cache),
            "/pause": ("POST", self._pause),
            "/resume": ("POST", self._resume),
            "/is_paused": ("GET", self._is_paused),
        }
        if self.state.protocol == "0.32" or self.state.tokens_only:
            routes["/abort_requests"] = ("POST", self._abort_requests)
        return routes

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.state.version})

    async def _get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.state.world_size})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

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
        self.state.pause(mode)
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.state.resume()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.state.paused})

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
