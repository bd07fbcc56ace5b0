"""Trainer side of the ``asyncsync_gloo`` backend: a torch.distributed gloo broadcast to
every server's workers, on CPU, across hosts.

The trainer hosts a TCPStore of its own (a free port unless one is given) and is rank 0
of a standalone gloo group; each server's worker joins it as rank ``rank_offset`` (1 +
the world sizes of the servers before it) when ``/init_weight_transfer_engine`` arrives:
the rendezvous runs while that HTTP call is in flight. A round packs the weights into
two reused, pre-touched heap buffers exactly like the shm backend (same plan, 64-byte
aligned offsets, the manifest in chunk 0, layer groups kept together), and each chunk's
broadcast runs while its ``/update_weights`` is in flight; packing chunk k+1 overlaps
chunk k's broadcast and load.

Failures never leave the trainer's thread in a collective (see
`asyncsync._transport.gloo_group`): a failed or late chunk ends the generation (the
abort key tells the servers' workers to leave the broadcast), the group and the buffers
its abandoned op may still read are buried, and the next round builds generation + 1,
which every server joins after dropping its old group. The next round also rebuilds the
group when the fleet's servers (or their world sizes) changed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from asyncsync._transport.gloo_group import GlooGroup, GlooTimeout, master_address_for
from asyncsync._transport.gloo_wire import GLOO_BACKEND_NAME, GlooInitFields, chunk_extent
from asyncsync._transport.trainer_factory import register_trainer_engines
from asyncsync._transport.wire import ShmUpdateFields
from asyncsync.backends._ceiling import link_ceiling
from asyncsync.backends._options import Gloo
from asyncsync.backends._segments import Segment
from asyncsync.backends._shm_pack import (
    DEFAULT_BUFFER_BYTES,
    ShmBuffers,
    manifest_of,
    plan_chunks,
    round_fields_of,
    stream_chunks,
)
from asyncsync.backends.contract import Ceiling, SendControl, SendStats, TrainerApi, TrainerBackend
from asyncsync.backends.shm import StartOnFirstChunk

if TYPE_CHECKING:
    import torch

    from asyncsync.backends.contract import InitInfo, SyncFleetClient, WeightSource

__all__ = [
    "GLOO_BACKEND_NAME",
    "BeginClient",
    "GlooBackend",
    "GlooLink",
    "GlooSettings",
    "GlooTrainerEngine",
    "GlooTrainerInitInfo",
    "HeapBuffers",
    "ThreadedClient",
]


class BeginClient(Protocol):
    """What a gloo round needs of a client: vLLM's four calls, two of them started
    without waiting (the collective runs while they are in flight)."""

    def begin_init(self, init_info: InitInfo) -> Future[None]: ...

    def begin_update(self, update_info: Any) -> Future[None]: ...

    def start_weight_update(self) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class ThreadedClient:
    """A `BeginClient` over any synchronous vLLM ``VLLMWeightSyncClient`` (e.g.
    vLLM's ``HTTPVLLMWeightSyncClient``): ``begin_*`` run its calls on helper threads,
    as vLLM's own NCCL engine does."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="asyncsync-gloo-http")

    def begin_init(self, init_info: InitInfo) -> Future[None]:
        info = init_info(self.url) if callable(init_info) else init_info
        return self._pool.submit(self.client.init_weight_transfer_engine, dict(info))

    def begin_update(self, update_info: Any) -> Future[None]:
        return self._pool.submit(self.client.update_weights, update_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)

    @property
    def url(self) -> str:
        return str(getattr(self.client, "base_url", "http://127.0.0.1"))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# --------------------------------------------------------------------------- buffers
class _HeapSegment(Segment):
    """A pre-touched heap buffer in a `ShmBuffers` slot (gloo sends from
    process memory: no /dev/shm, whose size containers often cap)."""

    def __init__(self, size: int) -> None:  # no shm segment: Segment.__init__ not called
        import torch

        self.size = size
        self.name = f"heap-{uuid.uuid4().hex[:16]}"
        self.owner_pid = os.getpid()  # the wire fields name no descriptor: nothing to open
        self.fd = -1
        self.tensor: torch.Tensor | None = torch.zeros(size, dtype=torch.uint8)

    @property
    def closed(self) -> bool:
        return self.tensor is None

    def buffer(self) -> Any:
        if self.tensor is None:
            raise ValueError(f"buffer {self.name} is closed")
        return self.tensor.numpy()

    def close(self) -> None:
        self.tensor = None  # a broadcast still reading it holds its own reference


class HeapBuffers(ShmBuffers):
    """The shm backend's double buffers, in process memory."""

    def _new_segment(self, size: int) -> Segment:
        return _HeapSegment(size)

    def tensor(self, name: str, count: int) -> torch.Tensor:
        for segment in self._segments:
            if segment.name == name and isinstance(segment, _HeapSegment):
                assert segment.tensor is not None
                return segment.tensor[:count]
        raise KeyError(f"no buffer named {name!r}")


# --------------------------------------------------------------------------- the link
@dataclass(frozen=True)
class GlooSettings:
    """Where the trainer listens and how long gloo may take."""

    master_address: str | None = None
    master_port: int | None = None
    create_timeout_s: float = 60.0
    op_timeout_s: float | None = None


def _failed(future: Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


class GlooLink:
    """The trainer's end of one gloo generation at a time, and the round over it."""

    def __init__(self, settings: GlooSettings, buffer_bytes: int) -> None:
        self.settings = settings
        self.buffers = HeapBuffers(buffer_bytes)
        self.group: GlooGroup | None = None
        self.generation = 0
        #: the servers (URL -> world size) the live group was built for
        self.members: dict[str, int] | None = None
        self.update_deadline_s: float | None = None

    @property
    def op_timeout_s(self) -> float:
        if self.settings.op_timeout_s is not None:
            return self.settings.op_timeout_s
        return (self.update_deadline_s or 600.0) + 30.0

    def chunk_deadline_s(self) -> float:
        """How long one chunk may take before the trainer ends the generation: a bit
        under the HTTP update deadline, so that live servers are told to leave before
        their own calls time out."""
        d = self.update_deadline_s
        return self.op_timeout_s if d is None else max(d * 0.9, d - 2.0)

    def ensure(self, client: BeginClient, members: dict[str, int]) -> None:
        """A live group for exactly ``members``, built now if needed."""
        if self.group is None or self.group.aborted.is_set() or self.members != members:
            self.connect(client, members)

    def connect(self, client: BeginClient, members: dict[str, int]) -> None:
        """Build generation + 1: the trainer's store, then each server's init (with its
        rank offset) in flight while the trainer joins the rendezvous."""
        self.end_generation()
        self.generation += 1
        urls = list(members)
        host = self.settings.master_address or master_address_for(urls)
        group = GlooGroup(
            host=host,
            port=self.settings.master_port or 0,
            rank=0,
            world_size=1 + sum(members.values()),
            generation=self.generation,
            op_timeout_s=self.op_timeout_s,
            create_timeout_s=self.settings.create_timeout_s,
        )
        infos, offset = {}, 1
        for url in urls:
            infos[url] = GlooInitFields(
                gen=self.generation,
                master_address=host,
                master_port=group.port,
                rank_offset=offset,
                world_size=group.world_size,
                create_timeout_s=self.settings.create_timeout_s,
                op_timeout_s=self.op_timeout_s,
            ).to_json()
            offset += members[url]
        pending = client.begin_init(infos.__getitem__ if len(infos) > 1 else infos[urls[0]])
        try:
            group.connect(
                time.monotonic() + self.settings.create_timeout_s, lambda: _failed(pending)
            )
            pending.result(timeout=self.settings.create_timeout_s)
        except BaseException:
            group.abort_generation()
            if _failed(pending):
                pending.result()  # the servers' own error names them
            raise
        self.group, self.members = group, dict(members)

    def send_round(
        self, source: Any, client: BeginClient, control: SendControl | None = None
    ) -> SendStats:
        """start -> one update + broadcast per chunk -> finish (start only once chunk 0
        is packed: bad input touches no server)."""
        cancel = control.cancel if control is not None else None
        stats = stream_chunks(
            iter(source),
            manifest_of(source),
            self.buffers,
            StartOnFirstChunk(client.start_weight_update, lambda i: self.send_chunk(client, i)),
            cancel=cancel,
            on_chunk=control.on_chunk if control is not None else None,
            fields=round_fields_of(source),
        )
        client.finish_weight_update()
        return stats

    def send_chunk(self, client: BeginClient, info: dict[str, Any]) -> None:
        """One chunk: its update in flight while the trainer broadcasts it; returns when
        every server loaded it. Any failure ends the generation first."""
        group = self.group
        assert group is not None, "send_chunk before connect"
        size = chunk_extent(info["dtype_names"], info["shapes"], info["offsets"])
        tensor = self.buffers.tensor(info["segment"], size)
        wire = {**info, "segment": "", "segment_size": size, "gen": group.generation}
        deadline = time.monotonic() + self.chunk_deadline_s()
        pending = client.begin_update(wire)
        try:
            group.wait(group.broadcast_async(tensor), deadline, lambda: _failed(pending))
            pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            self.end_generation(failed=True)
            if _failed(pending):
                pending.result()  # the servers' answers name what failed
            if isinstance(exc, TimeoutError):
                raise GlooTimeout(
                    f"chunk {info['chunk']} was not received everywhere within "
                    f"{self.chunk_deadline_s():.1f} s; the gloo group was torn down"
                ) from exc
            raise

    def end_generation(self, *, failed: bool = False) -> None:
        """Tell the servers' workers the generation is over and bury the group. After a
        failure the buffers go with it (an abandoned op may still read them)."""
        group, self.group, self.members = self.group, None, None
        if group is None:
            return
        if failed:
            old, self.buffers = self.buffers, HeapBuffers(self.buffers.buffer_bytes)
            group.abort_generation(keep=old)
        else:
            group.abort_generation()

    def close(self) -> None:
        self.end_generation()
        self.buffers.close()


# --------------------------------------------------------------------------- the backend
class GlooBackend(TrainerBackend):
    """``"gloo"``: broadcast over a gloo group (servers run ``asyncsync_gloo``).

    Options: ``buffer_bytes`` (each of the two pack buffers, and each server's two
    receive buffers; a buffer must hold the largest tensor), ``master_address`` (what
    the servers connect to; default: loopback when every server is local, else the
    local address that routes to them), ``master_port`` (default: a free port),
    ``create_timeout_s`` (the rendezvous), ``op_timeout_s`` (gloo's own bound on an
    abandoned operation; default: the fleet's update deadline + 30 s).
    """

    name = "gloo"
    server_backend = GLOO_BACKEND_NAME
    options_class = Gloo
    collective = True
    keeps_last_round = True

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        master_address: str | None = None,
        master_port: int | None = None,
        create_timeout_s: float = 60.0,
        op_timeout_s: float | None = None,
        link_gb_per_s: float | None = None,
    ) -> None:
        if api != "engine":
            raise ValueError(
                "backend 'gloo' drives rounds in vLLM 0.3x's engine style (api='engine')"
            )
        super().__init__(rank=rank, world_size=world_size, api=api)
        settings = GlooSettings(master_address, master_port, create_timeout_s, op_timeout_s)
        self.link = GlooLink(settings, buffer_bytes)
        self.link_gb_per_s = link_gb_per_s

    def delta_servers(self, urls: Iterable[str]) -> frozenset[str]:
        """Every server: a broadcast crosses a network, where bytes cost time."""
        return frozenset(urls)

    def init_info(self) -> Mapping[str, Any]:
        raise NotImplementedError("gloo init_info is per server and per generation")

    def init(self, client: SyncFleetClient) -> None:
        self.link.update_deadline_s = client.update_deadline()
        self.link.connect(client, client.world_sizes())

    def check(self, source: WeightSource) -> None:
        manifest = manifest_of(source)
        if manifest is not None:
            plan_chunks(manifest, self.link.buffers.buffer_bytes)

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        if client is None:  # another rank: iterate in lockstep, send nothing
            return stream_chunks(iter(source), None, self.link.buffers, None)
        self.link.update_deadline_s = client.update_deadline()
        self.link.ensure(client, client.world_sizes())
        return self.link.send_round(source, client, control)

    def servers_restarted(self, urls: Sequence[str]) -> None:
        """A restarted server is in no group: the next send forms a new one."""
        if urls:
            self.link.end_generation()

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """The link to the servers: ``link_gb_per_s`` when given; else loopback TCP,
        measured, when the group runs on loopback; else the rate the interface that
        routes to them reports."""
        if self.link_gb_per_s is not None:
            return Ceiling(self.link_gb_per_s, "link, as given (Gloo(link_gb_per_s=...))")
        if not urls:
            return None
        return link_ceiling(self.link.settings.master_address or master_address_for(list(urls)))

    def abort_info(self) -> Mapping[str, Any]:
        return ShmUpdateFields.abort_json()

    def close(self) -> None:
        self.link.close()


# --------------------------------------------------------------------------- vLLM shape
@dataclass
class GlooTrainerInitInfo:
    """``asyncsync_gloo`` for vLLM's trainer factory (the fields of vLLM's
    ``NCCLTrainerInitInfo`` that apply, plus ours). ``world_size`` is 1 + the server's
    world size; ``master_address`` defaults to the address that routes to the server,
    ``master_port`` to a free port. Creating one registers asyncsync's engines in vLLM's
    ``WeightTransferTrainerFactory``."""

    backend: ClassVar[str] = GLOO_BACKEND_NAME
    master_address: str | None = None
    master_port: int | None = None
    world_size: int = 2
    rank: int = 0
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    create_timeout_s: float = 60.0
    op_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        register_trainer_engines()

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class GlooTrainerEngine:
    """vLLM 0.3x's trainer-engine shape over one synchronous ``VLLMWeightSyncClient``:
    ``trainer_init`` joins the server into a new group, ``send_weights`` sends one
    round of ``source`` (re-joining after a failed round), ``shutdown`` ends it."""

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.link: GlooLink | None = None
        self._members: dict[str, int] = {}
        self._threaded: ThreadedClient | None = None

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> GlooTrainerEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        settings = GlooSettings(
            init_info.master_address,
            init_info.master_port,
            init_info.create_timeout_s,
            init_info.op_timeout_s,
        )
        engine.link = GlooLink(settings, init_info.buffer_bytes)
        timeout = getattr(client, "timeout", None)  # HTTPVLLMWeightSyncClient's per call
        engine.link.update_deadline_s = float(timeout) if timeout else None
        engine._threaded = ThreadedClient(client)
        engine._members = {engine._threaded.url: int(init_info.world_size) - 1}
        engine.link.connect(engine._threaded, engine._members)
        return engine

    def send_weights(self) -> None:
        if self.source is None:
            raise ValueError("GlooTrainerEngine.send_weights needs a source")
        if self.link is None or self._threaded is None:  # not the sender
            stream_chunks(iter(self.source), None, HeapBuffers(4096), None)
            return
        self.link.ensure(self._threaded, self._members)
        self.link.send_round(self.source, self._threaded)

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        if self._threaded is not None:
            self._threaded.close()
