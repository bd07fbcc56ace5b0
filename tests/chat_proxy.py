"""A proxy in front of a real vLLM server, for the chat tests' faults and old
behaviour: every request is forwarded and its answer returned unchanged, except

- with ``scale_out=False``, render, derender and the generate route answer exactly what
  vLLM >= 0.30 answers without ``--enable-scale-out`` (403, its own error body), and
- `fail_next` makes the next request on a path answer a 500 (vLLM's error shape)
  without reaching the server.
"""

from __future__ import annotations

from collections import Counter
from types import TracebackType

import aiohttp
from aiohttp import web

from asyncsync.testing import free_port

#: vLLM's answer on a scale-out route of a server started without --enable-scale-out.
SCALE_OUT_DISABLED = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with "
        "--enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}
SCALE_OUT_ROUTES = frozenset(
    {
        "/v1/chat/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/v1/chat/completions/derender",
        "/inference/v1/generate",
    }
)


class ChatProxy:
    """``async with ChatProxy(upstream_url) as proxy: proxy.url``."""

    def __init__(self, upstream: str, *, scale_out: bool = True) -> None:
        self.upstream = upstream.rstrip("/")
        self.scale_out = scale_out
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def fail_next(self, path: str, times: int = 1) -> None:
        """The next ``times`` requests on ``path`` answer 500."""
        self._failures[path] += times

    async def __aenter__(self) -> ChatProxy:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._runner is not None
        assert self._session is not None
        await self._runner.cleanup()
        await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests[path] += 1
        if not self.scale_out and path in SCALE_OUT_ROUTES:
            return web.json_response(SCALE_OUT_DISABLED, status=403)
        if self._failures[path] > 0:
            self._failures[path] -= 1
            error = {
                "error": {
                    "message": "injected",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            return web.json_response(error, status=500)
        assert self._session is not None
        body = await request.read()
        headers = {
            k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")
        }
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as upstream:
            payload = await upstream.read()
            kind = upstream.headers.get("Content-Type", "application/json")
            return web.Response(
                status=upstream.status, body=payload, headers={"Content-Type": kind}
            )
