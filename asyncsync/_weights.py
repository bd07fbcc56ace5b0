"""What ``publish`` accepts as weights, normalized into one source type.

A module (its ``named_parameters()``), ``(name, tensor)`` pairs (a mapping or an
iterable), an object with ``metadata()`` and ``__iter__`` (vLLM's ``WeightSource``), or a
zero-argument callable returning one of those. A callable is called in the worker thread,
so FSDP-style materialization happens off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["WeightSource", "WeightsLike", "is_factory", "resolve"]

#: What ``publish`` accepts (see the module docstring).
WeightsLike = Any

#: ``(name, dtype, shape)`` of one parameter, without materializing it.
ParamMeta = tuple[str, Any, tuple[int, ...]]


class WeightSource:
    """A normalized weight source: iteration of ``(name, tensor)`` plus, when the weights
    can describe themselves, their metadata (the shape of vLLM's ``WeightSource``)."""

    def __init__(self, weights: WeightsLike) -> None:
        self._weights = weights

    def metadata(self) -> list[ParamMeta] | None:
        """``(name, dtype, shape)`` of every parameter, or None for a stream."""
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return [(n, p.dtype, tuple(p.shape)) for n, p in named()]
        meta = getattr(w, "metadata", None)
        if callable(meta):
            out = []
            for m in meta():
                if isinstance(m, tuple):
                    out.append((str(m[0]), m[1], tuple(m[2])))
                else:
                    out.append((str(m.name), m.dtype, tuple(m.shape)))
            return out
        if isinstance(w, Mapping):
            return [(str(n), t.dtype, tuple(t.shape)) for n, t in w.items()]
        if isinstance(w, Sequence):
            return [(str(n), t.dtype, tuple(t.shape)) for n, t in w]
        return None

    def total_bytes(self) -> int | None:
        """Payload bytes of the whole source, when it describes itself."""
        meta = self.metadata()
        if meta is None:
            return None
        total = 0
        for _, dtype, shape in meta:
            count = 1
            for dim in shape:
                count *= int(dim)
            total += count * int(getattr(dtype, "itemsize", 0))
        return total

    def __iter__(self) -> Iterator[Any]:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return iter(named())
        if isinstance(w, Mapping):
            return iter(w.items())
        return iter(w)


def is_factory(weights: WeightsLike) -> bool:
    """A zero-argument callable producing the weights (a module is not one)."""
    return (
        callable(weights)
        and not hasattr(weights, "named_parameters")
        and not hasattr(weights, "__iter__")
    )


def resolve(weights: WeightsLike) -> WeightSource:
    """Normalize ``weights`` (calling a factory); TypeError for anything else."""
    if is_factory(weights):
        weights = weights()
    if not (
        hasattr(weights, "named_parameters")
        or hasattr(weights, "__iter__")
        or isinstance(weights, Mapping)
    ):
        raise TypeError(
            "publish(weights=...) takes a torch module, a mapping or iterable of "
            f"(name, tensor), or a callable returning one; got {type(weights).__name__}"
        )
    return WeightSource(weights)
