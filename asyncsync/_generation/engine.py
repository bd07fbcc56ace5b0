"""The generation engine: token-in-token-out on one server, plain and streamed.

A `GenerationEngine` sends over the server's
`Endpoint`; it picks the route (``"auto"`` prefers
``/inference/v1/generate`` and falls back to ``/v1/completions`` once, remembered, when
the server does not serve it), reads the server's weight version at admission and at
completion from the server's record in its ledger, and never re-tokenizes
unless the caller gave a tokenizer and the server returned no ids (then loudly: a
`RetokenizedWarning` once per server, and ``Completion.retokenized``).

`CompletionStream` streams one generation; where it is sent is decided by a
`StreamLease` (one server for a client, routing for a fleet).
"""

from __future__ import annotations

import asyncio
import functools
import time
import warnings
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

import aiohttp

from asyncsync._core import hooks as _hooks
from asyncsync._core.completion import Completion, PromptScores, RetokenizedWarning, TokenDelta
from asyncsync._core.errors import (
    AsyncSyncError,
    ClosedError,
    GenerationAborted,
    GenerationError,
    ProtocolError,
    ServerError,
    ServerTimeout,
)
from asyncsync._core.ledger import ServerRecord
from asyncsync._core.types import Route
from asyncsync._generation.served import ServedLookup
from asyncsync._http.transport import Endpoint, never_sent
from asyncsync._wire.control import (
    Call,
    Malformed,
    describe_error_body,
    generate_keeps_all_choices,
    stream_drops_silent_aborts,
)
from asyncsync._wire.generation.bodies import (
    ABSENT,
    client_spans,
    completions_from,
    parse_answer,
    parse_prompt_logprobs,
    parse_scored,
    request_body,
    retokenize,
)
from asyncsync._wire.generation.options import (
    COMPLETIONS_ROUTE,
    GENERATE_ROUTE,
    GenerationRequest,
    SendOptions,
    Tokenizer,
)
from asyncsync._wire.generation.stream import StreamAssembler, StreamFailed

__all__ = ["CompletionStream", "GenerationEngine", "StreamLease", "check_aborted", "run_all"]

T = TypeVar("T")

_NOT_FOUND_HINT = "this server does not serve token-in-token-out generation there"


@functools.lru_cache(maxsize=256)
def _generation_call(path: str, n: int, logprobs: int | None, stream: bool) -> Call[Any]:
    """The planned call of a generation shape (immutable; one per shape, shared by
    every request of that shape instead of being rebuilt per request)."""
    if stream:
        return Call("generate_stream", "POST", path, "generate", lambda _: None, "SSE")

    def parse(data: Any) -> list[Completion]:  # positional: a keyword partial costs more
        return parse_answer(data, path, n, logprobs)

    what = "choices with token_ids" if path == GENERATE_ROUTE else "completion choices"
    return Call(
        "generate", "POST", path, "generate", parse, '{"choices": [' + what + "]}",
        not_found_hint=_NOT_FOUND_HINT,
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _scoring_call(path: str) -> Call[Any]:
    return Call(
        "score", "POST", path, "generate", functools.partial(parse_scored, path=path),
        '{"choices": [one choice]}', not_found_hint=_NOT_FOUND_HINT,
    )  # fmt: skip


def _route_unavailable(err: AsyncSyncError) -> bool:
    """The generate route is not served here (403: scale-out disabled; 404: absent):
    the request was refused before any work, so falling back is safe."""
    return isinstance(err, (ServerError, ProtocolError)) and err.status in (403, 404)


class GenerationEngine:
    """Token-in-token-out on one server (see the module docstring)."""

    def __init__(self, endpoint: Endpoint, served: ServedLookup | None = None) -> None:
        self.endpoint = endpoint
        #: The served model's limits, learned before the first generation (when the
        #: caller gave none): prompts outside them are refused before they are sent.
        self.served = served if served is not None else ServedLookup(endpoint)
        #: Whether the server serves /inference/v1/generate (None: not tried yet).
        self.generate_route: bool | None = None
        self._warned = False

    @property
    def state(self) -> ServerRecord:
        """The server's record in its ledger (read only)."""
        return self.endpoint.record

    def route_for(self, route: Route, n: int = 1) -> str:
        """The path ``route`` means on this server now, for ``n`` samples: ``"auto"``
        takes ``/v1/completions`` for ``n > 1`` where the generate route loses choices
        (vLLM < 0.29)."""
        if route == "generate":
            return GENERATE_ROUTE
        if route == "completions" or self.generate_route is False:
            return COMPLETIONS_ROUTE
        if n > 1 and not generate_keeps_all_choices(self.state.vllm_version):
            return COMPLETIONS_ROUTE
        return GENERATE_ROUTE

    def _fell_back(self, route: Route, path: str, err: AsyncSyncError) -> bool:
        """Remember an unserved generate route; True when ``route`` allows retrying
        on ``/v1/completions``."""
        if path != GENERATE_ROUTE or not _route_unavailable(err):
            return False
        self.generate_route = False
        return route == "auto"

    async def _send(
        self,
        prompt: list[int],
        req: GenerationRequest,
        send: SendOptions,
        prompt_logprobs: int | None = None,
    ) -> tuple[str, Any, float]:
        """Send a generation (a scoring request with ``prompt_logprobs``) on the route
        ``send.route`` resolves to, falling back once; returns (path, parsed answer,
        latency)."""
        served = self.served
        if not served.known:
            await served.learn()
        served.check(prompt)
        timeouts = self.endpoint.timeouts
        if send.timeout is not None:
            timeouts = timeouts.with_generate(send.timeout)
        if send.route == "auto" and req.n > 1:
            await self.endpoint.vllm_version()  # route_for depends on it
        path = self.route_for(send.route, req.n)
        while True:
            if prompt_logprobs is None:
                call = _generation_call(path, req.n, req.logprobs, False)
            else:
                call = _scoring_call(path)
            body = request_body(path, prompt, req, prompt_logprobs=prompt_logprobs)
            started = time.monotonic()
            try:
                parsed = await self.endpoint.request(call, body, timeouts=timeouts)
            except AsyncSyncError as err:
                if self._fell_back(send.route, path, err):
                    path = COMPLETIONS_ROUTE
                    continue
                if isinstance(err, ServerError) and err.status and 200 <= err.status < 300:
                    raise _generation_error(err) from err  # a malformed 2xx answer
                raise
            if path == GENERATE_ROUTE:
                self.generate_route = True
            return path, parsed, time.monotonic() - started

    async def generate(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> list[Completion]:
        """``req.n`` samples for ``prompt``. Raises
        `GenerationAborted` (with the partial completions) when the
        server aborted any sample."""
        state = self.state
        admitted = state.weight_version
        _, parsed, latency = await self._send(prompt, req, send)
        completions = completions_from(
            parsed, server=self.endpoint.url, prompt=prompt, latency=latency,
            admitted=admitted, completed=state.weight_version,
        )  # fmt: skip
        for c in completions:
            if c.token_ids is ABSENT:
                self._retokenize(c, send.tokenizer)
        check_aborted(completions, self.endpoint.url)
        return completions

    async def score(self, token_ids: list[int], top_k: int, send: SendOptions) -> PromptScores:
        """Per-position logprobs of ``token_ids`` (vLLM's ``prompt_logprobs``)."""
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        req = GenerationRequest(max_tokens=1, temperature=0.0)
        path, parsed, latency = await self._send(token_ids, req, send, prompt_logprobs=top_k)
        try:
            logprobs, tops, ranks = parse_prompt_logprobs(parsed, token_ids)
        except Malformed as exc:
            raise GenerationError(
                f"cannot read prompt logprobs: {exc}", server=self.endpoint.url, route=path
            ) from exc
        return PromptScores(
            token_ids=list(token_ids), logprobs=logprobs, top_logprobs=tops, ranks=ranks,
            server=self.endpoint.url, weight_version=self.state.weight_version,
            latency=latency,
        )  # fmt: skip

    async def open_stream(
        self, prompt: list[int], req: GenerationRequest, route: Route, deadline: float | None
    ) -> tuple[str, aiohttp.ClientResponse]:
        """Send a streamed generation; returns (path, the open 200 response)."""
        served = self.served
        if not served.known:
            await served.learn()
        served.check(prompt)
        if route == "auto" and req.n > 1:
            await self.endpoint.vllm_version()  # route_for depends on it
        path = self.route_for(route, req.n)
        while True:
            call = _generation_call(path, req.n, req.logprobs, True)
            body = request_body(path, prompt, req, stream=True)
            try:
                resp = await self.endpoint.open_stream(call, body, deadline)
            except AsyncSyncError as err:
                if self._fell_back(route, path, err):
                    path = COMPLETIONS_ROUTE
                    continue
                raise
            if path == GENERATE_ROUTE:
                self.generate_route = True
            return path, resp

    def _retokenize(self, completion: Completion, tokenizer: Tokenizer | None) -> None:
        server, path = self.endpoint.url, completion.route
        if tokenizer is None:
            raise GenerationError(
                "the server returned no token ids (return_token_ids unsupported or "
                "ignored); pass tokenizer= to re-tokenize the text (lossy, flagged on the "
                "completion), or use a server that returns token ids",
                server=server,
                route=path,
            )
        if completion.text is None:
            raise GenerationError(
                "the server returned neither token ids nor text", server=server, route=path
            )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{server}{path} returned text without token ids; re-tokenizing with the "
                "given tokenizer (lossy: ids may differ from the sampled ones). "
                "Completion.retokenized is True for these results. Warned once per server.",
                RetokenizedWarning,
                stacklevel=5,
            )
        completion.token_ids = retokenize(tokenizer, completion.text)
        completion.retokenized = True
        if completion.logprobs is not None and len(completion.logprobs) != len(
            completion.token_ids
        ):  # logprobs of the sampled tokens cannot be re-aligned to re-tokenized ids
            completion.logprobs = completion.top_logprobs = completion.top_logprobs_text = None
        completion.weight_versions = client_spans(
            len(completion.token_ids), completion.admitted_version, completion.completed_version
        )


def _generation_error(err: ServerError) -> GenerationError:
    return GenerationError(
        err.message, server=err.server, route=err.route, status=err.status, body=err.body
    )


def check_aborted(completions: Sequence[Completion], server: str) -> None:
    """Raise `GenerationAborted` when the server aborted a sample."""
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if not aborted:
        return
    tokens = sum(len(c.token_ids) for c in aborted)
    raise GenerationAborted(
        f"the server aborted {len(aborted)} of {len(completions)} sample(s) after "
        f"{tokens} token(s) (paused with mode='abort'?); retryable, the partial "
        "completions are in .completions",
        completions=completions,
        server=server,
        route=completions[0].route,
    )


async def run_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; results in order. The first failure cancels the
    others; a single failure is raised as itself (not as an ``ExceptionGroup``)."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        if len(eg.exceptions) == 1:
            raise eg.exceptions[0] from None
        raise
    return [t.result() for t in tasks]


# ---------------------------------------------------------------------- streaming
class StreamLease(Protocol):
    """Where a stream is sent: a client's one server, or a fleet's routing."""

    async def acquire(self) -> GenerationEngine:
        """The engine of the server to send to (may wait for one)."""

    def unreached(self, err: AsyncSyncError) -> bool:
        """The request never reached that server: True to try another one."""

    def request(self, engine: GenerationEngine, req: GenerationRequest) -> GenerationRequest:
        """The request as sent to ``engine``'s server (a fleet's LoRA stream: that
        server's newest version of the adapter)."""

    def release(self, completions: list[Completion] | None) -> None:
        """The stream ended (completions when it finished, else None)."""


class OneServer:
    """The lease of a client's own server: always it, never another."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine

    async def acquire(self) -> GenerationEngine:
        return self.engine

    def unreached(self, err: AsyncSyncError) -> bool:
        return False

    def request(self, engine: GenerationEngine, req: GenerationRequest) -> GenerationRequest:
        return req

    def release(self, completions: list[Completion] | None) -> None:
        if completions:
            _hooks.generated(completions)


class CompletionStream:
    """Token deltas of one generation as they are produced: ``async for`` over
    `TokenDelta` objects, inside ``async with`` so the response is
    always released. After the last delta, `completions` holds the assembled
    `Completion` objects (one per sample); an aborted generation
    raises `GenerationAborted` at the end of the iteration, after every
    delta it produced was delivered.

    Opened lazily: the request is sent on ``__aenter__`` (or the first ``__anext__``).
    ``timeout`` bounds the whole stream.
    """

    def __init__(
        self, lease: StreamLease, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> None:
        self._lease = lease
        self._prompt = prompt
        self._req = req
        self._send = send
        self._engine: GenerationEngine | None = None
        self._resp: aiohttp.ClientResponse | None = None
        self._assembler: StreamAssembler | None = None
        self._deadline: float | None = None
        self._started = 0.0
        self._admitted: str | None = None
        self._pending: list[TokenDelta] = []
        self._closed = False
        self.completions: list[Completion] = []
        """The assembled completions once the stream ended (empty before)."""

    @property
    def completion(self) -> Completion:
        """The first assembled completion (after the stream ended)."""
        if not self.completions:
            raise RuntimeError("the stream has not finished yet")
        return self.completions[0]

    @property
    def server(self) -> str:
        """The server this stream was sent to ("" before it was opened)."""
        return "" if self._engine is None else self._engine.endpoint.url

    @property
    def _path(self) -> str:
        return "" if self._assembler is None else self._assembler.path

    async def __aenter__(self) -> CompletionStream:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> CompletionStream:
        return self

    async def aclose(self) -> None:
        """Release the response (closing the connection if unfinished). Idempotent."""
        if self._closed:
            return
        self._closed = True
        resp, self._resp = self._resp, None
        if resp is not None:
            resp.close()
        done = self._assembler is not None and self._assembler.done
        self._lease.release(self.completions if done else None)

    async def _open(self) -> None:
        if self._resp is not None or self._assembler is not None:
            return
        if self._closed:
            raise ClosedError("this CompletionStream is closed; open a new stream")
        loop = asyncio.get_running_loop()
        while True:
            engine = self._engine = await self._lease.acquire()
            limit = self._send.timeout
            limit = engine.endpoint.timeouts.generate if limit is None else limit
            self._deadline = None if limit is None else loop.time() + limit
            self._admitted = engine.state.weight_version
            self._started = loop.time()
            try:
                path, self._resp = await engine.open_stream(
                    self._prompt, self._lease.request(engine, self._req), self._send.route,
                    self._deadline,
                )  # fmt: skip
            except AsyncSyncError as err:
                if never_sent(err) and self._lease.unreached(err):
                    continue  # a fleet picks another server
                raise
            self._assembler = StreamAssembler(self._req.n, self._req.logprobs, path)
            return

    async def __anext__(self) -> TokenDelta:
        if self._pending:
            return self._pending.pop(0)
        if self._closed or (self._assembler is not None and self._assembler.done):
            raise StopAsyncIteration
        await self._open()
        try:
            async with asyncio.timeout_at(self._deadline):
                await self._read_until_deltas()
        except TimeoutError as exc:
            await self.aclose()
            raise ServerTimeout(
                "the stream did not finish within the generate deadline",
                server=self.server,
                route=self._path,
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            await self.aclose()
            raise GenerationError(
                f"the stream broke off: {type(exc).__name__}: {exc}",
                server=self.server,
                route=self._path,
            ) from exc
        if self._pending:
            return self._pending.pop(0)
        raise StopAsyncIteration

    async def _read_until_deltas(self) -> None:
        resp, assembler = self._resp, self._assembler
        assert resp is not None
        assert assembler is not None
        while not self._pending and not assembler.done:
            line = await resp.content.readline()
            if not line:
                assembler.done = True
                break
            try:
                self._pending.extend(assembler.feed(line.strip()))
            except Malformed as exc:
                raise self._error(f"malformed stream event: {exc}") from exc
            except StreamFailed as exc:
                body = exc.args[0]
                message = describe_error_body(body) or "error event"
                raise self._error(
                    f"the server failed mid-stream: {message}", body.decode("utf-8", "replace")
                ) from exc
        if assembler.done:
            await self._finish(assembler)

    async def _finish(self, assembler: StreamAssembler) -> None:
        engine = self._engine
        assert engine is not None
        silent = False
        if assembler.ended and not assembler.finished and assembler.path == GENERATE_ROUTE:
            # the server ended a generate stream with a sample unfinished: vLLM < 0.32's
            # way of saying "aborted" when the abort brought no new tokens (its version is
            # read once per server, under the stream's deadline)
            try:
                version = engine.state.vllm_version or await engine.endpoint.vllm_version()
            except AsyncSyncError:
                version = None  # unknown: the stream is reported as malformed
            silent = stream_drops_silent_aborts(version)
        try:
            completions = assembler.completions(self._prompt, silent_abort=silent)
        except Malformed as exc:
            raise self._error(f"malformed stream event: {exc}") from exc
        loop = asyncio.get_running_loop()
        self.completions = completions_from(
            completions, server=self.server, prompt=self._prompt,
            latency=loop.time() - self._started, admitted=self._admitted,
            completed=engine.state.weight_version,
        )  # fmt: skip
        check_aborted(self.completions, self.server)

    def _error(self, message: str, body: str | None = None) -> GenerationError:
        return GenerationError(message, server=self.server, route=self._path, body=body)
