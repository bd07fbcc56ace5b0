"""The ``"nccl"`` backend: vLLM's own NCCL weight transfer, driven by asyncsync.

The servers run vLLM's built-in engine (``--weight-transfer-config
'{"backend": "nccl"}'``); the trainer side is vLLM's too, in whichever API the installed
vLLM offers (`asyncsync._vllm.caps.installed_trainer_api`):

- ``"engine"`` (vLLM 0.28 and later): ``WeightTransferTrainerFactory.trainer_init(
  NCCLTrainerInitInfo(...), client=..., source=...)``, then ``engine.send_weights()``
  each round. The engine runs ``/init_weight_transfer_engine`` concurrently with its
  rendezvous and ``/update_weights`` concurrently with its broadcast, itself.
- ``"callback"`` (vLLM 0.23-0.27): the static ``NCCLWeightTransferEngine.trainer_init``
  and ``trainer_send_weights(iterator, NCCLTrainerSendWeightsArgs(...))``; asyncsync
  starts each HTTP call, runs vLLM's blocking side while it is in flight, and drives
  start and finish around it.

What asyncsync adds (`asyncsync.backends._vllm_drive`): the whole fleet is one NCCL
group (the trainer rank 0; each server at 1 + the world sizes, from ``/get_world_size``,
of the servers before it; world size 1 + their sum), the round's version on finish, and
no thread left waiting on the loop when a server fails: the engine's blocking call runs
in a thread of its own, and a failed HTTP call fails the round at once. The group is
then rebuilt by the next round (NCCL cannot leave a broadcast whose peer is gone: that
thread stays blocked, and its communicator is never reused). The next round also
rebuilds it when the fleet's servers or their world sizes changed.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncsync._core.errors import ProtocolError
from asyncsync._transport.gloo_group import master_address_for
from asyncsync.backends._options import (
    DEFAULT_PACKED_BUFFER_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    NCCL,
)
from asyncsync.backends._vllm_drive import (
    EngineClient,
    VllmEngineBackend,
    VllmSource,
    checked_pairs,
    run_guarded,
)
from asyncsync.backends.contract import Ceiling, RoundCancelled, SendControl, SendStats, TrainerApi

if TYPE_CHECKING:
    from asyncsync.backends.contract import InitInfo, SyncFleetClient, WeightSource

__all__ = ["DEFAULT_PACKED_BUFFER_BYTES", "CountingGroup", "NcclBackend", "rank_offsets"]

logger = logging.getLogger("asyncsync.publish")

#: vLLM's defaults for the packed broadcast (1 GiB, two buffers).

#: Engines and groups whose threads were left blocked in a collective: kept alive (a
#: destroyed communicator under a running kernel is undefined), never reused.
_abandoned: list[Any] = []


def rank_offsets(world_sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Each server's first NCCL rank (the trainer is rank 0; the servers follow in
    fleet order, each taking its world size) and the group's world size."""
    offsets, next_rank = {}, 1
    for url, size in world_sizes.items():
        if size < 1:
            raise ProtocolError(f"{url} reports a world size of {size}", server=url)
        offsets[url] = next_rank
        next_rank += size
    return offsets, next_rank


def free_port(host: str) -> int:
    """A port free on ``host`` now (the rendezvous store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _per_server(offsets: dict[str, int], world_size: int) -> Callable[[dict[str, Any]], InitInfo]:
    """vLLM's init info (``rank_offset=1`` for everyone) -> each server's own."""

    def per_server(info: dict[str, Any]) -> InitInfo:
        if info.get("world_size") != world_size:
            raise ProtocolError(
                f"vLLM's engine announced world_size {info.get('world_size')!r}, "
                f"asyncsync built a group of {world_size}"
            )
        infos = {url: {**info, "rank_offset": offset} for url, offset in offsets.items()}
        if len(infos) == 1:
            return next(iter(infos.values()))
        return infos.__getitem__

    return per_server


class CountingGroup:
    """vLLM's communicator, counting what its broadcasts carry (for the report)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.broadcasts = 0
        self.bytes = 0

    def broadcast(self, tensor: Any, src: int = 0, stream: Any = None) -> None:
        self.broadcasts += 1
        self.bytes += int(tensor.numel()) * int(tensor.element_size())
        if stream is None:
            self.group.broadcast(tensor, src=src)
        else:
            self.group.broadcast(tensor, src=src, stream=stream)

    def destroy(self) -> None:
        destroy = getattr(self.group, "destroy", None)
        if callable(destroy):
            destroy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


class NcclBackend(VllmEngineBackend):
    """``"nccl"``: vLLM's NCCL engine (servers run ``{"backend": "nccl"}``).

    Options: ``master_address`` (what the servers' workers connect to; default:
    loopback when every server is local, else the local address that routes to them),
    ``master_port`` (default: a free port, a new one for each group), ``packed``,
    ``packed_buffer_size_bytes``, ``packed_num_buffers`` (vLLM's packed broadcast; its
    defaults). The installed vLLM decides which of its trainer APIs runs
    (``publisher.api`` says which); the ``api`` argument is not consulted.
    """

    name = "nccl"
    server_backend = "nccl"
    options_class = NCCL
    collective = True

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        master_address: str | None = None,
        master_port: int | None = None,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        link_gb_per_s: float | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, api=api)
        self.link_gb_per_s = link_gb_per_s
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        #: vLLM's trainer engine ("engine" API), or the communicator ("callback" API)
        self._engine: Any = None
        self._group: CountingGroup | None = None
        #: the servers (URL -> world size) the live group was built for
        self._members: dict[str, int] | None = None

    def init_info(self) -> Mapping[str, Any]:
        raise NotImplementedError("nccl init_info is per server and per group")

    def servers_restarted(self, urls: Sequence[str]) -> None:
        """A restarted server is in no group: the next send forms a new one."""
        if urls:
            self._drop()

    # ------------------------------------------------------------------ the group
    def init(self, client: SyncFleetClient) -> None:
        self._connect(client, client.world_sizes())

    def _ensure(self, client: SyncFleetClient) -> None:
        members = client.world_sizes()
        if self._group is None or members != self._members:
            self._connect(client, members)

    def _connect(self, client: SyncFleetClient, members: dict[str, int]) -> None:
        """A new group for exactly ``members``: each server's init in flight while the
        trainer opens its endpoint as rank 0."""
        self._drop()
        offsets, world = rank_offsets(members)
        host = self.master_address or master_address_for(list(members))
        port = self.master_port or free_port(host)
        drive = EngineClient(client, per_server=_per_server(offsets, world))
        logger.info("nccl: a group of %d at %s:%d (%s)", world, host, port, offsets)
        # A failure leaves nothing behind: an init thread stuck in the rendezvous holds
        # its own endpoint, which is never reused.
        if self.api == "engine":
            self._engine = run_guarded(
                lambda: self._trainer_init(host, port, world, drive), drive, name="nccl-init"
            )
            self._group = CountingGroup(self._engine.model_update_group)
            self._engine.model_update_group = self._group
        else:
            self._group = CountingGroup(self._static_init(host, port, world, drive))
        self._members = dict(members)

    def _trainer_init(self, host: str, port: int, world: int, client: EngineClient) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            master_address=host,
            master_port=port,
            world_size=world,
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            rank=self.rank,
        )
        return self.factory_init(info, client)

    def _static_init(self, host: str, port: int, world: int, client: EngineClient) -> Any:
        """vLLM 0.23-0.27: the servers' init (exactly these four fields there) in flight
        while vLLM's static ``trainer_init`` opens rank 0."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        pending = client.begin_init(
            {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": world}
        )

        def open_endpoint() -> Any:
            with self.cuda_errors():
                return NCCLWeightTransferEngine.trainer_init(
                    {"master_address": host, "master_port": port, "world_size": world}
                )

        group = run_guarded(open_endpoint, client, name="nccl-init")
        pending.result()
        return group

    def _drop(self, *, stuck: bool = False) -> None:
        """Forget the group (destroyed, unless a thread is still blocked in it)."""
        engine, group = self._engine, self._group
        self._engine, self._group, self._members = None, None, None
        if stuck:
            _abandoned.append((engine, group))
            return
        try:  # vLLM's engine destroys its communicator; the static API left us the group
            if engine is not None:
                engine.shutdown()
            elif group is not None:
                group.destroy()
        except Exception as exc:  # a broken communicator: nothing more to release
            logger.warning("nccl: releasing the old group failed: %s", exc)

    # ------------------------------------------------------------------ a round
    def check(self, source: WeightSource) -> None:
        VllmSource(source).described()  # TypeError for weights without metadata

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        weights = VllmSource(source)
        if client is None:
            return self._send_non_sender(weights)
        self._ensure(client)
        assert self._group is not None
        self._group.broadcasts = self._group.bytes = 0
        drive = EngineClient(client, control=control)
        params = len(weights.described())
        try:
            if self.api == "engine":
                self._engine.client, self._engine.source = drive, weights
                run_guarded(self._engine.send_weights, drive, name="nccl-send")
            else:
                self._send_static(weights, drive)
        except RoundCancelled:
            raise  # at start or finish: the group saw a whole broadcast, or none
        except BaseException:
            if drive.stuck:
                self._drop(stuck=True)
            elif self._group.broadcasts:  # a broadcast began: the group's state is unknown
                self._drop()
            raise
        return SendStats(chunks=self._group.broadcasts, bytes=self._group.bytes, params=params)

    def _send_static(self, weights: VllmSource, client: EngineClient) -> None:
        """vLLM 0.23-0.27: start; the update (which carries the packing there) in
        flight while vLLM's static send broadcasts; finish with the version."""
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        meta = weights.described()
        info = {
            "names": [n for n, _, _ in meta],
            "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in meta],
            "shapes": [list(s) for _, _, s in meta],
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }
        args = NCCLTrainerSendWeightsArgs(
            group=self._group,
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
        )
        client.start_weight_update()
        pending = client.begin_update(info)
        run_guarded(
            lambda: NCCLWeightTransferEngine.trainer_send_weights(
                checked_pairs(iter(weights), meta), args
            ),
            client,
            name="nccl-send",
        )
        pending.result()
        client.finish_weight_update()

    def _send_non_sender(self, weights: VllmSource) -> SendStats:
        """Every rank runs the engine; only rank 0 sends. Here (rank > 0) vLLM's engine
        iterates the weights (FSDP gathers stay aligned) and calls no server."""
        if self.api == "engine":
            if self._engine is None:
                self._engine = self._trainer_init("127.0.0.1", 0, 1, EngineClient(None))
            self._engine.source = weights
            self._engine.send_weights()
        else:
            for _ in weights:
                pass
        return SendStats(params=len(weights.described()) if weights.source else 0)

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        """The link rate given (``NCCL(link_gb_per_s=...)``); NVLink or a network
        between GPUs cannot be measured from the trainer alone: None otherwise."""
        del urls
        if self.link_gb_per_s is None:
            return None
        return Ceiling(self.link_gb_per_s, "link, as given (NCCL(link_gb_per_s=...))")

    def close(self) -> None:
        self._drop()
