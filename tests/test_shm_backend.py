"""The shm backend's pieces without a server: planning, segments, streaming, receiving."""

from __future__ import annotations

import gc
import itertools
import os
import re
import threading
from typing import Any

import pytest
import torch

from asyncsync._transport.wire import (
    PROTOCOL_VERSION,
    Manifest,
    ShmFormatError,
    validate_chunk_layout,
)
from asyncsync.backends._segments import Segment, leaked_segments, open_segments
from asyncsync.backends.shm import (
    RoundCancelled,
    ShmBuffers,
    manifest_of,
    plan_chunks,
    stream_chunks,
)
from asyncsync.vllm_plugin.shm_engine import CheckpointTable, ShmReceiver


def _params(layers: int = 3, width: int = 16) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(32, width, generator=gen))]
    for i in range(layers):
        out.append((f"model.layers.{i}.q.weight", torch.randn(width, width, generator=gen)))
        out.append((f"model.layers.{i}.norm.weight", torch.randn(width, generator=gen)))
    out.append(("lm_head.weight", torch.randn(32, width, generator=gen)))
    return out


def _manifest(params: list[tuple[str, torch.Tensor]]) -> Manifest:
    return Manifest.from_entries(
        (n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in params
    )


class _Source:
    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        self.params = params

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.params]

    def __iter__(self) -> Any:
        return iter(self.params)


class _Worker:
    """A worker-side receiver over a plain dict model, as vLLM would drive it."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.restores = 0
        table = CheckpointTable(
            {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params},
            served_dtype="float32",
        )
        self.receiver = ShmReceiver(torch.nn.Module(), table)

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in weights:
            self.loaded[name] = view.clone()  # vLLM's loaders copy into parameters

    def restore(self) -> None:
        self.restores += 1

    def send(self, info: dict[str, Any]) -> None:
        self.receiver.receive(info, self.load, self.restore)


def test_plan_respects_buffer_and_layer_groups() -> None:
    params = _params(layers=3, width=16)
    manifest = _manifest(params)
    layer_bytes = 16 * 16 * 4 + 16 * 4 + 64  # one layer group, aligned
    buffer_bytes = 32 * 16 * 4 + 64  # the embedding fits; two layer groups do not
    assert 2 * layer_bytes > buffer_bytes
    chunks = plan_chunks(manifest, buffer_bytes=buffer_bytes)
    assert [n for c in chunks for n in c.names] == list(manifest.names)
    for chunk in chunks:
        assert chunk.nbytes <= buffer_bytes
        layers = {n.split(".")[2] for n in chunk.names if n.startswith("model.layers.")}
        assert len(layers) <= 1, chunk.names  # a layer group is never split here


def test_plan_rejects_tensor_larger_than_buffer() -> None:
    manifest = Manifest.from_entries([("big", "float32", [2048])])
    with pytest.raises(ValueError, match=re.escape("'big' needs 8192 bytes")):
        plan_chunks(manifest, buffer_bytes=4096)


def test_layout_validation_names_the_parameter() -> None:
    with pytest.raises(ShmFormatError, match=r"'b'.*overlap|'a'.*'b'.*overlap"):
        validate_chunk_layout(["a", "b"], ["float32", "float32"], [[16], [16]], [0, 0], 4096)
    with pytest.raises(ShmFormatError, match=re.escape("'a': bytes")):
        validate_chunk_layout(["a"], ["float32"], [[2048]], [0], 4096)
    with pytest.raises(ShmFormatError, match=re.escape("unsupported dtype 'complex64'")):
        validate_chunk_layout(["a"], ["complex64"], [[2]], [0], 4096)


def test_segment_is_released_on_close_and_on_gc() -> None:
    seg = Segment(8192)
    assert seg.name in open_segments()
    assert leaked_segments(pid=os.getpid()) == []  # never a name in /dev/shm
    seg.close()
    assert seg.name not in open_segments()
    seg.close()  # idempotent
    other = Segment(8192)
    name = other.name
    del other
    gc.collect()
    assert name not in open_segments()


def test_segment_is_owner_only_and_opened_through_the_trainers_descriptor() -> None:
    with Segment(8192) as seg:
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
        assert os.readlink(seg.path) == f"/memfd:{seg.name} (deleted)"


def test_stream_round_trip_is_exact_and_double_buffered() -> None:
    params = _params(layers=4, width=32)
    worker = _Worker(params)
    segments_used: list[str] = []

    def send(info: dict[str, Any]) -> None:
        segments_used.append(info["segment"])
        worker.send(info)

    with ShmBuffers(buffer_bytes=8192) as buffers:
        stats = stream_chunks(iter(params), _manifest(params), buffers, send)
        assert stats.chunks >= 3
        assert stats.params == len(params)
        assert len(set(segments_used)) == 2  # exactly two buffers, alternating
        assert all(a != b for a, b in itertools.pairwise(segments_used))
        assert buffers.allocated_bytes == 2 * 8192  # bounded by the buffers, not the model
    worker.receiver.end_round()
    for name, tensor in params:
        assert torch.equal(worker.loaded[name], tensor), name
    worker.receiver.close()  # the worker (in this process here) drops its mappings
    assert not [s for s in open_segments() if s in segments_used]


def test_stream_without_metadata_cuts_greedily() -> None:
    params = _params(layers=2, width=32)
    worker = _Worker(params)
    infos: list[dict[str, Any]] = []

    def send(info: dict[str, Any]) -> None:
        infos.append(info)
        worker.send(info)

    with ShmBuffers(buffer_bytes=8192) as buffers:
        stream_chunks((p for p in params), None, buffers, send)
    assert infos[0]["manifest"] is None
    assert [i["last"] for i in infos] == [False] * (len(infos) - 1) + [True]
    worker.receiver.end_round()
    assert set(worker.loaded) == {n for n, _ in params}


def test_wrong_shape_is_refused_before_anything_loads() -> None:
    params = _params()
    worker = _Worker(params)
    bad = [(n, t if i != 3 else t[:-1]) for i, (n, t) in enumerate(params)]
    with ShmBuffers(buffer_bytes=8192) as buffers, pytest.raises(RuntimeError) as info:
        stream_chunks(iter(bad), _manifest(bad), buffers, worker.send)
    message = str(info.value)
    assert "model.layers.1.q.weight" in message
    assert "does not match" in message
    assert "nothing was loaded" in message
    assert worker.loaded == {}
    assert worker.restores == 1


def test_unknown_name_and_dtype_mismatch_are_named() -> None:
    params = _params()
    worker = _Worker(params)
    renamed = [
        ("model.layers.0.k.weight" if n == "model.layers.0.q.weight" else n, t) for n, t in params
    ]
    with (
        ShmBuffers(buffer_bytes=8192) as buffers,
        pytest.raises(RuntimeError, match=re.escape("unknown parameter 'model.layers.0.k.weight'")),
    ):
        stream_chunks(iter(renamed), _manifest(renamed), buffers, worker.send)
    doubled = [(n, t.double() if n == "lm_head.weight" else t) for n, t in params]
    with (
        ShmBuffers(buffer_bytes=8192) as buffers,
        pytest.raises(RuntimeError, match=re.escape("'lm_head.weight': dtype float64")),
    ):
        stream_chunks(iter(doubled), _manifest(doubled), buffers, worker.send)


def test_missing_parameter_is_refused() -> None:
    params = _params()
    worker = _Worker(params)
    partial = params[:-1]
    with (
        ShmBuffers(buffer_bytes=8192) as buffers,
        pytest.raises(RuntimeError, match=re.escape("does not update 'lm_head.weight'")),
    ):
        stream_chunks(iter(partial), _manifest(partial), buffers, worker.send)
    # Without a manifest the gap is found at the last chunk, before it loads.
    worker2 = _Worker(params)
    with (
        ShmBuffers(buffer_bytes=8192) as buffers,
        pytest.raises(RuntimeError, match=re.escape("incomplete: missing 'lm_head.weight'")),
    ):
        stream_chunks(iter(partial), None, buffers, worker2.send)


def test_order_must_match_metadata() -> None:
    params = _params()
    swapped = [params[1], params[0], *params[2:]]
    with (
        ShmBuffers(buffer_bytes=8192) as buffers,
        pytest.raises(ValueError, match=re.escape("iteration order")),
    ):
        stream_chunks(iter(swapped), _manifest(params), buffers, lambda info: None)


def test_cancel_stops_at_a_chunk_boundary() -> None:
    params = _params(layers=6, width=32)
    cancel = threading.Event()
    sent: list[int] = []

    def send(info: dict[str, Any]) -> None:
        sent.append(info["chunk"])
        cancel.set()  # cancelled while the first chunk is being delivered

    with ShmBuffers(buffer_bytes=8192) as buffers, pytest.raises(RoundCancelled):
        stream_chunks(iter(params), _manifest(params), buffers, send, cancel=cancel)
    assert sent == [0]


def test_non_sender_rank_only_iterates() -> None:
    params = _params()
    seen: list[str] = []

    def items() -> Any:
        for name, tensor in params:
            seen.append(name)
            yield name, tensor

    with ShmBuffers(buffer_bytes=8192) as buffers:
        stats = stream_chunks(items(), _manifest(params), buffers, None)
        assert buffers.allocated_bytes == 0
    assert seen == [n for n, _ in params]
    assert stats.chunks == 0


def test_manifest_of_module_source() -> None:
    module = torch.nn.Linear(4, 3)

    class Src:
        def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
            return [(n, p.dtype, tuple(p.shape)) for n, p in module.named_parameters()]

    manifest = manifest_of(Src())
    assert manifest is not None
    assert manifest.names == ("weight", "bias")
    assert manifest.entry("weight") == ("float32", (3, 4))


@pytest.mark.server_deps
def test_vllm_023_engine_contract() -> None:
    """vLLM 0.23 drives the engine as ``receive_weights(update_info, load_weights)`` with
    its own layerwise reload; the adapter must validate and load the same wire format."""
    from asyncsync.vllm_plugin._infos import ShmUpdateInfo
    from asyncsync.vllm_plugin.engine_v023 import ShmWeightTransferEngineV023

    params = _params(layers=2, width=32)
    engine = ShmWeightTransferEngineV023(None, None, torch.nn.Module())
    engine.receiver.table = CheckpointTable(
        {n: ("float32", tuple(t.shape)) for n, t in params}, served_dtype="float32"
    )
    loaded: dict[str, torch.Tensor] = {}

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((name, view.clone()) for name, view in weights)

    def send(info: dict[str, Any]) -> None:
        engine.receive_weights(ShmUpdateInfo(**info), load_weights)

    with ShmBuffers(buffer_bytes=8192) as buffers:
        stats = stream_chunks(iter(params), _manifest(params), buffers, send)
    assert stats.chunks > 1
    assert all(torch.equal(loaded[n], t) for n, t in params)
    # A second round starts at chunk 0 again, and a bad one is refused by name.
    bad = [(n, t[:1] if n == "lm_head.weight" else t) for n, t in params]
    with ShmBuffers(buffer_bytes=8192) as buffers, pytest.raises(RuntimeError, match="lm_head"):
        stream_chunks(iter(bad), _manifest(bad), buffers, send)
    engine.shutdown()


@pytest.mark.server_deps
def test_plugin_entry_point_registers_the_engine() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from asyncsync.vllm_plugin import BACKEND_NAME, register
    from asyncsync.vllm_plugin.engine_v032 import ShmWeightTransferEngine

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == BACKEND_NAME]
    assert entry.value == "asyncsync.vllm_plugin:register"
    register()
    register()  # vLLM loads plugins in every process, possibly more than once
    assert WeightTransferEngineFactory._registry[BACKEND_NAME]() is ShmWeightTransferEngine


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randn(4, 6).t(),  # not contiguous
        torch.randn(3, requires_grad=True),
        torch.arange(10, dtype=torch.int64),
        torch.randn(3, dtype=torch.complex64).conj(),
    ],
    ids=["f32", "bf16", "bool", "transposed", "requires-grad", "int64", "conj-view"],
)
def test_pack_copies_bytes_exactly(tensor: torch.Tensor) -> None:
    from asyncsync.backends._shm_pack import _pack

    with Segment(1 << 20) as segment:
        _pack(segment, 64, tensor)
        n = tensor.numel() * tensor.element_size()
        back = torch.frombuffer(segment.buffer(), dtype=torch.uint8, count=n, offset=64)
        assert torch.equal(
            back.view(tensor.dtype).view(tensor.shape), tensor.detach().resolve_conj()
        )
        del back


def test_trainer_engine_drives_the_round_through_a_sync_client() -> None:
    """vLLM 0.3x style: trainer_init -> send_weights through a VLLMWeightSyncClient."""
    from asyncsync.backends.shm import ShmTrainerEngine, ShmTrainerInitInfo

    params = _params(layers=3, width=32)
    worker = _Worker(params)
    calls: list[str] = []

    class Client:
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            calls.append(f"init:{init_info['protocol']}")

        def start_weight_update(self) -> None:
            calls.append("start")
            worker.receiver.begin_round()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            calls.append("update")
            worker.send(update_info)

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            calls.append("finish")
            worker.receiver.end_round()

    engine = ShmTrainerEngine.trainer_init(
        ShmTrainerInitInfo(rank=0, buffer_bytes=8192), client=Client(), source=_Source(params)
    )
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    assert calls[0] == f"init:{PROTOCOL_VERSION}"
    assert calls[1] == "start"
    assert calls[-1] == "finish"
    assert calls.count("update") == engine.last_stats.chunks > 1  # type: ignore[union-attr]
    assert all(torch.equal(worker.loaded[n], t) for n, t in params)
    # A non-sender rank never touches the client.
    other = ShmTrainerEngine.trainer_init(
        ShmTrainerInitInfo(rank=1, buffer_bytes=8192), client=Client(), source=_Source(params)
    )
    before = list(calls)
    other.send_weights()
    other.shutdown()
    assert calls == before


def test_the_round_starts_once_chunk_zero_is_packed() -> None:
    """start_weight_update comes after the first chunk is packed (no trainer work while
    the servers already hold the round), and a source that fails before the first chunk
    is complete never starts a round."""
    from asyncsync.backends.shm import ShmTrainerEngine

    params = _params(layers=3, width=32)
    events: list[str] = []
    chunk_names: dict[int, list[str]] = {}

    class Source(_Source):
        def __iter__(self) -> Any:
            for name, tensor in self.params:
                events.append(f"yield:{name}")
                yield name, tensor

    class Client:
        def start_weight_update(self) -> None:
            events.append("start")

        def update_weights(self, update_info: dict[str, Any]) -> None:
            events.append(f"update:{update_info['chunk']}")
            chunk_names[update_info["chunk"]] = update_info["names"]

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            events.append("finish")

    engine = ShmTrainerEngine(
        client=Client(), source=Source(params), is_sender=True, buffers=ShmBuffers(16384)
    )
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    first_chunk = engine.last_stats.chunks  # type: ignore[union-attr]
    assert first_chunk > 1
    assert len(chunk_names[0]) > 1
    start = events.index("start")
    assert events[start + 1] == "update:0"
    packed_before_start = {e.removeprefix("yield:") for e in events[:start]}
    assert set(chunk_names[0]) <= packed_before_start  # all of chunk 0 was packed first
    assert set(chunk_names[1]).isdisjoint(packed_before_start)  # chunk 1 was not
    assert events.count("start") == 1
    assert events[-1] == "finish"

    # The source breaks before chunk 0 is complete: the servers were never touched.
    events.clear()

    class Broken(_Source):
        def __iter__(self) -> Any:
            yield from self.params[: len(chunk_names[0]) - 1]  # chunk 0 but its last tensor
            raise RuntimeError("the trainer's gather failed")

    engine = ShmTrainerEngine(
        client=Client(), source=Broken(params), is_sender=True, buffers=ShmBuffers(16384)
    )
    try:
        with pytest.raises(RuntimeError, match="gather failed"):
            engine.send_weights()
    finally:
        engine.shutdown()
    assert events == []


@pytest.mark.server_deps
def test_wire_types_are_shared_and_checked() -> None:
    """One protocol version and one definition of the info fields on both sides."""
    from asyncsync._transport.wire import PROTOCOL_VERSION, ShmInitFields, ShmUpdateFields
    from asyncsync.vllm_plugin._infos import ShmInitInfo, ShmUpdateInfo

    assert ShmInitInfo(**ShmInitFields(trainer_pid=7).to_json()).protocol == PROTOCOL_VERSION
    with pytest.raises(ValueError, match="trainer speaks protocol 99"):
        ShmInitInfo(protocol=99).check_protocol()
    sent = ShmUpdateFields(round="r", names=["a"], dtype_names=["float32"], shapes=[[2, 3]])
    received = ShmUpdateFields.parse(ShmUpdateInfo(**sent.to_json()))  # as vLLM builds it
    assert received.shapes == [(2, 3)]
    assert received == ShmUpdateFields.parse(sent.to_json())
    with pytest.raises(ShmFormatError, match="malformed update_info"):
        ShmUpdateFields.parse({"chunk": "first"})


@pytest.mark.parametrize(
    ("segment", "owner", "message"),
    [
        ("../../etc/passwd", None, "is not an asyncsync segment"),
        ("asyncsync-1-0123456789abcdef/../x", None, "is not an asyncsync segment"),
        ("asyncsync-1-0123456789abcdef", "not-a-segment", "not segment"),
        ("asyncsync-1-0123456789abcdef", "dead", "cannot open segment"),
    ],
)
def test_a_worker_maps_only_the_segment_it_was_told(
    segment: str, owner: str | None, message: str, tmp_path: Any
) -> None:
    """The segment name must be an asyncsync one, opened through the owner's descriptor,
    and the descriptor must link to that very memfd (never an arbitrary file)."""
    params = [("a", torch.ones(4))]
    worker = _Worker(params)
    other = open(tmp_path / "plain.bin", "wb+")  # noqa: SIM115 - closed below
    other.write(b"\0" * 4096)
    other.flush()
    fd = other.fileno() if owner == "not-a-segment" else 10_000
    info = {
        "round": "r",
        "chunk": 0,
        "last": True,
        "segment": segment,
        "segment_size": 4096,
        "owner_pid": os.getpid(),
        "fd": fd,
        "names": ["a"],
        "dtype_names": ["float32"],
        "shapes": [[4]],
        "offsets": [0],
    }
    try:
        worker.receiver.begin_round()
        with pytest.raises(RuntimeError, match=message):
            worker.send(info)
        assert worker.loaded == {}
    finally:
        other.close()


def test_a_new_segment_is_faulted_in_step_by_step() -> None:
    """Every page of a new segment is written once before packing (in steps of
    TOUCH_STEP, so that the event loop runs between them: one MAP_POPULATE of 256 MiB
    stopped it for 150-420 ms under memory pressure), a size that is no multiple of
    the step included; a segment asked not to populate is left untouched."""
    from unittest import mock

    from asyncsync.backends import _segments

    size = _segments.TOUCH_STEP + 4096 + 17
    with mock.patch.object(_segments, "_touch", wraps=_segments._touch) as touch:
        with _segments.Segment(size) as segment:
            view = memoryview(segment.buffer())
            assert len(view) == size
            assert view[-1] == 0
            view.release()
        with _segments.Segment(4096, populate=False):
            pass
    assert touch.call_count == 1
