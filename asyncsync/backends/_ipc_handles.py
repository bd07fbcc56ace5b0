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

__all__ = ["encode_ipc_update", "pickled_handles"]

#: Handles pickled per call of ``pickle.dumps`` (see `pickled_handles`).
BATCH = 256
#: Around the batches: ``list(itertools.chain(batch, batch, ...))`` in pickle's opcodes
#: (protocol 3: GLOBAL builtins.list, GLOBAL itertools.chain, MARK ... TUPLE, REDUCE,
#: TUPLE1, REDUCE, STOP).
_HEAD = b"\x80\x03cbuiltins\nlist\ncitertools\nchain\n("
_TAIL = b"tR\x85R."


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
        raw = pickled_handles(handles)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle

        raw = cloudpickle.dumps(handles)
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(raw).decode("ascii")
    return out


def pickled_handles(handles: Any) -> bytes:
    """``handles`` pickled, a long list of them (an unpacked round: one per tensor) in
    batches of `BATCH`, so that the GIL is free between batches: one ``pickle.dumps``
    of 9,339 CUDA handles holds it 50-60 ms, during which the event loop cannot run
    (measured as its longest lag on an H200); in batches it is held ~2 ms at a time,
    and the whole is faster (a smaller memo). Each batch is pickled with protocol 3,
    whose memo indices are explicit, so batches stand side by side; the stream
    rebuilds the one list (``list(itertools.chain(*batches))``), as plain pickle's
    would, for vLLM's server to read with ``pickle``."""
    if not isinstance(handles, list) or len(handles) <= BATCH:
        return pickle.dumps(handles)
    parts = [_HEAD]
    for start in range(0, len(handles), BATCH):
        batch = pickle.dumps(handles[start : start + BATCH], protocol=3)
        parts.append(batch[2:-1])  # without its PROTO and STOP
    parts.append(_TAIL)
    return b"".join(parts)
