"""``Fleet``: many vLLM servers driven as one, concurrently, with per-server outcomes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar

import aiohttp

from asyncsync._errors import (
    AsyncSyncError,
    FleetError,
    ProtocolError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._http import Call
from asyncsync._retry import RetryPolicy
from asyncsync._timeouts import Timeouts
from asyncsync.client import (
    DEFAULT_RETRY,
    AsyncVLLMClient,
    PauseMode,
    ProtocolGeneration,
    WeightComparison,
    _close_shielded,
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

__all__ = ["Fleet", "FleetResult", "Outcome", "Require", "ServerState"]

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
    ) -> None:
        _check_require(require)
        if isinstance(servers, str):
            raise TypeError("servers must be an iterable of URLs or clients, not one string")
        self._api_key = api_key
        self._timeouts = timeouts
        self._retry = retry
        self._vllm_version = vllm_version
        self.require: Require = require
        self._connection_limit = connection_limit
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
                connector=aiohttp.TCPConnector(limit=self._connection_limit or 0),
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
        self._states[url] = ServerState(url)
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
        """Record ``version`` as the weight version of servers (all when None)."""
        for url in self._resolve(urls):
            self._states[url].weight_version = version
            self._clients[url].weight_version = version

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
        return await self._fanout(
            "update_weight_version",
            lambda p, u: plan_update_weight_version(p, new_version, u),
            targets,
            require,
            _after_set_version(new_version),
        )

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
        return await self._fanout(
            "finish_weight_update",
            lambda p, _u: plan_finish_weight_update(p, weight_version),
            targets,
            require,
            _after_finish(weight_version),
        )

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
