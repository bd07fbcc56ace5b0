"""Worker side of the ``asyncsync_gloo`` backend (vLLM 0.3x engine contract).

``/init_weight_transfer_engine`` drops the worker's old group (if any) and joins the
trainer's new one as rank ``rank_offset`` + this worker's rank, the rendezvous bounded by
``create_timeout_s``. Each ``/update_weights`` is one chunk: it is validated exactly as an
``asyncsync_shm`` chunk (the round's manifest against the served checkpoint at chunk 0,
names, shapes, dtypes, layout, completeness at the last chunk) *before* the worker joins
the broadcast; the bytes land in one of two reused, pre-touched receive buffers and are
loaded as views. Layerwise reload runs once per round (start ... finish).

A receive never blocks the engine for good: it leaves when the trainer ends the
generation (the abort key in the trainer's store, or the store gone), on a gloo error,
or after ``op_timeout_s`` (a frozen trainer). The group and its buffers are then
abandoned (gloo cannot abort an op) and the next init builds a new one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from asyncsync._transport.gloo_group import GlooGroup
from asyncsync._transport.gloo_wire import GLOO_BACKEND_NAME, GlooUpdateFields
from asyncsync._transport.wire import ShmFormatError, ShmUpdateFields
from asyncsync.vllm_plugin._infos import GlooInitInfo, GlooUpdateInfo
from asyncsync.vllm_plugin.engine_v032 import ShmWeightTransferEngine
from asyncsync.vllm_plugin.shm_engine import BufferViews, CheckpointTable, ShmReceiver

if TYPE_CHECKING:
    from asyncsync._transport.gloo_wire import GlooInitFields

__all__ = ["GlooReceiver", "GlooWeightTransferEngine"]

_MIB = 1024 * 1024


class GlooReceiver(ShmReceiver):
    """`ShmReceiver`'s validation and loading, with the bytes of each chunk
    received from the trainer's gloo broadcast."""

    fields_cls = GlooUpdateFields
    backend_name = GLOO_BACKEND_NAME
    accepts_zero_copy = False

    def __init__(self, model: torch.nn.Module, table: CheckpointTable | None) -> None:
        super().__init__(model, table)
        self.group: GlooGroup | None = None
        self.op_timeout_s = 600.0
        self._ring: list[torch.Tensor] = []

    def join(self, fields: GlooInitFields, rank: int) -> None:
        """Leave the old group, join generation ``fields.gen`` as ``rank``."""
        self.leave()
        group = GlooGroup(
            host=fields.master_address,
            port=int(fields.master_port),
            rank=rank,
            world_size=int(fields.world_size),
            generation=int(fields.gen),
            op_timeout_s=float(fields.op_timeout_s),
            create_timeout_s=float(fields.create_timeout_s),
        )
        try:
            group.connect(time.monotonic() + float(fields.create_timeout_s))
        except BaseException:
            group.destroy()
            raise
        self.group, self.op_timeout_s = group, float(fields.op_timeout_s)

    def leave(self, *, failed: bool = False) -> None:
        """Drop the group; after a failure its receive buffers go with it (an abandoned
        op may still write into them)."""
        group, self.group = self.group, None
        if group is not None:
            group.destroy(keep=self._ring if failed else None)
        if failed:
            self._ring = []

    def _slot(self, chunk: int, size: int) -> torch.Tensor:
        """Receive buffer ``chunk % 2`` with at least ``size`` bytes (kept across rounds,
        grown in whole MiB)."""
        index = chunk % 2
        while len(self._ring) <= index:
            self._ring.append(torch.zeros(0, dtype=torch.uint8))
        if self._ring[index].numel() < size:
            self._ring[index] = torch.zeros(-(-size // _MIB) * _MIB, dtype=torch.uint8)
        return self._ring[index][:size]

    def _chunk_bytes(self, update: ShmUpdateFields) -> BufferViews:
        assert isinstance(update, GlooUpdateFields)
        group = self.group
        if group is None or group.generation != update.gen:
            have = "no group" if group is None else f"generation {group.generation}"
            raise ShmFormatError(
                f"chunk {update.chunk} belongs to gloo generation {update.gen} but this "
                f"worker has {have} (init_weight_transfer_engine missing or superseded)"
            )
        slot = self._slot(update.chunk, update.segment_size)
        try:
            group.wait(group.broadcast_async(slot, 0), time.monotonic() + self.op_timeout_s)
        except BaseException:
            self.leave(failed=True)
            raise
        return BufferViews(slot)

    def release_after_failure(self) -> None:
        """A failed update keeps the group. A broadcast that failed has left it already
        (`_chunk_bytes`); any other failure (a chunk refused or aborted before its
        broadcast) must not drop a group a newer init joined: the abort update that ends
        a round an earlier generation left open arrives after this generation's init."""
        ShmReceiver.close(self)

    def close(self) -> None:
        self.leave()
        self._ring = []
        super().close()


class GlooWeightTransferEngine(ShmWeightTransferEngine):
    """Receives trainer weights over a standalone gloo group on a CPU (or any) worker:
    the shm engine's round (layerwise reload once per round, validation before loading)
    with `GlooReceiver` and a group joined at init."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    receiver_cls = GlooReceiver
    receiver: GlooReceiver

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        init_info.check()
        pc = self.parallel_config
        worker = int(getattr(pc, "data_parallel_index", 0)) * int(pc.world_size) + int(pc.rank)
        self.receiver.join(init_info, worker + int(init_info.rank_offset))
