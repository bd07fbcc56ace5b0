"""Cancelling ``publish`` at many points (issue 12, item 3), against fakes.

Each seed picks a round (engine or callback style, a pause mode or none, a publisher
already initialized or not) and a point to cancel it at, by counting events rather than
reading a clock: the k-th request that reaches one of the servers, or the k-th chunk the
trainer announces; some seeds cancel a second time a few requests later (landing in the
rollback). The fakes load every chunk with asyncsync's real worker-side receiver, which
maps the trainer's segments in this process, so what a server holds can be compared with
the trainer's tensors. Afterwards:

- no thread is still sending (the backend's send has returned, its helper thread is
  joined, no fan-out started by the thread is pending);
- no server holds an active update or is left paused;
- nothing is in /dev/shm, and the trainer holds no segment but its two reused buffers;
- no connection is checked out of the pool, no asyncsync task is left;
- what the fleet says of each server is true: a server that is not dirty holds exactly
  the weights of the version recorded for it;
- the next publish succeeds and every server holds exactly its weights.

Cancelling real servers: ``tests/test_cancel_vllm.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch

import asyncsync as az
from asyncsync._core.types import PauseMode
from asyncsync._publish.weights import resolve
from asyncsync.backends._segments import leaked_segments, open_segments
from asyncsync.backends._shm_pack import manifest_of, plan_chunks
from asyncsync.testing import FakeVLLMServer, RecordedRequest
from tests.publish_fakes import ROUND_ROUTES, Server, receiving_fakes
from tests.test_shm_lifecycle import mapped_anywhere
from tests.waiting import checked_out

BUFFER = 8192
LAYERS = 8


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Eight 4 KiB layers of seeded values: each round publishes different bytes."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(1024, generator=gen) for i in range(LAYERS)}


#: What each version holds.
VERSIONS = {"v0": weights(0), "v1": weights(1), "v2": weights(2)}
#: Chunks of one round (two layers do not fit one buffer).
CHUNKS = len(plan_chunks(manifest_of(resolve(VERSIONS["v0"])), BUFFER))  # type: ignore[arg-type]


class SendWatch:
    """Counts the backend's blocking calls (init, send) running in worker threads."""

    def __init__(self, publisher: az.AsyncWeightPublisher) -> None:
        self.running = 0
        self._lock = threading.Lock()
        backend = publisher._backend
        backend.send = self._wrap(backend.send)  # type: ignore[method-assign]
        backend.init = self._wrap(backend.init)  # type: ignore[method-assign]

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any) -> Any:
            with self._lock:
                self.running += 1
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self.running -= 1

        return watched


@dataclass(frozen=True)
class CancelPoint:
    """Where one seed cancels: at the ``at``-th request to server ``server`` (or at the
    ``at``-th chunk announced, ``server=None``), and again at the ``again``-th request
    (to either server) after that."""

    api: Literal["engine", "callback"]
    pause: PauseMode | None
    warm: bool
    server: int | None
    at: int
    again: int | None

    @classmethod
    def draw(cls, seed: int) -> CancelPoint:
        rng = random.Random(seed)
        api: Literal["engine", "callback"] = rng.choice(["engine", "callback"])
        pause: PauseMode | None = rng.choice([None, "keep", "wait", "abort"])
        warm = rng.random() < 0.75
        # Requests a server receives in this round: init (first round only), pause,
        # start, one update per chunk, finish, cache reset, resume.
        requests = (0 if warm else 1) + 2 * (pause is not None) + 3 + CHUNKS
        if rng.random() < 0.25:
            server, at = None, rng.randint(1, CHUNKS)
        elif not warm:  # its init: the first request
            server, at = rng.randint(0, 1), 1
        else:
            server, at = rng.randint(0, 1), rng.randint(1, requests)
        again = rng.randint(1, 3) if rng.random() < 0.3 else None
        return cls(api, pause, warm, server, at, again)


SEEDS = range(48)
#: The routes a round sends (a publisher's first round starts with the init).
ROUTES = {"/init_weight_transfer_engine", *ROUND_ROUTES}


async def cancel_at(
    point: CancelPoint, publisher: az.AsyncWeightPublisher, fakes: list[FakeVLLMServer]
) -> BaseException | az.PublishReport:
    """Publish ``v1``, cancelled where ``point`` says; what ``publish`` ended with."""
    loop = asyncio.get_running_loop()
    task: asyncio.Task[az.PublishReport] | None = None
    cancels: list[int] = []  # the event counts at which a cancel was sent
    seen = {"at": 0, "after": 0}  # requests counted to the cancel, and after it

    def cancel(count: int) -> None:
        assert task is not None
        task.cancel()
        cancels.append(count)

    def on_request(request: RecordedRequest, index: int) -> None:
        if request.path not in ROUTES:  # the fleet's version probe
            return
        if cancels:  # a second cancel, ``again`` requests (to either server) later
            seen["after"] += 1
            if seen["after"] == point.again:
                cancel(seen["after"])
        elif index == point.server:
            seen["at"] += 1
            if seen["at"] == point.at:
                cancel(seen["at"])

    def on_chunk(chunks: int, nbytes: int) -> None:  # called in the worker thread
        if point.server is None and chunks == point.at:
            loop.call_soon_threadsafe(cancel, chunks)

    for index, fake in enumerate(fakes):
        fake.on_request = lambda request, i=index: on_request(request, i)
    try:
        task = asyncio.create_task(
            publisher.publish(VERSIONS["v1"], version="v1", pause=point.pause, progress=on_chunk)
        )
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
    finally:
        for fake in fakes:
            fake.on_request = None
    assert cancels, f"{point}: the cancel point was never reached"
    return outcome


def check_servers_told_the_truth(point: CancelPoint, fleet: az.Fleet, server: Server) -> None:
    """No active update, no pause; a clean server holds the version recorded for it
    (None: nothing is claimed yet) and reset its cache after finishing it (no KV block
    of older weights is reused)."""
    fake, state = server.fake, fleet.state(server.fake.url)
    assert not fake.update_active, point
    assert not fake.paused, point
    assert not state.updating, (point, state)
    assert not state.paused, (point, state)
    if state.dirty or state.weight_version is None:
        return
    assert state.weight_version == fake.weight_version, (point, state)
    assert server.worker.holds(VERSIONS[state.weight_version]), (point, state)
    paths = [r.path for r in fake.requests]
    finishes = [i for i, p in enumerate(paths) if p == "/finish_weight_update"]
    if finishes:
        assert "/reset_prefix_cache" in paths[finishes[-1] :], (point, paths)


def check_nothing_left(point: CancelPoint, fleet: az.Fleet, watch: SendWatch) -> None:
    """No thread sending, no connection checked out of the pool, no asyncsync task."""
    assert watch.running == 0, point
    assert [t.name for t in threading.enumerate() if "asyncsync-shm-send" in t.name] == []
    assert checked_out(fleet.session) == 0
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncsync:")] == []
    assert all(s.outstanding == 0 for s in fleet.servers)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_publish_cancelled_at_a_seeded_point(seed: int) -> None:
    point = CancelPoint.draw(seed)
    async with receiving_fakes() as (a, b), az.Fleet([a.fake.url, b.fake.url]) as fleet:
        # No catch-up: what the cancelled round left is what this test reads, and a
        # catch-up would start a round of its own right after (tests/test_membership.py).
        publisher = az.AsyncWeightPublisher(
            fleet, _api=point.api, backend=az.backends.Shm(buffer_bytes=BUFFER), catch_up="off"
        )
        watch = SendWatch(publisher)
        if point.warm:
            await publisher.publish(VERSIONS["v0"], version="v0")
        buffers = set(open_segments())

        outcome = await cancel_at(point, publisher, [a.fake, b.fake])
        assert isinstance(outcome, asyncio.CancelledError), f"{point}: {outcome!r}"

        check_nothing_left(point, fleet, watch)
        for server in (a, b):
            check_servers_told_the_truth(point, fleet, server)
        assert publisher.version in ({"v0", "v1"} if point.warm else {None, "v1"}), point
        assert fleet.current_version == publisher.version, point  # one fact, never two
        if publisher.version == "v1":  # committed before the cancel landed (at resume)
            assert all(s.weight_version == "v1" for s in fleet.servers)
            assert not any(s.dirty for s in fleet.servers)
        # Nothing in /dev/shm; no segment but the publisher's two reused buffers.
        assert leaked_segments(pid=os.getpid()) == []
        held = set(open_segments())
        assert len(held) <= 2, point
        assert held == buffers or not point.warm, point

        # The next publish succeeds, and every server holds exactly its weights.
        report = await publisher.publish(VERSIONS["v2"], version="v2", pause=point.pause)
        assert report.version == publisher.version == "v2"
        for server in (a, b):
            assert server.worker.holds(VERSIONS["v2"]), (point, server.fake.url)
            server.worker.receiver.end_round()  # the round is complete there
            assert server.fake.weight_version == "v2"
            assert not server.fake.update_active
        assert not any(s.dirty or s.paused for s in fleet.servers)
        await publisher.aclose()
        for server in (a, b):
            server.worker.receiver.close()  # the workers drop their mappings
        assert not set(open_segments()) & held
    for name in held:
        assert mapped_anywhere(name) == []


def test_the_seeds_cover_every_phase() -> None:
    """The seeds land in every phase of a round: init, pause, start, each chunk, finish,
    the cache reset and resume (by request position), and chunk announcements."""
    positions: set[str] = set()
    for seed in SEEDS:
        point = CancelPoint.draw(seed)
        if point.server is None:
            positions.add(f"chunk {point.at}")
            continue
        phases = ["init"] * (not point.warm) + ["pause"] * (point.pause is not None)
        phases += ["start"] + [f"update {i}" for i in range(1, CHUNKS + 1)] + ["finish", "reset"]
        phases += ["resume"] * (point.pause is not None)
        positions.add(phases[point.at - 1])
    wanted = {"init", "pause", "start", "finish", "reset", "resume"}
    wanted |= {f"update {i}" for i in range(1, CHUNKS + 1)}
    assert wanted <= positions, wanted - positions
    assert any(p.startswith("chunk") for p in positions)
    assert any(CancelPoint.draw(s).again for s in SEEDS)
