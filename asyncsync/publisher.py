"""``AsyncWeightPublisher``: one weight-sync round across a fleet, atomic from the
caller's view.

A round is: optional pause -> start -> update(s) -> finish with the version ->
prefix-cache reset -> resume (resume also on failure). The backend's blocking send runs
in a bounded worker thread; every payload it produces is fanned out to all targeted
servers concurrently on the event loop (see :mod:`asyncsync._bridge`).

``publisher.version`` advances only when every targeted server finished the round.
Otherwise :class:`~asyncsync.PublishError` carries each server's outcome, and servers
left mid-update are marked dirty in the fleet (generation avoids them) until a later
round succeeds on them. A cancelled round stops at the next chunk boundary and leaves no
server with an active update.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from asyncsync._bridge import LoopBridge, SyncFleetClient
from asyncsync._errors import AsyncSyncError, FleetError, PublishError
from asyncsync.backends._wire import BACKEND_NAME, ShmInitFields
from asyncsync.backends.shm import (
    DEFAULT_BUFFER_BYTES,
    RoundCancelled,
    SendStats,
    ShmBuffers,
    ShmTrainerEngine,
    ShmTrainerSendWeightsArgs,
    StartOnFirstChunk,
    manifest_of,
    plan_chunks,
    trainer_send_weights,
)

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = ["AsyncWeightPublisher", "PublishReport", "ServerOutcome", "WeightsLike"]

PauseMode = Literal["keep", "wait", "abort"]

#: What ``publish`` accepts: a module, ``(name, tensor)`` pairs (a mapping or an
#: iterable), an object with ``metadata()`` and ``__iter__`` (vLLM's ``WeightSource``),
#: or a zero-argument callable returning one of those (called in the worker thread, so
#: FSDP-style materialization happens off the event loop).
WeightsLike = Any


@dataclass
class ServerOutcome:
    """What happened on one server during a round."""

    url: str
    ok: bool
    phase: str | None = None
    error: BaseException | None = None
    dirty: bool = False

    def __repr__(self) -> str:
        if self.ok:
            return f"<ServerOutcome {self.url} ok>"
        return f"<ServerOutcome {self.url} failed at {self.phase}: {self.error!s}>"


@dataclass
class PublishReport:
    """The figures of one successful round."""

    version: str
    servers: list[str]
    bytes: int
    chunks: int
    params: int
    seconds: dict[str, float]
    outcomes: dict[str, ServerOutcome] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return self.seconds.get("total", 0.0)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes per second of the whole round (pack + transfer + finish)."""
        total = self.total_seconds
        return self.bytes / total / 1e9 if total > 0 else 0.0

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.seconds.items())
        return (
            f"published {self.version!r} to {len(self.servers)} server(s): "
            f"{self.bytes / 1e6:.1f} MB in {self.chunks} chunk(s), {_rate(self.gb_per_s)} "
            f"({phases})"
        )


def _rate(gb_per_s: float) -> str:
    return f"{gb_per_s:.2f} GB/s" if gb_per_s >= 0.1 else f"{gb_per_s * 1000:.1f} MB/s"


# ----------------------------------------------------------------------------- sources
class _Source:
    """A normalized weight source: iteration plus optional metadata."""

    def __init__(self, weights: WeightsLike) -> None:
        self._weights = weights

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]] | None:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return [(n, p.dtype, tuple(p.shape)) for n, p in named()]
        meta = getattr(w, "metadata", None)
        if callable(meta):
            out = []
            for m in meta():
                if isinstance(m, tuple):
                    out.append((str(m[0]), m[1], tuple(m[2])))
                else:
                    out.append((str(m.name), m.dtype, tuple(m.shape)))
            return out
        if isinstance(w, Mapping):
            return [(str(n), t.dtype, tuple(t.shape)) for n, t in w.items()]
        if isinstance(w, Sequence):
            return [(str(n), t.dtype, tuple(t.shape)) for n, t in w]
        return None

    def __iter__(self) -> Any:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return iter(named())
        if isinstance(w, Mapping):
            return iter(w.items())
        return iter(w)


def _is_factory(weights: WeightsLike) -> bool:
    """A zero-argument callable producing the weights (a module is not one)."""
    return (
        callable(weights)
        and not hasattr(weights, "named_parameters")
        and not hasattr(weights, "__iter__")
    )


def _resolve(weights: WeightsLike) -> _Source:
    if _is_factory(weights):
        weights = weights()
    if not (
        hasattr(weights, "named_parameters")
        or hasattr(weights, "__iter__")
        or isinstance(weights, Mapping)
    ):
        raise TypeError(
            "publish(weights=...) takes a torch module, a mapping or iterable of "
            f"(name, tensor), or a callable returning one; got {type(weights).__name__}"
        )
    return _Source(weights)


# ----------------------------------------------------------------------------- progress
def _progress_enabled(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    if os.environ.get("CI") or os.environ.get("ASYNCSYNC_NO_PROGRESS"):
        return False
    return sys.stderr.isatty()


class _Progress:
    def __init__(self, enabled: bool, total_bytes: int | None, version: str) -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"publish {version}")
        self._last = 0

    def __call__(self, chunks: int, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes - self._last)
            self._last = nbytes

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- publisher
class AsyncWeightPublisher:
    """Publishes trainer weights into every server of a :class:`~asyncsync.Fleet`.

    Args:
        fleet: the servers (rank 0 only; other ranks may pass ``None``).
        backend: ``"shm"`` (CPU shared memory, this package's vLLM plugin).
        executor: the bounded executor for the blocking send (default: one private
            worker thread).
        buffer_bytes: size of each of the two shared-memory buffers; bounds the
            trainer's extra memory whatever the model size.
        rank, world_size: this trainer process's rank; only rank 0 talks HTTP, every
            rank iterates the weights (so collectives such as FSDP all-gathers stay
            aligned).
        api: which trainer-engine style drives the round: ``"engine"`` (vLLM 0.3x
            ``send_weights`` with a synchronous client) or ``"callback"`` (vLLM 0.23
            ``trainer_send_weights`` with a rank-0 ``send_mode`` callback).
        if_busy: a second ``publish`` while one runs ``"wait"``s or ``"raise"``s.

    Every call of a round has a deadline: the fleet's ``Timeouts`` (``update`` for each
    chunk's fan-out, ``control`` for start, finish, pause and resume). A hung server
    fails the round with :class:`~asyncsync.ServerTimeout` inside the ``PublishError``.
    """

    def __init__(
        self,
        fleet: Fleet | None,
        *,
        backend: str = "shm",
        executor: ThreadPoolExecutor | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        rank: int = 0,
        world_size: int = 1,
        api: Literal["engine", "callback"] = "engine",
        if_busy: Literal["wait", "raise"] = "wait",
    ) -> None:
        if backend != "shm":
            raise ValueError(
                f"backend {backend!r} is not available in this build; supported: 'shm'"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if rank == 0 and fleet is None:
            raise ValueError("rank 0 needs a fleet: it is the rank that talks to the servers")
        if api not in ("engine", "callback"):
            raise ValueError(f"api must be 'engine' or 'callback', got {api!r}")
        if if_busy not in ("wait", "raise"):
            raise ValueError(f"if_busy must be 'wait' or 'raise', got {if_busy!r}")
        self.fleet = fleet
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.api = api
        self.if_busy = if_busy
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="asyncsync-publish"
        )
        self._buffers = ShmBuffers(buffer_bytes)
        self._lock = asyncio.Lock()
        self._initialized = False
        self.version: str | None = None
        self.last_report: PublishReport | None = None

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @property
    def backend_name(self) -> str:
        """The vLLM ``--weight-transfer-config`` backend the servers must run."""
        return BACKEND_NAME

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> AsyncWeightPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the shared-memory buffers and the private executor."""
        async with self._lock:
            self._buffers.close()
            if self._own_executor:
                self._executor.shutdown(wait=False)

    def _targets(self, targets: Sequence[str] | None) -> list[str]:
        assert self.fleet is not None
        urls = list(self.fleet.urls)
        if targets is None:
            return urls
        unknown = [t for t in targets if t not in urls]
        if unknown:
            raise ValueError(f"not in the fleet: {', '.join(unknown)}")
        return list(targets)

    async def init(self, *, targets: Sequence[str] | None = None) -> None:
        """Run ``/init_weight_transfer_engine`` on every server (once per server)."""
        if not self.is_sender:
            self._initialized = True
            return
        assert self.fleet is not None
        await self.fleet.init_weight_transfer_engine(
            ShmInitFields(trainer_pid=os.getpid()).to_json(),
            targets=self._targets(targets),
            require="all",
        )
        self._initialized = True

    # ------------------------------------------------------------------ publish
    async def publish(
        self,
        weights: WeightsLike,
        *,
        version: str,
        pause: PauseMode | None = None,
        reset_prefix_cache: bool = True,
        progress: bool | Callable[[int, int], None] | None = None,
        targets: Sequence[str] | None = None,
    ) -> PublishReport:
        """Publish ``weights`` as ``version`` to every (targeted) server.

        Returns a :class:`PublishReport`; raises :class:`~asyncsync.PublishError` with
        per-server outcomes when any server failed (the published version is then
        unchanged) and re-raises cancellation after ending the round everywhere.
        """
        if not isinstance(version, str) or not version:
            raise ValueError(f"version must be a non-empty string, got {version!r}")
        if pause not in (None, "keep", "wait", "abort"):
            raise ValueError(f"pause must be None, 'keep', 'wait' or 'abort', got {pause!r}")
        if self._lock.locked() and self.if_busy == "raise":
            raise RuntimeError("a publish is already running (if_busy='raise')")
        async with self._lock:
            if self._buffers is None:
                raise RuntimeError("publisher is closed")
            if not self.is_sender:
                return await self._publish_non_sender(weights, version)
            return await self._publish(
                weights, version, pause, reset_prefix_cache, progress, self._targets(targets)
            )

    async def _publish_non_sender(self, weights: WeightsLike, version: str) -> PublishReport:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()

        def run() -> SendStats:
            source = _resolve(weights)
            args = ShmTrainerSendWeightsArgs(
                send_mode=lambda info: None, buffers=self._buffers, rank=self.rank
            )
            stats = SendStats()
            args.stats = stats
            trainer_send_weights(iter(source), args)
            _barrier()
            return stats

        stats = await loop.run_in_executor(self._executor, run)
        self.version = version
        return PublishReport(
            version=version,
            servers=[],
            bytes=0,
            chunks=0,
            params=stats.params,
            seconds={"total": time.perf_counter() - started},
        )

    async def _publish(
        self,
        weights: WeightsLike,
        version: str,
        pause: PauseMode | None,
        reset_prefix_cache: bool,
        progress: bool | Callable[[int, int], None] | None,
        targets: list[str],
    ) -> PublishReport:
        fleet = self.fleet
        assert fleet is not None
        seconds: dict[str, float] = {}
        if not self._initialized:
            t0 = time.perf_counter()
            await self.init(targets=targets)
            seconds["init"] = time.perf_counter() - t0
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        bridge = LoopBridge(loop, cancel=cancel)
        bridge.bind_loop_thread()
        outcomes = {url: ServerOutcome(url, ok=True) for url in targets}
        t_round = time.perf_counter()
        # Servers the round reached with a start that succeeded: they must end the round.
        started: set[str] = set()
        paused: list[str] = []

        def record(phase: str, exc: BaseException) -> None:
            if isinstance(exc, FleetError):
                for url, outcome in exc.outcomes.items():
                    if url in outcomes and not getattr(outcome, "ok", True):
                        outcomes[url] = ServerOutcome(
                            url, ok=False, phase=phase, error=getattr(outcome, "error", exc)
                        )
            else:
                for url in targets:
                    if outcomes[url].ok:
                        outcomes[url] = ServerOutcome(url, ok=False, phase=phase, error=exc)

        async def fan(phase: str, call: Callable[[], Any]) -> None:
            try:
                await call()
            except BaseException as exc:
                record(phase, exc)
                raise

        async def start() -> None:
            try:
                await fleet.start_weight_update(targets=targets, require="all")
            except FleetError as exc:
                started.update(exc.succeeded)
                stale = [
                    url
                    for url in exc.failed
                    if "already active" in str(getattr(exc.outcomes[url], "error", ""))
                ]
                if not stale or len(stale) != len(exc.failed):
                    record("start", exc)
                    raise
                # A round that an earlier trainer left open (it died mid-round): end it
                # on those servers, then start this round there too.
                fleet.mark_dirty(stale)
                await self._abort_rounds(stale)
                await fan("start", lambda: fleet.start_weight_update(targets=stale, require="all"))
            started.update(targets)

        async def update(info: Any) -> None:
            await fan("update", lambda: fleet.update_weights(info, targets=targets, require="all"))

        async def finish(v: str | None) -> None:
            try:
                await fan(
                    "finish", lambda: fleet.finish_weight_update(v, targets=targets, require="all")
                )
            except FleetError as exc:
                started.difference_update(exc.succeeded)  # those hold the new version
                raise
            started.difference_update(targets)

        client = SyncFleetClient(
            bridge,
            init=lambda info: fleet.init_weight_transfer_engine(
                info, targets=targets, require="all"
            ),
            start=start,
            update=update,
            finish=finish,
            version=version,
        )
        source = None if _is_factory(weights) else _resolve(weights)
        # Known up front unless the weights come from a factory (called in the thread).
        manifest = manifest_of(source) if source is not None else None
        reporter: Callable[[int, int], None] | None
        bar: _Progress | None = None
        if callable(progress):
            reporter = progress
        else:
            total = manifest.total_bytes if manifest is not None else None
            bar = _Progress(_progress_enabled(progress), total, version)
            reporter = bar

        def run_send() -> SendStats:
            src = source if source is not None else _resolve(weights)
            round_manifest = manifest if source is not None else manifest_of(src)
            if self.api == "engine":
                engine = ShmTrainerEngine(
                    client=client,
                    source=src,
                    is_sender=True,
                    buffers=self._buffers,
                    cancel=cancel,
                    manifest=round_manifest,
                )
                engine.on_chunk = reporter
                try:
                    engine.send_weights()
                finally:
                    _barrier()
                assert engine.last_stats is not None
                return engine.last_stats
            # 0.23 style: the caller drives start/finish (start from this thread through
            # the bridge); the backend's static send only streams chunks to send_mode.
            stats = SendStats()
            if round_manifest is not None:  # bad input: refused before start
                plan_chunks(round_manifest, self._buffers.buffer_bytes)

            def start_round() -> None:
                client.started = True
                bridge.call(start)

            args = ShmTrainerSendWeightsArgs(
                # start once chunk 0 is packed (see StartOnFirstChunk)
                send_mode=StartOnFirstChunk(start_round, client.update_weights),
                buffers=self._buffers,
                rank=0,
                manifest=round_manifest,
                cancel=cancel,
                stats=stats,
                on_chunk=reporter,
            )
            try:
                trainer_send_weights(iter(src), args)
            finally:
                _barrier()
            return stats

        try:
            stats = await self._run_round(
                run_send, cancel, pause, paused, targets, seconds, fan, finish, client,
                reset_prefix_cache, version,
            )  # fmt: skip
        except BaseException as exc:
            await asyncio.shield(self._end_failed_round(started, outcomes))
            if paused:
                await asyncio.shield(self._resume_quietly(paused, outcomes))
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | RoundCancelled):
                raise
            if isinstance(exc, ValueError | TypeError) and not client.started:
                raise  # bad input, refused before any server was touched
            raise self._publish_error(version, outcomes, exc) from exc
        finally:
            if bar is not None:
                bar.close()
        # Every server finished: the version is published, whatever resume does next.
        fleet.mark_clean(targets)
        fleet.set_weight_version(version, targets)
        self.version = version
        if paused:
            t0 = time.perf_counter()
            try:
                await fan("resume", lambda: fleet.resume(targets=paused, require="all"))
            except AsyncSyncError as exc:
                raise self._publish_error(version, outcomes, exc) from exc
            seconds["resume"] = time.perf_counter() - t0
        times = client.times
        seconds.update(
            {
                "start": times.start,
                "pack": stats.pack_seconds,
                "transfer": times.transfer,
                "finish": times.finish,
                "total": time.perf_counter() - t_round,
            }
        )
        report = PublishReport(
            version=version,
            servers=list(targets),
            bytes=stats.bytes,
            chunks=stats.chunks,
            params=stats.params,
            seconds=seconds,
            outcomes=outcomes,
        )
        self.last_report = report
        return report

    async def _run_round(
        self,
        run_send: Callable[[], SendStats],
        cancel: threading.Event,
        pause: PauseMode | None,
        paused: list[str],
        targets: list[str],
        seconds: dict[str, float],
        fan: Callable[[str, Callable[[], Any]], Any],
        finish: Callable[[str | None], Any],
        client: SyncFleetClient,
        reset_prefix_cache: bool,
        version: str,
    ) -> SendStats:
        """pause -> the blocking send in the worker thread -> finish (callback style) ->
        prefix-cache reset. ``paused`` is filled in as soon as a pause is attempted."""
        fleet = self.fleet
        assert fleet is not None
        if pause is not None:
            t0 = time.perf_counter()
            paused.extend(targets)
            await fan("pause", lambda: fleet.pause(pause, targets=targets, require="all"))
            seconds["pause"] = time.perf_counter() - t0
        send_future = asyncio.get_running_loop().run_in_executor(self._executor, run_send)
        try:
            stats = await asyncio.shield(send_future)
        except asyncio.CancelledError:
            cancel.set()  # the thread stops at its next chunk boundary
            with contextlib.suppress(BaseException):
                await send_future
            raise
        if self.api == "callback":
            t0 = time.perf_counter()
            await finish(version)
            client.times.finish += time.perf_counter() - t0
        if reset_prefix_cache:
            t0 = time.perf_counter()
            await fan(
                "reset_prefix_cache",
                lambda: fleet.reset_prefix_cache(targets=targets, require="all"),
            )
            seconds["reset_prefix_cache"] = time.perf_counter() - t0
        return stats

    async def _end_failed_round(
        self, started: set[str], outcomes: dict[str, ServerOutcome]
    ) -> None:
        """Leave no server with an active update; mark every reached server dirty."""
        fleet = self.fleet
        assert fleet is not None
        reached = sorted(started)
        if reached:
            await self._abort_rounds(reached)
        touched = [u for u in outcomes if u in started or outcomes[u].phase in ("update", "finish")]
        for url in touched:
            outcomes[url].dirty = True
        fleet.mark_dirty(touched)

    async def _abort_rounds(self, urls: list[str]) -> None:
        """End the active update on ``urls``: the shm engine fails an abort on purpose,
        and vLLM clears its active-update flag when an update fails."""
        assert self.fleet is not None
        # A rejection is the expected answer (the server then holds no active update);
        # a server that accepted it, or did not answer, stays dirty.
        await self.fleet.update_weights(
            {"abort": True, "round": "abort"}, targets=urls, require="none", expect_failure=True
        )

    async def _resume_quietly(self, paused: list[str], outcomes: dict[str, ServerOutcome]) -> None:
        assert self.fleet is not None
        try:
            await self.fleet.resume(targets=paused, require="all")
        except FleetError as exc:
            for url in exc.failed:
                if url in outcomes and outcomes[url].ok:
                    outcomes[url] = ServerOutcome(url, ok=False, phase="resume", error=exc)

    def _publish_error(
        self, version: str, outcomes: dict[str, ServerOutcome], exc: BaseException
    ) -> PublishError:
        failed = [o for o in outcomes.values() if not o.ok]
        dirty = [o.url for o in outcomes.values() if o.dirty]
        lines = "; ".join(f"{o.url} failed at {o.phase}: {o.error}" for o in failed) or str(exc)
        return PublishError(
            f"publishing version {version!r} failed ({lines}); published version stays "
            f"{self.version!r}",
            version=version,
            outcomes=outcomes,
            needs_resync=dirty,
        )


def _barrier() -> None:
    """All trainer ranks leave the send together (no-op without torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is required to publish
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
