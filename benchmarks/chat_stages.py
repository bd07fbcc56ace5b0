"""Where a `ChatSession` turn with a `ChatRenderer` loses to vLLM's own chat endpoint at
32 episodes in flight: a diagnostic beside ``bench_chat.py`` (same server, model, flags
and episodes), not a benchmark with targets.

Cases, interleaved, the median of 3 rounds:

- vLLM's own ``/v1/chat/completions`` (bench_chat's case);
- bare aiohttp posting to ``/inference/v1/generate`` the exact bodies a session sends
  for the episode's two turns (captured from one session episode): the server's cost of
  the session's requests, without the session;
- the same through ``Fleet.generate``: asyncsync's generation path, without chat;
- the session with the renderer (bench_chat's case), its stages timed: admission,
  renders and derenders on the renderer's thread, the generation;
- the same with a renderer that runs every call at once on its thread (no
  ``CALLS_AT_ONCE`` limit, as before 2026-12-05): what taking the calls in turn gives.

Per case: turns per second, the engine's steps per turn and tokens per step (its
``/metrics``), CPU per turn of the server's API process, of its engine, and of this
client. The session's calls on the renderer's thread are also timed in three parts
(reaching its loop and its turn there, on it, back to the caller's), and the
renderer's own rate with nothing else running is measured first. The client's CPU is
split by thread as the kernel counts it (the caller's loop, the renderer's loop, vLLM's
tokenizer pool), and a few calls are timed in CPU on their own thread: validating vLLM's
request model, the derender's detokenization and its tool parser. Prints a table;
writes nothing.

    python benchmarks/chat_stages.py             # the server's OpenMP threads on one core
    ISOLATE=1 python benchmarks/chat_stages.py   # every thread of the server on it
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import bench_chat as bc

import asyncsync as az
from asyncsync._chat import render as _render
from asyncsync._core import encoding as _json
from asyncsync._generation import engine as _engine
from asyncsync._wire.chat import RENDER_ROUTE
from asyncsync.testing import LocalVLLMServer, make_tiny_model

EPISODES = 96
#: episodes in flight (``CONCURRENCY=1`` for the turns' latency, one at a time)
CONCURRENCY = int(os.environ.get("CONCURRENCY", "32"))
#: the timed rounds with every thread of the server on its core (its API process and
#: engine included), so the client's CPU takes nothing from it (bench_chat's
#: "server alone on its core")
ISOLATE = os.environ.get("ISOLATE") == "1"

#: the case whose stages are timed
SESSION = "`ChatSession` + `ChatRenderer`"
#: what this process's threads are, by name
THREADS = {
    "MainThread": "the caller's loop",
    "asyncsync-chat-renderer": "the renderer's loop",
    "ThreadPoolExecutor": "vLLM's renderer pool",
}


#: wall seconds of each timed stage of the session's turns
STAGES: dict[str, list[float]] = defaultdict(list)
#: the generation bodies the session sent (captured)
SENT: list[bytes] = []


def _timed(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await inner(*args, **kwargs)
        finally:
            STAGES[label].append(time.perf_counter() - began)

    setattr(owner, name, timed)


#: CPU seconds of each timed call on its own thread (`_cpu_timed`), and the calls
CPU: dict[str, list[float]] = defaultdict(list)


def _cpu_timed(owner: Any, name: str, label: str) -> None:
    """Time ``owner.name`` (a plain function) in CPU on the thread that runs it, where
    ``owner`` has it (vLLM's internals move between versions: a diagnostic, not a
    contract)."""
    inner = getattr(owner, name, None)
    if inner is None:
        return

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            CPU[label].append(time.thread_time() - began)

    setattr(owner, name, timed)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by thread name
    (the kernel's count, from ``/proc/self/task``; empty where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = (
            thread.name.rsplit("_", 1)[0] if thread.name.startswith("ThreadPool") else thread.name
        )
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def _time_hand_offs() -> None:
    """Each call on the renderer's thread, in three parts: reaching its loop and its turn
    there, on it, and back to the caller's loop."""
    inner = _render.ChatRenderer._there

    async def there(self: _render.ChatRenderer, work: Callable[[], Any]) -> Any:
        await self.start()
        began, marks = time.perf_counter(), {}

        async def timed() -> Any:
            marks["on"] = time.perf_counter()
            try:
                return await work()
            finally:
                marks["off"] = time.perf_counter()

        out = await inner(self, timed)
        STAGES["  reaching the renderer's loop, its turn"].append(marks["on"] - began)
        STAGES["  on the renderer's loop"].append(marks["off"] - marks["on"])
        STAGES["  back to the caller's loop"].append(time.perf_counter() - marks["off"])
        return out

    _render.ChatRenderer._there = there  # type: ignore[method-assign,assignment]


async def renderer_alone(renderer: az.ChatRenderer, body: dict[str, Any]) -> str:
    """The renderer's rate with nothing else in this process: the first turn's render at
    concurrency 1 and 32."""
    out = []
    for concurrency in (1, CONCURRENCY):
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(10):
            await asyncio.gather(*(renderer.render(RENDER_ROUTE, body) for _ in range(concurrency)))
        n = 10 * concurrency
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        out.append(
            f"concurrency {concurrency}: {n / wall:.0f} renders/s, "
            f"{1e3 * cpu / n:.2f} ms of CPU each, {1e3 * wall / 10:.1f} ms a batch"
        )
    return "; ".join(out)


def _capture() -> None:
    inner = _engine.request_body

    def captured(*args: Any, **kwargs: Any) -> bytes:
        body = inner(*args, **kwargs)
        SENT.append(body)
        return body

    _engine.request_body = captured  # type: ignore[assignment]


def bare(http: aiohttp.ClientSession, url: str, bodies: list[bytes]) -> bc.Episode:
    async def episode(_: int) -> None:
        for body in bodies:
            headers = {"Content-Type": "application/json"}
            async with http.post(url + "/inference/v1/generate", data=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()

    return episode


def through_fleet(fleet: az.Fleet, bodies: list[bytes]) -> bc.Episode:
    fields = set(az.Sampling.__dataclass_fields__)
    turns = []
    for raw in bodies:
        body = _json.loads(raw)
        params = {k: v for k, v in body["sampling_params"].items() if k != "n"}
        extra = {k: v for k, v in params.items() if k not in fields} or None
        own = {k: v for k, v in params.items() if k in fields}
        turns.append((body["token_ids"], az.Sampling(**own, extra_params=extra)))

    async def episode(_: int) -> None:
        for prompt, sampling in turns:
            await fleet.generate(prompt, sampling)

    return episode


async def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    server_core = str(cores[-1]) if len(cores) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = await asyncio.to_thread(
            make_tiny_model, Path(tmp) / "chat", seed=0, chat_template=True
        )
        # every request rendered: the episodes are one request repeated (as in bench_chat)
        renderer = az.ChatRenderer(model_dir, *bc.SERVER_FLAGS, cache_size=0)
        async with (
            LocalVLLMServer(
                model_dir,
                tool_call_parser="hermes",
                max_model_len=bc.CONTEXT,
                cpu_cores=server_core,
                log_stats=True,
            ) as server,
            az.Fleet([server.url]) as fleet,
            bc.http_client() as http,
        ):
            assert server.process is not None
            pgid = server.process.pid
            # this client on the other cores (the server's processes keep theirs), set
            # before the renderer's threads start: they inherit it
            os.sched_setaffinity(0, set(cores[:-1]) if len(cores) > 1 else set(cores))
            await renderer.start()

            def probe() -> Awaitable[bc.Counters]:
                return bc.counters(http, server.url, pgid)

            model = await az.ChatSession(fleet).served_model()
            first = {"model": model, "messages": bc.QUESTION, "tools": bc.TOOLS, "temperature": 0}
            alone = await renderer_alone(renderer, first)
            session = bc.session_chat(fleet, renderer, "r")
            # the same renderer's code, every call at once on its thread (no turns)
            all_at_once = az.ChatRenderer(model_dir, *bc.SERVER_FLAGS, cache_size=0)
            all_at_once._at_once = 1 << 30
            await all_at_once.start()
            _capture()
            await session(0)
            bodies = SENT[-2:]
            cases: dict[str, Callable[[int], Awaitable[None]]] = {
                "vLLM `/v1/chat/completions`": bc.vllm_chat(http, server.url, model),
                "bare `/inference/v1/generate`, the session's bodies": bare(
                    http, server.url, bodies
                ),
                "`Fleet.generate`, the same prompts and sampling": through_fleet(fleet, bodies),
                SESSION: session,
                "the same, the renderer's calls all at once": bc.session_chat(
                    fleet, all_at_once, "all"
                ),
            }
            for episode in cases.values():
                await bc.drive(episode, 8, 4, probe)
            for owner, name, label in (
                (_render.ChatRenderer, "render", "render (renderer thread)"),
                (_render.ChatRenderer, "derender", "derender (renderer thread)"),
                (az.Fleet, "generate", "generation"),
            ):
                _timed(owner, name, label)
            _time_hand_offs()
            from vllm.renderers.online_derenderer import OnlineDerenderer

            _cpu_timed(_render.ChatRenderer, "_validated", "validating vLLM's request model")
            _cpu_timed(OnlineDerenderer, "_detokenize_delta", "the derender's detokenization")
            _cpu_timed(OnlineDerenderer, "_parse_and_assemble", "the derender's tool parser")
            runs: dict[str, list[bc.Run]] = {name: [] for name in cases}
            threads: dict[str, dict[str, float]] = {name: defaultdict(float) for name in cases}
            session_stages: list[dict[str, list[float]]] = []
            session_cpu: dict[str, list[float]] = defaultdict(list)
            isolated_core = cores[-1] if ISOLATE and len(cores) > 1 else None
            with bc.server_alone(pgid, isolated_core, set(cores)):
                for _ in range(3):
                    for name, episode in cases.items():
                        STAGES.clear()
                        CPU.clear()
                        before = thread_cpu()
                        runs[name].append(await bc.drive(episode, EPISODES, CONCURRENCY, probe))
                        for thread, seconds in thread_cpu().items():
                            threads[name][thread] += seconds - before.get(thread, 0.0)
                        if name == SESSION:
                            session_stages.append(dict(STAGES))
                            for label, times in CPU.items():
                                session_cpu[label].extend(times)
        await renderer.aclose()
        await all_at_once.aclose()
        os.sched_setaffinity(0, cores)
    report(runs, session_stages)
    report_cpu(threads, session_cpu, rounds=3)
    print(f"\nthe renderer alone in this process: {alone}")


def report_cpu(
    threads: dict[str, dict[str, float]], calls: dict[str, list[float]], *, rounds: int
) -> None:
    """This client's CPU a turn by thread, per case; the session's timed calls."""
    turns = 2 * EPISODES * rounds
    print("\nthis client's CPU a turn by thread (the kernel's count, all rounds):")
    for name, use in threads.items():
        named: dict[str, float] = defaultdict(float)
        for thread, seconds in use.items():
            kind = next((v for k, v in THREADS.items() if thread.startswith(k)), thread)
            named[kind] += seconds
        parts = ", ".join(
            f"{kind} {1e3 * seconds / turns:.2f} ms"
            for kind, seconds in sorted(named.items(), key=lambda kv: -kv[1])
            if seconds * 1e3 / turns >= 0.01
        )
        print(f"  {name}: {parts}")
    print("the session's calls timed in CPU on their own thread: per turn, mean")
    for label, times in calls.items():
        print(f"  {label:34s} {len(times) / turns:5.2f}  {1e6 * statistics.mean(times):7.1f} us")


def report(runs: dict[str, list[bc.Run]], stages: list[dict[str, list[float]]]) -> None:
    turns = 2 * EPISODES
    base = None
    print(f"concurrency {CONCURRENCY}, {EPISODES} two-turn episodes per round, median of 3")
    print("| case | turns/s | vs vLLM's | engine steps / turn | tokens / step "
          "| CPU / turn: API, engine, client |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, rounds in runs.items():
        run = sorted(rounds, key=lambda r: r.wall)[len(rounds) // 2]
        rate = turns / run.wall
        base = base or rate
        s = run.server
        print(
            f"| {name} | {rate:.1f} | {rate / base:.2f}x | {s.steps / turns:.1f} "
            f"| {s.step_tokens / max(s.steps, 1):.0f} | {1e3 * s.api_cpu / turns:.1f}, "
            f"{1e3 * s.engine_cpu / turns:.1f}, {1e3 * run.client_cpu / turns:.1f} ms |"
        )
    print("\nthe session's stages (all rounds): count, mean, p50, max")
    merged: dict[str, list[float]] = defaultdict(list)
    for one in stages:
        for label, times in one.items():
            merged[label].extend(times)
    for label, times in merged.items():
        print(
            f"  {label:28s} {len(times):5d}  {1e3 * statistics.mean(times):7.1f} ms  "
            f"{1e3 * statistics.median(times):7.1f} ms  {1e3 * max(times):7.1f} ms"
        )


if __name__ == "__main__":
    asyncio.run(main())
