"""Cancelling ``publish`` on the session's real vLLM-CPU servers (issue 12, item 3): a
few points of a round, each reached by an event (the k-th chunk announced, the finish
or cache-reset fan-out starting), never by a clock. The many seeded points against
fakes are in ``tests/test_cancel_points.py``.

After each cancel: no thread is still sending; neither server holds an active update
(a new ``/start_weight_update`` is accepted there; it is then ended with the abort
update); both servers answer a generation (a server whose layers were replaced half way
and left mid-reload would crash its worker); nothing is in /dev/shm and the trainer
holds no segment but its two buffers; no connection is checked out of the pool. Then
the next publish succeeds and both servers' greedy tokens equal transformers'.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import asyncsync as az
from asyncsync._transport.wire import ShmUpdateFields
from asyncsync.backends._segments import leaked_segments, open_segments
from asyncsync.testing import check_greedy
from tests.conftest import VLLMFleet
from tests.test_cancel_points import SendWatch
from tests.waiting import checked_out

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7]
MAX_TOKENS = 8
#: Small buffers: the tiny model goes in several chunks.
BUFFER = 256 * 1024


def _original(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(model_dir / "model.safetensors"))


def _perturbed(weights: dict[str, Any]) -> dict[str, Any]:
    return {name: tensor * 1.01 for name, tensor in weights.items()}


async def _no_active_update(fleet: az.Fleet, url: str) -> None:
    """vLLM accepts a start only when no update is active; the abort update (refused
    by the engine on purpose) ends the one this opened."""
    client = fleet.client(url)
    await client.start_weight_update()
    with pytest.raises(az.ServerError, match="aborted by the trainer"):
        await client.update_weights(ShmUpdateFields.abort_json())


async def _publish_cancelled(
    point: str, fleet: az.Fleet, publisher: az.AsyncWeightPublisher, weights: dict[str, Any]
) -> None:
    """Publish ``weights``, cancelled at ``point``: the k-th chunk announced, or as the
    finish or cache-reset fan-out starts."""
    loop = asyncio.get_running_loop()
    task: asyncio.Task[Any] | None = None

    def on_chunk(chunks: int, nbytes: int) -> None:  # in the worker thread
        if point == f"chunk {chunks}":
            assert task is not None
            loop.call_soon_threadsafe(task.cancel)

    def cancelling(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            assert task is not None
            task.cancel()
            return await method(*args, **kwargs)

        return wrapper

    name = {"finish": "finish_weight_update", "reset": "reset_prefix_cache"}.get(
        point
    )  # the round's fan-outs
    if name is not None:
        setattr(fleet, name, cancelling(getattr(fleet, name)))
    try:
        task = asyncio.create_task(
            publisher.publish(weights, version=f"cancelled at {point}", progress=on_chunk)
        )
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        if name is not None:
            delattr(fleet, name)


#: Where each case cancels: the k-th chunk announced, or a phase's fan-out starting.
POINTS = ["chunk 1", "chunk 3", "finish", "reset"]


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("original_weights_restored")
async def test_publish_cancelled_on_real_servers(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    weights = _original(tiny_model_dir)
    async with az.Fleet(vllm_fleet.urls) as fleet:
        # No catch-up: what each cancel left is what this test reads (and starts an
        # update of its own on), before the next publish repairs it.
        publisher = az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(buffer_bytes=BUFFER), catch_up="off"
        )
        watch = SendWatch(publisher)
        report = await publisher.publish(weights, version="before-cancel")
        assert report.chunks > 3
        buffers = set(open_segments())
        for point in POINTS:
            await _publish_cancelled(point, fleet, publisher, _perturbed(weights))
            assert publisher.version == "before-cancel", point
            assert watch.running == 0, point
            assert [t for t in threading.enumerate() if "asyncsync-shm-send" in t.name] == []
            assert leaked_segments(pid=os.getpid()) == []
            assert set(open_segments()) == buffers
            assert checked_out(fleet.session) == 0
            for url in fleet.urls:
                state = fleet.state(url)
                assert not state.updating, (point, state)
                # Cancelled, before or after the servers finished: the round was not
                # published, so each holds weights of no published version (dirty).
                assert state.dirty, (point, state)
                completion = await fleet.client(url).generate(
                    PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
                assert len(completion.token_ids) == MAX_TOKENS
                await _no_active_update(fleet, url)
        report = await publisher.publish(weights, version="after-cancel")
        assert report.version == publisher.version == "after-cancel"
        assert not any(s.dirty for s in fleet.servers)
        for url in fleet.urls:
            completion = await fleet.client(url).generate(
                PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            )
            check_greedy(tiny_model_dir, PROMPT, completion.token_ids, max_new_tokens=MAX_TOKENS)
        await publisher.aclose()
