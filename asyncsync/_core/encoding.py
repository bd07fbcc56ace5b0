"""JSON encoding for request payloads: orjson when installed, the standard library otherwise.

Payloads are encoded to ``bytes`` once and the same bytes are sent to every server of a
fan-out. Values that are not JSON but commonly appear in weight metadata are converted:
``torch.Size`` and other tuples become lists, integer-like scalars (``__index__``) become
ints, and ``torch.dtype`` becomes its vLLM name (``torch.bfloat16`` -> ``"bfloat16"``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["BACKEND", "Encoded", "dumps", "encoded", "json_safe", "loads"]


class Encoded(Mapping[str, Any]):
    """A mapping with its JSON made beforehand, in the thread that built it: a payload
    that holds it takes these bytes as they are (orjson's ``Fragment``) instead of
    encoding the mapping again. An unpacked ``ipc`` update of 10,000 handles is 1.3 MB
    of JSON: encoded in the trainer's worker thread, not on the event loop. Read as a
    mapping, it is the original one."""

    __slots__ = ("_data", "json")

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data
        self.json = dumps(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Encoded({self._data!r})"


def encoded(payload: Any) -> Any:
    """``payload`` (a mapping, or a list of mappings) with each mapping's JSON made now
    (`Encoded`); as it is when it is neither, or when it does not encode (the error is
    then raised where the payload is sent, naming its server and route)."""
    try:
        if isinstance(payload, Mapping):
            return Encoded(payload)
        if isinstance(payload, list) and all(isinstance(item, Mapping) for item in payload):
            return [Encoded(item) for item in payload]
    except (TypeError, ValueError):
        pass
    return payload


def _default(obj: Any) -> Any:
    """Convert the non-JSON values that weight metadata carries; reject everything else."""
    if isinstance(obj, (tuple, list)):  # tuple subclasses such as torch.Size under orjson
        return [_default(v) if not isinstance(v, (int, float, str, bool)) else v for v in obj]
    type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if type_name == "torch.dtype":
        return str(obj).removeprefix("torch.")
    if hasattr(obj, "__index__"):
        return obj.__index__()
    if isinstance(obj, Encoded):
        return _fragment(obj)
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (set, frozenset)):
        raise TypeError(f"a set is not JSON (order is undefined): {obj!r}")
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, bytearray)):
        return list(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


try:
    import orjson

    BACKEND = "orjson"

    def _fragment(obj: Encoded) -> Any:
        return orjson.Fragment(obj.json)

    def dumps(obj: Any) -> bytes:
        """Encode ``obj`` as compact UTF-8 JSON bytes."""
        return orjson.dumps(obj, default=_default)

    #: Decode JSON bytes or text (orjson's own function: no wrapper call per answer).
    loads: Callable[[bytes | str], Any] = orjson.loads

except ImportError:  # pragma: no cover - exercised where orjson is absent
    BACKEND = "json"

    def _fragment(obj: Encoded) -> Any:
        return dict(obj._data)  # the standard library has no fragments: encode it again

    _encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_default)

    def dumps(obj: Any) -> bytes:
        """Encode ``obj`` as compact UTF-8 JSON bytes."""
        return _encoder.encode(obj).encode("utf-8")

    def loads(data: bytes | str) -> Any:
        """Decode JSON bytes or text."""
        return json.loads(data)


def json_safe(obj: Any) -> Any:
    """A copy of ``obj`` made of JSON types only (see the module docstring for conversions).

    Useful to inspect exactly what will be sent; encoding does the same conversion itself.
    """
    return loads(dumps(obj))
