"""asyncsync's transports as vLLM trainer engines (vLLM 0.28+ ``WeightTransferTrainerFactory``).

Importing this module registers them (so does the vLLM plugin's ``register()``), under
the names of their worker engines, so that vLLM's own trainer API drives them with any
``VLLMWeightSyncClient``, e.g. vLLM's ``HTTPVLLMWeightSyncClient``::

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from asyncsync.vllm_plugin.trainer import GlooTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, world_size=2),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()   # start -> update(s) -> finish, each round
    engine.shutdown()

``ShmTrainerInitInfo(rank=0)`` does the same over shared memory (servers on this host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from asyncsync.backends._gloo_wire import GLOO_BACKEND_NAME
from asyncsync.backends._shm_pack import DEFAULT_BUFFER_BYTES, ShmBuffers
from asyncsync.backends._shm_zerocopy import ZeroCopyMode, check_zero_copy_mode
from asyncsync.backends._wire import BACKEND_NAME
from asyncsync.backends.gloo import GlooTrainerEngine
from asyncsync.backends.shm import ShmTrainerEngine
from asyncsync.vllm_plugin import register_trainer_engines

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "ShmTrainerInitInfo",
    "ShmTrainerWeightTransferEngine",
]


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """``asyncsync_shm`` for vLLM's trainer factory: the size of each of the two
    shared-memory buffers, and ``zero_copy`` (``True`` or ``"auto"``: the servers read
    the trainer's tensors in place, see docs/transports/shm.md)."""

    backend: ClassVar[str] = BACKEND_NAME
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    zero_copy: ZeroCopyMode = False

    def __post_init__(self) -> None:
        check_zero_copy_mode(self.zero_copy)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """``asyncsync_gloo`` for vLLM's trainer factory. ``world_size`` is 1 + the
    server's world size; ``master_address`` defaults to the address that routes to the
    server, ``master_port`` to a free port."""

    backend: ClassVar[str] = GLOO_BACKEND_NAME
    master_address: str | None = None
    master_port: int | None = None
    world_size: int = 2
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    create_timeout_s: float = 60.0
    op_timeout_s: float = 600.0


class _AsyncsyncTrainerEngine(TrainerWeightTransferEngine[Any]):  # type: ignore[misc]
    """vLLM's trainer-engine interface over one of asyncsync's engines (``self.engine``,
    built by the subclass's ``trainer_init``)."""

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.engine: ShmTrainerEngine | GlooTrainerEngine | None = None

    def send_weights(self) -> None:
        assert self.engine is not None, "use trainer_init"
        self.engine.send_weights()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


class ShmTrainerWeightTransferEngine(_AsyncsyncTrainerEngine):
    """``asyncsync_shm``: `ShmTrainerEngine`."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: ShmTrainerInitInfo, *, client: Any, source: Any = None
    ) -> ShmTrainerWeightTransferEngine:
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        buffers = ShmBuffers(init_info.buffer_bytes)
        self.engine = ShmTrainerEngine.trainer_init(
            init_info, client=client, source=source, buffers=buffers
        )
        return self


class GlooTrainerWeightTransferEngine(_AsyncsyncTrainerEngine):
    """``asyncsync_gloo``: `GlooTrainerEngine`."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
    ) -> GlooTrainerWeightTransferEngine:
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.engine = GlooTrainerEngine.trainer_init(init_info, client=client, source=source)
        return self


register_trainer_engines()
