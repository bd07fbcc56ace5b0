"""``asyncsync_shm`` for vLLM 0.23's engine contract (the worker owns layerwise reload
and calls ``receive_weights(update_info, load_weights)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from asyncsync.vllm_plugin._infos import ShmInitInfo, ShmUpdateInfo
from asyncsync.vllm_plugin.shm_engine import (
    CheckpointTable,
    ShmReceiver,
    describe,
    send_from_trainer,
)

__all__ = ["ShmWeightTransferEngineV023"]


def _current_model_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config().model_config
    except Exception:  # no config in scope: validate without the checkpoint table
        return None


class ShmWeightTransferEngineV023(WeightTransferEngine):  # type: ignore[misc]
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, config: Any, parallel_config: Any, model: torch.nn.Module) -> None:
        # vLLM 0.23's base __init__ only stores these; set them here so the adapter does
        # not depend on that signature (it changed in 0.3x).
        self.config = config
        self.parallel_config = parallel_config
        self.model = model
        model_config = self.model_config = _current_model_config()
        table = None
        if model_config is not None:
            served = str(model_config.dtype).removeprefix("torch.")
            table = CheckpointTable.from_model_path(str(model_config.model), served)
        self.receiver = ShmReceiver(model, table)

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        return None

    # In 0.23 the worker owns layerwise reload; these only track the round (chunk 0 also
    # opens one) and check its completeness if a caller drives them.
    def start_weight_update(self) -> None:
        self.receiver.begin_round()

    def finish_weight_update(self) -> None:
        self.receiver.end_round()

    def receive_weights(
        self,
        update_info: ShmUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        if update_info.chunk == 0 and not update_info.abort:
            self.receiver.begin_round()  # 0.23 has no engine-level start hook
        self.receiver.receive(update_info, load_weights, restore=None)

    def shutdown(self) -> None:
        self.receiver.close()

    def __call__(self, query: str, checkpoint: str = "0") -> dict[str, Any]:
        """The trainer's question through vLLM's dev-mode ``/collective_rpc`` (see the
        0.3x engine's)."""
        return describe(
            self.receiver.backend_name, self.receiver.table, self.model_config, query,
            checkpoint,
        )  # fmt: skip

    trainer_send_weights = staticmethod(send_from_trainer)
