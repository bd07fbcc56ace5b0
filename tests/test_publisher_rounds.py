"""Publishing rounds against protocol-faithful fakes: what every server sees, in both
trainer-engine styles, the progress callback, and a backend registered from outside."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync._transport.wire import PROTOCOL_VERSION
from asyncsync.backends import (
    BackendOptions,
    SendControl,
    SendStats,
    TrainerBackend,
    register_backend,
)
from asyncsync.backends.contract import SyncFleetClient, WeightSource
from asyncsync.testing import FakeVLLMServer, Fault
from tests.publish_fakes import aborts_received, round_calls, shm_fakes

pytestmark = pytest.mark.asyncio

#: 8 layers of 4 KiB: several chunks with 8 KiB buffers.
LAYERS = {f"model.layers.{i}.w": torch.full((1024,), float(i)) for i in range(8)}


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with shm_fakes() as servers:
        yield servers


@pytest.mark.parametrize("api", ["engine", "callback"])
async def test_both_trainer_engine_styles_drive_the_same_round(
    fakes: list[FakeVLLMServer], api: str
) -> None:
    """vLLM 0.3x's engine style and 0.23's callback style: the same calls in the same
    order, the version carried by finish, every chunk announced once."""
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(
            fleet, _api=api, backend=az.backends.Shm(buffer_bytes=8192)
        ) as publisher,  # type: ignore[arg-type]
    ):
        report = await publisher.publish(LAYERS, version="v1", pause="keep")
        assert publisher.version == "v1"
    assert report.chunks > 2
    assert report.params == len(LAYERS)
    assert list(report.seconds) == [
        "init",
        "probe",
        "pause",
        "start",
        "pack",
        "transfer",
        "finish",
        "reset_prefix_cache",
        "resume",
        "total",
    ]
    for fake in fakes:
        assert fake.init_infos == [{"protocol": PROTOCOL_VERSION, "trainer_pid": os.getpid()}]
        assert round_calls(fake) == [
            "/pause",
            "/start_weight_update",
            *["/update_weights"] * report.chunks,
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert fake.requests_to("/finish_weight_update")[0].json == {"weight_version": "v1"}
        updates = fake.updates
        assert [u["chunk"] for u in updates] == list(range(report.chunks))
        assert [u["last"] for u in updates] == [False] * (report.chunks - 1) + [True]
        assert [n for u in updates for n in u["names"]] == list(LAYERS)
        assert updates[0]["manifest"]["names"] == list(LAYERS)  # validated before loading
        assert all(u["manifest"] is None for u in updates[1:])
        assert len({u["segment"] for u in updates}) == 2  # double-buffered
        assert fake.weight_version == "v1"
        assert not fake.update_active
        assert not fake.paused


async def test_the_progress_callback_sees_every_chunk(fakes: list[FakeVLLMServer]) -> None:
    seen: list[tuple[int, int]] = []
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        report = await publisher.publish(
            LAYERS, version="v1", progress=lambda chunks, nbytes: seen.append((chunks, nbytes))
        )
    assert [c for c, _ in seen] == list(range(1, report.chunks + 1))
    assert seen[-1][1] == report.bytes
    assert all(a[1] < b[1] for a, b in itertools.pairwise(seen))


async def test_a_factory_is_called_in_the_worker_thread(fakes: list[FakeVLLMServer]) -> None:
    threads: list[str] = []

    def materialize() -> dict[str, torch.Tensor]:
        threads.append(threading.current_thread().name)
        return LAYERS

    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        report = await publisher.publish(materialize, version="v1")
    assert len(threads) == 1
    assert threads[0].startswith("asyncsync-publish")
    assert report.params == len(LAYERS)
    # What the factory returned describes itself: chunk 0 still carries the manifest.
    assert fakes[0].updates[0]["manifest"]["names"] == list(LAYERS)


async def test_each_update_is_encoded_in_the_worker_thread(
    fakes: list[FakeVLLMServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update's JSON (1.3 MB for an unpacked ``ipc`` update of 10,000 handles) is made
    in the trainer's worker thread; on the loop, the body takes those bytes as they are:
    the loop's work per update does not grow with the tensor count. The servers get
    what they would have got."""
    from asyncsync._core import encoding

    encoded_in: list[tuple[str, Any]] = []
    real_dumps = encoding.dumps

    def recording(obj: Any) -> bytes:
        encoded_in.append((threading.current_thread().name, obj))
        return real_dumps(obj)

    monkeypatch.setattr(encoding, "dumps", recording)
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        loop_thread = threading.current_thread().name
        report = await publisher.publish(LAYERS, version="v1")
    updates = [(t, o) for t, o in encoded_in if isinstance(o, Mapping) and "segment" in o]
    assert len(updates) == report.chunks
    assert all(t != loop_thread for t, _ in updates), updates
    bodies = [o for t, o in encoded_in if isinstance(o, Mapping) and "update_info" in o]
    assert len(bodies) == report.chunks  # one body per chunk for both servers
    assert all(isinstance(o["update_info"], encoding.Encoded) for o in bodies)
    assert {t for t, o in encoded_in if o in bodies} == {loop_thread}
    for fake in fakes:
        assert [n for u in fake.updates for n in u["names"]] == list(LAYERS)
        assert fake.weight_version == "v1"


async def test_the_ceiling_is_measured_once_per_publisher_in_its_worker_thread(
    fakes: list[FakeVLLMServer],
) -> None:
    """shm's ceiling is this host's memcpy, measured once per publisher before its first
    round, off the event loop; every report states it and the efficiency against it."""
    measured: list[str] = []
    async with az.Fleet([f.url for f in fakes]) as fleet:
        for n in range(2):  # a second publisher measures again
            async with az.AsyncWeightPublisher(
                fleet, backend=az.backends.Shm(buffer_bytes=8192)
            ) as publisher:
                backend = publisher._backend
                measure = backend.ceiling

                def spy(urls: list[str], measure: Any = measure) -> Any:
                    measured.append(threading.current_thread().name)
                    return measure(urls)

                backend.ceiling = spy  # type: ignore[method-assign]
                # (the fleet's versions: every round a new one, whichever publisher)
                reports = [await publisher.publish(LAYERS, version=f"p{n}-v{i}") for i in range(3)]
            assert {r.ceiling_gb_per_s for r in reports} == {reports[0].ceiling_gb_per_s}
            for report in reports:
                assert report.ceiling_basis == "this host's memcpy, 1 thread"
                assert report.efficiency is not None
                assert 0 < report.efficiency <= 1.5, report
                assert report.efficiency == report.gb_per_s / report.ceiling_gb_per_s
                assert "of the ceiling" in str(report)
    assert len(measured) == 2
    assert all(name.startswith("asyncsync-publish") for name in measured)


@dataclass(frozen=True, kw_only=True)
class Loopback(BackendOptions):
    """The made-up transport's options, the way a third-party backend declares them."""

    name: ClassVar[str] = "loopback"
    group: str = "g"


class LoopbackBackend(TrainerBackend):
    """A transport made up for this test, shaped like the gloo/NCCL ones to come: a
    per-server init_info from the servers' world sizes, a "rendezvous" while the HTTP
    init is in flight, and each payload's "broadcast" while its update is in flight.
    The payload rides in the update_info itself."""

    name = "loopback"
    server_backend = "fake"
    options_class = Loopback

    def __init__(
        self, *, rank: int = 0, world_size: int = 1, api: Any = "engine", group: str = "g"
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, api=api)
        self.group = group
        self.events: list[str] = []
        self.closed = False
        self.offsets: dict[str, int] = {}

    def init_info(self) -> Callable[[str], Mapping[str, Any]]:
        return lambda url: {"group": self.group, "rank_offset": self.offsets[url]}

    def init(self, client: SyncFleetClient) -> None:
        offset = 1  # the trainer is rank 0
        for url, size in client.world_sizes().items():
            self.offsets[url] = offset
            offset += size
        pending = client.begin_init(self.init_info())
        self.events.append("rendezvous")  # runs while the HTTP init is in flight
        pending.result()

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        stats = SendStats()
        assert client is not None
        client.start_weight_update()
        for name, tensor in source:
            pending = client.begin_update({"names": [name], "values": tensor.tolist()})
            self.events.append(f"broadcast {name}")  # runs while the update is in flight
            pending.result()
            stats.chunks += 1
            stats.params += 1
            stats.bytes += tensor.numel() * tensor.element_size()
            if control.on_chunk is not None:
                control.on_chunk(stats.chunks, stats.bytes)
        client.finish_weight_update()
        return stats

    def close(self) -> None:
        self.closed = True


register_backend("loopback", LoopbackBackend, replace=True)


async def test_a_registered_backend_plugs_into_the_round() -> None:
    weights = {"a": torch.ones(2), "b": torch.zeros(3)}
    async with (
        FakeVLLMServer(world_size=2, reject_update_keys=["asyncsync_abort"]) as first,
        FakeVLLMServer(world_size=3, reject_update_keys=["asyncsync_abort"]) as second,
        az.Fleet([first.url, second.url]) as fleet,
    ):
        publisher = az.AsyncWeightPublisher(fleet, backend=Loopback(group="trainers"))
        backend = publisher._backend
        assert isinstance(backend, LoopbackBackend)
        assert publisher.vllm_backend == "fake"
        report = await publisher.publish(weights, version="v1")
        assert (report.chunks, report.params, report.bytes) == (2, 2, 20)
        # A backend that names no ceiling: the report says nothing about one.
        assert (report.ceiling_gb_per_s, report.efficiency) == (None, None)
        assert "ceiling" not in str(report)
        assert first.init_infos == [{"group": "trainers", "rank_offset": 1}]
        assert second.init_infos == [{"group": "trainers", "rank_offset": 3}]
        assert (
            first.updates
            == second.updates
            == [
                {"names": ["a"], "values": [1.0, 1.0]},
                {"names": ["b"], "values": [0.0, 0.0, 0.0]},
            ]
        )
        assert backend.events == ["rendezvous", "broadcast a", "broadcast b"]
        assert [s.weight_version for s in fleet.servers] == ["v1", "v1"]

        # A failed update ends the round with the backend's default abort update, which
        # the servers' engine refuses (an unknown key), clearing its active update.
        second.inject("/update_weights", Fault.error(500, "broadcast timed out"))
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(weights, version="v2", min_servers="all")
        assert info.value.outcomes[second.url].phase == "update"
        assert [r.json["update_info"] for r in first.requests_to("/update_weights")][-1] == {
            "asyncsync_abort": True
        }
        assert aborts_received(first) == []  # not the shm abort
        assert not first.update_active
        assert not second.update_active
        assert publisher.version == "v1"
        await publisher.aclose()
        assert backend.closed


async def test_backend_options_are_checked_by_the_backend() -> None:
    with pytest.raises(TypeError, match=r"backend 'shm' got unknown option.* master_port"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, master_port=29500)
    with pytest.raises(TypeError, match="it takes: buffer_bytes"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, master_port=29500)
    with pytest.raises(ValueError, match="buffer_bytes must be >= 4096"):
        az.AsyncWeightPublisher(
            None, rank=1, world_size=2, backend=az.backends.Shm(buffer_bytes=100)
        )
    async with az.AsyncWeightPublisher(
        None, rank=1, world_size=2, backend=az.backends.Shm(buffer_bytes=1 << 20)
    ) as pub:
        assert pub._backend.buffers.buffer_bytes == 1 << 20  # type: ignore[attr-defined]
        assert pub.vllm_backend == "asyncsync_shm"


async def test_no_garbage_collection_runs_during_a_round(fakes: list[FakeVLLMServer]) -> None:
    """A collection stops every thread, the event loop's too, for as long as it walks
    the heap: the collector is paused while a round runs (the weights' checks, the
    send, the fan-outs) and resumes after, also when the round fails."""
    import gc

    from asyncsync._core.collector import collections_paused

    seen: list[bool] = []

    def materialize() -> dict[str, torch.Tensor]:
        seen.append(gc.isenabled())  # in the worker thread, mid-round
        return LAYERS

    assert gc.isenabled()
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=8192)) as publisher,
    ):
        await publisher.publish(materialize, version="v1")
        assert seen == [False]
        assert gc.isenabled()
        fakes[0].inject("/start_weight_update", Fault.error(500, "worker failed"))
        with pytest.raises(az.PublishError):
            await publisher.publish(materialize, version="v2", min_servers="all")
        assert gc.isenabled()
    # counted: nested pauses resume once, a collector disabled before stays disabled
    with collections_paused():
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
