"""A synchronous facade for scripts and notebooks: the async API, without ``await``.

::

    from asyncsync import blocking

    with blocking.Fleet(urls) as fleet:
        c = fleet.generate([1, 2, 3], max_tokens=8, temperature=0.0, logprobs=1)
        with blocking.WeightPublisher(fleet, backend="shm") as publisher:
            publisher.publish(model.named_parameters(), version="step-1")

`Fleet`, `VLLMClient`, `WeightPublisher` and `Trajectory`
take the same arguments as `asyncsync.Fleet`, `asyncsync.AsyncVLLMClient`,
`asyncsync.AsyncWeightPublisher` and `asyncsync.Trajectory`; every method
has the async method's name, arguments and result, and raises the same typed errors.
``aclose()`` is ``close()``, ``async with`` is ``with``, and a stream is a plain iterator.

The async objects live on a portal thread: one event loop of its own, on a daemon
thread, shared by every facade object (so a publisher and its fleet share a loop). The
calling thread only waits, so the facade works the same whether or not an event loop is
already running in it (a Jupyter cell); in a notebook, top-level ``await`` on the async
API works as well. Interrupting a call (Ctrl-C) cancels it on the portal's loop.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Literal, Never, Protocol, Self, TypeVar

import asyncsync as az
from asyncsync._core.completion import Completion, TokenDelta
from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.portal import (
    Facade,
    blocking_method,
    loop_method,
    shared_portal,
    wrapping_method,
)
from asyncsync._core.state import ServerState
from asyncsync._core.timeouts import DEFAULT_TIMEOUTS, Timeouts
from asyncsync._core.types import Require
from asyncsync._fleet.hosts import members_of
from asyncsync._fleet.routing import StalenessStats
from asyncsync._http.retry import RetryPolicy
from asyncsync._publish.catchup import CatchUpLike
from asyncsync._wire.generation.options import Tokenizer
from asyncsync.backends import BackendOptions, TrainerApi
from asyncsync.client import DEFAULT_RETRY

__all__ = ["CompletionStream", "Fleet", "Trajectory", "VLLMClient", "WeightPublisher"]


class _AsyncResource(Protocol):
    async def __aenter__(self) -> Any: ...

    async def aclose(self) -> None: ...


C = TypeVar("C", bound=_AsyncResource)


class _Closing(Facade[C]):
    """``with``-block support: entering is the async ``__aenter__``, leaving closes."""

    def __enter__(self) -> Self:
        self._call(self._async.__aenter__)
        return self

    def _track(self) -> None:
        """Close the async object at interpreter exit if it is still open then."""
        self._portal.track(self._async)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the async object (``aclose()``). Idempotent."""
        self._call(self._async.aclose)

    @classmethod
    def _adopt(cls, obj: C) -> Self:
        """The facade of an async object that already lives on the portal's loop."""
        facade = cls.__new__(cls)
        facade._portal = shared_portal()
        facade._async = obj
        return facade

    def __repr__(self) -> str:
        return f"blocking.{self._call(repr, self._async)}"


class CompletionStream(_Closing[az.CompletionStream]):
    """A streamed generation as a plain iterator of `TokenDelta`:
    ``with fleet.stream(ids, ...) as s: for delta in s: ...``; then ``s.completion``.
    The request is sent on entering (or on the first ``next``)."""

    def __iter__(self) -> Iterator[TokenDelta]:
        return self

    def __next__(self) -> TokenDelta:
        try:
            return self._call(self._async.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    @property
    def completions(self) -> list[Completion]:
        """The assembled completions once the stream ended (empty before)."""
        return self._async.completions

    @property
    def completion(self) -> Completion:
        """The first assembled completion (after the stream ended)."""
        return self._async.completion

    @property
    def server(self) -> str:
        """The server this stream was sent to ("" before it was opened)."""
        return self._async.server


class VLLMClient(_Closing[az.AsyncVLLMClient]):
    """One vLLM server, blocking: `asyncsync.AsyncVLLMClient`'s methods and
    arguments (an aiohttp ``session`` cannot be lent: it belongs to the portal's loop)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        vllm_version: str | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self._portal = shared_portal()
        self._async = self._call(
            functools.partial(
                az.AsyncVLLMClient, base_url, api_key=api_key, timeouts=timeouts,
                retry=retry, vllm_version=vllm_version, vocab_size=vocab_size,
                max_model_len=max_model_len,
            )
        )  # fmt: skip
        self._track()

    @property
    def base_url(self) -> str:
        """The server's base URL (no trailing slash)."""
        return self._async.base_url

    @property
    def state(self) -> Literal["unopened", "open", "closed"]:
        """``"unopened"``, ``"open"`` or ``"closed"``."""
        return self._async.state

    @property
    def server_state(self) -> ServerState:
        """What is known about the server (shared with a fleet holding this client)."""
        return self._async.server_state

    @property
    def timeouts(self) -> Timeouts:
        """The deadlines per phase of this client's calls."""
        return self._async.timeouts

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of this client's idempotent calls."""
        return self._async.retry

    @property
    def weight_version(self) -> str | None:
        """The last weight version finished or set on the server through asyncsync."""
        return self._async.weight_version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        self._call(setattr, self._async, "weight_version", version)

    @property
    def vocab_size(self) -> int | None:
        """Prompts with a token id outside ``[0, vocab_size)`` are refused when set."""
        return self._async.vocab_size

    @property
    def max_model_len(self) -> int | None:
        """Prompts of ``max_model_len`` tokens or more are refused when set."""
        return self._async.max_model_len

    vllm_version = blocking_method(az.AsyncVLLMClient.vllm_version)
    protocol = blocking_method(az.AsyncVLLMClient.protocol)
    health = blocking_method(az.AsyncVLLMClient.health)
    pause = blocking_method(az.AsyncVLLMClient.pause)
    resume = blocking_method(az.AsyncVLLMClient.resume)
    is_paused = blocking_method(az.AsyncVLLMClient.is_paused)
    abort_requests = blocking_method(az.AsyncVLLMClient.abort_requests)
    weight_info = blocking_method(az.AsyncVLLMClient.weight_info)
    update_weight_version = blocking_method(az.AsyncVLLMClient.update_weight_version)
    weight_checksums = blocking_method(az.AsyncVLLMClient.weight_checksums)
    compare_weights = blocking_method(az.AsyncVLLMClient.compare_weights)
    get_world_size = blocking_method(az.AsyncVLLMClient.get_world_size)
    reset_prefix_cache = blocking_method(az.AsyncVLLMClient.reset_prefix_cache)
    init_weight_transfer_engine = blocking_method(az.AsyncVLLMClient.init_weight_transfer_engine)
    start_weight_update = blocking_method(az.AsyncVLLMClient.start_weight_update)
    start_draft_weight_update = blocking_method(az.AsyncVLLMClient.start_draft_weight_update)
    update_weights = blocking_method(az.AsyncVLLMClient.update_weights)
    finish_weight_update = blocking_method(az.AsyncVLLMClient.finish_weight_update)
    shutdown_weight_transfer_engine = blocking_method(
        az.AsyncVLLMClient.shutdown_weight_transfer_engine
    )
    generate = blocking_method(az.AsyncVLLMClient.generate)
    generate_n = blocking_method(az.AsyncVLLMClient.generate_n)
    generate_batch = blocking_method(az.AsyncVLLMClient.generate_batch)
    score = blocking_method(az.AsyncVLLMClient.score)
    stream = wrapping_method(az.AsyncVLLMClient.stream, CompletionStream._adopt)


class Fleet(_Closing[az.Fleet]):
    """Many vLLM servers, blocking: `asyncsync.Fleet`'s methods and arguments.
    ``servers`` may hold `VLLMClient` objects besides URLs."""

    def __init__(
        self,
        servers: Iterable[str | VLLMClient] = (),
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
        if isinstance(servers, str):
            raise TypeError("servers must be an iterable of URLs or clients, not one string")
        self._portal = shared_portal()
        self._async = self._call(
            functools.partial(
                az.Fleet, [_unwrap(s) for s in servers], api_key=api_key, timeouts=timeouts,
                retry=retry, require=require, vllm_version=vllm_version,
                connection_limit=connection_limit, max_staleness=max_staleness,
                max_concurrency_per_server=max_concurrency_per_server,
                admission_timeout=admission_timeout, tokenizer=tokenizer,
                vocab_size=vocab_size, max_model_len=max_model_len, hosts=hosts,
                router_url=router_url,
            )
        )  # fmt: skip
        self._track()

    @classmethod
    def from_ray(cls, servers: Any, *, timeout: float = 60.0, **options: Any) -> Fleet:
        """A fleet (not yet opened) over servers launched on Ray (see
        `asyncsync.Fleet.from_ray`): ``with blocking.Fleet.from_ray(group) as fleet:``."""
        urls, hosts = shared_portal().call(members_of, servers, timeout)
        return cls(urls, hosts=hosts, **options)

    # ------------------------------------------------------------------ servers
    def add_server(
        self, server: str | VLLMClient, *, check: bool = False, host: str | None = None
    ) -> ServerState:
        """Add a server at runtime (see `asyncsync.Fleet.add_server`)."""
        add = self._async.add_server
        return self._call(functools.partial(add, _unwrap(server), check=check, host=host))

    def client(self, url: str) -> VLLMClient:
        """The client of server ``url`` (sharing the fleet's session)."""
        return VLLMClient._adopt(self._call(self._async.client, url))

    remove_server = blocking_method(az.Fleet.remove_server)
    ready = blocking_method(az.Fleet.ready)
    watch = loop_method(az.Fleet.watch)
    state = loop_method(az.Fleet.state)
    where = loop_method(az.Fleet.where)
    mark_dirty = loop_method(az.Fleet.mark_dirty)
    mark_clean = loop_method(az.Fleet.mark_clean)
    mark_published = loop_method(az.Fleet.mark_published)
    set_weight_version = loop_method(az.Fleet.set_weight_version)
    versions_behind = loop_method(az.Fleet.versions_behind)
    set_concurrency_limit = loop_method(az.Fleet.set_concurrency_limit)
    session_server = loop_method(az.Fleet.session_server)
    end_session = loop_method(az.Fleet.end_session)
    routing_reasons = loop_method(az.Fleet.routing_reasons)
    wait_for_version = blocking_method(az.Fleet.wait_for_version)
    resolve_hosts = blocking_method(az.Fleet.resolve_hosts)

    @property
    def router_url(self) -> str | None:
        """The router generations go through (see `asyncsync.Fleet.router_url`)."""
        return self._async.router_url

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' URLs, in the order they were added."""
        return self._async.urls

    @property
    def servers(self) -> tuple[ServerState, ...]:
        """Every server's state, in fleet order."""
        return self._call(lambda: self._async.servers)

    @property
    def current_version(self) -> str | None:
        """The newest weight version published through this fleet, or None before any."""
        return self._async.current_version

    @property
    def versions(self) -> tuple[str, ...]:
        """Weight versions published through this fleet, oldest first."""
        return self._async.versions

    @property
    def staleness(self) -> StalenessStats:
        """Fleet-wide staleness of completions (see `StalenessStats`)."""
        return self._async.staleness

    @property
    def max_staleness(self) -> int | None:
        """Generations go only to servers at most this many published versions behind."""
        return self._async.max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int | None) -> None:
        self._call(setattr, self._async, "max_staleness", value)

    @property
    def admission_timeout(self) -> float | None:
        """How long a generation waits for an eligible server before failing."""
        return self._async.admission_timeout

    @admission_timeout.setter
    def admission_timeout(self, value: float | None) -> None:
        self._call(setattr, self._async, "admission_timeout", value)

    @property
    def require(self) -> Require:
        """The default partial-failure policy of the fleet's calls."""
        return self._async.require

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the re-tokenize fallback (None: none)."""
        return self._async.tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Prompts with a token id outside ``[0, vocab_size)`` are refused when set."""
        return self._async.vocab_size

    @property
    def max_model_len(self) -> int | None:
        """Prompts of ``max_model_len`` tokens or more are refused when set."""
        return self._async.max_model_len

    def __len__(self) -> int:
        return len(self._async)

    def __contains__(self, url: object) -> bool:
        return url in self._async

    # ------------------------------------------------------------------ control
    health = blocking_method(az.Fleet.health)
    vllm_version = blocking_method(az.Fleet.vllm_version)
    pause = blocking_method(az.Fleet.pause)
    resume = blocking_method(az.Fleet.resume)
    is_paused = blocking_method(az.Fleet.is_paused)
    abort_requests = blocking_method(az.Fleet.abort_requests)
    weight_info = blocking_method(az.Fleet.weight_info)
    update_weight_version = blocking_method(az.Fleet.update_weight_version)
    weight_checksums = blocking_method(az.Fleet.weight_checksums)
    compare_weights = blocking_method(az.Fleet.compare_weights)
    get_world_size = blocking_method(az.Fleet.get_world_size)
    reset_prefix_cache = blocking_method(az.Fleet.reset_prefix_cache)
    load_lora_adapter = blocking_method(az.Fleet.load_lora_adapter)
    unload_lora_adapter = blocking_method(az.Fleet.unload_lora_adapter)
    models = blocking_method(az.Fleet.models)
    lora_limits = blocking_method(az.Fleet.lora_limits)
    init_weight_transfer_engine = blocking_method(az.Fleet.init_weight_transfer_engine)
    start_weight_update = blocking_method(az.Fleet.start_weight_update)
    start_draft_weight_update = blocking_method(az.Fleet.start_draft_weight_update)
    draft_models = blocking_method(az.Fleet.draft_models)
    update_weights = blocking_method(az.Fleet.update_weights)
    finish_weight_update = blocking_method(az.Fleet.finish_weight_update)
    shutdown_weight_transfer_engine = blocking_method(az.Fleet.shutdown_weight_transfer_engine)

    # ------------------------------------------------------------------ generation
    generate = blocking_method(az.Fleet.generate)
    generate_n = blocking_method(az.Fleet.generate_n)
    generate_batch = blocking_method(az.Fleet.generate_batch)
    score = blocking_method(az.Fleet.score)
    stream = wrapping_method(az.Fleet.stream, CompletionStream._adopt)


class WeightPublisher(_Closing[az.AsyncWeightPublisher]):
    """Publishes trainer weights into every server of a blocking `Fleet`:
    `asyncsync.AsyncWeightPublisher`'s methods and arguments. The backend's send
    runs in the publisher's worker thread, the fan-outs on the portal's loop."""

    def __init__(
        self,
        fleet: Fleet | None,
        *,
        backend: str | BackendOptions = "shm",
        executor: ThreadPoolExecutor | None = None,
        rank: int = 0,
        world_size: int = 1,
        if_busy: Literal["wait", "raise"] = "wait",
        catch_up: CatchUpLike = "auto",
        _api: TrainerApi = "engine",
        **removed: Never,
    ) -> None:
        self._portal = shared_portal()
        self.fleet = fleet
        """The blocking fleet published into (None on ranks other than 0)."""
        self._async = self._call(
            functools.partial(
                az.AsyncWeightPublisher, None if fleet is None else fleet._async,
                backend=backend, executor=executor, rank=rank, world_size=world_size,
                if_busy=if_busy, catch_up=catch_up, _api=_api, **removed,
            )
        )  # fmt: skip
        self._track()

    init = blocking_method(az.AsyncWeightPublisher.init)
    publish = blocking_method(az.AsyncWeightPublisher.publish)
    publish_lora = blocking_method(az.AsyncWeightPublisher.publish_lora)
    verify = blocking_method(az.AsyncWeightPublisher.verify)

    @property
    def version(self) -> str | None:
        """The last published version (None before any): see
        `asyncsync.AsyncWeightPublisher.version`."""
        return self._async.version

    @property
    def draft_version(self) -> str | None:
        """The last version published into the servers' draft model: see
        `asyncsync.AsyncWeightPublisher.draft_version`."""
        return self._async.draft_version

    @property
    def last_report(self) -> az.PublishReport | None:
        """The report of the last successful round."""
        return self._async.last_report

    @property
    def backend(self) -> str:
        """The backend's name in asyncsync's registry (``"shm"``...; the servers'
        engine is `vllm_backend`)."""
        return self._async.backend

    @property
    def vllm_backend(self) -> str:
        """The weight-transfer engine the servers must run, by vLLM's registered name:
        see `asyncsync.AsyncWeightPublisher.vllm_backend`."""
        return self._async.vllm_backend

    @property
    def backend_name(self) -> str:
        """Deprecated: `vllm_backend`."""
        warn_deprecated("WeightPublisher.backend_name", "WeightPublisher.vllm_backend")
        return self._async.vllm_backend

    @property
    def options(self) -> BackendOptions:
        """The backend's options (`asyncsync.backends.Shm`, ...)."""
        return self._async.options

    @property
    def if_busy(self) -> Literal["wait", "raise"]:
        """What a second ``publish`` does while one runs: ``"wait"`` or ``"raise"``."""
        return self._async.if_busy

    @property
    def api(self) -> str:
        """Which trainer-side API drives a round: ``"engine"`` or ``"callback"`` (for
        ``nccl`` and ``ipc``, the one the installed vLLM offers; see docs/versions.md)."""
        return self._async.api

    @property
    def rank(self) -> int:
        return self._async.rank

    @property
    def world_size(self) -> int:
        return self._async.world_size

    @property
    def is_sender(self) -> bool:
        return self._async.is_sender


class Trajectory(az.Trajectory):
    """`asyncsync.Trajectory` whose `generate` takes a blocking
    `Fleet` or `VLLMClient` and returns the completion (no ``await``).
    Everything else is the async API's `Trajectory` unchanged."""

    def generate(  # type: ignore[override]  # the blocking form of an async method
        self, fleet_or_client: Fleet | VLLMClient, **kwargs: Any
    ) -> Completion:
        """Generate the next turn from `next_prompt` and append it; on a fleet
        `session_id` keeps every turn on one server. ``kwargs`` go to
        ``generate``."""
        turn = functools.partial(super().generate, fleet_or_client._async, **kwargs)
        return fleet_or_client._call(turn)


def _unwrap(server: str | VLLMClient) -> str | az.AsyncVLLMClient:
    return server._async if isinstance(server, VLLMClient) else server
