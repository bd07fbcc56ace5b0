"""Worker side of ``backend="auto"``: ``asyncsync_auto`` takes either transport.

The trainer decides per server (shm on its own host, gloo elsewhere), so a server
launched before anyone knows where the trainer runs (a Ray actor) takes both: each
``/init_weight_transfer_engine`` names the transport by its fields (a gloo init carries
``master_address``; an shm init does not), and the engine switches to that transport's
receiver until the next init. Everything else (validation before loading, layerwise
reload once per round) is the `ShmWeightTransferEngine`'s and `GlooReceiver`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncsync._transport.gloo_wire import AUTO_BACKEND_NAME
from asyncsync.vllm_plugin._infos import GlooInitInfo, GlooUpdateInfo, ShmInitInfo, ShmUpdateInfo
from asyncsync.vllm_plugin.gloo_engine import GlooReceiver, GlooWeightTransferEngine
from asyncsync.vllm_plugin.shm_engine import ShmReceiver

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["AUTO_BACKEND_NAME", "AutoWeightTransferEngine"]


class AutoWeightTransferEngine(GlooWeightTransferEngine):
    """``asyncsync_auto``: the shm or the gloo engine, as the last init chose."""

    receiver: Any  # a GlooReceiver or a ShmReceiver, as the last init chose

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._gloo: GlooReceiver = self.receiver
        self._shm = ShmReceiver(model, self._gloo.table)
        self.transport = "gloo"

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        cls = GlooInitInfo if "master_address" in init_dict else ShmInitInfo
        try:
            return cls(**init_dict)
        except TypeError as exc:
            raise ValueError(f"Invalid init_info for {AUTO_BACKEND_NAME}: {exc}") from exc

    def init_transfer_engine(self, init_info: Any) -> None:
        if isinstance(init_info, GlooInitInfo):
            self.receiver, self.update_info_cls, self.transport = (
                self._gloo, GlooUpdateInfo, "gloo",
            )  # fmt: skip
            super().init_transfer_engine(init_info)
            return
        init_info.check_protocol()
        self._gloo.leave()  # a trainer on this host now: no group is needed any more
        self.receiver, self.update_info_cls, self.transport = self._shm, ShmUpdateInfo, "shm"
        self.initialized = True

    def shutdown(self) -> None:
        self._shm.close()
        self._gloo.close()
