"""vLLM plugin: registers asyncsync's worker-side weight-transfer engines.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point
``asyncsync_shm = asyncsync.vllm_plugin:register``. Registration is lazy (a module path),
so vLLM processes that never use the backend import nothing more.
"""

from __future__ import annotations

import logging

from asyncsync.backends._wire import BACKEND_NAME

__all__ = ["BACKEND_NAME", "engine_for_this_vllm", "register"]

logger = logging.getLogger("asyncsync.vllm_plugin")


def engine_for_this_vllm() -> tuple[str, str]:
    """``(module, class)`` of the ``asyncsync_shm`` engine for the running vLLM.

    The one place that decides by vLLM version: 0.30 and later construct engines as
    ``(config, vllm_config, device, model)`` and let them own layerwise reload; earlier
    ones (0.23) as ``(config, parallel_config, model)`` with ``receive_weights(info,
    load_weights)``.
    """
    import vllm

    parts = str(getattr(vllm, "__version__", "0.0")).split(".")
    try:
        generation = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        generation = (0, 0)
    if generation >= (0, 30):
        return "asyncsync.vllm_plugin.engine_v032", "ShmWeightTransferEngine"
    return "asyncsync.vllm_plugin.engine_v023", "ShmWeightTransferEngineV023"


def register() -> None:
    """Register ``asyncsync_shm`` with vLLM's weight-transfer engine factory."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # vLLM without pluggable weight transfer: nothing to register
        logger.debug("asyncsync: this vLLM has no weight-transfer factory")
        return
    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    module, cls = engine_for_this_vllm()
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, module, cls)
