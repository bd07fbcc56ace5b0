"""Delta rounds on the session's real vLLM-CPU servers (``asyncsync_shm``): after every
round the servers' mirrors hold the trainer's bytes (their checksum, in the server log)
and greedy generation equals transformers'; a repeated delta is refused, never applied."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._transport.delta_codec import combined_digest
from asyncsync.testing import check_greedy
from tests.conftest import VLLMFleet

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
_MIRROR = re.compile(
    r"asyncsync mirror: version '([^']+)', (\d+) tensor\(s\).*checksum ([0-9a-f]{8})"
)


def _trainer(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _sparse_step(model: Any, fraction: float, seed: int) -> None:
    """Change ``fraction`` of every matrix's elements (a low-learning-rate step's shape)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
            flat[idx] += 0.05 * torch.randn(idx.numel(), generator=g)


def mirror_checksums(log: Path) -> dict[str, str]:
    """Version -> the mirror's checksum the server logged at that round's finish."""
    return {m[1]: m[3] for m in _MIRROR.finditer(log.read_text(errors="replace"))}


async def _greedy_everywhere(fleet: az.Fleet, model: Any) -> None:
    for url in fleet.urls:
        async with az.AsyncVLLMClient(url) as client:
            c = await client.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        check_greedy(model, PROMPT, c.token_ids, max_new_tokens=8)


@pytest.mark.usefixtures("original_weights_restored")
async def test_delta_rounds_are_exact_and_send_only_what_changed(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    model = _trainer(tiny_model_dir)
    async with (
        az.Fleet(vllm_fleet.urls) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(buffer_bytes=1 << 20, send_deltas=True)
        ) as pub,
    ):
        _sparse_step(model, 0.5, seed=1)
        first = await pub.publish(model, version="d1", delta=True)
        assert first.delta.kind == "full"
        await _greedy_everywhere(fleet, model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(2, 5):
            if step == 4:  # a real optimizer step: every element moves (dense patches)
                loss = model(input_ids=torch.tensor([PROMPT]), labels=torch.tensor([PROMPT])).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                _sparse_step(model, 0.02, seed=step)
            report = await pub.publish(model, version=f"d{step}", delta=True)
            assert report.delta.kind == "delta"
            assert report.delta.base == f"d{step - 1}"
            if step < 4:
                assert report.bytes < 0.1 * report.delta.full_bytes, report.delta
            await _greedy_everywhere(fleet, model)
            chain = pub._chain
            assert chain is not None
            want = f"{combined_digest(chain.digests[n] for n in sorted(chain.digests)):08x}"
            for server in vllm_fleet.servers:
                assert mirror_checksums(server.log_path)[f"d{step}"] == want, server.url
        # A round outside the chain: the servers drop their mirrors, the record goes.
        await pub.publish(model, version="d-plain")
        assert pub._chain is not None
        assert pub._chain.nbytes == 0
        await _greedy_everywhere(fleet, model)


@pytest.mark.usefixtures("original_weights_restored")
async def test_a_repeated_delta_is_refused_and_never_applied(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    """The trainer's record says the servers hold another version than they do (as
    after a dropped round): the delta is refused at chunk 0 with the chain error, the
    servers keep serving their weights, and the next round is a full one."""
    model = _trainer(tiny_model_dir)
    async with (
        az.Fleet(vllm_fleet.urls) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(send_deltas=True)) as pub,
    ):
        await pub.publish(model, version="r1", delta=True)
        _sparse_step(model, 0.02, seed=7)
        await pub.publish(model, version="r2", delta=True)
        held = {n: t.clone() for n, t in model.state_dict().items()}
        chain = pub._chain
        assert chain is not None
        chain.version = "r1"  # the record goes back: the next delta says base r1
        chain.acked = dict.fromkeys(fleet.urls, "r1")
        _sparse_step(model, 0.02, seed=8)
        with pytest.raises(az.PublishError, match="computed against 'r1'"):
            await pub.publish(model, version="r3", delta=True)
        reference = _trainer(tiny_model_dir)
        reference.load_state_dict(held)
        fleet.mark_clean()  # nothing was loaded: what they serve is r2
        await _greedy_everywhere(fleet, reference)
        report = await pub.publish(model, version="r4", delta=True)
        assert report.delta.kind == "full"
        await _greedy_everywhere(fleet, model)


@pytest.mark.usefixtures("original_weights_restored")
async def test_delta_rounds_over_shm_go_whole_by_default_and_are_exact(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    """``delta=True`` with the default ``Shm()``: every round a plain full round (on the
    trainer's host a copy costs less than the comparison), exact on every server, and
    the servers keep no mirror (none is logged)."""
    model = _trainer(tiny_model_dir)
    async with az.Fleet(vllm_fleet.urls) as fleet, az.AsyncWeightPublisher(fleet) as pub:
        for step in (1, 2):
            _sparse_step(model, 0.02, seed=20 + step)
            report = await pub.publish(model, version=f"w{step}", delta=True)
            assert (report.delta.kind, report.delta.direct) == ("full", tuple(fleet.urls))
            assert report.bytes == report.delta.full_bytes > 0
            await _greedy_everywhere(fleet, model)
    for server in vllm_fleet.servers:
        assert not {"w1", "w2"} & set(mirror_checksums(server.log_path)), server.url
