"""The ``asyncsync_shm`` and ``asyncsync_gloo`` info classes vLLM builds with
``cls(**info)``: vLLM's bases plus the shared wire fields of `asyncsync._transport.wire`
and `asyncsync._transport.gloo_wire` (one definition of the fields for the trainer
and the worker side)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from asyncsync._transport.gloo_wire import GlooInitFields, GlooUpdateFields
from asyncsync._transport.wire import ShmInitFields, ShmUpdateFields

__all__ = ["GlooInitInfo", "GlooUpdateInfo", "ShmInitInfo", "ShmUpdateInfo"]


@dataclass
class ShmInitInfo(ShmInitFields, WeightTransferInitInfo):  # type: ignore[misc]
    """Sent once by the trainer at ``/init_weight_transfer_engine``."""


@dataclass
class ShmUpdateInfo(ShmUpdateFields, WeightTransferUpdateInfo):  # type: ignore[misc]
    """One chunk (see `asyncsync._transport.wire`)."""


@dataclass
class GlooInitInfo(GlooInitFields, WeightTransferInitInfo):  # type: ignore[misc]
    """``asyncsync_gloo``: the trainer's store, this server's rank offset, the group."""


@dataclass
class GlooUpdateInfo(GlooUpdateFields, WeightTransferUpdateInfo):  # type: ignore[misc]
    """One ``asyncsync_gloo`` chunk (see `asyncsync._transport.gloo_wire`)."""
