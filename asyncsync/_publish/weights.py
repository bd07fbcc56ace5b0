"""What ``publish`` accepts as weights, normalized into one source type.

A module (its ``named_parameters()``), ``(name, tensor)`` pairs (a mapping or an
iterable), an object with ``metadata()`` and ``__iter__`` (vLLM's ``WeightSource``), or a
zero-argument callable returning one of those. A callable is called in the worker thread,
so FSDP-style materialization happens off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

__all__ = [
    "FiniteChecked",
    "WeightSource",
    "WeightsLike",
    "check_finite",
    "check_source",
    "check_tensor",
    "check_weights",
    "finite",
    "is_factory",
    "resolve",
]

#: What ``publish`` accepts (see the module docstring).
WeightsLike = Any

#: ``(name, dtype, shape)`` of one parameter, without materializing it.
ParamMeta = tuple[str, Any, tuple[int, ...]]


class WeightSource:
    """A normalized weight source: iteration of ``(name, tensor)`` plus, when the weights
    can describe themselves, their metadata (the shape of vLLM's ``WeightSource``)."""

    def __init__(self, weights: WeightsLike) -> None:
        self._weights = weights
        #: `metadata`'s answer, read once per source (a round reads it for its checks,
        #: its backend and its report; a model of 10,000 tensors costs ~25 ms a walk)
        self._described: list[ParamMeta] | None = None

    @property
    def weights(self) -> WeightsLike:
        """What the caller passed (after calling a factory)."""
        return self._weights

    @property
    def reiterable(self) -> bool:
        """Whether iterating twice yields the same tensors (not a one-shot stream)."""
        w = self._weights
        return callable(getattr(w, "named_parameters", None)) or isinstance(w, Mapping | Sequence)

    def metadata(self) -> list[ParamMeta] | None:
        """``(name, dtype, shape)`` of every parameter, or None for a stream (read once:
        a source lives for one round, during which the weights keep their shapes)."""
        if self._described is None:
            self._described = self._read_metadata()
        return self._described

    def _read_metadata(self) -> list[ParamMeta] | None:
        w = self._weights
        named = getattr(w, "named_parameters", None)
        if callable(named):
            return [(n, p.dtype, tuple(p.shape)) for n, p in named()]
        meta = getattr(w, "metadata", None)
        described = meta() if callable(meta) else None
        if described is not None:
            out = []
            for m in described:
                if isinstance(m, tuple):
                    out.append((str(m[0]), m[1], tuple(m[2])))
                else:
                    out.append((str(m.name), m.dtype, tuple(m.shape)))
            return out
        if isinstance(w, Mapping):
            return [_meta(n, t) for n, t in w.items()]
        if isinstance(w, Sequence):
            return [_meta(*_pair(item)) for item in w]
        return None

    def whole(self) -> WeightSource:
        """The weights as servers outside a delta chain take them: this source (a
        delta chain's source returns the one it computes its patches from)."""
        return self

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


def _pair(item: Any) -> tuple[Any, Any]:
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise TypeError(f"weights must be (name, tensor) pairs, got {item!r:.80}")
    return item[0], item[1]


def _meta(name: Any, tensor: Any) -> ParamMeta:
    check_tensor(name, tensor)
    return (name, tensor.dtype, tuple(tensor.shape))


def check_tensor(name: Any, tensor: Any) -> None:
    """One ``(name, tensor)`` pair a backend can read: a str name and a dense tensor
    with data (TypeError/ValueError naming the parameter)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
    layout = getattr(tensor, "layout", None)
    if layout is None or not hasattr(tensor, "dtype"):
        raise TypeError(f"parameter {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if str(layout) != "torch.strided":
        raise TypeError(f"parameter {name!r} is a {layout} tensor; only dense tensors can be sent")
    if str(getattr(tensor, "device", "")) == "meta":
        raise ValueError(f"parameter {name!r} is on the meta device: it holds no data")


def check_weights(source: WeightSource) -> None:
    """Bad input refused before a round touches any server, from metadata alone (and,
    for mappings, sequences and modules, each tensor's kind): names that are not
    strings or repeat, values that are not dense tensors with data, no weights at all.
    A stream without metadata is checked tensor by tensor while it is packed."""
    meta = source.metadata()
    if meta is None:
        return
    if not meta:
        raise ValueError("no weights to publish: the source holds no parameters")
    seen: set[str] = set()
    for name, _dtype, _shape in meta:
        if not isinstance(name, str) or not name:
            raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in the weights")
        seen.add(name)
    named = getattr(source.weights, "named_parameters", None)
    if callable(named):
        for name, tensor in named():
            check_tensor(name, tensor)


def _non_finite(name: str, tensor: Any) -> None:
    import torch

    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"parameter {name!r} holds {bad} NaN or Inf value(s)")


def check_finite(source: WeightSource) -> None:
    """Every floating-point tensor of a re-iterable source is finite (ValueError naming
    the first that is not). Reads every tensor: run it off the event loop."""
    for name, tensor in source:
        full = getattr(tensor, "full_tensor", None)
        _non_finite(name, full() if callable(full) else tensor)


class FiniteChecked(WeightSource):
    """A source whose tensors are checked for NaN/Inf as they are produced (a stream or
    a factory's weights, which cannot be read twice)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__(source.weights)
        self._source = source

    def metadata(self) -> list[ParamMeta] | None:
        return self._source.metadata()

    def __iter__(self) -> Iterator[Any]:
        for name, tensor in self._source:
            _non_finite(name, tensor)
            yield name, tensor


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


async def finite(weights: WeightsLike, executor: Executor) -> WeightsLike:
    """``publish(check_finite=True)``: weights whose NaN/Inf are refused: read now (in
    ``executor``, off the loop) when they can be read twice, else checked as they are
    produced."""
    if is_factory(weights):
        return lambda: FiniteChecked(resolve(weights))
    source = resolve(weights)
    if not source.reiterable:
        return FiniteChecked(source)
    check_weights(source)
    await asyncio.get_running_loop().run_in_executor(executor, check_finite, source)
    return weights


async def check_source(
    source: WeightSource, backend_check: Callable[[WeightSource], None], executor: Executor
) -> None:
    """A round's weights checked before any server is touched (what the wire carries,
    then ``backend_check``: the transport's own rules), in ``executor``: the work grows
    with the tensor count, and zero-copy's check reads this process's memory map."""

    def check() -> None:
        check_weights(source)
        backend_check(source)

    await asyncio.get_running_loop().run_in_executor(executor, check)
