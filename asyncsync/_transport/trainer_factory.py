"""asyncsync's engines in vLLM's trainer factory (``WeightTransferTrainerFactory``,
vLLM 0.28+), so that vLLM's own trainer API drives them.

Registration is by module path (vLLM imports ``asyncsync.vllm_plugin.trainer`` when it
first builds one), and happens whenever an init info of ours is created
(`asyncsync.backends.shm.ShmTrainerInitInfo`, `asyncsync.backends.gloo.GlooTrainerInitInfo`)
or the vLLM plugin loads: however a user reached those classes, the factory knows them
by the time it is called. Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

from asyncsync._transport.gloo_wire import GLOO_BACKEND_NAME
from asyncsync._transport.wire import BACKEND_NAME

__all__ = ["register_trainer_engines"]

#: (vLLM backend name, class in ``asyncsync.vllm_plugin.trainer``)
_ENGINES = (
    (BACKEND_NAME, "ShmTrainerWeightTransferEngine"),
    (GLOO_BACKEND_NAME, "GlooTrainerWeightTransferEngine"),
)


def register_trainer_engines() -> None:
    """Register ``asyncsync_shm`` and ``asyncsync_gloo`` in vLLM's trainer factory (a
    no-op without vLLM, before 0.28, or when already registered)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return
    registry = WeightTransferTrainerFactory._registry
    for name, cls in _ENGINES:
        if name not in registry:
            WeightTransferTrainerFactory.register_engine(name, "asyncsync.vllm_plugin.trainer", cls)
