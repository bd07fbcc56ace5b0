"""vLLM plugin: registers asyncsync's weight-transfer engines.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point
``asyncsync_shm = asyncsync.vllm_plugin:register``. Registration is lazy (a module path),
so vLLM processes that never use the backends import nothing more. Worker engines:
``asyncsync_shm`` (vLLM 0.32 and 0.23 contracts), ``asyncsync_gloo`` and
``asyncsync_auto`` (either transport, chosen by each init; 0.3x). Trainer
engines (vLLM's ``WeightTransferTrainerFactory``, where it exists) under the same names:
see `asyncsync.vllm_plugin.trainer`.
"""

from __future__ import annotations

import logging

from asyncsync._transport.gloo_wire import AUTO_BACKEND_NAME, GLOO_BACKEND_NAME
from asyncsync._transport.trainer_factory import register_trainer_engines
from asyncsync._transport.wire import BACKEND_NAME

__all__ = [
    "ADAPTERS",
    "BACKEND_NAME",
    "GLOO_BACKEND_NAME",
    "engine_for_this_vllm",
    "log_through_vllm",
    "register",
    "register_trainer_engines",
]

logger = logging.getLogger("asyncsync.vllm_plugin")


#: The ``asyncsync_shm`` adapter for each engine contract (``asyncsync._vllm.caps``).
ADAPTERS = {
    "worker-owns-round": ("asyncsync.vllm_plugin.engine_v023", "ShmWeightTransferEngineV023"),
    "engine-owns-round": ("asyncsync.vllm_plugin.engine_v032", "ShmWeightTransferEngine"),
}


def engine_for_this_vllm() -> tuple[str, str]:
    """``(module, class)`` of the ``asyncsync_shm`` engine for the running vLLM.

    Chosen by probing vLLM's ``WeightTransferEngine`` base class (its constructor and
    ``receive_weights`` signatures), not by version number: vLLM 0.23-0.24 build engines
    as ``(config, parallel_config, model)``, 0.25 and later as ``(config, vllm_config,
    device, model)``. An unknown contract raises `UnsupportedVLLMError`.
    """
    from asyncsync._vllm.caps import installed_engine_contract

    return ADAPTERS[installed_engine_contract()]


def log_through_vllm() -> None:
    """Send the plugin's log records to vLLM's own handlers at vLLM's level
    (``VLLM_LOGGING_LEVEL``, INFO by default), so they appear in the server's log beside
    vLLM's lines. Without it they would reach Python's last-resort handler, which drops
    everything below WARNING. A no-op when the plugin's logger has handlers already (the
    application configured it) or vLLM's logger has none."""
    vllm_logger = logging.getLogger("vllm")
    if logger.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(vllm_logger.level)
    logger.propagate = False


def register() -> None:
    """Register ``asyncsync_shm`` (and, where engines own the round, ``asyncsync_gloo``) with vLLM's
    weight-transfer engine factory, and the trainer engines where vLLM has them."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # vLLM without pluggable weight transfer: nothing to register
        logger.debug("asyncsync: this vLLM has no weight-transfer factory")
        return
    log_through_vllm()
    registry = WeightTransferEngineFactory._registry
    module, cls = engine_for_this_vllm()
    if BACKEND_NAME not in registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, module, cls)
    if GLOO_BACKEND_NAME not in registry and ADAPTERS["engine-owns-round"] == (module, cls):
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND_NAME, "asyncsync.vllm_plugin.gloo_engine", "GlooWeightTransferEngine"
        )
    if AUTO_BACKEND_NAME not in registry and ADAPTERS["engine-owns-round"] == (module, cls):
        WeightTransferEngineFactory.register_engine(
            AUTO_BACKEND_NAME, "asyncsync.vllm_plugin.auto_engine", "AutoWeightTransferEngine"
        )
    register_trainer_engines()
