"""``backend="nccl"`` and ``backend="ipc"``: the installed vLLM's real trainer and worker
engine classes (0.32: both in the trainer factory; 0.27.1: NCCL's static send, IPC in the
factory), driven by asyncsync's publisher on CPU against fake servers that claim the
same version, with stand-ins only where CUDA is needed (``tests/cuda_standins.py``).

The stand-in communicator's broadcast, like NCCL's, completes only once every server's
worker joined it, i.e. once that server's ``/update_weights`` arrived: a round passes only
if the HTTP call is in flight while vLLM's engine broadcasts. What rank 0 broadcast is then
replayed into vLLM's worker-side engine, built for each worker of each server, which
computes its own NCCL rank from the offset asyncsync sent and loads the weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._core.errors import ProtocolError
from asyncsync.testing import FakeVLLMServer, Fault
from tests.calls import recording
from tests.cuda_standins import (
    STANDIN_GPU_UUID,
    NcclHub,
    RecordingModel,
    ReplayComm,
    install_cuda_on_cpu,
    install_ipc_handles,
    worker_engine,
)
from tests.publish_fakes import round_calls
from tests.waiting import HANG

pytestmark = [pytest.mark.server_deps]

#: Small buffers: several chunks from a model of a few KB.
BUFFER = 2048


def _engine_api(backend: str) -> None:
    from asyncsync._vllm.caps import installed_trainer_api

    api = installed_trainer_api(backend)
    if api != "engine":
        pytest.skip(f"the installed vLLM's static {backend} send (API {api!r}) is not exercised")


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A small model in several dtypes; its tensors change with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(24, 16, generator=g),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(48, 16, generator=g).to(
            torch.bfloat16
        ),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g),
        "model.layers.1.self_attn.qkv_proj.weight": torch.randn(48, 16, generator=g).to(
            torch.float16
        ),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(24, 16, generator=g),
    }


def assert_loaded(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def finish_versions(fake: FakeVLLMServer) -> list[Any]:
    return [r.json for r in fake.requests_to("/finish_weight_update")]


def installed_version() -> str:
    """The installed vLLM's version: the fakes claim it, so they speak its protocol."""
    import vllm

    return str(vllm.__version__)


def held(fleet: az.Fleet, fake: FakeVLLMServer) -> str | None:
    """The version ``fake`` holds: the server's own (vLLM 0.32: finish carries it) or,
    on the 0.23 protocol (vLLM < 0.32), the fleet's record of what it finished."""
    if fake.protocol == "0.32":
        return fake.weight_version
    return fleet.state(fake.url).weight_version


def assert_finished_with(fleet: az.Fleet, fake: FakeVLLMServer, version: str) -> None:
    """The round's version travelled with its finish (vLLM's engines pass none)."""
    if fake.protocol == "0.32":
        assert finish_versions(fake)[-1] == {"weight_version": version}
    assert held(fleet, fake) == version


# --------------------------------------------------------------------------- NCCL
@dataclass
class NcclSetup:
    hub: NcclHub
    fakes: list[FakeVLLMServer]
    fleet: az.Fleet
    #: the worker-side communicators' source: what the next worker group replays
    replay: list[list[torch.Tensor]]
    #: the installed vLLM's NCCL trainer API ("engine": 0.28+, "callback": 0.23-0.27)
    api: str

    @property
    def wire(self) -> dict[str, Any]:
        """The packing fields, in the init info (0.28+) or in every update (0.23-0.27)."""
        return {"packed": True, "packed_buffer_size_bytes": BUFFER, "packed_num_buffers": 2}


#: The deadlines a fleet gets when a test does not choose any.
DEFAULTS = az.Timeouts()


@asynccontextmanager
async def nccl_fleet(
    monkeypatch: pytest.MonkeyPatch,
    world_sizes: tuple[int, ...] = (2, 1),
    timeouts: az.Timeouts = DEFAULTS,
    own_timeouts: Mapping[int, az.Timeouts] | None = None,
) -> AsyncIterator[NcclSetup]:
    """Fakes with vLLM's NCCL engine (CUDA replaced by stand-ins) and a fleet over them
    with ``timeouts``; the fakes at the indices of ``own_timeouts`` through clients of
    their own with those."""
    from asyncsync._vllm.caps import installed_trainer_api

    install_cuda_on_cpu(monkeypatch)
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine

    fakes = [
        FakeVLLMServer(version=installed_version(), backend="nccl", world_size=n)
        for n in world_sizes
    ]
    for fake in fakes:
        await fake.start()
    hub = NcclHub(fakes)
    replay: list[list[torch.Tensor]] = [[]]
    for fake in fakes:
        fake.update_hook = hub.worker_hook(fake, nccl_engine.NCCLWeightTransferUpdateInfo)

    def open_group(
        master_address: str, master_port: int, rank: int, world_size: int, device: Any
    ) -> Any:
        """vLLM's stateless group setup, for the trainer (rank 0, through vLLM's own
        trainer_init) and for each worker (through vLLM's worker_init_process_group)."""
        if rank == 0:
            return hub.open_trainer(master_address, master_port, world_size)
        hub.worker_ranks.append((master_port, rank, world_size))
        return ReplayComm(replay[0])

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", open_group)
    try:
        async with AsyncExitStack() as stack:
            members: list[str | az.AsyncVLLMClient] = [f.url for f in fakes]
            for index, own in (own_timeouts or {}).items():
                client = az.AsyncVLLMClient(fakes[index].url, timeouts=own)
                members[index] = await stack.enter_async_context(client)
            fleet = await stack.enter_async_context(az.Fleet(members, timeouts=timeouts))
            yield NcclSetup(hub, fakes, fleet, replay, installed_trainer_api("nccl"))
    finally:
        hub.release()  # a broadcast left blocked by a failed round ends now
        for fake in fakes:
            await fake.stop()


def nccl_workers_load(setup: NcclSetup, fake: FakeVLLMServer) -> list[dict[str, torch.Tensor]]:
    """vLLM's worker engine, once per worker of ``fake``: init from what the fake last
    received, then its last accepted update, receiving what rank 0 broadcast."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    setup.replay[0] = list(setup.hub.sent)
    loaded = []
    for rank in range(fake.world_size):
        model = RecordingModel()
        engine = worker_engine(
            NCCLWeightTransferEngine, "nccl", rank=rank, world_size=fake.world_size, model=model
        )
        engine.init_transfer_engine(engine.parse_init_info(fake.init_infos[-1]))
        engine.update_weights(fake.updates[-1])
        loaded.append(model.loaded)
    return loaded


@pytest.mark.asyncio
async def test_nccl_rounds_through_vllms_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    async with nccl_fleet(monkeypatch) as setup:
        a, b = setup.fakes
        publisher = az.AsyncWeightPublisher(
            setup.fleet, backend=az.backends.NCCL(packed_buffer_size_bytes=BUFFER)
        )
        assert publisher.vllm_backend == "nccl"
        async with publisher:
            for step in (1, 2):
                setup.hub.sent.clear()
                model = weights(seed=step)
                report = await publisher.publish(model, version=f"step-{step}")
                assert publisher.version == f"step-{step}"

                # Every server finished with the round's version (vLLM's engine passes none).
                for fake in (a, b):
                    assert_finished_with(setup.fleet, fake, f"step-{step}")
                    assert round_calls(fake)[-4:] == [
                        "/start_weight_update",
                        "/update_weights",
                        "/finish_weight_update",
                        "/reset_prefix_cache",
                    ]
                assert publisher.api == setup.api
                # One update per server: vLLM's update info, names in order; the packing
                # rides it only on 0.23-0.27 (0.28+ refuses it there).
                assert a.updates[-1] == b.updates[-1]
                assert a.updates[-1]["names"] == list(model)
                assert a.updates[-1]["shapes"] == [list(t.shape) for t in model.values()]
                fields = {"names", "dtype_names", "shapes"}
                if setup.api == "callback":
                    fields |= set(setup.wire)
                    assert {k: a.updates[-1][k] for k in setup.wire} == setup.wire
                assert set(a.updates[-1]) == fields

                # Packed chunks, each just over the buffer (vLLM's packing), all exact.
                sent = setup.hub.sent
                assert len(sent) > 1
                assert report.chunks == len(sent)
                assert report.bytes == sum(t.numel() for t in sent)
                assert report.bytes == sum(t.numel() * t.element_size() for t in model.values())
                assert all(t.dtype == torch.uint8 for t in sent)
                for fake in (a, b):
                    for loaded in nccl_workers_load(setup, fake):
                        assert_loaded(loaded, model)

        # One group for both rounds: the trainer is rank 0 of 1 + 2 + 1 ranks; each
        # server got its own offset, and vLLM's workers computed disjoint ranks from it.
        assert len(setup.hub.endpoints) == 1
        endpoint = setup.hub.endpoints[0]
        assert endpoint["world_size"] == 4
        assert endpoint["master_address"] == "127.0.0.1"
        wire = setup.wire if setup.api == "engine" else {}  # 0.23-0.27: exactly four fields
        assert [f.init_infos for f in (a, b)] == [
            [
                {
                    "master_address": "127.0.0.1",
                    "master_port": endpoint["master_port"],
                    "rank_offset": offset,
                    "world_size": 4,
                    **wire,
                }
            ]
            for offset in (1, 3)
        ]
        port = endpoint["master_port"]
        assert sorted(set(setup.hub.worker_ranks)) == [(port, 1, 4), (port, 2, 4), (port, 3, 4)]


@pytest.mark.asyncio
async def test_nccl_unpacked_broadcasts_each_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    async with nccl_fleet(monkeypatch, world_sizes=(1,)) as setup:
        (fake,) = setup.fakes
        model = weights(seed=5)
        async with az.AsyncWeightPublisher(
            setup.fleet, backend=az.backends.NCCL(packed=False)
        ) as pub:
            report = await pub.publish(model, version="v")
        assert [tuple(t.shape) for t in setup.hub.sent] == [tuple(t.shape) for t in model.values()]
        assert report.chunks == len(model)
        packing = fake.init_infos[0] if setup.api == "engine" else fake.updates[-1]
        assert packing["packed"] is False
        assert fake.init_infos[0]["rank_offset"] == 1
        (loaded,) = nccl_workers_load(setup, fake)
        assert_loaded(loaded, model)


@pytest.mark.asyncio
async def test_nccl_refused_update_fails_the_round_without_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that refuses ``/update_weights`` never joins the broadcast: vLLM's engine
    stays blocked in it, as with NCCL. A round that needs both servers fails at once
    with that server's error (the loop's error reaches the engine's thread and comes
    back out of ``publish``); the next round builds a new group and is exact."""
    async with nccl_fleet(monkeypatch) as setup:
        a, b = setup.fakes
        async with az.AsyncWeightPublisher(
            setup.fleet, backend=az.backends.NCCL(packed_buffer_size_bytes=BUFFER)
        ) as publisher:
            await publisher.publish(weights(seed=1), version="v1")
            b.inject("/update_weights", Fault.error(500, "worker refused the update"))
            with pytest.raises(az.PublishError) as caught:
                await publisher.publish(weights(seed=2), version="v2", min_servers="all")
            outcomes = caught.value.outcomes
            assert outcomes[b.url].phase == "update"
            assert not outcomes[b.url].ok
            assert "worker refused the update" in str(outcomes[b.url].error)
            assert publisher.version == "v1"
            assert held(setup.fleet, a) == "v1"
            assert not a.update_active
            assert not b.update_active
            assert sorted(caught.value.needs_resync) == sorted([a.url, b.url])

            setup.hub.sent.clear()
            model = weights(seed=3)
            await publisher.publish(model, version="v3")
        assert len(setup.hub.endpoints) == 2  # the group was rebuilt
        ports = [e["master_port"] for e in setup.hub.endpoints]
        assert [i["master_port"] for i in a.init_infos] == ports
        assert [i["rank_offset"] for i in b.init_infos] == [3, 3]
        for fake in (a, b):
            assert held(setup.fleet, fake) == "v3"
            for loaded in nccl_workers_load(setup, fake):
                assert_loaded(loaded, model)


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["/start_weight_update", "/update_weights"])
async def test_nccl_lost_server_is_left_out_of_a_new_group_in_the_same_publish(
    monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """The collective cannot go on without a lost server: the round ends the survivor's
    update, builds a new group without the lost one (a new init and rendezvous) and
    sends the whole round again to the survivor, inside the same ``publish``. The next
    round brings the lost server back into a group of both."""
    async with nccl_fleet(monkeypatch) as setup:
        a, b = setup.fakes
        async with az.AsyncWeightPublisher(
            setup.fleet, backend=az.backends.NCCL(packed_buffer_size_bytes=BUFFER)
        ) as publisher:
            await publisher.publish(weights(seed=1), version="v1")
            b.inject(route, Fault.error(500, "refused"))
            setup.hub.sent.clear()
            model = weights(seed=2)
            report = await publisher.publish(model, version="v2")
            assert (report.version, report.attempts) == ("v2", 2)
            assert (report.servers, report.lost) == ([a.url], [b.url])
            assert report.outcomes[b.url].phase == route.strip("/").split("_")[0]
            assert publisher.version == setup.fleet.current_version == "v2"
            assert held(setup.fleet, a) == "v2"
            assert setup.fleet.state(b.url).dirty
            assert [e["world_size"] for e in setup.hub.endpoints] == [4, 3]  # 1+2+1, 1+2
            assert a.init_infos[-1]["master_port"] == setup.hub.endpoints[-1]["master_port"]
            # Only the second attempt's broadcasts completed (the first never did).
            for loaded in nccl_workers_load(setup, a):
                assert_loaded(loaded, model)
            assert not a.update_active
            # The next round: a group of both again, both exact.
            b.clear_faults()
            setup.hub.sent.clear()
            model = weights(seed=3)
            report = await publisher.publish(model, version="v3")
            assert (report.lost, report.attempts) == ([], 1)
        assert [e["world_size"] for e in setup.hub.endpoints] == [4, 3, 4]
        for fake in (a, b):
            assert held(setup.fleet, fake) == "v3"
            for loaded in nccl_workers_load(setup, fake):
                assert_loaded(loaded, model)


@pytest.mark.asyncio
async def test_nccl_frozen_server_fails_the_round_at_the_update_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that never answers ``/update_weights`` never joins the broadcast either.
    A round that needs both fails with its ServerTimeout at its update deadline (3 s,
    its own client's; control's is 60 s, so the phase is the update's; the other
    server's deadlines only catch a hang, so its answers never race one), and the
    trainer is not left in the broadcast; with the default ``min_servers=1`` the same
    round goes on in a new group without it. Each round waits that one deadline, read
    from the calls that timed out."""
    frozen = az.Timeouts(connect=5, control=60, update=3, generate=60)
    async with nccl_fleet(
        monkeypatch, timeouts=az.Timeouts.uniform(HANG), own_timeouts={1: frozen}
    ) as setup:
        a, b = setup.fakes
        b.inject("/update_weights", Fault.hang(), times=None)
        fleet = setup.fleet
        async with az.AsyncWeightPublisher(fleet, backend="nccl") as publisher:
            with (
                recording(fleet.client(url) for url in fleet.urls) as log,
                pytest.raises(az.PublishError) as caught,
            ):
                await publisher.publish(weights(seed=1), version="v1", min_servers="all")
            assert [(s.url, s.op) for s in log.timed_out()] == [(b.url, "update_weights")]
            assert log.round_calls(b.url)[-1].timed_out
            outcome = caught.value.outcomes[b.url]
            assert outcome.phase == "update"
            assert isinstance(outcome.error, az.ServerTimeout)
            assert caught.value.outcomes[a.url].ok  # it took the update; the round ended it
            assert setup.hub.sent == []  # the broadcast never completed
            assert not a.update_active
            assert publisher.version is None
            # b is known unhealthy: it is probed (it answers /health) and included; it
            # still holds v1's update (refused: "already active"), so the update that
            # ends it is sent, and times out: the round's one deadline. Then the group
            # of a alone takes the round.
            with recording(fleet.client(url) for url in fleet.urls) as log:
                report = await publisher.publish(weights(seed=2), version="v2")
            assert [(s.url, s.op) for s in log.timed_out()] == [(b.url, "update_weights")]
            assert (report.servers, report.lost, report.attempts) == ([a.url], [b.url], 2)
            assert held(setup.fleet, a) == "v2"
            assert not a.update_active


@pytest.mark.asyncio
async def test_nccl_failed_start_reaches_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    async with nccl_fleet(monkeypatch) as setup:
        a, b = setup.fakes
        b.inject("/start_weight_update", Fault.error(500, "start refused"))
        async with az.AsyncWeightPublisher(setup.fleet, backend="nccl") as publisher:
            with pytest.raises(az.PublishError) as caught:
                await publisher.publish(weights(seed=1), version="v1", min_servers="all")
            assert caught.value.outcomes[b.url].phase == "start"
            assert "start refused" in str(caught.value)
            assert setup.hub.sent == []  # nothing was broadcast
            aborts = a.requests_to("/update_weights")
            assert [r.json["update_info"] for r in aborts] == [{"asyncsync_abort": True}]
            assert not a.update_active
            assert publisher.version is None

            # Nothing was broadcast: the next round keeps the group.
            model = weights(seed=2)
            await publisher.publish(model, version="v2")
        assert len(setup.hub.endpoints) == 1
        assert held(setup.fleet, a) == held(setup.fleet, b) == "v2"
        for fake in (a, b):
            for loaded in nccl_workers_load(setup, fake):
                assert_loaded(loaded, model)


@pytest.mark.asyncio
async def test_nccl_cancelled_round_stops_at_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while vLLM broadcasts: the servers' workers are already in the
    broadcast, so it runs to its end; the round then stops before finish and ends the
    update everywhere."""
    async with nccl_fleet(monkeypatch, world_sizes=(1,)) as setup:
        (fake,) = setup.fakes
        gate = asyncio.Event()
        fake.inject("/update_weights", Fault.until(gate))
        async with az.AsyncWeightPublisher(setup.fleet, backend="nccl") as publisher:
            task = asyncio.create_task(publisher.publish(weights(seed=1), version="v1"))
            async with asyncio.timeout(60):  # only catches a hang
                while not fake.requests_to("/update_weights"):  # noqa: ASYNC110 - the fake's records
                    await asyncio.sleep(0.01)  # until the update is held there
            task.cancel()
            gate.set()  # the worker joins; the broadcast completes
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(setup.hub.sent) > 0  # the broadcast ran to its end
            assert finish_versions(fake) == []
            bodies = [r.json["update_info"] for r in fake.requests_to("/update_weights")]
            assert [b.get("asyncsync_abort") for b in bodies] == [None, True]
            assert not fake.update_active
            assert publisher.version is None

            # The group saw a whole broadcast: the next round reuses it.
            setup.hub.sent.clear()
            model = weights(seed=2)
            await publisher.publish(model, version="v2")
        assert len(setup.hub.endpoints) == 1
        (loaded,) = nccl_workers_load(setup, fake)
        assert_loaded(loaded, model)


@pytest.mark.asyncio
async def test_nccl_fleet_change_rebuilds_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    async with nccl_fleet(monkeypatch, world_sizes=(1, 2)) as setup:
        _a, b = setup.fakes
        async with az.AsyncWeightPublisher(setup.fleet, backend="nccl") as publisher:
            await publisher.publish(weights(seed=1), version="v1")
            b.world_size = 3  # the server was restarted with more workers
            setup.hub.sent.clear()
            model = weights(seed=2)
            await publisher.publish(model, version="v2")
        assert [e["world_size"] for e in setup.hub.endpoints] == [4, 5]
        assert [i["rank_offset"] for i in b.init_infos] == [2, 2]
        for loaded in nccl_workers_load(setup, b):
            assert_loaded(loaded, model)


class CountingWeights:
    """Weights that count how often they were iterated (and describe themselves)."""

    def __init__(self, model: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.passes = 0

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.model.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        yield from self.model.items()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
async def test_other_ranks_run_the_engine_but_never_send(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    from asyncsync._vllm.caps import installed_trainer_api

    api = installed_trainer_api(backend)
    if backend == "ipc" and api != "engine":
        pytest.skip(f"vLLM's static IPC send (API {api!r}) is not exercised here")
    install_cuda_on_cpu(monkeypatch)
    handles = install_ipc_handles(monkeypatch)
    source = CountingWeights(weights(seed=1))
    options = (
        az.backends.IPC(allow_insecure_serialization=True)
        if backend == "ipc"
        else az.backends.NCCL()
    )
    async with az.AsyncWeightPublisher(None, backend=options, rank=1, world_size=2) as publisher:
        report = await publisher.publish(source, version="v1")
        engine = publisher._backend._engine  # type: ignore[attr-defined]
    if api == "engine":
        assert type(engine).__name__ == f"{backend.upper()}TrainerWeightTransferEngine"
        assert engine.is_sender is False
    else:  # vLLM 0.23-0.27's static send has nothing to run on other ranks
        assert engine is None
    assert source.passes == 1  # vLLM's engine iterated the weights (collectives aligned)
    assert report.servers == []
    assert report.bytes == 0
    if backend == "ipc":
        assert handles.produced == len(source.model)  # it produced handles, sent none


@pytest.mark.asyncio
async def test_nccl_refuses_weights_without_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    async with nccl_fleet(monkeypatch, world_sizes=(1,)) as setup:
        async with az.AsyncWeightPublisher(setup.fleet, backend="nccl") as publisher:
            stream = iter(weights(seed=1).items())
            with pytest.raises(TypeError, match="announces every name, dtype and shape"):
                await publisher.publish(stream, version="v1")
        assert setup.fakes[0].requests_to("/start_weight_update") == []


# --------------------------------------------------------------------------- IPC
@dataclass
class IpcServer:
    """A fake server whose update hook is vLLM's IPC worker engine (one worker),
    initialized again by each new ``/init_weight_transfer_engine``, as vLLM's is."""

    fake: FakeVLLMServer
    model: RecordingModel
    engine: Any = None
    inits: int = 0

    def hook(self, info: Any) -> None:
        if self.engine is None:
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

            self.engine = worker_engine(
                IPCWeightTransferEngine, "ipc", rank=0, world_size=1, model=self.model
            )
        if self.inits != len(self.fake.init_infos):
            self.inits = len(self.fake.init_infos)
            self.engine.init_transfer_engine(self.engine.parse_init_info(self.fake.init_infos[-1]))
        self.engine.update_weights(info)


@asynccontextmanager
async def ipc_fleet(monkeypatch: pytest.MonkeyPatch, count: int = 2) -> AsyncIterator[Any]:
    _engine_api("ipc")
    install_cuda_on_cpu(monkeypatch)
    handles = install_ipc_handles(monkeypatch)
    servers = [
        IpcServer(FakeVLLMServer(version=installed_version(), backend="ipc"), RecordingModel())
        for _ in range(count)
    ]
    for server in servers:
        server.fake.update_hook = server.hook
        await server.fake.start()
    try:
        async with az.Fleet([s.fake.url for s in servers]) as fleet:
            yield servers, fleet, handles
    finally:
        for server in servers:
            await server.fake.stop()


def test_ipc_needs_the_explicit_opt_in() -> None:
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1") as caught:
        az.AsyncWeightPublisher(None, backend="ipc", rank=1, world_size=2)
    assert "allow_insecure_serialization=True" in str(caught.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("packed", [False, True])
async def test_ipc_rounds_through_vllms_engine(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    async with ipc_fleet(monkeypatch) as (servers, fleet, handles):
        publisher = az.AsyncWeightPublisher(
            fleet,
            backend=az.backends.IPC(
                allow_insecure_serialization=True, packed=packed, packed_buffer_size_bytes=BUFFER
            ),
        )
        seen: list[tuple[int, int]] = []
        async with publisher:
            for step in (1, 2):
                model = weights(seed=step)
                report = await publisher.publish(
                    model, version=f"step-{step}", progress=lambda n, b: seen.append((n, b))
                )
                for server in servers:
                    assert_loaded(server.model.loaded, model)
                    assert_finished_with(fleet, server.fake, f"step-{step}")
                total = sum(t.numel() * t.element_size() for t in model.values())
                assert report.bytes == total
        for server in servers:
            assert server.fake.init_infos == [{"packed": packed}]
            bodies = [r.json["update_info"] for r in server.fake.requests_to("/update_weights")]
            # The handles went pickled, as vLLM's HTTP route takes them.
            assert all("ipc_handles" not in b and b["ipc_handles_pickled"] for b in bodies)
        updates = servers[0].fake.updates
        if packed:
            # Chunks in order, none over the staging buffer, every tensor once.
            assert len(updates) > 2
            assert report.chunks == len(updates) // 2
            last = updates[len(updates) // 2 :]
            assert [n for u in last for n in u["names"]] == list(weights(seed=2))
            assert all(sum(u["tensor_sizes"]) <= BUFFER for u in last)
        else:
            assert report.chunks == 1
            assert len(updates) == 2
        assert seen[-1][1] == report.bytes
        assert handles.opened > 0


@pytest.mark.asyncio
async def test_ipc_packs_a_model_of_many_small_tensors_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``IPC(packed=None)``: each round goes as the packing rule says for its model
    (docs/transports/ipc.md); the servers' engines are told at init, again when the
    mode changes."""
    from asyncsync.backends.ipc import IpcBackend

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    many = {f"model.layers.0.experts.{i}.w": torch.full((16,), float(i)) for i in range(80)}
    few = weights(seed=3)  # 6 tensors: one handle each
    async with ipc_fleet(monkeypatch, count=1) as (servers, fleet, _handles):
        server = servers[0]
        ipc = az.backends.IPC(allow_insecure_serialization=True)
        async with az.AsyncWeightPublisher(fleet, backend=ipc) as publisher:
            backend = publisher._backend
            assert isinstance(backend, IpcBackend)
            report = await publisher.publish(many, version="many")
            assert backend.last_packed is True
            assert report.chunks == 1  # the staging buffer holds the whole (small) model
            assert server.fake.init_infos[-1] == {"packed": True}
            assert server.fake.updates[-1]["tensor_sizes"] == [64] * 80
            assert_loaded(server.model.loaded, many)

            server.model.loaded.clear()
            await publisher.publish(few, version="few")
            assert backend.last_packed is False
            assert server.fake.init_infos[-1] == {"packed": False}
            assert server.fake.updates[-1].get("tensor_sizes") is None
            assert_loaded(server.model.loaded, few)
            inits = len(server.fake.init_infos)
            await publisher.publish(weights(seed=4), version="few-again")
            assert len(server.fake.init_infos) == inits  # same mode: no new init
        # An explicit choice wins over the rule.
        explicit = az.backends.IPC(allow_insecure_serialization=True, packed=False)
        async with az.AsyncWeightPublisher(fleet, backend=explicit) as publisher:
            await publisher.publish(many, version="many-unpacked")
            assert server.fake.init_infos[-1] == {"packed": False}
            assert server.fake.updates[-1].get("tensor_sizes") is None


@pytest.mark.asyncio
async def test_ipc_server_without_insecure_serialization_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    async with ipc_fleet(monkeypatch, count=1) as (servers, fleet, _handles):
        async with az.AsyncWeightPublisher(
            fleet, backend=az.backends.IPC(allow_insecure_serialization=True)
        ) as publisher:
            with pytest.raises(az.PublishError) as caught:
                await publisher.publish(weights(seed=1), version="v1")
        assert publisher.version is None
        cause = caught.value.__cause__
        assert isinstance(cause, ProtocolError)
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in str(cause)
        assert "Restart every server" in str(cause)
        assert not servers[0].fake.update_active


@pytest.mark.asyncio
async def test_ipc_cancelled_round_stops_between_updates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    async with ipc_fleet(monkeypatch, count=1) as (servers, fleet, _handles):
        fake = servers[0].fake
        gate = asyncio.Event()
        fake.inject("/update_weights", Fault.until(gate))
        ipc = az.backends.IPC(
            allow_insecure_serialization=True, packed=True, packed_buffer_size_bytes=BUFFER
        )
        async with az.AsyncWeightPublisher(fleet, backend=ipc) as publisher:
            task = asyncio.create_task(publisher.publish(weights(seed=1), version="v1"))
            async with asyncio.timeout(60):  # only catches a hang
                while not fake.requests_to("/update_weights"):  # noqa: ASYNC110 - the fake's records
                    await asyncio.sleep(0.01)  # until the first update is held there
            task.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The held chunk finished; no later chunk was sent; the round was ended.
        bodies = [r.json["update_info"] for r in fake.requests_to("/update_weights")]
        assert [b.get("asyncsync_abort") for b in bodies] == [None, True]
        assert not fake.update_active
        assert publisher.version is None
        assert finish_versions(fake) == []


def test_payload_bytes_follows_shapes_and_sizes() -> None:
    from asyncsync.backends._vllm_drive import payload_bytes

    info = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[3, 4], [5]]}
    assert payload_bytes(info) == 3 * 4 * 2 + 5 * 4
    assert payload_bytes({**info, "tensor_sizes": [7, 9]}) == 16
    assert payload_bytes([info]) == payload_bytes(info)
    assert payload_bytes({}) == 0


def test_ipc_handles_are_pickled_like_vllms_http_client() -> None:
    from vllm.distributed.weight_transfer.clients import _json_safe_update_info

    from asyncsync.backends._ipc_handles import encode_ipc_update

    info = {
        "names": ["w"],
        "dtype_names": ["float32"],
        "shapes": [[2]],
        "ipc_handles": [{STANDIN_GPU_UUID: (torch.Tensor, torch.Size([2]), 0, b"h")}],
        "ipc_handles_pickled": None,
        "tensor_sizes": None,
    }
    assert encode_ipc_update(info) == _json_safe_update_info(info)
    assert encode_ipc_update({"names": []}) == {"names": []}


def test_many_handles_are_pickled_in_batches_that_read_back_as_one_list() -> None:
    """An unpacked round's 9,339 handles pickled in one call hold the GIL 50-60 ms (the
    event loop's longest stall on an H200): they are pickled in batches, into a stream
    that vLLM's server (``pickle.loads`` in its update info class) reads back as the
    same list; a short list is pickled exactly as vLLM's HTTP client pickles it."""
    import base64
    import pickle

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from asyncsync.backends._ipc_handles import BATCH, encode_ipc_update, pickled_handles

    def handle(i: int) -> dict[str, tuple[Any, ...]]:
        own = i.to_bytes(64, "little")
        return {STANDIN_GPU_UUID: (
            torch.Tensor, torch.Size([256, 1024]), (1024, 1), 0, torch.UntypedStorage,
            torch.bfloat16, 0, own, 524288, 0, False, own[::-1], i, own + b"e", True,
        )}  # fmt: skip

    for count in (0, 1, BATCH, BATCH + 1, 3 * BATCH + 7, 9_339):
        handles = [handle(i) for i in range(count)]
        assert pickle.loads(pickled_handles(handles)) == handles, count
        if count <= BATCH:
            assert pickled_handles(handles) == pickle.dumps(handles)
    # no single call pickles more than a batch: the GIL is free between them
    dumped: list[int] = []
    real_dumps = pickle.dumps

    def counting(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        dumped.append(len(obj) if isinstance(obj, list) else 1)
        return real_dumps(obj, *args, **kwargs)

    spy = pytest.MonkeyPatch()
    spy.setattr(pickle, "dumps", counting)
    try:
        pickled_handles([handle(i) for i in range(9_339)])
    finally:
        spy.undo()
    assert max(dumped) == BATCH
    assert sum(dumped) == 9_339
    names = [f"w{i}" for i in range(9_339)]
    handles = [handle(i) for i in range(9_339)]
    body = encode_ipc_update(
        {"names": names, "dtype_names": ["bfloat16"] * 9_339, "shapes": [[256, 1024]] * 9_339,
         "ipc_handles": handles}
    )  # fmt: skip
    assert pickle.loads(base64.b64decode(body["ipc_handles_pickled"])) == handles
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        info = IPCWeightTransferUpdateInfo(**body)  # vLLM's own reading of it
    finally:
        monkeypatch.undo()
    assert info.ipc_handles == handles


def test_rank_offsets_follow_the_fleet_order() -> None:
    from asyncsync.backends.nccl import rank_offsets

    assert rank_offsets({"a": 2, "b": 1, "c": 4}) == ({"a": 1, "b": 3, "c": 4}, 8)
    with pytest.raises(ProtocolError, match="world size of 0"):
        rank_offsets({"a": 0})


def test_checked_pairs_refuse_what_was_not_announced() -> None:
    from asyncsync.backends._vllm_drive import checked_pairs

    w = torch.zeros(4, 6)
    meta = [("w", torch.float32, (6, 4)), ("b", torch.float32, (2,))]
    pairs = list(checked_pairs(iter([("w", w.t()), ("b", torch.ones(2))]), meta))
    assert pairs[0][1].is_contiguous()  # a transposed view is sent as its values
    assert torch.equal(pairs[0][1], w.t())
    with pytest.raises(ValueError, match=r"weight 1 is 'c'.*'b'"):
        list(checked_pairs(iter([("w", w.t()), ("c", torch.ones(2))]), meta))
    with pytest.raises(ValueError, match="ended after 1 of 2"):
        list(checked_pairs(iter([("w", w.t())]), meta))
    with pytest.raises(ValueError, match="after the 2 announced"):
        list(checked_pairs(iter([("w", w.t()), ("b", torch.ones(2)), ("x", w)]), meta))


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_missing_cuda_device_is_named_and_other_errors_pass_through(backend: str) -> None:
    from asyncsync.backends import backend_class

    options = {"allow_insecure_serialization": True} if backend == "ipc" else {}
    engine_backend = backend_class(backend)(**options)
    missing = f"backend '{backend}' needs a CUDA device"
    with pytest.raises(RuntimeError, match=missing) as info, engine_backend.cuda_errors():
        raise RuntimeError("Torch not compiled with CUDA enabled")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(AssertionError, match=r"^unrelated$"), engine_backend.cuda_errors():
        raise AssertionError("unrelated")
