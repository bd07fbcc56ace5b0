"""``publish(..., verify=...)`` and ``publisher.verify`` against fakes (issue 12, item 4).

The fakes load every chunk with asyncsync's real worker-side receiver
(:class:`tests.publish_fakes.ShmWorker`), and their ``/weight_checker`` answers, in
vLLM's exact shape, the SHA-256 of what was loaded: a server that loaded wrong bytes is
found by the trainer's digests. The probe scores the fake's generations with
:class:`~asyncsync.testing._fake.FakeLM`'s closed-form logprobs as the trainer's
"forward pass". Real servers: ``tests/test_verify_vllm.py``.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import torch

import asyncsync as az
from asyncsync import blocking
from asyncsync._publish.verify import VerifyResult, compare_checksums
from asyncsync.testing import FakeVLLMServer, Fault
from asyncsync.testing._fake import FakeLM
from tests.publish_fakes import ShmWorker, receiving_fakes, round_calls

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def model_weights(seed: int) -> dict[str, torch.Tensor]:
    """A decoder layer's checkpoint names (vLLM fuses q/k/v and gate/up)."""
    gen = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(64, 16, generator=gen)}
    for part in QKV:
        out[f"model.layers.0.self_attn.{part}.weight"] = torch.randn(16, 16, generator=gen)
    out["model.layers.0.self_attn.o_proj.weight"] = torch.randn(16, 16, generator=gen)
    for part in GATE_UP:
        out[f"model.layers.0.mlp.{part}.weight"] = torch.randn(32, 16, generator=gen)
    out["model.layers.0.mlp.down_proj.weight"] = torch.randn(16, 32, generator=gen)
    out["model.norm.weight"] = torch.randn(16, generator=gen)
    return out


WEIGHTS = model_weights(0)


class FusingWorker(ShmWorker):
    """Reports what vLLM's ``/weight_checker`` reports for such a model: the fused
    ``qkv_proj`` and ``gate_up_proj`` (their parts concatenated along dim 0) instead of
    their parts."""

    FUSED: ClassVar[dict[str, list[str]]] = {
        "model.layers.0.self_attn.qkv_proj.weight": [
            f"model.layers.0.self_attn.{p}.weight" for p in QKV
        ],
        "model.layers.0.mlp.gate_up_proj.weight": [
            f"model.layers.0.mlp.{p}.weight" for p in GATE_UP
        ],
    }

    def checksums(self) -> dict[str, str]:
        plain = super().checksums()
        parts = {p for members in self.FUSED.values() for p in members}
        out = {name: digest for name, digest in plain.items() if name not in parts}
        for fused, members in self.FUSED.items():
            if all(m in self.loaded for m in members):
                cat = torch.cat([self.loaded[m] for m in members]).contiguous()
                data = b"" if fused in self.unseen else cat.view(-1).view(torch.uint8).numpy()
                out[fused] = hashlib.sha256(data).hexdigest()
        return out


@pytest.mark.asyncio
async def test_checksums_of_what_every_server_loaded_match_the_trainers() -> None:
    # Server b keeps no bytes of its fused q/k/v (as vLLM-CPU's prepacked linear layers).
    workers = [FusingWorker(), FusingWorker(unseen={"model.layers.0.self_attn.qkv_proj.weight"})]
    async with (
        receiving_fakes(workers=workers) as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        report = await publisher.publish(WEIGHTS, version="v1", verify="checksum")
        assert publisher.version == "v1"
        assert set(report.verified) == {a.fake.url, b.fake.url}
        found_a, found_b = report.verified[a.fake.url], report.verified[b.fake.url]
        assert found_a.ok
        assert found_b.ok
        assert found_a.mismatched == found_b.mismatched == []
        # Every parameter a reports is vouched for, the fused ones included.
        assert sorted(found_a.checked) == sorted(a.worker.checksums())
        assert "model.layers.0.self_attn.qkv_proj.weight" in found_a.checked
        assert "model.layers.0.mlp.gate_up_proj.weight" in found_a.checked
        assert found_a.unseen == []
        assert found_b.unseen == ["model.layers.0.self_attn.qkv_proj.weight"]
        assert "verify" in report.seconds
        # The checksums were read after the finish, from every server.
        for server in (a, b):
            assert server.worker.holds(WEIGHTS)
            assert round_calls(server.fake)[-2:] == ["/finish_weight_update", "/reset_prefix_cache"]
            assert len(server.fake.requests_to("/weight_checker")) == 1


@pytest.mark.asyncio
async def test_a_server_that_loaded_wrong_bytes_drops_out_of_the_round_dirty() -> None:
    workers = [FusingWorker(), FusingWorker(corrupt={"model.norm.weight"})]
    async with (
        receiving_fakes(workers=workers) as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")  # not verified: b's error unseen
        report = await publisher.publish(model_weights(1), version="v2", verify="checksum")
        outcome = report.outcomes[b.fake.url]
        assert (outcome.ok, outcome.phase, outcome.dirty) == (False, "verify", True)
        assert isinstance(outcome.error, az.WeightMismatchError)
        assert outcome.error.server == b.fake.url
        assert outcome.error.mismatched == ("model.norm.weight",)
        assert "checksum differs for 1 parameter(s): model.norm.weight" in str(outcome.error)
        assert report.outcomes[a.fake.url].ok
        # Published on a alone; b is dirty (generation avoids it).
        assert publisher.version == fleet.current_version == "v2"
        assert (report.servers, report.lost) == ([a.fake.url], [b.fake.url])
        assert fleet.state(b.fake.url).dirty
        assert fleet.routing_reasons()[b.fake.url] == "dirty"
        assert not fleet.state(a.fake.url).dirty
        assert fleet.state(a.fake.url).weight_version == "v2"
        assert not a.fake.update_active
        assert not b.fake.update_active
        # Repaired (the load is right again): the next verified round clears it.
        b.worker.corrupt.clear()
        report = await publisher.publish(model_weights(2), version="v3", verify="checksum")
        assert report.version == publisher.version == "v3"
        assert all(v.ok for v in report.verified.values())
        assert not any(s.dirty for s in fleet.servers)


@pytest.mark.asyncio
async def test_weights_from_a_factory_are_hashed_as_they_are_packed() -> None:
    produced: list[str] = []

    def factory() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in WEIGHTS.items():
            produced.append(name)
            yield name, tensor

    workers = [FusingWorker(), FusingWorker(corrupt={"model.layers.0.self_attn.k_proj.weight"})]
    async with (
        receiving_fakes(workers=workers) as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            await publisher.publish(factory, version="v1", verify="checksum", min_servers=2)
        assert produced == list(WEIGHTS)  # read once
        error = info.value.outcomes[b.fake.url].error
        assert isinstance(error, az.WeightMismatchError)
        # k_proj is a part of the fused qkv_proj: that is what the server reports.
        assert error.mismatched == ("model.layers.0.self_attn.qkv_proj.weight",)
        assert info.value.outcomes[a.fake.url].ok


def test_tensor_parallel_shards_are_unseen_replicas_compared() -> None:
    """With tensor parallelism every rank reports its shard of a sharded parameter (a
    digest per shard: the trainer cannot vouch for it, even when the shards are equal)
    and the same bytes of a replicated one (compared); data-parallel replicas must all
    match."""
    norm, head, bias = "model.norm.weight", "lm_head.weight", "model.zero.bias"
    expected = {norm: "n" * 64, head: "h" * 64, bias: "z" * 64, "model.extra.weight": "e" * 64}
    checksums = {
        f"dp0:pp0:pcp0:tp0:{norm}": "n" * 64,
        f"dp0:pp0:pcp0:tp1:{norm}": "n" * 64,
        f"dp0:pp0:pcp0:tp0:{head}": "a" * 64,
        f"dp0:pp0:pcp0:tp1:{head}": "b" * 64,
        f"dp0:pp0:pcp0:tp0:{bias}": "0" * 64,  # two equal shards of a zero bias
        f"dp0:pp0:pcp0:tp1:{bias}": "0" * 64,
    }
    result = VerifyResult("http://server")
    compare_checksums(result, checksums, expected)
    assert result.checked == [norm]
    assert result.unseen == [head, bias, "model.extra.weight"]
    assert result.ok
    replicas = {f"dp{i}:pp0:pcp0:tp0:{norm}": "n" * 64 for i in range(2)}
    replicas["dp1:pp0:pcp0:tp0:" + norm] = "x" * 64  # one data-parallel replica differs
    mismatch = VerifyResult("http://server")
    compare_checksums(mismatch, replicas, expected)
    assert mismatch.mismatched == [norm]
    assert mismatch.problems == ["checksum differs for 1 parameter(s): model.norm.weight"]


def fake_lm_probe(vocab_size: int, generation: int) -> Callable[[list[int]], torch.Tensor]:
    """The trainer's "forward pass" for a FakeVLLMServer whose weights were updated
    ``generation`` times: FakeLM's closed-form logprobs at every position."""
    lm = FakeLM(vocab_size)

    def logits(ids: list[int]) -> torch.Tensor:
        out = torch.full((len(ids), vocab_size), lm.rest_logprob, dtype=torch.float64)
        for pos in range(len(ids)):
            out[pos, lm.greedy(ids[: pos + 1], generation)] = math.log(0.5)
        return out

    return logits


@pytest.mark.asyncio
async def test_a_probe_finds_the_server_whose_generations_differ() -> None:
    async with (
        receiving_fakes() as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1", targets=[b.fake.url])
        # a's weights will have been updated once, b's twice: only a matches this probe.
        checks = az.Verify(probe=fake_lm_probe(a.fake.lm.vocab_size, generation=1))
        report = await publisher.publish(WEIGHTS, version="v2", verify=checks, pause="keep")
        error = report.outcomes[b.fake.url].error
        assert isinstance(error, az.WeightMismatchError)
        assert error.mismatched == ()
        assert "probe prompt 0, token 0: the server chose" in str(error)
        assert "where the trainer's greedy choice is" in str(error)
        assert report.outcomes[a.fake.url].ok
        assert report.lost == [b.fake.url]
        assert publisher.version == "v2"
        assert fleet.state(b.fake.url).dirty
        # The probe generated, so the paused servers were resumed first, once.
        for server in (a, b):
            assert not server.fake.paused
            assert [r.path for r in server.fake.requests].count("/resume") == 1
        # Every prompt of the probe was generated and confirmed on a.
        assert a.fake.generation_requests == len(checks.prompts)
        # Standalone, the same probe now confirms a and finds b.
        found = await publisher.verify(WEIGHTS, how=checks)
        assert found[a.fake.url].ok
        assert found[a.fake.url].prompts == len(checks.prompts)
        assert not found[b.fake.url].ok


@pytest.mark.asyncio
async def test_verify_between_rounds_finds_a_server_changed_since() -> None:
    async with (
        receiving_fakes(workers=[FusingWorker(), FusingWorker()]) as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1", verify="checksum")
        found = await publisher.verify(WEIGHTS)
        assert all(v.ok for v in found.values())
        b.worker.loaded["model.layers.0.mlp.down_proj.weight"][3, 4] += 0.5  # bit rot
        found = await publisher.verify(WEIGHTS)
        assert found[a.fake.url].ok
        assert found[b.fake.url].mismatched == ["model.layers.0.mlp.down_proj.weight"]
        assert fleet.state(b.fake.url).dirty
        assert not fleet.state(a.fake.url).dirty


@pytest.mark.asyncio
async def test_verify_marks_every_mismatch_and_reports_every_server_in_one_error() -> None:
    """One server changed since the round, one that cannot be checked (it answers the
    checker with an error), one fine: the mismatched one is marked dirty before the
    error is raised, and that one error carries all three results."""
    workers = [FusingWorker(), FusingWorker(), FusingWorker()]
    async with (
        receiving_fakes(workers=workers) as (fine, changed, unreachable),
        az.Fleet([s.fake.url for s in (fine, changed, unreachable)]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")
        changed.worker.loaded["model.norm.weight"][0] += 1.0
        unreachable.fake.inject("/weight_checker", Fault.error(503, "checker down"))
        with pytest.raises(az.FleetError, match=r"could not check 1 of 3") as info:
            await publisher.verify(WEIGHTS)
        outcomes = info.value.outcomes
        assert outcomes[fine.fake.url].value.ok
        assert outcomes[changed.fake.url].value.mismatched == ["model.norm.weight"]
        assert "checker down" in str(outcomes[unreachable.fake.url].error)
        assert info.value.failed == (unreachable.fake.url,)
        assert [s.dirty for s in fleet.servers] == [False, True, False]


@pytest.mark.asyncio
async def test_impossible_verification_is_refused_before_anything_is_sent() -> None:
    async with (
        receiving_fakes() as (a, b),
        az.Fleet([a.fake.url, b.fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        with pytest.raises(ValueError, match="verify='probe' needs the weights to be the model"):
            await publisher.publish(WEIGHTS, version="v1", verify="probe")
        with pytest.raises(ValueError, match="verify must be None, 'checksum', 'probe'"):
            await publisher.publish(WEIGHTS, version="v1", verify="sha")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs checksum=True, a probe, or both"):
            az.Verify()
        with pytest.raises(ValueError, match="max_tokens"):
            az.Verify(checksum=True, max_tokens=0)
        assert publisher.version is None
        for server in (a, b):
            assert round_calls(server.fake) == []
    async with (
        FakeVLLMServer(version="0.23.0") as old,
        az.Fleet([old.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        with pytest.raises(az.UnsupportedVLLMError, match="/weight_checker"):
            await publisher.publish(WEIGHTS, version="v1", verify="checksum")
        assert old.requests_to("/start_weight_update") == []


def test_the_blocking_facade_keeps_the_signatures() -> None:
    for name in ("publish", "verify"):
        mine = inspect.signature(getattr(blocking.WeightPublisher, name))
        theirs = inspect.signature(getattr(az.AsyncWeightPublisher, name))
        assert mine == theirs, name
    assert "verify" in inspect.signature(blocking.WeightPublisher.publish).parameters
