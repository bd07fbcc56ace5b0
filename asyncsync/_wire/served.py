"""What a server says about the model it serves, as plain JSON (no I/O, no torch).

asyncsync's worker-side engines (``asyncsync_shm``, ``asyncsync_gloo``,
``asyncsync_auto``) answer a
question the trainer asks through vLLM's dev-mode ``POST /collective_rpc``: vLLM calls
``getattr(worker, method)(*args, **kwargs)`` on every worker, and ``method`` names the
worker's ``weight_transfer_engine`` attribute, which is the engine itself; asyncsync's
engines are callable and answer `DESCRIBE_QUERY` with a `ServedModel` (as JSON), one
per worker. vLLM's own engines (NCCL, IPC) are not callable: vLLM answers 500
"'NCCLWeightTransferEngine' object is not callable", which `cannot_describe` turns
into a reason. Servers without dev mode answer 404.

`CheckpointTable` is what both sides check weights against: the names, dtypes and
shapes of the checkpoint the server loaded (read from its safetensors headers by the
plugin). The worker validates every update with it before loading anything; the
trainer checks a whole round with `CheckpointTable.problems` before any server is
touched (`asyncsync.IncompatibleWeightsError`).

/v1/models gives ``max_model_len`` on every vLLM server (`control.parse_model_entries`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from asyncsync._core import encoding as _json
from asyncsync._core.errors import AsyncSyncError, ServerError

__all__ = [
    "ASYNCSYNC_ENGINES",
    "DESCRIBE_METHOD",
    "DESCRIBE_QUERY",
    "SERVED_PROTOCOL",
    "CheckpointTable",
    "ServedModel",
    "cannot_describe",
    "describe_payload",
    "parse_described",
    "quoted_names",
]

#: The server-side engines that answer (asyncsync's plugin); vLLM's own do not.
ASYNCSYNC_ENGINES = ("asyncsync_shm", "asyncsync_gloo", "asyncsync_auto")
#: The worker attribute ``/collective_rpc`` calls: vLLM's worker keeps its engine there.
DESCRIBE_METHOD = "weight_transfer_engine"
#: The question asyncsync's engines answer when called.
DESCRIBE_QUERY = "asyncsync:describe"
#: The version of the answer's fields (a newer trainer reads older answers).
SERVED_PROTOCOL = 1

#: One checkpoint tensor's dtype name and shape.
Entry = tuple[str, tuple[int, ...]]


def quoted_names(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` names, quoted, and how many more there are."""
    text = ", ".join(repr(n) for n in names[:shown])
    return f"{text} and {len(names) - shown} more" if len(names) > shown else text


@dataclass
class CheckpointTable:
    """Names, dtypes and shapes of the checkpoint a server loaded (from the safetensors
    headers: a few KB read, no tensor data). ``served_dtype`` is the dtype the server
    computes in: a tensor may come in it or in the checkpoint's own dtype."""

    entries: dict[str, Entry]
    served_dtype: str | None = None

    def problem(self, name: str, dtype_name: str, shape: Sequence[int]) -> str | None:
        """Why tensor ``name`` (``dtype_name``, ``shape``) does not fit, or None."""
        if name not in self.entries:
            return f"unknown parameter {name!r}: the served model has no such checkpoint tensor"
        want_dtype, want_shape = self.entries[name]
        if tuple(shape) != want_shape:
            return (
                f"parameter {name!r}: shape {list(shape)} does not match the served "
                f"model's {list(want_shape)}"
            )
        allowed = {want_dtype} | ({self.served_dtype} if self.served_dtype else set())
        if dtype_name not in allowed:
            return (
                f"parameter {name!r}: dtype {dtype_name} does not match the served "
                f"model's {' or '.join(sorted(allowed))}"
            )
        return None

    def missing(self, received: Iterable[str]) -> list[str]:
        """Checkpoint tensors not in ``received``, in checkpoint order."""
        got = set(received)
        return [n for n in self.entries if n not in got]

    def problems(self, entries: Iterable[tuple[str, str, Sequence[int]]]) -> list[str]:
        """Every way a whole round of ``(name, dtype name, shape)`` does not fit: each
        tensor that does not, then the checkpoint tensors it lacks (a round must update
        every one: vLLM's layerwise reload would otherwise leave a partly updated layer
        with uninitialized memory, and a layer not updated at all with the old weights)."""
        out: list[str] = []
        names: list[str] = []
        for name, dtype_name, shape in entries:
            names.append(name)
            found = self.problem(name, dtype_name, shape)
            if found is not None:
                out.append(found)
        missing = self.missing(names)
        if missing:
            out.append(self.missing_problem(missing))
        return out

    @staticmethod
    def missing_problem(missing: Sequence[str]) -> str:
        """The sentence for checkpoint tensors a round lacks."""
        return (
            f"the round does not update {quoted_names(missing)} (a round must update every "
            "checkpoint tensor)"
        )

    @cached_property
    def fingerprint(self) -> str:
        """A digest of the whole table (servers of one model share it): computed once."""
        return hashlib.sha256(_json.dumps(self.to_json())).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "served_dtype": self.served_dtype,
            "tensors": {n: [d, list(s)] for n, (d, s) in self.entries.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> CheckpointTable:
        """ValueError when ``data`` is not `to_json`'s shape."""
        if not isinstance(data, Mapping) or not isinstance(data.get("tensors"), Mapping):
            raise ValueError("a checkpoint table is {'served_dtype', 'tensors': {name: ...}}")
        entries: dict[str, Entry] = {}
        for name, entry in data["tensors"].items():
            if not (
                isinstance(name, str)
                and isinstance(entry, Sequence)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and isinstance(entry[1], Sequence)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in entry[1])
            ):
                raise ValueError(f"malformed checkpoint entry {name!r}: {entry!r:.80}")
            entries[name] = (entry[0], tuple(entry[1]))
        served = data.get("served_dtype")
        if served is not None and not isinstance(served, str):
            raise ValueError("served_dtype is not a string")
        return cls(entries, served)


@dataclass(frozen=True)
class ServedModel:
    """What a server's asyncsync engine says about the model it serves.

    Attributes:
        backend: the engine that answered (``"asyncsync_shm"``, ``"asyncsync_gloo"``).
        model: the model path or name the server loaded.
        vocab_size: the model's vocabulary size (vLLM's ``get_vocab_size()``).
        max_model_len: the server's context length.
        checkpoint: the served checkpoint's table (None when not asked for, or when
            the plugin could not read it: ``checkpoint_unknown`` says why).
        checkpoint_unknown: why there is no table, when asked for and absent.
    """

    backend: str
    model: str | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    checkpoint: CheckpointTable | None = None
    checkpoint_unknown: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "asyncsync": SERVED_PROTOCOL,
            "backend": self.backend,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
            "checkpoint_unknown": self.checkpoint_unknown,
        }

    @classmethod
    def from_json(cls, data: Any) -> ServedModel:
        """ValueError when ``data`` is not an engine's answer."""
        if not isinstance(data, Mapping) or not isinstance(data.get("asyncsync"), int):
            raise ValueError("not an asyncsync engine's answer")
        backend = data.get("backend")
        if not isinstance(backend, str):
            raise ValueError("backend is not a string")

        def size(key: str) -> int | None:
            value = data.get(key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} is not an int >= 1")
            return value

        model, unknown = data.get("model"), data.get("checkpoint_unknown")
        table = data.get("checkpoint")
        return cls(
            backend=backend,
            model=model if isinstance(model, str) else None,
            vocab_size=size("vocab_size"),
            max_model_len=size("max_model_len"),
            checkpoint=None if table is None else CheckpointTable.from_json(table),
            checkpoint_unknown=unknown if isinstance(unknown, str) else None,
        )


def describe_payload(*, checkpoint: bool) -> dict[str, Any]:
    """The ``/collective_rpc`` body that asks the engine (vLLM passes only strings)."""
    return {
        "method": DESCRIBE_METHOD,
        "args": [DESCRIBE_QUERY],
        "kwargs": {"checkpoint": "1" if checkpoint else "0"},
    }


def parse_described(data: Any) -> ServedModel:
    """``{"results": [answer per worker]}``: the first worker's answer (every worker
    holds the same model). ValueError when no worker answered like asyncsync's engine."""
    results = data.get("results") if isinstance(data, Mapping) else None
    if not isinstance(results, list) or not results:
        raise ValueError("no 'results' list")
    return ServedModel.from_json(results[0])


_NOT_CALLABLE = re.compile(r"'([A-Za-z_][\w.]*)' object is not callable")


def cannot_describe(error: BaseException) -> str:
    """Why a server did not describe its model, from the error its ``/collective_rpc``
    answered, in words."""
    text = error.message if isinstance(error, AsyncSyncError) else str(error)
    found = _NOT_CALLABLE.search(text)
    if found is not None:
        engine = found[1]
        if engine == "NoneType":
            return "the server runs no weight-transfer engine (no --weight-transfer-config)"
        return (
            f"its weight-transfer engine is {engine}, not one of asyncsync's engines "
            "(asyncsync_shm, asyncsync_gloo); vLLM's own engines cannot describe the model"
        )
    if isinstance(error, ServerError) and error.status == 404:
        return "the server has no /collective_rpc (start it with VLLM_SERVER_DEV_MODE=1)"
    if "is not implemented" in text:
        return f"this vLLM has no worker attribute {DESCRIBE_METHOD!r}"
    return f"{type(error).__name__}: {text}"
