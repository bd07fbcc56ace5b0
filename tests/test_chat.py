"""Chat sessions without a server: the prefix rules, request checks, the SSE rendering
of a finished turn and the gateway's OpenAI-shaped errors. The real turns are in
tests/test_chat_vllm.py."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

import asyncsync as az
from asyncsync._chat.chat import _sampling
from asyncsync._chat.gateway import ChatAPI, sse_chunks
from asyncsync._chat.prefix import (
    align_end,
    closing_after,
    first_difference,
    history_mismatch,
    same_message,
    template_closing,
)
from asyncsync._core.completion import Completion
from asyncsync._wire.chat import (
    DERENDER_PROMPT_TAIL,
    check_chat_request,
    derender_body,
    generate_response_of,
)

EOS, NL = 4, 203


def test_first_difference() -> None:
    assert first_difference([1, 2], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_closing_after_an_end_of_sequence_is_what_the_template_puts_after_it() -> None:
    turn = [NL, 60, 61, EOS, NL]  # "\n<tool_call>...<|im_end|>\n" as the template renders it
    assert closing_after([60, 62, EOS], turn, EOS, ()) == [NL]
    # Truncated: the template's whole closing follows, less what was sampled of it.
    assert closing_after([60, 62], turn, None, [EOS, NL]) == [EOS, NL]
    assert closing_after([60, EOS], turn, None, [EOS, NL]) == [NL]


def test_template_closing_is_the_common_suffix_of_a_turn_and_an_empty_turn() -> None:
    assert template_closing([9, 60, 61, EOS, NL], [9, EOS, NL]) == [EOS, NL]
    assert template_closing([1, 2], [3, 4]) == []


def test_align_end_finds_the_last_assistant_turn_in_a_render_that_dropped_thinking() -> None:
    before, think, content, close, user = [1, 2], [70, 71], [80, 81], [EOS, NL], [3, 90, EOS, NL]
    history = before + think + content + close
    full = before + content + close + user + [3, 5, NL]
    end = align_end(history, full)
    assert full[end:] == [*user, 3, 5, NL]


def test_messages_echoed_back_with_other_json_spacing_and_ids_still_match() -> None:
    ours = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"x": 1, "y": [1]}'}}],
    }
    theirs = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "b",
                "type": "function",
                "function": {"name": "f", "arguments": '{"y":[1],"x":1}'},
            }
        ],
    }
    assert same_message(ours, theirs)
    other = json.loads(json.dumps(theirs))
    other["tool_calls"][0]["function"]["arguments"] = '{"x": 2}'
    assert not same_message(ours, other)
    user = {"role": "user", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert same_message(user, parts)
    history = [user, ours]
    assert history_mismatch(history, [parts, theirs, {"role": "tool", "content": "r"}]) is None
    assert history_mismatch(history, [{"role": "user", "content": "edited"}, theirs, user]) == 0
    assert history_mismatch(history, [user, theirs]) == 2  # nothing new


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "model": 7}, "model"),
        ({"messages": [{"role": "user", "content": "x"}], "audio": {}}, "audio"),
        ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "content": "y", "tool_call_id": "nope"},
                ]
            },
            "messages[1].tool_call_id",
        ),
    ],
)
def test_bad_chat_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(az.ChatRequestError) as raised:
        check_chat_request(body)
    assert raised.value.param == param


def test_a_finished_turn_streams_as_openai_chunks() -> None:
    data = {
        "id": "c1", "created": 1, "model": "m", "usage": {"prompt_tokens": 3},
        "choices": [{"finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None,
            "tool_calls": [
                {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }}],
    }  # fmt: skip
    body = sse_chunks(data, usage=True)
    events = [line[6:] for line in body.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[2]["usage"] == {"prompt_tokens": 3}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _completion(ids: list[int], finish: str, stop: Any = None) -> Completion:
    return Completion(
        prompt_token_ids=[1], token_ids=ids, logprobs=[-0.5] * len(ids), top_logprobs=None,
        finish_reason=finish, weight_versions=(), server="s", route="r", latency=0.0,
        stop_reason=stop,
    )  # fmt: skip


def test_derender_gets_the_ids_without_the_one_it_stopped_on() -> None:
    stopped = generate_response_of(_completion([7, 8, EOS], "stop"))["choices"][0]
    assert stopped["token_ids"] == [7, 8]
    assert len(stopped["logprobs"]["content"]) == 2
    # Both vLLM generations' shapes: 0.32 reads token_id, 0.27.1 requires token (its
    # "token_id:N" placeholder, which its derender resolves with the tokenizer).
    entry = stopped["logprobs"]["content"][0]
    assert entry == {"token_id": 7, "token": "token_id:7", "logprob": -0.5, "top_logprobs": []}
    truncated = generate_response_of(_completion([7, 8], "length"))["choices"][0]
    assert truncated["token_ids"] == [7, 8]
    on_string = generate_response_of(_completion([7, 8], "stop", "STOP"))["choices"][0]
    assert on_string["token_ids"] == [7, 8]


def test_derender_gets_the_prompts_tail_and_its_whole_length() -> None:
    """Derender seeds its detokenizer from the prompt's last ids (vLLM reads 7): a long
    conversation's prompt is not re-sent whole on every turn; usage keeps its length."""
    long = replace(_completion([7, 8], "length"), prompt_token_ids=list(range(5000)))
    body = derender_body(long, {"messages": [], "tools": []}, "policy")
    assert body["prompt_token_ids"] == list(range(5000 - DERENDER_PROMPT_TAIL, 5000))
    assert body["prompt_tokens"] == 5000
    assert DERENDER_PROMPT_TAIL >= 7
    short = derender_body(_completion([7], "length"), {"messages": []}, None)
    assert short["prompt_token_ids"] == [1]
    assert "model" not in short


def test_derender_decodes_logprobs_only_when_the_request_asked_for_them() -> None:
    """Derender turns every logprob into OpenAI's shape (a decode per token): sent only
    for a request with ``logprobs``; the session records them from the completion."""
    plain = derender_body(_completion([7, 8], "length"), {"messages": []}, None)
    assert "logprobs" not in plain["generate_response"]["choices"][0]
    asked = derender_body(_completion([7, 8], "length"), {"messages": [], "logprobs": True}, None)
    assert len(asked["generate_response"]["choices"][0]["logprobs"]["content"]) == 2


def test_sampling_keeps_the_servers_parameters_and_fits_max_tokens_to_the_session() -> None:
    params = {
        "temperature": 0.0,
        "max_tokens": 896,
        "n": 1,
        "output_kind": 2,
        "stop": [],
        "logprobs": None,
    }
    out = _sampling(params, None, prompt_len=300, limit=1024)
    assert out == az.Sampling(temperature=0.0, stop=(), logprobs=0, max_tokens=724)
    assert _sampling(params, 8, 300, 1024).max_tokens == 8
    assert _sampling(params, 900, 300, 1024).max_tokens == 724
    assert _sampling({**params, "logprobs": 3}, None, 300, None).logprobs == 3
    # a vLLM parameter Sampling has no field for goes to vLLM as given
    other = _sampling({**params, "structured_outputs": {"json": {}}}, None, 300, None)
    assert other.extra_params == {"structured_outputs": {"json": {}}}


def test_session_arguments_are_checked() -> None:
    fleet = az.Fleet([])
    with pytest.raises(ValueError, match="on_unstable"):
        az.ChatSession(fleet, on_unstable="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session_id"):
        az.ChatSession(fleet, session_id="")
    assert az.ChatSession.of(fleet, "a") is az.ChatSession.of(fleet, "a")


@pytest.mark.asyncio
async def test_the_api_answers_bad_requests_before_any_server_is_asked() -> None:
    async with az.Fleet([]) as fleet:
        api = ChatAPI(lambda sid: az.ChatSession.of(fleet, sid))
        cases = [
            ("POST", "/chat/completions", b"{", 400, None),
            ("POST", "/chat/completions", b'{"messages": [], "n": 1}', 400, "messages"),
            (
                "POST",
                "/chat/completions",
                b'{"messages": [{"role": "user", "content": "x"}], "n": 2}',
                400,
                "n",
            ),
            ("GET", "/chat/completions", b"", 405, None),
            ("POST", "/embeddings", b"{}", 404, None),
        ]
        for method, path, body, status, param in cases:
            answer = await api.handle("s", method, path, {}, body)
            error = json.loads(answer.body)["error"]
            assert answer.status == status, (path, error)
            assert error["param"] == param, (path, error)
            assert set(error) == {"message", "type", "param", "code"}
        assert az.ChatSession.of(fleet, "s").turns == ()


@pytest.mark.asyncio
async def test_fleet_openai_returns_an_async_openai_client() -> None:
    openai = pytest.importorskip("openai")
    async with az.Fleet([]) as fleet:
        client = fleet.openai("e3")
        assert isinstance(client, openai.AsyncOpenAI)
        with pytest.raises(TypeError):
            fleet.openai(3)
        await client.close()
