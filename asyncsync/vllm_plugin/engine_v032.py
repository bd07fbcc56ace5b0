"""``asyncsync_shm`` for the engine contract of vLLM 0.25 and later (engine objects own
the round; tested for real on 0.27.1 and 0.32.0)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from asyncsync.vllm_plugin._infos import ShmInitInfo, ShmUpdateInfo
from asyncsync.vllm_plugin._mirror import Mirror
from asyncsync.vllm_plugin.shm_engine import (
    CheckpointTable,
    ShmReceiver,
    describe,
    send_from_trainer,
)

logger = logging.getLogger("asyncsync.vllm_plugin")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["ShmInitInfo", "ShmUpdateInfo", "ShmWeightTransferEngine"]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):  # type: ignore[misc]
    """Loads trainer weights from POSIX shared memory on a CPU (or any) worker."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    #: vLLM retargets the engine at the speculative draft model for a round started with
    #: ``/start_draft_weight_update`` (`set_weight_update_target`); the receiver follows
    supports_draft_weight_update = True
    #: the version-neutral receive logic (validation, loading) this engine drives
    receiver_cls: type[ShmReceiver] = ShmReceiver

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
        self.receiver = self.receiver_cls(model, table)
        #: the draft model's checkpoint table and mirror, made at its first round
        self._draft: tuple[torch.nn.Module, CheckpointTable | None, Mirror] | None = None
        self._main = (model, table, self.receiver.mirror)
        self.initialized = False
        #: calls of vLLM's initialize/finalize_layerwise_reload made by this engine; each
        #: is also logged (INFO, in the server's log), so a test can count them from the
        #: server side: one of each per round, never one per chunk.
        self.reloads_initialized = 0
        self.reloads_finalized = 0

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        init_info.check_protocol()
        self.initialized = True

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """A draft round (vLLM calls this before `start_weight_update`): the receiver
        checks chunks against the draft's own checkpoint (its names and shapes) and
        keeps the draft's own delta mirror."""
        super().set_weight_update_target(model, model_config)
        if model is self._main[0]:
            self.receiver.retarget(*self._main)
            return
        if self._draft is None or self._draft[0] is not model:
            served = str(model_config.dtype).removeprefix("torch.")
            table = CheckpointTable.from_model_path(str(model_config.model), served)
            self._draft = (model, table, Mirror())
        self.receiver.retarget(*self._draft)
        logger.info(
            "%s: this round loads into the draft model %s", self.receiver.backend_name,
            model_config.model,
        )  # fmt: skip

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        self.receiver.retarget(*self._main)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.receiver.begin_round()
        initialize_layerwise_reload(self.model)
        self.reloads_initialized += 1
        logger.info(
            "%s: layerwise reload initialized (#%d)", self.receiver.backend_name,
            self.reloads_initialized,
        )  # fmt: skip

    def _restore(self, why: str = "an update was refused; previous weights restored") -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.reloads_finalized += 1
        logger.info(
            "%s: layerwise reload finalized (#%d): %s", self.receiver.backend_name,
            self.reloads_finalized, why,
        )  # fmt: skip

    def parse_update_info(self, update_dict: Any) -> ShmUpdateInfo:
        # vLLM's base update_weights parses after start_weight_update began layerwise
        # reload and before receive_weights: an update that does not parse (a list on
        # vLLM < 0.29, an unknown key) would leave the model mid-reload while the worker
        # clears its update flag, and the next forward pass crashes the worker (SIGSEGV
        # on 0.27.1 and 0.32). Restore the previous weights first.
        try:
            return super().parse_update_info(update_dict)  # type: ignore[no-any-return]
        except BaseException:
            self.receiver.begin_round()
            self._restore()
            raise

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        self.receiver.receive(update_info, self.model.load_weights, self._restore)

    def finish_weight_update(self) -> None:
        summary = self.receiver.round_summary()
        try:
            self.receiver.end_round()
        finally:
            self._restore(f"finish after {summary}")

    def shutdown(self) -> None:
        self.receiver.close()

    def __call__(self, query: str, checkpoint: str = "0") -> dict[str, Any]:
        """The trainer's question, through vLLM's dev-mode ``/collective_rpc``
        (``{"method": "weight_transfer_engine", "args": [query]}``: vLLM calls the
        worker's engine): what this server serves (`asyncsync._wire.served`)."""
        return describe(
            self.receiver.backend_name, self.receiver.table, self.model_config, query,
            checkpoint,
        )  # fmt: skip

    # vLLM 0.25-0.27 still declare this static trainer method abstract on the worker-side
    # base class (dropped in 0.28); without it the engine cannot be built there.
    trainer_send_weights = staticmethod(send_from_trainer)
