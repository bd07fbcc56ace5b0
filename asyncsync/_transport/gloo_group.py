"""One generation of a standalone gloo group: a TCPStore of its own plus a
``ProcessGroupGloo`` built directly on it, independent of any ``torch.distributed`` world
(vLLM's included). Shared by the trainer side (`asyncsync.backends.gloo`) and the
worker side (`asyncsync.vllm_plugin.gloo_engine`).

gloo cannot abort a collective: ``abort()``/``shutdown()`` return at once while a pending
``wait()`` still runs to the op's own timeout, and dropping the last reference to a group
with a pending op blocks until that timeout. So nothing here ever blocks a caller inside
gloo or the store:

- every wait polls ``work.wait(POLL)`` and gives up on a deadline, a cancel condition or
  the group's ``aborted`` flag, leaving the op to end by its own timeout in gloo's threads;
- a group that failed is never reused: `GlooGroup.destroy` marks it aborted, shuts
  it down and hands it (with the buffers its pending ops may still touch) to a graveyard
  that a daemon thread empties after the op timeout;
- the trainer ends a generation by writing ``abort/<gen>`` into its own store (it is the
  store's server: that never blocks); each worker's watcher thread polls that key and
  aborts its group when it appears or when the store fails (the trainer died);
- group construction (the rendezvous) runs in a helper thread the caller can walk away
  from.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import torch

__all__ = [
    "POLL_SECONDS",
    "GlooAborted",
    "GlooGroup",
    "GlooTimeout",
    "graveyard_size",
    "local_address_for",
    "master_address_for",
]

logger = logging.getLogger("asyncsync.gloo")

#: How often a wait looks at its deadline, its cancel condition and the abort flag.
POLL_SECONDS = 0.1


class GlooAborted(RuntimeError):
    """The group's generation was aborted (by the trainer, a cancel, or a lost store)."""


class GlooTimeout(TimeoutError):
    """A gloo operation did not complete before its deadline."""


def _is_wait_timeout(exc: RuntimeError) -> bool:
    return "timed out" in str(exc).lower() and "operation" in str(exc).lower()


def local_address_for(host: str) -> str:
    """The local address the kernel routes ``host`` from (no packet is sent)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            return str(sock.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def master_address_for(urls: list[str]) -> str:
    """The trainer's address as the servers see it: loopback when every server is on
    this host, else the local address that routes to the first remote server."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    remote = [h for h in hosts if local_address_for(h) != "127.0.0.1"]
    return local_address_for(remote[0]) if remote else "127.0.0.1"


# --------------------------------------------------------------------------- graveyard
_graveyard: list[tuple[float, Any]] = []
_graveyard_lock = threading.Lock()
_reaper: list[threading.Thread] = []  # started once, on the first burial
_live: weakref.WeakSet[GlooGroup] = weakref.WeakSet()


def _reap() -> None:
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        with _graveyard_lock:
            # Dropped outside the lock, by this daemon thread: a destructor may block.
            due = [entry for entry in _graveyard if entry[0] <= now]
            _graveyard[:] = [entry for entry in _graveyard if entry[0] > now]
        del due


def _bury(until: float, things: Any) -> None:
    with _graveyard_lock:
        _graveyard.append((until, things))
        if not _reaper:
            _reaper.append(
                threading.Thread(target=_reap, name="asyncsync-gloo-reaper", daemon=True)
            )
            _reaper[0].start()


def graveyard_size() -> int:
    """How many abandoned groups are still held until their ops time out."""
    with _graveyard_lock:
        return len(_graveyard)


@atexit.register
def _shutdown_live() -> None:
    # A live ProcessGroupGloo left to interpreter finalization can abort the process.
    for group in list(_live):
        group.destroy()


# --------------------------------------------------------------------------- the group
class GlooGroup:
    """One generation: ``rank`` of ``world_size`` over the store at ``host:port``.

    Rank 0 (the trainer) hosts the store: pass ``port=0`` to let the OS pick a free one
    and read `port` before telling the other ranks. `connect` runs the
    rendezvous. ``broadcast(tensor, src, stream=None)`` and ``destroy()`` have the call
    shape of vLLM's ``PyNcclCommunicator``.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        generation: int,
        op_timeout_s: float,
        create_timeout_s: float,
        bind: str | None = None,
    ) -> None:
        import torch.distributed as dist

        self.host, self.rank, self.world_size = host, rank, world_size
        self.generation = generation
        self.op_timeout_s = op_timeout_s
        self.create_timeout_s = create_timeout_s
        self.bind = bind or (host if rank == 0 else local_address_for(host))
        self.aborted = threading.Event()
        self.pg: Any = None
        self._keep: list[Any] = []  # buffers of pending ops, buried with the group
        self._watch_store: Any = None
        self.store = dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=create_timeout_s),
            wait_for_workers=False,
        )
        self.port = int(self.store.port)
        _live.add(self)

    @property
    def abort_key(self) -> str:
        return f"asyncsync/abort/{self.generation}"

    def __repr__(self) -> str:
        state = "aborted" if self.aborted.is_set() else ("live" if self.pg else "joining")
        return (
            f"<GlooGroup gen {self.generation} rank {self.rank}/{self.world_size} "
            f"{self.host}:{self.port} {state}>"
        )

    # ------------------------------------------------------------------ rendezvous
    def connect(self, deadline: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Build the process group (every rank must call it); give up at ``deadline``,
        on ``cancelled()`` or on abort, without waiting for the rendezvous thread."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def build() -> None:
            try:
                box["pg"] = self._make_pg()
            except BaseException as exc:  # reported to the waiting caller
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=build, name="asyncsync-gloo-connect", daemon=True).start()
        while not done.wait(POLL_SECONDS):
            self._check(deadline, cancelled, "rendezvous")
        if "error" in box:
            raise GlooAborted(f"{self!r}: rendezvous failed: {box['error']}") from box["error"]
        self.pg = box["pg"]
        if self.rank != 0:
            self._start_watcher()

    def _make_pg(self) -> Any:
        import torch.distributed as dist
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=self.create_timeout_s)
        options._devices = [ProcessGroupGloo.create_device(hostname=self.bind)]
        prefix = dist.PrefixStore(f"asyncsync/{self.generation}", self.store)
        pg = ProcessGroupGloo(prefix, self.rank, self.world_size, options)
        pg.set_timeout(timedelta(seconds=self.op_timeout_s))
        return pg

    def _start_watcher(self) -> None:
        """Workers: poll the trainer's store for this generation's abort key (a separate
        client: store calls block for good against a frozen trainer)."""
        import torch.distributed as dist

        ref = weakref.ref(self)
        timeout = timedelta(seconds=self.create_timeout_s)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        self._watch_store = store
        key = self.abort_key

        def watch() -> None:
            while True:
                group = ref()
                if group is None or group.aborted.is_set():
                    return
                del group
                try:
                    found = store.check([key])
                except Exception as exc:  # the trainer's store is gone: the trainer died
                    logger.info("asyncsync gloo: trainer store lost (%s); aborting", exc)
                    found = True
                if found:
                    group = ref()
                    if group is not None:
                        group.aborted.set()
                    return
                time.sleep(POLL_SECONDS)

        threading.Thread(target=watch, name="asyncsync-gloo-watch", daemon=True).start()

    # ------------------------------------------------------------------ data
    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast of ``tensor`` from ``src``; returns gloo's work."""
        if self.pg is None or self.aborted.is_set():
            raise GlooAborted(f"{self!r} cannot broadcast")
        self._keep.append(tensor)
        return self.pg.broadcast([tensor], self._options(src))

    def wait(
        self, work: Any, deadline: float, cancelled: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait for ``work``; raise on a gloo error, at ``deadline``, on ``cancelled()``
        or on abort (the op is then left to end in gloo's threads)."""
        while True:
            try:
                if work.wait(timedelta(seconds=POLL_SECONDS)):
                    break
            except RuntimeError as exc:
                if not _is_wait_timeout(exc):
                    raise GlooAborted(f"{self!r}: broadcast failed: {exc}") from exc
            self._check(deadline, cancelled, "broadcast")
        self._keep.clear()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        """PyNccl's shape: a blocking broadcast, bounded by the op timeout and
        interrupted by `destroy` from another thread."""
        del stream
        work = self.broadcast_async(tensor, src)
        self.wait(work, time.monotonic() + self.op_timeout_s)

    def _check(self, deadline: float, cancelled: Callable[[], bool], what: str) -> None:
        if self.aborted.is_set():
            raise GlooAborted(f"{self!r}: {what} aborted (generation ended)")
        if cancelled():
            raise GlooAborted(f"{self!r}: {what} cancelled")
        if time.monotonic() > deadline:
            raise GlooTimeout(f"{self!r}: {what} did not complete before its deadline")

    @staticmethod
    def _options(src: int) -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        return options

    # ------------------------------------------------------------------ teardown
    def abort_generation(self, keep: Any = None) -> None:
        """Trainer: tell every worker this generation is over (never blocks: rank 0
        serves the store), then `destroy` (holding ``keep`` too)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self.store.set(self.abort_key, b"1")
        self.destroy(keep)

    def destroy(self, keep: Any = None) -> None:
        """Abandon the group: mark it aborted, shut gloo down, and hold it (with
        ``keep`` and the buffers of pending ops) until its ops timed out."""
        self.aborted.set()
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()
        pending = bool(self._keep) or keep is not None
        things = (pg, self.store, self._watch_store, list(self._keep), keep)
        self._keep.clear()
        _live.discard(self)
        # With an op pending: until gloo's own timeout ended it. Without: a few seconds,
        # for the workers' watchers to read the abort key from this store.
        _bury(time.monotonic() + (self.op_timeout_s + 2.0 if pending else 5.0), things)

    def close(self) -> None:
        """Orderly end of a healthy group (no op pending): the same teardown."""
        self.destroy()
