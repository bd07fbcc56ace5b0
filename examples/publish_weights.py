"""Publish trainer weights into two real vLLM-CPU servers and check what they generate.

Runs on a CPU-only machine (about two minutes, mostly server start-up):

    python examples/publish_weights.py [--servers URL URL]  # running servers (shm backend)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import aiohttp
import torch
from transformers import AutoModelForCausalLM

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy, make_tiny_model

PROMPT = [1, 17, 42, 99, 123, 7]


async def greedy(session: aiohttp.ClientSession, url: str) -> tuple[list[int], object]:
    payload = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    async with session.post(f"{url}/inference/v1/generate", json=payload) as resp:
        choice = (await resp.json())["choices"][0]
    return choice["token_ids"], choice["weight_versions"]


async def main(urls: list[str] | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        servers = []
        if urls is None:
            servers = [
                LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2))
                for i in range(2)
            ]
            await asyncio.gather(*(s.astart() for s in servers))
            urls = [s.url for s in servers]
        try:
            # The "trainer": the same architecture, one optimizer step away.
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)

            async with (
                az.Fleet(urls) as fleet,
                az.AsyncWeightPublisher(fleet) as publisher,
            ):
                report = await publisher.publish(model, version="step-1", pause="keep")
                print(report)
                session = fleet.session
                assert session is not None
                for state in fleet.servers:
                    tokens, versions = await greedy(session, state.url)
                    print(state.url, state.weight_version, tokens, versions)
                    # the server must generate from the new weights: transformers ranks
                    # each of its greedy tokens first (check_greedy holds on any CPU)
                    check_greedy(model, PROMPT, tokens, max_new_tokens=8)

                # Weights that do not fit the served model are refused before any server
                # is touched, every mismatch named; nothing is lost, nobody needs a resync.
                bad = dict(model.named_parameters())
                bad["model.norm.weight"] = torch.ones(127)
                try:
                    await publisher.publish(bad, version="step-2")
                except az.IncompatibleWeightsError as err:
                    print("refused:", err.problems)
                    print("published version is still", publisher.version)
                    assert not any(s.dirty for s in fleet.servers)
                else:
                    raise AssertionError("a weight of the wrong shape was published")
                await publisher.publish(model, version="step-2")
                print(
                    "after a good round:",
                    [(s.url, s.weight_version, s.dirty) for s in fleet.servers],
                )
        finally:
            await asyncio.gather(*(s.astop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", metavar="URL", help="use running servers")
    az.run(main(parser.parse_args().servers))
