"""vLLM plugin: registers asyncsync's worker-side weight-transfer engines.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point
``asyncsync_shm = asyncsync.vllm_plugin:register``. Registration is lazy (a module path),
so vLLM processes that never use the backend import nothing more.
"""

from __future__ import annotations

import logging

from asyncsync.backends._shm_format import BACKEND_NAME

__all__ = ["BACKEND_NAME", "register"]

logger = logging.getLogger("asyncsync.vllm_plugin")


def _vllm_generation() -> tuple[int, int]:
    import vllm

    parts = str(getattr(vllm, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def register() -> None:
    """Register ``asyncsync_shm`` with vLLM's weight-transfer engine factory."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # vLLM without pluggable weight transfer: nothing to register
        logger.debug("asyncsync: this vLLM has no weight-transfer factory")
        return
    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    if _vllm_generation() >= (0, 30):
        module, cls = "asyncsync.vllm_plugin.engine_v032", "ShmWeightTransferEngine"
    else:
        module, cls = "asyncsync.vllm_plugin.engine_v023", "ShmWeightTransferEngineV023"
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, module, cls)
