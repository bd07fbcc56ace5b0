"""``FakeVLLMServer``: serves a `FakeState` over HTTP like vLLM's API server,
and applies the faults a test injects."""

from __future__ import annotations

import asyncio
import socket
from types import TracebackType

from aiohttp import web

from asyncsync.testing._fake._chat import ChatRoutes
from asyncsync.testing._fake._completions import CompletionsRoute
from asyncsync.testing._fake._control import ControlRoutes
from asyncsync.testing._fake._faults import Fault, error_response
from asyncsync.testing._fake._generate import GenerateRoute
from asyncsync.testing._fake._recording import recorded
from asyncsync.testing._fake._responses import (
    ClosingResponse,
    method_not_allowed,
    not_found,
)
from asyncsync.testing._fake._routes import Handler, Routes
from asyncsync.testing._fake._state import FakeState
from asyncsync.testing._fake._weights import WeightRoutes

__all__ = ["FakeVLLMServer"]

#: What vLLM's API server answers by itself, its engine dead or alive (`Fault.engine_dies`).
_ENGINELESS = frozenset({"/version", "/v1/models", "/server_info", "/metrics"})


def _engine_dead(path: str) -> web.Response:
    """vLLM 0.32's answer once its engine died: ``/health`` 503 with no body, the
    engine's routes 500 ``EngineDeadError``."""
    if path == "/health":
        return web.Response(status=503)
    message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    return error_response(Fault.error(500, message, shape="openai"))


class FakeVLLMServer(FakeState):
    """An aiohttp server speaking vLLM's RL protocol (0.23 or 0.32), with fault injection.

    Args:
        version: the vLLM version it claims (``GET /version``); ``"0.23.x"`` selects the
            0.23 protocol, ``"0.32.x"`` (default) the current one.
        backend: the weight-transfer backend name; ``None`` behaves like a server started
            without ``--weight-transfer-config`` (weight routes answer 500).
        tokens_only: like ``--tokens-only`` (0.23 serves ``/abort_requests`` only then).
        delay: seconds every request waits before it is handled (a slow server).
        world_size: answered by ``/get_world_size``.
        params: parameter names the weight checker reports.
        host: the address to listen on.
        port: the port to listen on (0: a free one).
        reject_update_keys: ``update_info`` keys the fake engine refuses with a worker
            failure (default: ``packed`` on 0.32, like the IPC engine).
        update_hook: called with each accepted ``update_info``; raising fails the update
            like a worker error (and vLLM then drops its active update).
        on_request: called (on the server's event loop) with each request as it
            arrives, before any fault or handler: a test acts at the k-th request (for
            example, cancels a publish there) without reading a clock.
        checksum_hook: what ``/weight_checker`` reports, as ``{parameter name: sha256
            hex of its bytes}`` (a test's engine hashes what it loaded); by default,
            digests of nothing real that change with every finished update.
        scale_out: like ``--enable-scale-out``: vLLM 0.32 serves ``/inference/v1/generate``
            only then (or with ``tokens_only``), else 403.
        tokenizer: False behaves like ``--skip-tokenizer-init`` (empty text; legacy
            logprobs only with ``return_tokens_as_token_ids``).
        return_token_ids: False emulates a server that ignores ``return_token_ids`` on
            ``/v1/completions`` (no token ids: the re-tokenize fallback case).
        token_delay: seconds per generated token (to pause or abort mid-generation).
        tokens_per_event: how many tokens each streamed event carries: an int for every
            event, or the sizes of a sample's successive events (the last size repeats).
            vLLM sends one event per engine step while its HTTP writer keeps up and
            coalesces several tokens into one event when it does not (under load); the
            final event always carries the last tokens with the finish reason.
        vocab_size: the fake model's vocabulary size (`FakeLM`).
        max_model_len: the fake model's context length (256; 16,384 with ``chat``).
        model: the model name the fake serves.
        max_recorded: how many requests (`requests`) and accepted updates
            (`updates`) the server keeps, the oldest dropped first; ``None``: all
            of them (memory grows with every request).
        checkpoint: ``{name: (dtype name, shape)}`` of the checkpoint the server
            loaded, which a ``backend`` of asyncsync's (``"asyncsync_shm"``,
            ``"asyncsync_gloo"``) describes through ``/collective_rpc`` like the real
            plugin (a publish checks its weights against it); other backends answer
            that their engine is not callable, as vLLM's own engines do.
        dtype: the dtype the server computes in (a tensor may come in it or in the
            checkpoint's dtype).
        server_info: serve dev mode's ``/server_info`` (its config's ``instance_id``:
            the process identity a fleet reads; `restart` changes it). Off by default:
            a server without it has no identity to compare.
        chat: a chat policy: the model chats (ChatML with hermes tool calls, a
            byte-level tokenizer) and answers each assistant turn with
            ``chat(conversation)`` (`scripted` replies, `tool_call` text); the chat
            routes are then served in vLLM 0.32's shapes: render of the three dialects
            (``/v1/chat/completions/render``, ``/v1/messages/render``,
            ``/v1/responses/render``), ``/v1/chat/completions/derender`` (whole and
            streamed) and ``/v1/chat/completions`` with ``return_token_ids``. Without
            one they answer 404 (docs/testing.md, "Testing an agent offline").

    Generation follows `FakeLM` (deterministic, closed-form logprobs). Pausing
    behaves like vLLM: new requests wait until resume; ``mode="abort"`` ends in-flight
    ones with ``finish_reason="abort"`` and the tokens so far; ``"keep"`` freezes them
    (tokens after a weight update carry the new version: two spans); ``"wait"`` lets
    them run on.
    """

    _runner: web.AppRunner | None = None
    _site: web.SockSite | None = None
    _alive = False
    _routes: Routes  # set by start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        if self._site is None:
            raise RuntimeError("FakeVLLMServer is not started")
        return f"http://{self.host}:{self._port}"

    async def start(self) -> FakeVLLMServer:
        """Listens on ``host:port`` (a free port for 0). The routes served follow the
        configuration at this point (``version``, ``tokens_only``)."""
        self._routes = {}
        for group in (ControlRoutes, WeightRoutes, GenerateRoute, CompletionsRoute, ChatRoutes):
            self._routes.update(group(self).routes())
        # No limit on a request's body, as vLLM's server (uvicorn) sets none: an unpacked
        # IPC update of 10,000 tensors is about 1.5 MB of JSON (aiohttp's default, 1 MiB,
        # would answer 413 where vLLM takes it).
        app = web.Application(middlewares=[self._middleware], client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # handler_cancellation: a hung handler is cancelled when the client goes away,
        # so tests can see that a cancelled client closed its connection.
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
            self._port = int(sock.getsockname()[1])
            # uvicorn's (vLLM's) listen backlog; aiohttp's default of 128 drops SYNs when
            # hundreds of clients connect at once, and each drop costs a 1 s retransmit.
            site = web.SockSite(runner, sock, backlog=2048)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site
        self._alive = True
        return self

    async def stop(self) -> None:
        self._alive = False
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> FakeVLLMServer:
        """Stop and start again on the same port, as a new process: a new identity
        (``instance_id``), the checkpoint's weights (version ``"default"``), nothing
        paused or recorded. Connections open to the old one are cut."""
        await self._die()
        await self.stop()
        self._restarted()
        return await self.start()

    async def __aenter__(self) -> FakeVLLMServer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def alive(self) -> bool:
        """False once stopped or killed by a ``die`` fault."""
        return self._alive

    @property
    def open_connections(self) -> int:
        """Client connections currently open on this server."""
        if self._runner is None or self._runner.server is None:
            return 0
        return len(self._runner.server.connections)

    async def _die(self) -> None:
        self._alive = False
        if self._site is not None:
            server = self._site._server  # the listening asyncio.Server
            if server is not None:
                server.close()
        if self._runner is not None and self._runner.server is not None:
            for proto in list(self._runner.server.connections):
                if proto.transport is not None:
                    proto.transport.abort()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every request is recorded, waits ``delay``, then meets its injected fault (if
        any) or its handler."""
        body = await request.read()
        self._record(recorded(request, body))
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            result: web.StreamResponse | None = None
            if self.engine_dead and request.path not in _ENGINELESS:
                return _engine_dead(request.path)
            fault = self._faults.take(request.path)
            if fault is not None:
                result = await self._apply(fault, request)
            if result is None:
                result = await handler(request)
            if isinstance(result, ClosingResponse):
                # Close once this response is sent, without a "Connection: close" header.
                request.protocol.close()
            return result
        except asyncio.CancelledError:
            self.cancelled.append(request.path)
            raise

    async def _apply(self, fault: Fault, request: web.Request) -> web.StreamResponse | None:
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            return None
        if fault.kind == "engine_dies":
            self.engine_dead = True
            await asyncio.Event().wait()  # vLLM leaves the call that met the death unanswered
        if fault.kind == "hang":
            await asyncio.Event().wait()  # never set: until the handler is cancelled
        if fault.kind == "until":
            assert fault.event is not None
            await fault.event.wait()
            return None
        if fault.kind == "error":
            if fault.shape == "collective" and request.path == "/update_weights":
                self.update_active = False  # as vLLM does after a worker failure there
            return error_response(fault)
        if fault.kind == "malformed":
            return web.Response(status=200, body=fault.body, content_type=fault.content_type)
        if fault.kind in ("drop", "die"):
            if request.transport is not None:
                request.transport.abort()
            if fault.kind == "die":
                await self._die()
            raise asyncio.CancelledError  # nothing more to send on a cut connection
        raise AssertionError(fault.kind)  # pragma: no cover

    # ------------------------------------------------------------------ routes
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        entry = self._routes.get(request.path)
        if entry is None:
            return not_found()
        method, handler = entry
        if request.method != method:
            return method_not_allowed()
        return await handler(request)
