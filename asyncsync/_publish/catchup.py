"""Catch-up: servers that lack the fleet's version get it again without the trainer's
next step.

What a publisher keeps (``AsyncWeightPublisher(..., catch_up=...)``):

- ``"auto"`` (the default): the last round's weights where the transport is a host one
  (``shm``, ``gloo``, ``auto``): a host copy of every tensor, taken as the round sends
  it (in the worker thread), in shared memory when the shm transport reads tensors in
  place (``zero_copy``), so that the catch-up round is zero-copy too; nothing for the
  GPU transports (``nccl``, ``ipc``);
- ``"host"``: that host copy whatever the transport (GPU tensors copied to host memory);
- a callable: called (in the worker thread) to produce the published weights again,
  instead of keeping a copy;
- ``"off"``: nothing; a server that lacks the version waits for the next round.

Two copies live at most (the last committed round, and the one a running round fills,
reused from round to round: no page fault after the first), so a catch-up costs the
trainer two model's bytes of host memory; ``catch_up="off"`` or a callable keeps none.

`CatchUp` watches the fleet's ledger: a server that answers, whose identity was read,
and that a fault left ``stale`` (restarted, joined, left dirty by a failed round, back
from the dead) gets a round of its own (all such servers together), of the fleet's
current version, from what was kept, paused (``"keep"``: a request sent to it directly,
not through the fleet, waits for the round instead of meeting a half-loaded model); the
other servers keep serving, undisturbed. A server that is only behind because a round
did not target it is left as it is. The ledger admits it
once the round finished there (`Ledger.caught_up`). A trainer's round takes precedence:
``publish`` cancels a running catch-up (which ends its update on that server, as any
cancelled round does) and its round, which targets every server, includes the stale
ones. A catch-up that fails on a server is tried again after a back-off (1 s, doubling,
up to `MAX_RETRY`); one that reached it is no failure, even if the server is stale again
by its end (marked by hand after its finish, restarted): it is caught up again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from asyncsync._core.errors import PublishError
from asyncsync._publish.weights import WeightsLike
from asyncsync.backends.contract import WeightSource, check_tensor

if TYPE_CHECKING:
    from asyncsync._core.ledger import Ledger, ServerRecord

__all__ = ["MAX_RETRY", "CatchUp", "CatchUpLike", "KeptRound", "check_catch_up"]

logger = logging.getLogger("asyncsync.publish")

#: What ``AsyncWeightPublisher(catch_up=...)`` takes.
CatchUpLike = Literal["auto", "host", "off"] | Callable[[], WeightsLike]
#: The longest wait before a failed catch-up is tried again (seconds).
MAX_RETRY = 60.0


def check_catch_up(value: object) -> None:
    if callable(value) or value in ("auto", "host", "off"):
        return
    raise ValueError(
        f"catch_up must be 'auto', 'host', 'off' or a callable that returns the weights, "
        f"got {value!r}"
    )


class KeptRound:
    """The last committed round's weights, kept to send again (see the module)."""

    def __init__(self, *, shared: bool) -> None:
        #: the version ``tensors`` hold (None: nothing kept)
        self.version: str | None = None
        self.shared = shared
        self._kept: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._spare: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        """Trainer memory the kept copy holds."""
        return sum(int(t.numel()) * int(t.element_size()) for t in self._kept.values())

    def tap(self, source: WeightSource) -> WeightSource:
        """``source``, each tensor copied as the round produces it (worker thread)."""
        self._pending = {}
        return _KeepTap(source, self)

    def _copy(self, name: str, tensor: Any) -> None:
        import torch

        full = getattr(tensor, "full_tensor", None)
        src = (full() if callable(full) else tensor).detach()
        dst = self._spare.pop(name, None)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            if self.shared:
                dst.share_memory_()
        dst.copy_(src)
        self._pending[name] = dst

    def committed(self, version: str) -> None:
        """The round that filled the pending copy was published: it is the kept one (the
        previous kept copy's buffers are reused by the next round)."""
        if not self._pending:
            return
        self._spare, self._kept = self._kept, self._pending
        self._pending = {}
        self.version = version

    def failed(self) -> None:
        """The round failed: the kept copy stays (its buffers untouched)."""
        self._spare.update(self._pending)
        self._pending = {}

    def weights(self) -> list[tuple[str, Any]]:
        """The kept tensors, in the order they were sent."""
        return list(self._kept.items())

    def clear(self) -> None:
        self._kept, self._pending, self._spare = {}, {}, {}
        self.version = None


class _KeepTap(WeightSource):
    """A source whose tensors are copied into a `KeptRound` as they are produced."""

    def __init__(self, source: WeightSource, kept: KeptRound) -> None:
        super().__init__(source.weights)
        self._source = source
        self._kept = kept

    @property
    def reiterable(self) -> bool:
        return self._source.reiterable

    def metadata(self) -> Any:
        return self._source.metadata()

    def whole(self) -> WeightSource:
        return self._source.whole()

    def __iter__(self) -> Iterator[Any]:
        self._kept._pending = {}
        for name, tensor in self._source:
            check_tensor(name, tensor)  # what the backend would refuse, refused as it would
            self._kept._copy(name, tensor)
            yield name, tensor


#: Runs one catch-up round of ``version`` to ``urls`` (the publisher's).
Round = Callable[[str, list[str]], Awaitable[object]]


class CatchUp:
    """Catches stale servers up in the background (see the module)."""

    def __init__(self, ledger: Ledger, ready: Callable[[], str | None], run: Round) -> None:
        self._ledger = ledger
        # The publisher's methods, held weakly: a publisher nobody holds is collected
        # (its buffers released) even though its fleet's ledger still calls this back.
        self._ready_ref = weakref.WeakMethod(ready)
        self._run_ref = weakref.WeakMethod(run)
        self._task: asyncio.Task[None] | None = None
        self._round: asyncio.Task[object] | None = None
        self._wake: asyncio.Event | None = None
        self._retry: dict[str, tuple[float, float]] = {}  # url -> (when, back-off)
        self._closed = False
        ledger.add_listener(self._kick)

    @property
    def running(self) -> bool:
        """A catch-up round is under way."""
        return self._round is not None and not self._round.done()

    def _ready(self) -> str | None:
        """The version the publisher can send again now (None: nothing, or gone)."""
        ready = self._ready_ref()
        if ready is None:
            self.close()
            return None
        return ready()

    def _run_round(self, version: str, urls: list[str]) -> Awaitable[object]:
        run = self._run_ref()
        if run is None:
            raise RuntimeError("the publisher is gone")
        return run(version, urls)

    def stale(self) -> list[str]:
        """The servers to catch up now: answering, identified, not held out, lacking
        an accepted version or dirty, not waiting for a retry."""
        version = self._ready()
        if version is None or self._ledger.current() != version:
            return []
        now = time.monotonic()
        return [r.url for r in self._ledger.records() if _lacks(self._ledger, r, now, self._retry)]

    def _kick(self) -> None:
        if self._closed:
            return
        if self._task is not None and not self._task.done():
            if self._wake is not None:
                self._wake.set()
            return
        if not self._ledger.unwell or not self.stale():  # the first: without a pass
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._loop(), name="asyncsync:catch-up")

    async def _loop(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while not self._closed:
            urls = self.stale()
            version = self._ready()
            if urls and version is not None:
                self._round = asyncio.ensure_future(self._run_round(version, urls))
                try:
                    done = await asyncio.shield(self._round)
                    reached = set(getattr(done, "servers", ()))
                except asyncio.CancelledError:
                    if not self._round.cancelled():
                        raise  # this loop itself was cancelled
                    logger.info("catch-up of %s superseded by a round", ", ".join(urls))
                except PublishError as exc:
                    self._failed(urls, exc)
                except Exception:
                    logger.exception("catching up %s failed", ", ".join(urls))
                    self._failed(urls, None)
                else:
                    self._succeeded(urls, reached)
                finally:
                    self._round = None
                continue
            retry = [when for when, _ in self._retry.values()]
            wake.clear()
            timeout = max(min(retry) - time.monotonic(), 0.0) if retry else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await wake.wait()
            if not self.stale() and not self._retry:
                return

    def _failed(self, urls: list[str], exc: PublishError | None) -> None:
        now = time.monotonic()
        for url in urls:
            outcome = exc.outcomes.get(url) if exc is not None else None
            if outcome is not None and getattr(outcome, "ok", False):
                continue
            _, backoff = self._retry.get(url, (0.0, 0.5))
            backoff = min(backoff * 2, MAX_RETRY)
            self._retry[url] = (now + backoff, backoff)
            logger.warning("catch-up of %s failed: tried again in %.0f s", url, backoff)

    def _succeeded(self, urls: list[str], reached: set[str]) -> None:
        """The round ended: a server it reached has no back-off left (stale again by now,
        marked by hand after its finish or restarted, it is a new need, caught up at
        once); one it did not reach is tried again after its back-off."""
        for url in urls:
            record = self._ledger.record(url) if url in self._ledger else None
            if url in reached or (record is not None and record.health == "healthy"):
                self._retry.pop(url, None)
            else:
                self._failed([url], None)

    async def supersede(self) -> None:
        """A trainer's round begins: a running catch-up round is cancelled and ended."""
        task = self._round
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await _settled(task)

    def close(self) -> None:
        """Stop (no await: the fleet or the publisher is closing)."""
        self._closed = True
        self._ledger.remove_listener(self._kick)
        for task in (self._round, self._task):
            if task is not None and not task.done():
                task.cancel()

    async def aclose(self) -> None:
        self.close()
        for task in (self._round, self._task):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await _settled(task)


async def _settled(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to end, whatever its outcome."""
    await asyncio.wait([task])


def _lacks(
    ledger: Ledger, record: ServerRecord, now: float, retry: dict[str, tuple[float, float]]
) -> bool:
    if record.health != "stale" or not record.healthy or record.suspect or record.held_out(now):
        return False
    # What a fault left behind: dirty (a round that reached it failed, it came back from
    # the dead, it reported what it should not hold), restarted or added (no version
    # loaded by the process it is now). A server that is merely behind because a round
    # did not target it keeps what it holds; one stale for its draft model alone is
    # repaired by a draft round.
    lost = record.weight_version is None or record.loaded_by != record.identity
    if not (record.dirty or lost):
        return False
    if record.updating or ledger.in_round(record.url):
        return False
    when = retry.get(record.url)
    return when is None or when[0] <= now
