"""The transport contract: everything a trainer-side backend implements or is handed.

A transport is a `TrainerBackend` subclass with its options (a `BackendOptions`
subclass), registered under a name (`asyncsync.backends.register_backend`). The
publisher creates one per publisher and calls, in its worker thread,
`TrainerBackend.init` once and `TrainerBackend.send` once per round, and
`TrainerBackend.close` when it closes. A backend reaches the servers only through the
`SyncFleetClient` it is handed (vLLM's synchronous ``VLLMWeightSyncClient`` calls plus
``begin_init`` / ``begin_update``, which start a fan-out and return a
`concurrent.futures.Future` at once); the publish round behind that client keeps the
per-server outcomes, timings and rollback. Each round's weights arrive as a
`WeightSource`; what one send moved is a `SendStats`; `SendControl` carries the round's
cancel event and progress callback, and `RoundCancelled` is how a send stops at a
payload boundary. `Ceiling` is the rate the hardware allows the transport.

Everything here is public: a transport of your own imports only this module (and
`asyncsync.backends` for the registry). The publish round (``asyncsync._publish``)
implements the client and builds the sources against these names. This module imports
neither torch nor vLLM.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = [
    "BackendOptions",
    "Ceiling",
    "InitInfo",
    "ParamMeta",
    "RoundCancelled",
    "SendControl",
    "SendStats",
    "SyncFleetClient",
    "TrainerApi",
    "TrainerBackend",
    "UpdateInfo",
    "WeightSource",
    "check_tensor",
]

#: An init_info: one mapping for every server, or a function of the server's URL that
#: returns that server's mapping (per-server ranks, for example).
InitInfo = Mapping[str, Any] | Callable[[str], Mapping[str, Any]]
#: An update_info: one JSON-able mapping, or (vLLM 0.32) one per worker rank.
UpdateInfo = Any
#: ``(name, dtype, shape)`` of one parameter, read without materializing it.
ParamMeta = tuple[str, Any, tuple[int, ...]]
#: Which trainer-engine style drives a round: vLLM 0.3x's ``send_weights`` with a
#: synchronous client (``"engine"``) or vLLM 0.23's ``trainer_send_weights`` with a
#: rank-0 ``send_mode`` callback (``"callback"``).
TrainerApi = Literal["engine", "callback"]


class RoundCancelled(Exception):
    """Raised by a backend's send when the round was cancelled: it stopped at a payload
    boundary and sends nothing more. The caller of ``publish`` gets its
    ``CancelledError``; the round ends the servers' open update."""


@dataclass(frozen=True)
class SendControl:
    """The round's hold on a send.

    Attributes:
        cancel: set when the round is cancelled; the send checks it at each payload
            boundary and raises `RoundCancelled`.
        on_chunk: called after each payload is announced, with (payloads so far, bytes
            so far); None when nobody listens.
    """

    cancel: threading.Event
    on_chunk: Callable[[int, int], None] | None = None


@dataclass
class SendStats:
    """What one send moved, for the round's report.

    Attributes:
        chunks: payloads announced (``/update_weights`` calls).
        bytes: payload bytes sent.
        params: tensors sent.
        pack_seconds: time spent packing (copying into buffers), if measured.
    """

    chunks: int = 0
    bytes: int = 0
    params: int = 0
    pack_seconds: float = 0.0


@dataclass(frozen=True)
class Ceiling:
    """The rate the hardware allows a transport (what `PublishReport.efficiency` divides
    the achieved rate by).

    Attributes:
        gb_per_s: payload bytes per second, in GB/s (1e9 bytes); must be > 0.
        basis: what bounds it, in words (e.g. ``"this host's memcpy, 1 thread"``).
    """

    gb_per_s: float
    basis: str

    def __post_init__(self) -> None:
        if not self.gb_per_s > 0:
            raise ValueError(f"a ceiling must be > 0 GB/s, got {self.gb_per_s!r}")


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """The options of one registered backend: a frozen dataclass whose fields are the
    backend's keyword-only ``__init__`` options, validated when built.

    ``name`` is the registry name the options belong to
    (`asyncsync.backends.register_backend`), so ``AsyncWeightPublisher(fleet,
    backend=MyOptions(...))`` finds its backend.
    """

    name: ClassVar[str]

    def as_kwargs(self) -> dict[str, Any]:
        """The options as the backend's keyword arguments."""
        return asdict(self)


class SyncFleetClient(Protocol):
    """What a backend's blocking send calls to reach the servers: vLLM's synchronous
    ``VLLMWeightSyncClient`` protocol over the round's servers.

    Each call fans out to the round's servers on the event loop and blocks the calling
    worker thread until every one of them answered (an error raised on the loop side
    propagates unchanged); ``begin_init`` and ``begin_update`` start the fan-out and
    return its future at once, for a transport whose own rendezvous or broadcast must
    run while the HTTP call is in flight. Calling it from the event loop's own thread
    raises RuntimeError (it would deadlock). vLLM's own trainer engines
    (``WeightTransferTrainerFactory.trainer_init(init_info, client=...)``) can drive a
    round through it.
    """

    def begin_init(self, init_info: InitInfo) -> Future[None]:
        """Start ``/init_weight_transfer_engine`` on every server; do not wait."""
        ...

    def begin_update(self, update_info: UpdateInfo) -> Future[None]:
        """Start ``/update_weights`` on every server; do not wait."""
        ...

    def init_weight_transfer_engine(self, init_info: InitInfo) -> None:
        """``/init_weight_transfer_engine`` on every server, waited for."""
        ...

    def start_weight_update(self) -> None:
        """``/start_weight_update`` on every server, waited for: the round's update
        begins (call it once the first payload is known good)."""
        ...

    def update_weights(self, update_info: UpdateInfo) -> None:
        """``/update_weights`` with one payload's ``update_info`` on every server,
        waited for."""
        ...

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update`` on every server, waited for. Without a
        ``weight_version`` the round's version is sent (vLLM's own engines pass none)."""
        ...

    def world_sizes(self) -> dict[str, int]:
        """Each server's ``/get_world_size`` by URL (rank offsets for a collective)."""
        ...

    def servers(self) -> list[str]:
        """The URLs of the servers still in the round."""
        ...

    def lane(self, urls: Sequence[str]) -> SyncFleetClient:
        """A client whose calls go only to ``urls`` of this client's servers (one
        transport's share of a mixed round), recorded in the same round."""
        ...

    def update_deadline(self) -> float | None:
        """The update deadline (seconds) of the servers' calls, when known: a transport
        bounds its own collective by it."""
        ...

    def settle(self) -> None:
        """Wait for every fan-out begun through this client, so that none outlives the
        send (their errors were raised where they were awaited, or are in the round's
        outcomes)."""
        ...


class WeightSource:
    """One round's weights, as a backend reads them: iteration of ``(name, tensor)``
    pairs plus, when the weights can describe themselves, their metadata (the shape of
    vLLM's ``WeightSource``).

    ``publish`` normalizes what it was given (a module's ``named_parameters()``, a
    mapping, a sequence or an iterable of pairs, an object with ``metadata()`` and
    ``__iter__``) into one of these; a round may hand a backend a subclass (a delta
    round's patches, a checked stream). Build one yourself to test a backend:
    ``WeightSource({"w": torch.ones(4)})``.

    Args:
        weights: what the caller passed (after calling a factory).
    """

    def __init__(self, weights: Any) -> None:
        self._weights = weights
        #: `metadata`'s answer, read once per source (a round reads it for its checks,
        #: its backend and its report; a model of 10,000 tensors costs ~25 ms a walk)
        self._described: list[ParamMeta] | None = None

    @property
    def weights(self) -> Any:
        """What the caller passed (after calling a factory)."""
        return self._weights

    @property
    def reiterable(self) -> bool:
        """Whether iterating twice yields the same tensors (not a one-shot stream)."""
        w = self._weights
        return callable(getattr(w, "named_parameters", None)) or isinstance(w, Mapping | Sequence)

    def metadata(self) -> list[ParamMeta] | None:
        """``(name, dtype, shape)`` of every parameter, or None for a stream (read once:
        a source lives for one round, during which the weights keep their shapes)."""
        if self._described is None:
            self._described = self._read_metadata()
        return self._described

    def _read_metadata(self) -> list[ParamMeta] | None:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return [(n, p.dtype, tuple(p.shape)) for n, p in named()]
        meta = getattr(w, "metadata", None)
        described = meta() if callable(meta) else None
        if described is not None:
            out = []
            for m in described:
                if isinstance(m, tuple):
                    out.append((str(m[0]), m[1], tuple(m[2])))
                else:
                    out.append((str(m.name), m.dtype, tuple(m.shape)))
            return out
        if isinstance(w, Mapping):
            return [_meta(n, t) for n, t in w.items()]
        if isinstance(w, Sequence):
            return [_meta(*_pair(item)) for item in w]
        return None

    def whole(self) -> WeightSource:
        """The weights as servers outside a delta chain take them: this source (a delta
        round's source returns the one it computes its patches from)."""
        return self

    def round_fields(self) -> dict[str, Any] | None:
        """What the round's first payload carries beside its tensors (a delta round's
        chain fields, which the servers' engine checks), or None. A transport that
        carries delta rounds (`TrainerBackend.delta_servers`) sends them with chunk 0."""
        return None

    def total_bytes(self) -> int | None:
        """Payload bytes of the whole source, when it describes itself."""
        meta = self.metadata()
        if meta is None:
            return None
        total = 0
        for _, dtype, shape in meta:
            count = 1
            for dim in shape:
                count *= int(dim)
            total += count * int(getattr(dtype, "itemsize", 0))
        return total

    def __iter__(self) -> Iterator[Any]:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return iter(named())
        if isinstance(w, Mapping):
            return iter(w.items())
        return iter(w)


def _pair(item: Any) -> tuple[Any, Any]:
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise TypeError(f"weights must be (name, tensor) pairs, got {item!r:.80}")
    return item[0], item[1]


def _meta(name: Any, tensor: Any) -> ParamMeta:
    check_tensor(name, tensor)
    return (name, tensor.dtype, tuple(tensor.shape))


def check_tensor(name: Any, tensor: Any) -> None:
    """Check one ``(name, tensor)`` pair a backend is about to read: a non-empty str
    name and a dense tensor with data.

    A backend calls it on each pair of a stream it packs (a source that describes
    itself was checked before the round).

    Raises:
        TypeError: the name is not a non-empty str, or the value is not a dense
            ``torch.Tensor``.
        ValueError: the tensor is on the meta device (it holds no data).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
    layout = getattr(tensor, "layout", None)
    if layout is None or not hasattr(tensor, "dtype"):
        raise TypeError(f"parameter {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if str(layout) != "torch.strided":
        raise TypeError(f"parameter {name!r} is a {layout} tensor; only dense tensors can be sent")
    if str(getattr(tensor, "device", "")) == "meta":
        raise ValueError(f"parameter {name!r} is on the meta device: it holds no data")


class TrainerBackend(ABC):
    """The trainer side of one transport.

    Subclasses set `name`, `server_backend` and `options_class`, implement `init_info`
    and `send`, and take their options (the fields of `options_class`) as keyword-only
    ``__init__`` arguments after the common ones (``rank``, ``world_size``, ``api``);
    ``AsyncWeightPublisher`` passes the options object's fields through.

    Args:
        rank: this trainer process's rank; rank 0 sends, the others iterate the weights
            in lockstep.
        world_size: the number of trainer processes.
        api: the trainer-engine style (`TrainerApi`).
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
