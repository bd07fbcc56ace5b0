"""Serving fake servers from a separate process (``python -m asyncsync.testing._fake_cli``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from asyncsync.testing._fake._server import FakeVLLMServer


async def _serve(args: argparse.Namespace) -> None:
    servers = [
        FakeVLLMServer(
            version=args.version,
            backend=None if args.no_backend else "fake",
            delay=args.delay,
            scale_out=not args.no_scale_out,
            tokenizer=not args.no_tokenizer,
            host=args.host,
            port=args.port + i if args.port else 0,
            max_recorded=args.max_recorded,
        )
        for i in range(args.count)
    ]
    for server in servers:
        await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A serving process for benchmarks: what it holds after start-up lives until it
    # exits (frozen out of every collection), and it makes no reference cycles worth
    # collecting often. Parsing a large update_info allocates thousands of lists, and
    # the default gen-0 threshold (700) collects many times per request: these two
    # lines cut the fakes' CPU per bench_fanout round by ~15%.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    print(json.dumps({"urls": [s.url for s in servers]}), flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve ``--count`` fake servers in this process until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m asyncsync.testing._fake_cli")
    parser.add_argument("--count", type=int, default=1, help="servers in this process")
    parser.add_argument("--port", type=int, default=0, help="first port (0: free ports)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--version", default="0.32.0", help="vLLM version to claim")
    parser.add_argument("--no-backend", action="store_true", help="no weight-transfer engine")
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    parser.add_argument(
        "--no-scale-out", action="store_true", help="403 on /inference/v1/generate (vLLM 0.32)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="like --skip-tokenizer-init")
    parser.add_argument(
        "--max-recorded",
        type=int,
        default=10_000,
        help="requests and updates each server keeps (0: none; benchmarks need none)",
    )
    args = parser.parse_args(argv)
    runner_loop: Mapping[str, Any] = {}
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            runner_loop = {"loop_factory": uvloop.new_event_loop}
    with asyncio.Runner(**runner_loop) as runner:
        runner.run(_serve(args))
