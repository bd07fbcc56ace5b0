"""Two trainer processes (gloo): only rank 0 talks HTTP; both run the collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncsync.testing import check_greedy, free_port
from tests.conftest import VLLMFleet

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [1, 17, 42, 99, 123, 7]

# Each rank holds half of every tensor (rows split, FSDP-style); iterating the source
# all-gathers the full tensor: a real collective that every rank must join in order.
_RANK = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import torch
    import torch.distributed as dist
    import asyncsync as az

    rank, world, port, model_dir, url, out = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    from transformers import AutoModelForCausalLM
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    shards = {n: p.detach().chunk(world, dim=0)[rank].clone() for n, p in full.named_parameters()}
    meta = [(n, p.dtype, tuple(p.shape)) for n, p in full.named_parameters()]
    del full
    gathered = []

    class ShardedSource:
        def metadata(self):
            return meta

        def __iter__(self):
            for name, dtype, shape in meta:
                parts = [torch.empty_like(shards[name]) for _ in range(world)]
                dist.all_gather(parts, shards[name])  # collective: all ranks, same order
                gathered.append(name)
                yield name, torch.cat(parts, dim=0)

    async def main():
        if rank == 0:
            async with az.Fleet([url]) as fleet:
                async with az.AsyncWeightPublisher(fleet, rank=0, world_size=world) as pub:
                    report = await pub.publish(ShardedSource(), version="multi-rank")
                    return {"bytes": report.bytes, "version": pub.version}
        async with az.AsyncWeightPublisher(None, rank=rank, world_size=world) as pub:
            report = await pub.publish(ShardedSource(), version="multi-rank")
            return {"bytes": report.bytes, "version": pub.version, "params": report.params}

    result = asyncio.run(main())
    result["gathered"] = len(gathered)
    with open(out, "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
    """
)


@pytest.mark.usefixtures("original_weights_restored")
@pytest.mark.timeout(600)
def test_two_rank_trainer_publishes_through_rank_zero(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    url = vllm_fleet.token_only_server.url
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK,
                str(rank),
                "2",
                port,
                str(tiny_model_dir),
                url,
                str(tmp_path / f"rank{rank}.json"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n_params = results[1]["params"]
    assert results[0]["version"] == results[1]["version"] == "multi-rank"
    assert results[0]["gathered"] == results[1]["gathered"] == n_params  # lockstep
    assert results[0]["bytes"] > 0
    assert results[1]["bytes"] == 0  # rank 1 packed and sent nothing

    # The server holds the full (gathered) weights, exactly.
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    import urllib.request

    request = urllib.request.Request(
        f"{url}/inference/v1/generate",
        data=json.dumps(
            {
                "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        body = json.loads(resp.read())
    check_greedy(full, PROMPT, body["choices"][0]["token_ids"], max_new_tokens=8)
    assert body["choices"][0]["weight_versions"][0]["version"] == "multi-rank"
