"""A round's weights checked against the checkpoint each server serves, before any
server is touched.

The servers' asyncsync engines (``asyncsync_shm``, ``asyncsync_gloo``) describe the
checkpoint they loaded (names, dtypes, shapes; `asyncsync._wire.served`), learned once
per server by its client (`asyncsync._generation.served.ServedLookup`). `Checkpoints`
holds the tables of the round's servers and refuses weights that do not fit with one
`IncompatibleWeightsError` listing every mismatch:

- weights that describe themselves (a module, a mapping, a list, a ``WeightSource``)
  are checked whole before the round (a factory's once it was called, in the worker
  thread, still before the first ``/start_weight_update``);
- a stream without metadata is checked tensor by tensor as it is produced, and for the
  tensors it lacked once it ends: a mismatch in the first chunk touches no server, a
  later one fails the round like any other error (the servers' engines would refuse it
  too).

A server that cannot describe its checkpoint (vLLM's own engines, a plugin that could
not read the checkpoint, no dev mode) is not checked here: its engine's own validation,
if any, is what remains (docs/publishing.md says what each transport does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from asyncsync._core.errors import (
    IncompatibleWeightsError,
    ServerTimeout,
    ServerUnavailableError,
)
from asyncsync._wire.served import ASYNCSYNC_ENGINES, CheckpointTable
from asyncsync.backends.contract import ParamMeta, WeightSource

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = ["Checkpoints", "served_checkpoints"]

logger = logging.getLogger("asyncsync.publish")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class Checkpoints:
    """The checkpoint tables of a round's servers (those that could describe theirs),
    grouped: servers of one model share one table."""

    def __init__(self, tables: dict[str, CheckpointTable]) -> None:
        by_digest: dict[str, tuple[CheckpointTable, list[str]]] = {}
        for url, table in tables.items():
            by_digest.setdefault(table.fingerprint, (table, []))[1].append(url)
        self.groups: list[tuple[CheckpointTable, list[str]]] = list(by_digest.values())

    def __bool__(self) -> bool:
        return bool(self.groups)

    def check(self, metadata: Sequence[ParamMeta]) -> None:
        """Every way ``metadata`` (a whole round) does not fit any server's checkpoint,
        in one `IncompatibleWeightsError`."""
        entries = [(name, _dtype_name(dtype), tuple(shape)) for name, dtype, shape in metadata]
        for table, urls in self.groups:
            problems = table.problems(entries)
            if problems:
                named = [n for n, d, s in entries if table.problem(n, d, s) is not None]
                named += table.missing(n for n, _d, _s in entries)
                raise IncompatibleWeightsError(problems, parameters=named, servers=urls)

    def check_one(self, name: str, dtype: Any, shape: Sequence[int]) -> None:
        for table, urls in self.groups:
            problem = table.problem(name, _dtype_name(dtype), tuple(shape))
            if problem is not None:
                raise IncompatibleWeightsError(
                    [problem], parameters=[name], servers=urls, whole=False
                )

    def check_missing(self, sent: set[str]) -> None:
        for table, urls in self.groups:
            missing = table.missing(sent)
            if missing:
                problem = table.missing_problem(missing)
                raise IncompatibleWeightsError(
                    [problem], parameters=missing, servers=urls, whole=False
                )

    def checked(self, source: WeightSource) -> WeightSource:
        """``source`` refused now when it describes itself, else checked as produced."""
        if not self.groups:
            return source
        metadata = source.metadata()
        if metadata is not None:
            self.check(metadata)
            return source
        return _CheckedStream(source, self)


class _CheckedStream(WeightSource):
    """A stream whose tensors are checked against the checkpoints as they come, and
    whose end is checked for the checkpoint tensors it lacked."""

    def __init__(self, source: WeightSource, checkpoints: Checkpoints) -> None:
        super().__init__(source.weights)
        self._source = source
        self._checkpoints = checkpoints

    def metadata(self) -> list[ParamMeta] | None:
        return self._source.metadata()

    def __iter__(self) -> Iterator[Any]:
        sent: set[str] = set()
        for item in self._source:
            name, tensor = item
            if isinstance(name, str) and hasattr(tensor, "dtype") and hasattr(tensor, "shape"):
                self._checkpoints.check_one(name, tensor.dtype, tuple(tensor.shape))
                sent.add(name)
            yield item
        self._checkpoints.check_missing(sent)


async def served_checkpoints(
    fleet: Fleet, targets: Sequence[str], server_backend: str
) -> Checkpoints:
    """The checkpoint tables of ``targets``, asked once per server (cached by its
    client) and all at once. Servers that cannot tell are left out (said once in the
    log, by the lookup); one that cannot be reached now is left out of this check
    (the round then finds out)."""
    if server_backend not in ASYNCSYNC_ENGINES:
        return Checkpoints({})
    targets = [url for url in targets if url in fleet]  # removed meanwhile: not asked
    found = await asyncio.gather(
        *(fleet.client(url)._served.checkpoint() for url in targets), return_exceptions=True
    )
    tables: dict[str, CheckpointTable] = {}
    for url, table in zip(targets, found, strict=True):
        if isinstance(table, CheckpointTable):
            tables[url] = table
        elif isinstance(table, ServerTimeout | ServerUnavailableError):
            logger.debug("%s: checkpoint not checked this round (%s)", url, table)
        elif isinstance(table, BaseException):
            raise table  # cancellation, or a bug
    return Checkpoints(tables)
