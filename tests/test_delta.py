"""Delta rounds without vLLM: the codec, the worker's mirror and chain rule (the real
receiver, in this process), and the publisher against fakes that load with it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._publish.delta import DeltaChain
from asyncsync._transport.delta_codec import (
    KIND_DENSE,
    KIND_SAME,
    KIND_SPARSE,
    DeltaChainError,
    apply_payload,
    combined_digest,
    digest,
    encode,
)
from asyncsync._transport.wire import ShmUpdateFields
from asyncsync.backends._shm_pack import ShmBuffers, round_fields_of, stream_chunks
from asyncsync.backends.contract import WeightSource
from tests.publish_fakes import ShmWorker, receiving_fakes


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.w": (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(4)
    } | {"model.norm.weight": torch.ones(64, dtype=torch.float32)}


def _step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change: ``fraction`` of each big tensor's elements."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        t = tensor.clone()
        if t.numel() > 64:
            idx = torch.randperm(t.numel(), generator=g)[: int(t.numel() * fraction)]
            t[idx] = (t[idx].float() + 1e-2).to(t.dtype)
        out[name] = t
    return out


# ---------------------------------------------------------------------------- codec
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.bool]
)
def test_a_patch_reproduces_the_new_bits_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    base = (
        torch.rand(10_000, generator=g) > 0.5
        if dtype == torch.bool
        else (torch.randn(10_000, generator=g) * 4).to(dtype)
    )
    new = base.clone()
    idx = torch.randperm(10_000, generator=g)[:150]
    new[idx] = ~new[idx] if dtype == torch.bool else (new[idx] + 1).to(dtype)
    if dtype.is_floating_point:
        new[0], new[1] = float("nan"), -0.0  # bits, not values: NaN and -0.0 travel
    record, mirror = base.clone(), base.clone()
    encoded = encode(record, new)
    assert encoded.kind == KIND_SPARSE
    assert encoded.payload.numel() < 10_000 * new.element_size() / 4
    assert apply_payload("t", mirror, encoded.payload) == digest(new)
    for got in (record, mirror):
        assert got.view(torch.uint8).numpy().tobytes() == new.view(torch.uint8).numpy().tobytes()


def test_unchanged_dense_and_same_payloads() -> None:
    same = encode(torch.ones(100), torch.ones(100))
    assert same.payload is None
    assert same.changed == 0
    marker = encode(torch.ones(100), torch.ones(100), always=True)
    assert marker.kind == KIND_SAME
    apply_payload("t", torch.ones(100), marker.payload)
    new = torch.randn(100)
    dense = encode(torch.zeros(100), new)
    assert dense.kind == KIND_DENSE
    mirror = torch.zeros(100)
    apply_payload("t", mirror, dense.payload)
    assert torch.equal(mirror, new)


def test_a_patch_on_other_bytes_is_refused_naming_the_tensor() -> None:
    new = torch.zeros(100)
    new[3] = 1.0
    encoded = encode(torch.zeros(100), new)
    with pytest.raises(DeltaChainError, match=r"'layer\.w'"):
        apply_payload("layer.w", torch.ones(100), encoded.payload)


# ---------------------------------------------------------------------------- receiver
class _Finishing(ShmWorker):
    """A fake's engine that also finishes the round at its last chunk (the fake has no
    finish hook): the real engine's ``end_round``, which commits the mirror."""

    def __call__(self, info: Any) -> None:
        super().__call__(info)
        if ShmUpdateFields.parse(info[0] if isinstance(info, list) else info).last:
            self.receiver.end_round()


#: The buffers `_send` packed into, closed after each test (a test replays them).
_PACKED: list[ShmBuffers] = []


@pytest.fixture(autouse=True)
def _close_packed_buffers() -> Iterator[None]:
    yield
    while _PACKED:
        _PACKED.pop().close()


def _send(
    chain: DeltaChain, weights: dict[str, torch.Tensor], version: str, kind: str
) -> list[tuple[dict[str, Any], ShmBuffers]]:
    """One round of the chain packed into fresh buffers (kept: a test replays them)."""
    buffers = ShmBuffers(1 << 20)
    _PACKED.append(buffers)
    sent: list[dict[str, Any]] = []
    source = chain.source(WeightSource(weights), version, kind)
    stream_chunks(iter(source), None, buffers, sent.append, fields=round_fields_of(source))
    return [(info, buffers) for info in sent]


def _deliver(worker: _Finishing, chunks: list[tuple[dict[str, Any], ShmBuffers]]) -> None:
    for info, _ in chunks:
        worker(info)


def test_the_chain_rule_refuses_dropped_repeated_and_reordered_deltas() -> None:
    worker = _Finishing()
    chain, w1 = DeltaChain(), _weights()
    _deliver(worker, _send(chain, w1, "v1", "full"))
    chain.committed("v1", ["s"])
    assert worker.receiver.mirror.version == "v1"
    assert worker.holds(w1)
    w2 = _step(w1, 0.02, seed=2)
    d2 = _send(chain, w2, "v2", chain.kind_for(["s"]))
    assert d2[0][0]["delta"]["mode"] == "delta"
    _deliver(worker, d2)
    chain.committed("v2", ["s"])
    assert worker.receiver.mirror.version == "v2"
    assert worker.holds(w2)
    before = {n: t.clone() for n, t in worker.loaded.items()}

    def refused(chunks: list[tuple[dict[str, Any], ShmBuffers]], what: str) -> None:
        with pytest.raises(RuntimeError, match="computed against") as caught:
            _deliver(worker, chunks)
        assert isinstance(caught.value.__cause__, DeltaChainError), what
        assert "nothing was loaded" in str(caught.value)
        assert worker.receiver.mirror.version == "v2", what  # never applied
        assert all(torch.equal(before[n], t) for n, t in worker.loaded.items()), what

    refused(d2, "repeated")  # v2's delta again (base v1)
    w3 = _step(w2, 0.02, seed=3)
    _send(chain, w3, "v3", "delta")  # computed, never delivered: dropped
    chain.committed("v3", ["s"])
    d4 = _send(chain, _step(w3, 0.02, seed=4), "v4", "delta")
    refused(d4, "after a dropped one")  # base v3, the server holds v2
    refused(d2[:1], "out of order")  # an older delta arriving late


def test_a_delta_sends_a_few_percent_and_the_mirror_matches_every_tensor() -> None:
    worker = _Finishing()
    chain, w = DeltaChain(), _weights()
    _deliver(worker, _send(chain, w, "v1", "full"))
    chain.committed("v1", ["s"])
    full_bytes = sum(t.numel() * t.element_size() for t in w.values())
    for step in range(2, 6):
        w = _step(w, 0.01, seed=step)
        chunks = _send(chain, w, f"v{step}", "delta")
        sent = sum(shape[0] for info, _ in chunks for shape in info["shapes"])
        assert 0 < sent < 0.05 * full_bytes
        _deliver(worker, chunks)
        chain.committed(f"v{step}", ["s"])
        mirror = worker.receiver.mirror
        assert mirror.version == f"v{step}"
        assert worker.holds(w)
        assert {n: digest(t) for n, t in mirror.tensors.items()} == chain.digests
        assert combined_digest(digest(w[n]) for n in sorted(w)) == combined_digest(
            mirror.digests[n] for n in sorted(mirror.digests)
        )


# ---------------------------------------------------------------------------- publisher


@pytest.mark.asyncio
async def test_publish_delta_full_first_then_patches_and_full_again_off_chain() -> None:
    workers = [_Finishing(), _Finishing()]
    async with receiving_fakes(workers=workers) as servers:
        urls = [s.fake.url for s in servers]
        async with (
            az.Fleet(urls) as fleet,
            az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(send_deltas=True)) as publisher,
        ):
            w = _weights()
            first = await publisher.publish(w, version="v1", delta=True)
            assert first.delta.kind == "full"
            assert first.delta.direct == ()
            for step in (2, 3):
                w = _step(w, 0.01, seed=step)
                report = await publisher.publish(w, version=f"v{step}", delta=True)
                assert report.delta.kind == "delta"
                assert report.delta.base == f"v{step - 1}"
                assert report.bytes < 0.05 * report.delta.full_bytes
                assert 0 < report.delta.changed_fraction < 0.05
                assert all(x.worker.holds(w) for x in servers)
            # a server off the chain (another round reached only the other one)
            w = _step(w, 0.01, seed=4)
            await publisher.publish(w, version="v4", delta=True, targets=urls[:1])
            w = _step(w, 0.01, seed=5)
            report = await publisher.publish(w, version="v5", delta=True)
            assert report.delta.kind == "full"  # urls[1] holds v3: the chain rule
            assert all(x.worker.holds(w) for x in servers)
            # a round outside the chain drops the record (and the servers' mirrors)
            await publisher.publish(w, version="v6")
            assert publisher._chain is not None
            assert publisher._chain.nbytes == 0
            assert all(x.worker.receiver.mirror.nbytes == 0 for x in servers)


@pytest.mark.asyncio
async def test_shm_takes_delta_rounds_whole_unless_told_to_send_deltas() -> None:
    """On the trainer's host a copy of the model costs less than comparing it with the
    last version: ``delta=True`` over shm is a plain full round, reported as one, and
    neither side keeps a record of it."""
    workers = [_Finishing(), _Finishing()]
    async with receiving_fakes(workers=workers) as servers:
        urls = [s.fake.url for s in servers]
        async with az.Fleet(urls) as fleet, az.AsyncWeightPublisher(fleet) as publisher:
            w = _weights()
            for step in (1, 2, 3):
                report = await publisher.publish(w, version=f"v{step}", delta=True)
                stats = report.delta
                assert (stats.kind, stats.base, stats.direct) == ("full", None, tuple(urls))
                assert stats.changed_fraction == 1.0
                size = sum(t.numel() * t.element_size() for t in w.values())
                assert report.bytes == stats.full_bytes == size
                assert stats.tensors == len(w)
                assert all(x.worker.holds(w) for x in servers)
                assert all(x.worker.receiver.mirror.nbytes == 0 for x in servers)
                w = _step(w, 0.01, seed=step)
            assert publisher._chain is None  # never made: no snapshot on the trainer
    with pytest.raises(ValueError, match="send_deltas=True packs patches"):
        az.backends.Shm(zero_copy=True, send_deltas=True)
    with pytest.raises(TypeError, match="send_deltas must be True or False, got 'yes'"):
        az.backends.Shm(send_deltas="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 4099])
@pytest.mark.parametrize("offset", [0, 1])
def test_changed_positions_are_every_differing_element_in_order(
    dtype: torch.dtype, numel: int, offset: int
) -> None:
    """8 bytes at a time, then inside the words that differ: the same positions as an
    element-by-element compare, for every element size, a tail shorter than a word and
    a view whose storage is not 8-byte aligned."""
    from asyncsync._transport.delta_codec import _as_ints, changed_positions

    g = torch.Generator().manual_seed(numel)
    base = (torch.rand(numel + offset, generator=g) * 100).to(dtype)
    old = base[offset:]  # a view into a larger storage: not aligned for offset 1
    new = old.clone()
    flat = new.view(-1)
    picks = torch.randperm(numel, generator=g)[: max(numel // 10, min(numel, 3))]
    flat[picks] = (flat[picks].to(torch.float64) + 1).to(dtype)
    if numel:
        flat[-1] = (flat[-1].to(torch.float64) + 2).to(dtype)  # the tail changes too
    a, b = _as_ints(old), _as_ints(new)
    expected = torch.ne(a, b).nonzero().reshape(-1).numpy()
    assert changed_positions(a, b).tolist() == expected.tolist()
    assert changed_positions(a, a.clone()).tolist() == []
