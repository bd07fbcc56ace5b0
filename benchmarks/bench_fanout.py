"""Control-plane fan-out: one weight-sync control round against N slow servers.

A round is ``start_weight_update`` -> ``update_weights`` (a 1,000-parameter update_info)
-> ``finish_weight_update(version)``. Every server is a FakeVLLMServer that takes
``--delay`` seconds (default 50 ms) per call and runs in other processes than the
client (``--procs`` processes serving all the ports). For N = 1, 32, 256 servers it
measures, side by side in one run:

- asyncsync's ``Fleet`` (one concurrent fan-out per phase, payload encoded once);
- vLLM's own ``HTTPVLLMWeightSyncClient`` (``requests``), one client per server,
  called for each server in turn;
- the same vLLM clients driven from a 32-thread pool.

It also times JSON encoding of the update_info (orjson vs the standard library).

    python benchmarks/bench_fanout.py                       # print the table
    python benchmarks/bench_fanout.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _plots
from _markdown import write_section
from _plots import plot_path

import asyncsync as az
from asyncsync._core import encoding as _json
from asyncsync._core.loop import run as run_loop
from asyncsync._core.loop import uvloop_enabled

BEGIN = "<!-- bench_fanout:begin -->"
END = "<!-- bench_fanout:end -->"


def make_update_info(params: int) -> dict[str, Any]:
    """An update_info shaped like a real one for ``params`` parameters."""
    names = [f"model.layers.{i // 10}.block.{i % 10}.weight" for i in range(params)]
    shapes = [[128 + (i % 7) * 64, 256 + (i % 5) * 128] for i in range(params)]
    sizes = [a * b * 2 for a, b in shapes]
    offsets = [sum(sizes[:i]) for i in range(params)] if params < 5000 else []
    return {
        "names": names,
        "dtype_names": ["bfloat16"] * params,
        "shapes": shapes,
        "offsets": offsets,
        "segment": "/asyncsync-bench-0",
    }


def start_fake_processes(total: int, procs: int, delay: float) -> tuple[list[Any], list[str]]:
    """``procs`` processes serving ``total`` fake servers; returns (processes, urls)
    interleaved across processes so that any prefix spreads over all of them."""
    per = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncsync.testing._fake_cli",
                "--count",
                str(n),
                "--delay",
                str(delay),
                "--uvloop",
                # Servers that keep every request they received (62 KiB bodies, parsed
                # headers) grow their heaps round after round, and their collections
                # then cost more CPU on the cores the client shares: keep none.
                "--max-recorded",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in per
        if n
    ]
    groups: list[list[str]] = []
    for child in children:
        assert child.stdout is not None
        groups.append(json.loads(child.stdout.readline())["urls"])
    urls = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    return children, urls


def stop_processes(children: Sequence[Any]) -> None:
    for child in children:
        child.terminate()
    for child in children:
        child.wait(timeout=30)


def processes_cpu(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (one that
    is gone meanwhile counts nothing)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


async def asyncsync_round(
    urls: Sequence[str], info: dict[str, Any], repeats: int, server_pids: Sequence[int]
) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds, client CPU seconds and the fake servers' CPU seconds per round."""
    times: list[float] = []
    cpu: list[float] = []
    server_cpu: list[float] = []
    async with az.Fleet(urls) as fleet:
        await fleet.vllm_version()  # warm-up: version probe and first connections
        for r in range(repeats + 1):
            t0, c0, s0 = time.perf_counter(), time.process_time(), processes_cpu(server_pids)
            await fleet.start_weight_update()
            await fleet.update_weights(info)
            await fleet.finish_weight_update(f"v{r}")
            if r:  # the first round is a warm-up
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                server_cpu.append(processes_cpu(server_pids) - s0)
    return times, cpu, server_cpu


def vllm_clients(urls: Sequence[str]) -> list[Any] | None:
    try:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    except ImportError:
        return None
    return [HTTPVLLMWeightSyncClient(u) for u in urls]


def vllm_sequential(clients: Sequence[Any], info: dict[str, Any], repeats: int) -> list[float]:
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for c in clients:
            c.start_weight_update()
        for c in clients:
            c.update_weights(info)
        for c in clients:
            c.finish_weight_update(f"s{r}")
        times.append(time.perf_counter() - t0)
    return times


def vllm_threaded(
    clients: Sequence[Any], info: dict[str, Any], repeats: int, threads: int
) -> list[float]:
    times = []
    with ThreadPoolExecutor(threads) as pool:

        def phase(fn: Callable[[Any], None]) -> None:
            list(pool.map(fn, clients))

        for r in range(repeats):
            t0 = time.perf_counter()
            phase(lambda c: c.start_weight_update())
            phase(lambda c: c.update_weights(info))
            phase(lambda c, v=f"t{r}": c.finish_weight_update(v))
            times.append(time.perf_counter() - t0)
    return times


def encode_times(info: dict[str, Any], repeats: int = 200) -> dict[str, float]:
    out: dict[str, float] = {}
    std = json.JSONEncoder(separators=(",", ":"))
    for name, fn in (
        ("stdlib json", lambda: std.encode(info).encode()),
        (_json.BACKEND, lambda: _json.dumps(info)),
    ):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        out[name] = statistics.median(samples)
    out["bytes"] = float(len(_json.dumps(info)))
    return out


def fmt_ms(values: list[float] | None) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values) * 1000:,.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,32,256", help="fleet sizes (comma separated)")
    parser.add_argument("--procs", type=int, default=4, help="processes serving the fakes")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per server call")
    parser.add_argument("--params", type=int, default=1000, help="parameters in update_info")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per cell")
    parser.add_argument("--threads", type=int, default=32, help="thread pool size for vLLM")
    parser.add_argument("--skip-vllm", action="store_true", help="asyncsync only")
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    args = parser.parse_args()

    sizes = [int(s) for s in args.sizes.split(",")]
    info = make_update_info(args.params)
    children, all_urls = start_fake_processes(max(sizes), args.procs, args.delay)
    rows = []
    try:
        for n in sizes:
            urls = all_urls[:n]
            pids = [child.pid for child in children]
            ours, cpu, server_cpu = run_loop(asyncsync_round(urls, info, args.repeats, pids))
            clients = None if args.skip_vllm else vllm_clients(urls)
            seq = thr = None
            if clients is not None:
                # A sequential round at N=256 takes ~40 s: measure it once there.
                seq = vllm_sequential(clients, info, 1 if n > 64 else min(3, args.repeats))
                thr = vllm_threaded(clients, info, min(3, args.repeats), args.threads)
            rows.append((n, ours, cpu, server_cpu, seq, thr))
            print(f"N={n}: asyncsync {fmt_ms(ours)}, vLLM sequential {fmt_ms(seq)}, "
                  f"vLLM {args.threads} threads {fmt_ms(thr)}", flush=True)  # fmt: skip
    finally:
        stop_processes(children)
    enc = encode_times(info)

    base = statistics.median(rows[0][1])
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{'uvloop' if uvloop_enabled() else 'asyncio'} loop, JSON: {_json.BACKEND}. "
        f"One round = start + one update_weights ({args.params:,} parameters, "
        f"{enc['bytes'] / 1024:,.0f} KiB of JSON) + finish; every call takes "
        f"{args.delay * 1000:.0f} ms on the server; servers run in {args.procs} other "
        f"processes. Median of {args.repeats} rounds (asyncsync) after a warm-up round.",
        "",
        "| servers N | asyncsync `Fleet` | x N=1 | asyncsync client CPU | fake servers' CPU | "
        "vLLM `HTTPVLLMWeightSyncClient`, one server after another | "
        f"vLLM clients, {args.threads}-thread pool | asyncsync speed-up vs sequential |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, ours, cpu, server_cpu, seq, thr in rows:
        ratio = statistics.median(ours) / base
        speed = f"{statistics.median(seq) / statistics.median(ours):,.1f}x" if seq else "n/a"
        lines.append(
            f"| {n} | {fmt_ms(ours)} | {ratio:.2f}x | {fmt_ms(cpu)} | {fmt_ms(server_cpu)} | "
            f"{fmt_ms(seq)} | {fmt_ms(thr)} | {speed} |"
        )
    lines += [
        "",
        f"Encoding the update_info once: stdlib `json` {enc['stdlib json'] * 1e3:.2f} ms, "
        f"`{_json.BACKEND}` {enc[_json.BACKEND] * 1e3:.2f} ms. A fleet encodes it once per "
        "round, not once per server. CPU columns: per round (median); the client and the "
        f"fake servers share this machine's {os.cpu_count()} cores.",
    ]
    if args.write is not None:
        plot = plot_path(args.write, "fanout")
        sizes_done = [row[0] for row in rows]
        _plots.lines(
            plot,
            f"One control round against N servers ({args.delay * 1000:.0f} ms per call)",
            sizes_done,
            {
                "asyncsync Fleet": [statistics.median(r[1]) * 1000 for r in rows],
                "vLLM client, servers in turn": [
                    statistics.median(r[4]) * 1000 if r[4] else None for r in rows
                ],
                f"vLLM clients, {args.threads} threads": [
                    statistics.median(r[5]) * 1000 if r[5] else None for r in rows
                ],
            },
            xlabel="servers N",
            ylabel="round time (ms)",
            floor=3 * args.delay * 1000,
            floor_label="3 calls x delay (the floor)",
        )
        lines += ["", f"![Round time against N](img/{plot.name})"]
    lines.append(END)
    block = "\n".join(lines)
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Control-plane fan-out")


if __name__ == "__main__":
    main()
