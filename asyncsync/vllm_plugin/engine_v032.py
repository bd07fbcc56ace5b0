"""``asyncsync_shm`` for vLLM 0.3x's engine contract (engine objects own the round)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from asyncsync.vllm_plugin.shm_engine import CheckpointTable, ShmReceiver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["ShmInitInfo", "ShmUpdateInfo", "ShmWeightTransferEngine"]

PROTOCOL_VERSION = 1


@dataclass
class ShmInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Sent once by the trainer at ``/init_weight_transfer_engine``."""

    protocol: int = PROTOCOL_VERSION
    trainer_pid: int | None = None


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One chunk (see :mod:`asyncsync.backends._shm_format`)."""

    round: str = ""
    chunk: int = 0
    last: bool = False
    num_chunks: int | None = None
    segment: str = ""
    segment_size: int = 0
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    abort: bool = False


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):  # type: ignore[misc]
    """Loads trainer weights from POSIX shared memory on a CPU (or any) worker."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        served = str(self.model_config.dtype).removeprefix("torch.")
        table = CheckpointTable.from_model_path(str(self.model_config.model), served)
        self.receiver = ShmReceiver(model, table)
        self.initialized = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if init_info.protocol != PROTOCOL_VERSION:
            raise ValueError(
                f"asyncsync_shm: trainer speaks protocol {init_info.protocol}, this worker "
                f"speaks {PROTOCOL_VERSION}; install the same asyncsync on both sides"
            )
        self.initialized = True

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.receiver.begin_round()
        initialize_layerwise_reload(self.model)

    def _restore(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        self.receiver.receive(
            dataclasses.asdict(update_info), self.model.load_weights, self._restore
        )

    def finish_weight_update(self) -> None:
        try:
            self.receiver.end_round()
        finally:
            self._restore()

    def shutdown(self) -> None:
        self.receiver.close()
