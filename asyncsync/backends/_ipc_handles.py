"""The one place asyncsync pickles: CUDA IPC handles for vLLM's ``ipc`` engine.

vLLM's IPC engine takes its handles over HTTP only as ``ipc_handles_pickled`` (base64 of
a pickle), which its servers unpickle only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
Only ``backend="ipc"`` imports this module, and a publisher calls it only once it was
created with ``allow_insecure_serialization=True`` (docs/transports/ipc.md,
docs/security.md). Nothing
in asyncsync unpickles; ``tests/test_security.py`` holds every other module of the
trainer side, the wire and the plugin to that, and this one to pickling only.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping
from typing import Any

__all__ = ["encode_ipc_update"]


def encode_ipc_update(update_info: Any) -> Any:
    """An IPC update info as vLLM's HTTP route takes it: ``ipc_handles`` pickled and
    base64-encoded into ``ipc_handles_pickled`` (the servers unpickle it only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Plain pickle first; cloudpickle where
    plain pickle cannot (handles holding locally defined objects)."""
    if isinstance(update_info, list):
        return [encode_ipc_update(info) for info in update_info]
    if not isinstance(update_info, Mapping) or update_info.get("ipc_handles") is None:
        return update_info
    handles = update_info["ipc_handles"]
    try:
        raw = pickle.dumps(handles)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle

        raw = cloudpickle.dumps(handles)
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(raw).decode("ascii")
    return out
