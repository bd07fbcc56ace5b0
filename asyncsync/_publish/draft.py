"""Draft-model rounds: ``publish(weights, *, version, target="draft")``.

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
``publisher.draft_version`` (the last draft round published) and each server's
``ServerState.draft_version``. A server that drops out of a draft round has its draft
model marked dirty (``ServerState.dirty_draft``, routing reason ``"dirty_draft"``):
speculative decoding runs the draft on every step, and a draft left mid-update (its
layers on the meta device) must not be run; a later draft round that reaches the server
repairs it (a round of the served model does not).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from asyncsync._core.errors import UnsupportedVLLMError
from asyncsync._publish.report import PublishReport
from asyncsync._publish.round import PublishRound
from asyncsync._publish.weights import WeightSource
from asyncsync._wire.draft import DRAFT_START_ROUTE
from asyncsync.backends._base import SendStats

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from asyncsync._core.types import FleetResult
    from asyncsync.fleet import Fleet

__all__ = ["TARGETS", "DraftRound", "Target", "check_draft_servers", "check_target"]

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

    async def finish(self, weight_version: str | None) -> None:
        # The served model's version is not the draft's: vLLM would set it from here.
        await super().finish(None)

    def _mark_dirty(self, urls: list[str]) -> None:
        self.fleet._mark_draft_dirty(urls)

    def commit(self) -> None:
        self.fleet._published_draft(self.version, self.live)
        self.published_version = self.version

    def report(self, stats: SendStats, total: float) -> PublishReport:
        report = super().report(stats, total)
        report.target = "draft"
        return report


def check_target(target: object, *, verify: object) -> None:
    """``target`` is ``"main"`` or ``"draft"``; a draft round takes no ``verify``
    (vLLM's ``/weight_checker`` and a greedy probe see the served model only)."""
    if target not in TARGETS:
        raise ValueError(f"target must be 'main' or 'draft', got {target!r}")
    if target == "draft" and verify is not None:
        raise ValueError(
            "verify= checks the served model (/weight_checker, greedy probes), not a "
            "draft model: publish(target='draft') takes no verify"
        )


async def check_draft_servers(
    fleet: Fleet, urls: Sequence[str], source: WeightSource | None, executor: Executor
) -> None:
    """Before a draft round touches anything: every target speaks vLLM >= 0.32 and runs
    a draft model (``/server_info``), else `UnsupportedVLLMError` naming it; where the
    draft's directory is readable here (the same host), the weights must be its
    checkpoint's tensors with its shapes (ValueError naming the first that is not)."""
    for url in urls:
        client = fleet.client(url)
        if await client.protocol() != "0.32":
            raise UnsupportedVLLMError(
                client.server_state.vllm_version or "0.23",
                f"{DRAFT_START_ROUTE} (publish(target='draft'))",
                server=url,
            )
    found = await fleet.draft_models(targets=urls, require="all")
    for url, draft in found.values_by_url:
        if not draft.has_draft_model or draft.model is None:
            why = f"speculative method {draft.method!r}" if draft.method else "no speculative config"
            raise UnsupportedVLLMError(
                fleet.client(url).server_state.vllm_version or "0.32",
                f"a draft model to publish into ({why}; start it with --speculative-config "
                "'{\"method\": \"draft_model\", \"model\": ...}')",
                server=url,
            )
        meta = source.metadata() if source is not None else None
        if meta is None:
            continue
        loop = asyncio.get_running_loop()  # a few KB of file headers, read off the loop
        shapes = await loop.run_in_executor(executor, _checkpoint_shapes, draft.model)
        if shapes is not None:
            _check_against(meta, shapes, draft.model, url)


def _check_against(
    meta: Sequence[tuple[str, object, tuple[int, ...]]],
    shapes: dict[str, tuple[int, ...]],
    where: str,
    url: str,
) -> None:
    for name, _dtype, shape in meta:
        if name not in shapes:
            raise ValueError(
                f"parameter {name!r} is not in the draft model's checkpoint ({where}, "
                f"served by {url}): a draft round publishes the draft's own tensors"
            )
        if tuple(shape) != shapes[name]:
            raise ValueError(
                f"parameter {name!r}: shape {list(shape)} does not match the draft model's "
                f"{list(shapes[name])} ({where}, served by {url})"
            )
    missing = sorted(set(shapes) - {m[0] for m in meta})
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"the weights lack the draft model's {', '.join(map(repr, missing[:3]))}{more} "
            f"({where}, served by {url}): a draft round updates every tensor of the draft"
        )


def _checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """The tensor shapes of the safetensors checkpoint in directory ``model`` (from the
    file headers: a few KB read), or None when it is not a readable directory here."""
    path = Path(model)
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with file.open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(int(d) for d in entry["shape"])
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return shapes or None
