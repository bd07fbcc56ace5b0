"""Draft-model rounds: ``publish(weights, *, version, into="draft")``.

A server running speculative decoding with a draft model (``--speculative-config
'{"method": "draft_model", "model": DIR, ...}'``) holds two models; vLLM 0.32 updates
the draft with ``/start_draft_weight_update`` -> ``/update_weights`` (any number) ->
``/finish_weight_update``: the worker retargets its weight-transfer engine at the draft
for that round, so the chunks are checked against the *draft's* checkpoint (its own
names and shapes) and loaded into it (asyncsync's shm and gloo engines follow:
`asyncsync.vllm_plugin.engine_v032`). `DraftRound` is that round; everything else is a
weight round's (pause, partial rounds, regrouping of a collective, cancellation).

Versions: a draft round changes no token the server samples (speculative decoding only
proposes tokens that the served model accepts or replaces; greedy output is the served
model's exactly, sampling keeps its distribution), so it finishes *without* a weight
version: ``/weight_info``, every completion's `weight_versions` and the fleet's
``current_version`` stay the served model's. The draft's version is recorded apart:
``publisher.draft_version`` (the last draft round published, the ledger's history of
target ``"draft"``) and each server's ``ServerState.draft_version``. A server that
drops out of a draft round has its draft model marked dirty
(``ServerState.dirty_draft``, routing reason ``"dirty_draft"``): speculative decoding
runs the draft on every step, and a draft left mid-update (its layers on the meta
device) must not be run; a later draft round that reaches the server repairs it (a round
of the served model does not).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from asyncsync._core.errors import ProtocolError, UnsupportedVLLMError
from asyncsync._publish.checkpoint import Checkpoints
from asyncsync._publish.delta import ChainRound, DeltaChain, chain_round
from asyncsync._publish.report import PublishReport
from asyncsync._publish.round import PublishRound
from asyncsync._publish.weights import WeightsLike, check_source, is_factory, resolve
from asyncsync._wire.draft import DRAFT_START_ROUTE
from asyncsync._wire.served import CheckpointTable
from asyncsync.backends.contract import SendStats, WeightSource

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from asyncsync._core.types import FleetResult
    from asyncsync.backends import TrainerBackend
    from asyncsync.fleet import Fleet

__all__ = ["TARGETS", "DraftRound", "DraftRounds", "Target", "check_target"]

#: What a round loads into: the served model, or its speculative draft model.
Target = Literal["main", "draft"]
TARGETS: tuple[Target, ...] = ("main", "draft")


class DraftRound(PublishRound):
    """A round into the servers' speculative draft model (see the module docstring):
    started on ``/start_draft_weight_update``, finished without a weight version,
    committed as the servers' draft version; a server that drops out has its draft
    model marked dirty, not its served model."""

    async def _start_route(self, urls: list[str]) -> FleetResult[None]:
        return await self.fleet.start_draft_weight_update(targets=urls, require="none")

    async def _finish_on(self, live: list[str], weight_version: str | None) -> FleetResult[None]:
        # The served model's version is not the draft's: vLLM would set it from here.
        return await super()._finish_on(live, None)

    target = "draft"

    def report(self, stats: SendStats, total: float) -> PublishReport:
        report = super().report(stats, total)
        report.into = "draft"
        return report


class DraftRounds:
    """A publisher's record of its draft rounds: their own delta chain (the servers keep
    a mirror per model). The draft's published version is the fleet ledger's (target
    ``"draft"``), apart from the served model's."""

    def __init__(self) -> None:
        self._chain: DeltaChain | None = None

    def chain_round(
        self, delta: bool, backend: TrainerBackend, targets: Sequence[str], version: str
    ) -> ChainRound | None:
        self._chain, chain = chain_round(self._chain, delta, backend, targets, version)
        return chain

    async def checked(
        self,
        fleet: Fleet,
        weights: WeightsLike,
        targets: Sequence[str],
        backend: TrainerBackend,
        executor: Executor,
    ) -> tuple[WeightSource | None, Checkpoints]:
        """The weights checked before the round touches any server (a factory's in the
        thread), against the *draft's* checkpoint where its directory is readable here:
        `IncompatibleWeightsError` listing every mismatch; every target must run a
        draft model (`UnsupportedVLLMError` naming it)."""
        source = None if is_factory(weights) else resolve(weights)
        if source is not None:
            await check_source(source, backend.check, executor)
        checkpoints = await draft_checkpoints(fleet, targets, executor)
        if source is not None:
            source = checkpoints.checked(source)
        return source, checkpoints


def check_target(target: object, *, verify: object) -> None:
    """``publish``'s ``into`` is ``"main"`` or ``"draft"``; a draft round takes no ``verify``
    (vLLM's ``/weight_checker`` and a greedy probe see the served model only)."""
    if target not in TARGETS:
        raise ValueError(f"into must be 'main' or 'draft', got {target!r}")
    if target == "draft" and verify is not None:
        raise ValueError(
            "verify= checks the served model (/weight_checker, greedy probes), not a "
            "draft model: publish(into='draft') takes no verify"
        )


async def draft_checkpoints(fleet: Fleet, urls: Sequence[str], executor: Executor) -> Checkpoints:
    """Before a draft round touches anything: every target speaks vLLM >= 0.32 and runs
    a draft model (``/server_info``), else `UnsupportedVLLMError` naming it; the draft
    checkpoints' tables, of those whose directory is readable here (the same host)."""
    for url in urls:
        client = fleet.client(url)
        protocol = await client.protocol()  # the RL protocol generation, not a number
        if protocol != "0.32":
            raise UnsupportedVLLMError(
                client.server_state.vllm_version or "0.23",
                f"{DRAFT_START_ROUTE} (publish(into='draft'))",
                server=url,
            )
    found = await fleet.draft_models(targets=urls, require="none")
    for outcome in found.values():
        # no /server_info (no dev mode): the server's ProtocolError names it and the flag
        if isinstance(outcome.error, ProtocolError):
            raise outcome.error
    found.raise_on_failure("all")
    tables: dict[str, CheckpointTable] = {}
    loop = asyncio.get_running_loop()
    for url, draft in found.values_by_url.items():
        if not draft.has_draft_model or draft.model is None:
            why = f"method {draft.method!r}" if draft.method else "no speculative config"
            raise UnsupportedVLLMError(
                fleet.client(url).server_state.vllm_version or "0.32",
                f"a draft model to publish into ({why}; start it with --speculative-config "
                '\'{"method": "draft_model", "model": ...}\')',
                server=url,
            )
        # a few KB of file headers, read off the loop
        table = await loop.run_in_executor(executor, _checkpoint_table, draft.model, draft.dtype)
        if table is not None:
            tables[url] = table
    return Checkpoints(tables)


#: safetensors' dtype names, as torch names them
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _checkpoint_table(model: str, served_dtype: str | None) -> CheckpointTable | None:
    """The table of the safetensors checkpoint in directory ``model`` (from the file
    headers: a few KB read), or None when it is not a readable directory here."""
    path = Path(model)
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for file in files:
            with file.open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    dtype = _DTYPES.get(entry["dtype"], str(entry["dtype"]).lower())
                    entries[name] = (dtype, tuple(int(d) for d in entry["shape"]))
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return CheckpointTable(entries, served_dtype) if entries else None
