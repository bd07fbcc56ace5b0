"""vLLM plugin: registers asyncsync's worker-side weight-transfer engines.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point
``asyncsync_shm = asyncsync.vllm_plugin:register``. Registration is lazy (a module path),
so vLLM processes that never use the backend import nothing more.
"""

from __future__ import annotations

import logging

from asyncsync.backends._wire import BACKEND_NAME

__all__ = ["ADAPTERS", "BACKEND_NAME", "engine_for_this_vllm", "register"]

logger = logging.getLogger("asyncsync.vllm_plugin")


#: The ``asyncsync_shm`` adapter for each engine contract (``asyncsync._vllm_caps``).
ADAPTERS = {
    "worker-owns-round": ("asyncsync.vllm_plugin.engine_v023", "ShmWeightTransferEngineV023"),
    "engine-owns-round": ("asyncsync.vllm_plugin.engine_v032", "ShmWeightTransferEngine"),
}


def engine_for_this_vllm() -> tuple[str, str]:
    """``(module, class)`` of the ``asyncsync_shm`` engine for the running vLLM.

    Chosen by probing vLLM's ``WeightTransferEngine`` base class (its constructor and
    ``receive_weights`` signatures), not by version number: vLLM 0.23-0.24 build engines
    as ``(config, parallel_config, model)``, 0.25 and later as ``(config, vllm_config,
    device, model)``. An unknown contract raises :class:`~asyncsync.UnsupportedVLLM`.
    """
    from asyncsync._vllm_caps import installed_engine_contract

    return ADAPTERS[installed_engine_contract()]


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
