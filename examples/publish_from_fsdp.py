"""Publish from a sharded trainer: two processes (gloo on CPU), FSDP2's ``fully_shard``.

Each rank holds a shard of every parameter. Publishing iterates the full weights on every
rank (``full_tensor()`` is an all-gather: a collective each rank joins in the same
order); only rank 0 talks to the servers and sends, and all ranks leave ``publish``
together. Rank 0 then checks that the servers generate exactly what the trained model
does. Runs on a CPU-only machine (tiny model, two local vLLM-CPU servers; ~2 minutes):

    python examples/publish_from_fsdp.py [--servers URL URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy, free_port, make_tiny_model

WORLD = 2
PROMPT = [1, 17, 42, 99, 123, 7]


def sharded_model(model_dir: Path) -> Any:
    """The model, FSDP2-sharded over the process group, after one training step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([PROMPT * 4])
    model(input_ids=ids, labels=ids).loss.backward()  # a step the servers do not have yet
    optimizer.step()
    return model


async def publish(rank: int, model: Any, urls: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Publish the full weights from every rank; returns them and rank 0's greedy
    tokens per server."""
    gathered: dict[str, torch.Tensor] = {}
    greedy: dict[str, list[int]] = {}

    def full_weights() -> Any:  # runs in the publisher's worker thread, on every rank
        for name, param in model.named_parameters():
            full = param.full_tensor().detach()  # all-gather: every rank, same order
            gathered[name] = full
            yield name, full

    if rank == 0:
        async with (
            az.Fleet(urls) as fleet,
            az.AsyncWeightPublisher(fleet, rank=0, world_size=WORLD) as publisher,
        ):
            report = await publisher.publish(full_weights, version="fsdp-step-1")
            print(f"rank 0: {report}")
            for url in fleet.urls:
                got = await fleet.client(url).generate(
                    PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True
                )
                print(f"rank 0: {url} generates {got.token_ids} with {got.version}")
                greedy[url] = got.token_ids
    else:
        async with az.AsyncWeightPublisher(None, rank=rank, world_size=WORLD) as publisher:
            report = await publisher.publish(full_weights, version="fsdp-step-1")
            print(f"rank {rank}: iterated {report.params} parameters, sent {report.bytes} bytes")
    return gathered, greedy


def rank_main(rank: int, port: int, model_dir: Path, urls: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        gathered, greedy = asyncio.run(publish(rank, sharded_model(model_dir), urls))
        if rank == 0:  # the servers must generate what the trained (gathered) model does
            reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            reference.load_state_dict(gathered)
            for tokens in greedy.values():  # transformers ranks each token first
                check_greedy(reference, PROMPT, tokens, max_new_tokens=8)
            print(f"rank 0: both servers generate the trained model's greedy tokens {greedy}")
    finally:
        dist.destroy_process_group()


def main(urls: list[str] | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, tokenizer=False)
        servers = []
        if urls is None:
            servers = [
                LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2))
                for i in range(2)
            ]
            print("starting two vLLM-CPU servers (about a minute on 2 cores)...")
            for server in servers:
                server.start()
            urls = [s.url for s in servers]
        try:
            mp.spawn(rank_main, args=(free_port(), model_dir, urls), nprocs=WORLD)
        finally:
            for server in servers:
                server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", metavar="URL", help="use running servers")
    main(parser.parse_args().servers)
