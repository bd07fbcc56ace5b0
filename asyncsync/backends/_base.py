"""What a trainer-side transport implements to plug into ``AsyncWeightPublisher``.

A backend is a class registered under a name (see `asyncsync.backends`). The
publisher creates one per publisher, calls `TrainerBackend.init` once and
`TrainerBackend.send` once per round, both in its worker thread, and
`TrainerBackend.close` when it closes. A backend talks to the servers only through
the `SyncFleetClient` it is handed: vLLM's four blocking
``VLLMWeightSyncClient`` methods plus ``begin_init`` / ``begin_update``, which start a
fan-out and return a `concurrent.futures.Future` at once (for transports whose own
handshake or broadcast must run while the HTTP call is in flight). The publish round
behind that client does the bookkeeping: per-server outcomes, timings, rollback.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from asyncsync._publish.bridge import InitInfo, SyncFleetClient
from asyncsync.backends._options import BackendOptions

if TYPE_CHECKING:
    from asyncsync._publish.weights import WeightSource
    from asyncsync.backends._ceiling import Ceiling
    from asyncsync.fleet import Fleet

#: Which trainer-engine style drives a round: vLLM 0.3x's ``send_weights`` with a
#: synchronous client (``"engine"``) or vLLM 0.23's ``trainer_send_weights`` with a
#: rank-0 ``send_mode`` callback (``"callback"``).
TrainerApi = Literal["engine", "callback"]


class RoundCancelled(Exception):
    """The round was cancelled at a chunk boundary (nothing more is sent)."""


@dataclass(frozen=True)
class SendControl:
    """The round's hold on a send: its cancel event and its progress callback."""

    cancel: threading.Event
    #: called after each payload is announced with (payloads so far, bytes so far)
    on_chunk: Callable[[int, int], None] | None = None


@dataclass
class SendStats:
    """What one send moved, for reports."""

    chunks: int = 0
    bytes: int = 0
    params: int = 0
    pack_seconds: float = 0.0


class TrainerBackend(ABC):
    """The trainer side of one transport.

    Subclasses set `name`, `server_backend` and `options_class`, implement `init_info`
    and `send`, and take their options (the fields of `options_class`) as keyword-only
    ``__init__`` arguments after the common ones (``rank``, ``world_size``, ``api``);
    ``AsyncWeightPublisher`` passes the options object's fields through.
    """

    #: The name ``AsyncWeightPublisher(backend=...)`` looks up, e.g. ``"shm"``.
    name: ClassVar[str]
    #: The vLLM ``--weight-transfer-config`` backend the servers must run.
    server_backend: ClassVar[str]
    #: Its options (a frozen dataclass whose fields are the keyword-only options of
    #: ``__init__``); a backend without options keeps the empty base class.
    options_class: ClassVar[type[BackendOptions]] = BackendOptions
    #: Whether each payload is a collective across every server's workers (a lost
    #: server breaks it: the round is sent again without it, in a new group), rather
    #: than something each server loads on its own.
    collective: ClassVar[bool] = False
    #: Whether the publisher keeps a host copy of each round by default, to catch up
    #: servers that lack it (``AsyncWeightPublisher(catch_up="auto")``): the host
    #: transports do; a GPU transport's weights would need a copy to host memory
    #: (``catch_up="host"``).
    keeps_last_round: ClassVar[bool] = False

    def __init__(self, *, rank: int = 0, world_size: int = 1, api: TrainerApi = "engine") -> None:
        self.rank = rank
        self.world_size = world_size
        self.api = api

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of this backend's options (the fields of `options_class`)."""
        return tuple(f.name for f in fields(cls.options_class))

    @property
    def is_sender(self) -> bool:
        """Rank 0 packs and talks HTTP; other ranks iterate the weights in lockstep."""
        return self.rank == 0

    @abstractmethod
    def init_info(self) -> InitInfo:
        """What ``/init_weight_transfer_engine`` sends (one mapping, or one per server)."""

    async def prepare(self, fleet: Fleet, targets: Sequence[str]) -> None:
        """On the event loop, before each round (and before the first init): learn what
        the backend needs to know of the servers (``"auto"``: their hosts). Default:
        nothing."""
        del fleet, targets

    def collective_servers(self, urls: Iterable[str]) -> frozenset[str]:
        """Which of ``urls`` this backend reaches through a collective (a lost one is a
        regroup): all of them or none, by `collective`; a mixed backend says per
        server."""
        return frozenset(urls) if self.collective else frozenset()

    def delta_servers(self, urls: Iterable[str]) -> frozenset[str] | None:
        """Which of ``urls`` a ``publish(..., delta=True)`` round sends patches to (the
        others take it whole and keep no mirror); None: this transport cannot carry a
        delta chain. Default: None."""
        del urls
        return None

    def init(self, client: SyncFleetClient) -> None:
        """Rank 0, worker thread, once before the first round: initialize the servers'
        engines. A transport whose rendezvous must run while the HTTP call is in flight
        overrides this: ``pending = client.begin_init(info)``, rendezvous, then
        ``pending.result()``."""
        client.init_weight_transfer_engine(self.init_info())

    def check(self, source: WeightSource) -> None:
        """Refuse input that cannot be sent (ValueError/TypeError naming the parameter)
        from the source's metadata alone, before the round touches any server. Runs on
        the event loop: metadata only, no tensor data."""
        del source

    @abstractmethod
    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        """Send one round, in the worker thread.

        With a client (rank 0): call ``client.start_weight_update()`` once, only when the
        input is known good (once the first payload is ready), then
        ``client.update_weights(info)`` per payload (it returns when every server took
        it; or ``begin_update``), then ``client.finish_weight_update()``. Report each
        payload to ``control.on_chunk``; stop with `RoundCancelled` at the next
        payload boundary once ``control.cancel`` is set. Without a client (other ranks):
        iterate ``source`` in lockstep, send nothing.
        """

    def servers_restarted(self, urls: Sequence[str]) -> None:
        """On the event loop, before a round's send: ``urls`` are new processes since
        this backend last reached them (a restart); forget what was set up with them
        (a group, an init), so that the send sets it up again. Default: nothing (a
        per-server transport needs no setup)."""
        del urls

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """The rate the hardware allows this transport to the servers ``urls`` (what
        `PublishReport.efficiency` divides by), or None when it is not known. Worker
        thread, once per publisher, before its first round; a measurement may take tens
        of milliseconds. Default: None."""
        del urls
        return None

    def abort_info(self) -> Mapping[str, Any]:
        """An update_info the servers' engine rejects on purpose. vLLM clears its
        active-update flag when an update fails, so sending it ends a round that a dead
        or cancelled trainer left open. The default is a key that no vLLM update-info
        class accepts."""
        return {"asyncsync_abort": True}

    def close(self) -> None:  # noqa: B027 - a backend without resources keeps it
        """Release the backend's resources (idempotent)."""
