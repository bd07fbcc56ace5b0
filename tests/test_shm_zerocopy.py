"""Zero-copy shm rounds without a server: servers read the trainer's own tensors in
shared memory (``share_weights``, ``module.share_memory()``), the safety check on the
trainer's side, and what a worker refuses. The worker side is asyncsync's real receiver;
the fleet is fakes whose update hook runs it (a real server is in
tests/test_publish_zerocopy_vllm.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._transport.wire import SegmentRef, ShmFormatError, ShmUpdateFields
from asyncsync.backends._segments import open_segments
from asyncsync.backends._shm_zerocopy import NotInSharedMemory, SharedMemoryIndex, place
from asyncsync.backends.shm import ShmBuffers, send_round
from asyncsync.testing import FakeVLLMServer
from asyncsync.vllm_plugin.shm_engine import CheckpointTable, ShmReceiver, _Mapping
from tests.publish_fakes import aborts_received, round_calls, shm_fakes


@pytest.fixture(autouse=True)
def _no_segment_outlives_the_test() -> Iterator[None]:
    """Every segment a test's models made goes with them (later tests count segments)."""
    with contextlib.suppress(ImportError):
        # What the receiver imports, imported outside a round: importing vLLM keeps an
        # exception whose traceback would hold the round's frames (and the parameters).
        import vllm.model_executor.model_loader.reload.layerwise  # noqa: F401
    held = set(open_segments())
    yield
    gc.collect()
    assert set(open_segments()) <= held


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(32, 16)
    model.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
    model.head = torch.nn.Linear(16, 32, bias=False)
    return model


class _Worker:
    """asyncsync's receiver over a plain dict model, as vLLM drives it; ``during_load``
    runs inside each load (while the server reads the trainer's memory)."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        table = CheckpointTable(
            {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params},
            served_dtype="float32",
        )
        self.receiver = ShmReceiver(torch.nn.Module(), table)
        self.loaded: dict[str, torch.Tensor] = {}
        self.infos: list[dict[str, Any]] = []
        self.during_load: Callable[[], None] | None = None

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.during_load is not None:
            self.during_load()
        for name, view in weights:
            self.loaded[name] = view.clone()  # vLLM's loaders copy into parameters

    def hook(self, info: Any) -> None:
        """A fake server's update hook: the real receiver (which refuses aborts)."""
        if info.get("chunk") == 0 and not info.get("abort"):
            self.receiver.begin_round()
        self.infos.append(info)
        self.receiver.receive(info, self.load, None)


def test_share_weights_keeps_parameters_values_and_ties_in_one_owner_only_memfd() -> None:
    model = _model()
    model.head.weight = torch.nn.Parameter(torch.randn(16, 32).T)  # not contiguous
    model.tied = torch.nn.Linear(16, 16)
    model.tied.weight = model.layers[0].weight  # one parameter, two modules
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    identities = [id(p) for p in model.parameters()]
    held = set(open_segments())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    assert az.share_weights(model) is model

    (segment,) = set(open_segments()) - held
    assert [id(p) for p in model.parameters()] == identities
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.stride() == before[name].stride(), name
    assert model.tied.weight is model.layers[0].weight
    index = SharedMemoryIndex()
    refs = {index.locate(n, p)[0] for n, p in model.named_parameters() if p.is_contiguous()}
    assert {r.segment for r in refs} == {segment}  # every parameter in the one segment
    (ref,) = refs
    assert os.fstat(ref.fd).st_mode & 0o777 == 0o600
    assert os.readlink(ref.path) == f"/memfd:{segment} (deleted)"
    # Training goes on in the segment: the optimizer's parameters are the moved ones.
    model.layers[0](torch.ones(2, 16)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.layers[0].weight, before["layers.0.weight"])
    del model, optimizer, index, p
    gc.collect()
    assert segment not in open_segments()  # freed with the parameters


@pytest.mark.parametrize("how", ["share_weights", "share_memory"])
def test_a_round_reads_the_trainers_tensors_in_place_exactly(how: str) -> None:
    model = _model()
    if how == "share_weights":
        az.share_weights(model)
    else:
        model.share_memory()
    params = list(model.named_parameters())
    worker = _Worker(params)
    with ShmBuffers(buffer_bytes=4096) as buffers:  # smaller than the embedding
        worker.receiver.begin_round()
        stats = send_round(iter(params), None, buffers, worker.hook, zero_copy=True)
        assert buffers.allocated_bytes == 0  # nothing packed
    worker.receiver.end_round()
    assert stats.params == len(params)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in params)
    assert stats.chunks == len(worker.infos) > 1  # bounded chunks, the big one alone
    for info in worker.infos:
        assert info["segment"] == ""
        assert info["segments"]
    expected = {"share_weights": 1, "share_memory": len(params)}[how]
    assert len({s["segment"] for i in worker.infos for s in i["segments"]}) == expected
    for name, tensor in params:
        assert torch.equal(worker.loaded[name], tensor), name
    worker.receiver.close()


_READER = textwrap.dedent(
    """
    import json, sys
    from asyncsync._transport.wire import ShmUpdateFields
    from asyncsync.vllm_plugin.shm_engine import _Mapping

    info = ShmUpdateFields.parse(json.loads(sys.argv[1]))
    (ref,) = info.segments
    mapping = _Mapping(ref)
    view = mapping.view(info.offsets[0], info.dtype_names[0], tuple(info.shapes[0]))
    for _ in sys.stdin:  # one read per line
        print(json.dumps(view.tolist()), flush=True)
    """
)


@pytest.mark.parametrize("how", ["share_weights", "share_memory"])
def test_another_process_reads_the_parameter_itself_not_a_copy(how: str) -> None:
    """What a vLLM worker does, in another process: open ``/proc/<pid>/fd/<fd>``, check
    the link, map it and read the parameter; after an in-place change it reads the new
    values (the trainer's memory, not a snapshot)."""
    layer = torch.nn.Linear(4, 4, bias=False)
    if how == "share_weights":
        az.share_weights(layer)
    else:
        layer.share_memory()
    weight = layer.weight
    infos: list[dict[str, Any]] = []
    send_round([("w", weight)], None, ShmBuffers(4096), infos.append, zero_copy=True)

    with subprocess.Popen(
        [sys.executable, "-c", _READER, json.dumps(infos[0])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as reader:
        assert reader.stdin is not None
        assert reader.stdout is not None

        def read() -> Any:
            assert reader.stdin is not None
            assert reader.stdout is not None
            reader.stdin.write("read\n")
            reader.stdin.flush()
            return json.loads(reader.stdout.readline())

        try:
            assert read() == weight.tolist()
            with torch.no_grad():
                weight.mul_(-2.0)
            assert read() == weight.tolist()
        finally:
            reader.stdin.close()
            assert reader.wait(timeout=120) == 0


def test_tensors_outside_shared_memory_are_named_and_refused_before_any_send() -> None:
    shared = torch.nn.Linear(8, 8)
    az.share_weights(shared)
    cases = {
        "plain": torch.ones(8),
        "transposed": shared.weight.T,
        "slice": shared.weight[:, :4],
    }
    for name, tensor in cases.items():
        sent: list[Any] = []
        with pytest.raises(NotInSharedMemory, match=f"parameter {name!r} cannot be published"):
            send_round(
                [("ok", shared.bias), (name, tensor)],
                None,
                ShmBuffers(4096),
                sent.append,
                zero_copy=True,
            )
        assert sent == []
    with pytest.raises(TypeError, match="complex64"):
        place([("c", torch.ones(2, dtype=torch.complex64).share_memory_())])


def test_memory_readable_by_others_is_never_handed_over() -> None:
    fd = os.memfd_create(f"asyncsync-{os.getpid()}-{'0' * 16}", os.MFD_CLOEXEC)
    os.fchmod(fd, 0o644)
    os.ftruncate(fd, 4096)
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, 4096)
    os.close(fd)
    tensor = torch.empty(0).set_(storage, 0, (16,), (1,))
    with pytest.raises(NotInSharedMemory, match="mode 644"):
        place([("open", tensor)])
    # A worker refuses it too, whatever the trainer announced.
    held_fd = SharedMemoryIndex()._fds  # the descriptor torch keeps for the storage
    (ref_fd,) = [fd for fd, _, name in held_fd.values() if name.endswith("0" * 16)]
    ref = SegmentRef(f"asyncsync-{os.getpid()}-{'0' * 16}", 4096, os.getpid(), ref_fd)
    with pytest.raises(ShmFormatError, match="must be owner-only"):
        _Mapping(ref)


def test_a_worker_maps_only_what_the_link_names() -> None:
    layer = torch.nn.Linear(4, 4)
    az.share_weights(layer)
    (placed,), _ = place([("w", layer.weight)])
    real = placed.ref
    for lie in (f"torch_{os.getpid()}_1_2", f"asyncsync-{os.getpid()}-{'f' * 16}"):
        with pytest.raises(ShmFormatError, match=f"not segment '{lie}'"):
            _Mapping(SegmentRef(lie, real.segment_size, real.owner_pid, real.fd))
    with pytest.raises(ShmFormatError, match="is not an asyncsync segment"):
        _Mapping(SegmentRef("../../etc/passwd", 4096, os.getpid(), real.fd))


def test_a_zero_copy_chunk_is_validated_before_it_loads() -> None:
    layer = torch.nn.Linear(4, 4, bias=False)
    az.share_weights(layer)
    infos: list[dict[str, Any]] = []
    send_round([("w", layer.weight)], None, ShmBuffers(4096), infos.append, zero_copy=True)
    good = infos[0]
    bad_cases = {
        "segment index 1 outside": {"segment_of": [1]},
        "offset 2 is not aligned": {"offsets": [2]},
        "exceed the size": {"offsets": [good["segments"][0]["segment_size"] - 4]},
    }
    for message, change in bad_cases.items():
        worker = _Worker([("w", layer.weight)])
        worker.receiver.begin_round()
        with pytest.raises(RuntimeError, match=message):
            worker.hook({**good, **change})
        assert worker.loaded == {}


@pytest.mark.asyncio
async def test_publish_zero_copy_sends_no_bytes_and_auto_packs_when_it_must() -> None:
    model = _model()
    az.share_weights(model)
    plain = _model(seed=1)
    async with shm_fakes() as fakes, az.Fleet([f.url for f in fakes]) as fleet:
        async with az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(zero_copy=True)
        ) as publisher:
            report = await publisher.publish(model, version="v1")
            assert report.params == len(list(model.parameters()))
            # delta=True over shm is a whole round: in place too
            whole = await publisher.publish(model, version="v1d", delta=True)
            assert (whole.delta.kind, whole.delta.direct) == ("full", tuple(fleet.urls))
            # Refused before any server is touched (before the pause, too).
            with pytest.raises(ValueError, match="cannot be published without a copy"):
                await publisher.publish(plain, version="v2", pause="keep")
            assert publisher.version == "v1d"
        assert [len(f.updates) for f in fakes] == [2, 2]
        assert all(u["segments"] for f in fakes for u in f.updates)
        async with az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(zero_copy="auto")
        ) as publisher:
            await publisher.publish(model, version="v3")
            await publisher.publish(plain, version="v4")  # not shared: packed
        last = [f.updates[-1] for f in fakes]
        assert all(u["segments"] is None and u["segment"] for u in last)
        assert [round_calls(f).count("/start_weight_update") for f in fakes] == [4, 4]
    with pytest.raises(ValueError, match="zero_copy must be True, False or 'auto'"):
        az.AsyncWeightPublisher(
            None, rank=1, world_size=2, backend=az.backends.Shm(zero_copy="yes")
        )


@pytest.mark.asyncio
@pytest.mark.parametrize("api", ["engine", "callback"])
async def test_weights_modified_while_servers_read_them_fail_the_round(api: str) -> None:
    """The trainer steps while a server loads: the version counters moved, so the round
    fails with WeightsModifiedError before finish; the version stays, the servers are
    dirty; the next round, with the weights held still, publishes."""
    model = _model()
    az.share_weights(model)
    params = list(model.named_parameters())
    workers = [_Worker(params), _Worker(params)]

    def step() -> None:
        with torch.no_grad():
            model.layers[1].bias.add_(1.0)  # what an optimizer step does, in place

    workers[1].during_load = step
    async with (
        FakeVLLMServer(update_hook=workers[0].hook) as first,
        FakeVLLMServer(update_hook=workers[1].hook) as second,
    ):
        fakes = [first, second]
        async with (
            az.Fleet([f.url for f in fakes]) as fleet,
            az.AsyncWeightPublisher(
                fleet, _api=api, backend=az.backends.Shm(zero_copy=True)
            ) as publisher,  # type: ignore[arg-type]
        ):
            with pytest.raises(az.WeightsModifiedError) as info:
                await publisher.publish(model, version="v1")
            error = info.value
            assert isinstance(error, az.PublishError)
            assert error.parameters == ("layers.1.bias",)
            assert "'layers.1.bias' in place" in str(error)
            assert publisher.version is None
            assert set(error.needs_resync) == set(fleet.urls)
            for fake in fakes:
                assert "/finish_weight_update" not in round_calls(fake)
                assert aborts_received(fake)  # the round was ended everywhere
            assert isinstance(pickle.loads(pickle.dumps(error)), az.WeightsModifiedError)

            workers[1].during_load = None
            await publisher.publish(model, version="v2")
            assert publisher.version == "v2"
    for worker in workers:
        for name, tensor in params:
            assert torch.equal(worker.loaded[name], tensor), name
        worker.receiver.close()


def test_update_fields_round_trip_with_segments() -> None:
    ref = SegmentRef(f"asyncsync-1-{'a' * 16}", 4096, 1, 5)
    fields = ShmUpdateFields(
        names=["w"],
        dtype_names=["float32"],
        shapes=[[4]],
        offsets=[0],
        segments=[ref],
        segment_of=[0],
    )
    parsed = ShmUpdateFields.parse(json.loads(json.dumps(fields.to_json())))
    assert parsed.segments == [ref]
    assert parsed.segment_of == [0]
    assert parsed.zero_copy
    assert not ShmUpdateFields.parse({"names": []}).zero_copy
    with pytest.raises(ShmFormatError, match="malformed segment entry"):
        ShmUpdateFields.parse({"segments": [{"segment": "x"}]})


@pytest.mark.server_deps
def test_vllm_builds_the_zero_copy_info_and_gloo_refuses_it() -> None:
    """vLLM builds the engine's info with ``cls(**update_info)``: the zero-copy keys are
    fields of asyncsync's info class; a gloo worker (whose bytes come from its own
    broadcast) refuses a chunk that points at the trainer's memory."""
    from asyncsync.vllm_plugin._infos import ShmUpdateInfo
    from asyncsync.vllm_plugin.gloo_engine import GlooReceiver

    layer = torch.nn.Linear(4, 4, bias=False)
    az.share_weights(layer)
    infos: list[dict[str, Any]] = []
    send_round([("w", layer.weight)], None, ShmBuffers(4096), infos.append, zero_copy=True)
    worker = _Worker([("w", layer.weight)])
    worker.receiver.begin_round()
    worker.receiver.receive(ShmUpdateInfo(**infos[0]), worker.load, None)
    worker.receiver.end_round()
    assert torch.equal(worker.loaded["w"], layer.weight)
    gloo = GlooReceiver(torch.nn.Module(), None)
    with pytest.raises(RuntimeError, match="zero-copy chunk"):
        gloo.receive(infos[0], worker.load, None)
