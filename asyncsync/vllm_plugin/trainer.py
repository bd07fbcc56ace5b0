"""asyncsync's transports as vLLM trainer engines (vLLM 0.28+ ``WeightTransferTrainerFactory``).

Importing this module registers them (so does the vLLM plugin's ``register()``), under
the names of their worker engines, so that vLLM's own trainer API drives them with any
``VLLMWeightSyncClient``, e.g. vLLM's ``HTTPVLLMWeightSyncClient``::

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from asyncsync.backends.gloo import GlooTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, world_size=2),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()   # start -> update(s) -> finish, each round
    engine.shutdown()

``ShmTrainerInitInfo(rank=0)`` does the same over shared memory (servers on this host).
The init infos are the backends' own (`asyncsync.backends.shm.ShmTrainerInitInfo`,
`asyncsync.backends.gloo.GlooTrainerInitInfo`, re-exported here): creating one
registers these engines in the factory.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from asyncsync._transport.trainer_factory import register_trainer_engines
from asyncsync.backends.gloo import GlooTrainerEngine, GlooTrainerInitInfo
from asyncsync.backends.shm import ShmBuffers, ShmTrainerEngine, ShmTrainerInitInfo

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "ShmTrainerInitInfo",
    "ShmTrainerWeightTransferEngine",
]


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
