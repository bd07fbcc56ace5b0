"""What ``publish`` accepts as weights, normalized into one source type.

A module (its ``named_parameters()``), ``(name, tensor)`` pairs (a mapping or an
iterable), an object with ``metadata()`` and ``__iter__`` (vLLM's ``WeightSource``), or a
zero-argument callable returning one of those. A callable is called in the worker thread,
so FSDP-style materialization happens off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any

from asyncsync.backends.contract import ParamMeta, WeightSource, check_tensor

__all__ = [
    "FiniteChecked",
    "WeightsLike",
    "check_finite",
    "check_source",
    "check_weights",
    "finite",
    "is_factory",
    "resolve",
]

#: What ``publish`` accepts (see the module docstring).
WeightsLike = Any


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
