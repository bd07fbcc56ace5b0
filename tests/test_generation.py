"""Generation against FakeVLLMServers (vLLM 0.23 and 0.32 shapes) and the pure parsers."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

import asyncsync as az
from asyncsync._wire.control import Call, Malformed
from asyncsync._wire.generation.bodies import (
    parse_answer,
    parse_legacy_logprobs,
    parse_prompt_logprobs,
    parse_spans,
    retokenize,
)
from asyncsync._wire.generation.options import COMPLETIONS_ROUTE, GENERATE_ROUTE
from asyncsync.testing import FakeVLLMServer, Fault
from asyncsync.testing._fake import FakeLM
from tests.waiting import wait_until

PROMPT = [1, 17, 42, 99]
LM = FakeLM()


def expected_greedy(prompt: list[int], n: int, generation: int = 0) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(LM.greedy(ctx, generation))
    return ctx[len(prompt) :]


@pytest_asyncio.fixture
async def fake32() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer() as server:
        yield server


@pytest_asyncio.fixture
async def fake23() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(version="0.23.0") as server:
        yield server


# ---------------------------------------------------------------- every route, both versions
@pytest.mark.parametrize(
    ("version", "kwargs", "route", "source"),
    [
        ("0.32.0", {}, "/inference/v1/generate", "server"),
        ("0.23.0", {}, "/inference/v1/generate", "client"),
        ("0.32.0", {"scale_out": False}, "/v1/completions", "client"),
        ("0.32.0", {"scale_out": False, "tokenizer": False}, "/v1/completions", "client"),
    ],
)
@pytest.mark.asyncio
async def test_greedy_tokens_logprobs_and_versions(
    version: str, kwargs: dict[str, Any], route: str, source: str
) -> None:
    async with (
        FakeVLLMServer(version=version, **kwargs) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        client.weight_version = "v0"  # what a publisher would have recorded
        c = await client.generate(PROMPT, max_tokens=5, temperature=0.0, logprobs=2)
    expected = expected_greedy(PROMPT, 5)
    assert c.token_ids == expected
    assert c.prompt_token_ids == PROMPT
    assert c.route == route
    assert c.server == fake.url
    assert c.finish_reason == "length"
    assert c.logprobs == pytest.approx([math.log(0.5)] * 5)
    assert c.top_logprobs is not None
    for pos, top in enumerate(c.top_logprobs):
        assert next(iter(top)) == expected[pos]  # sampled token first, then the best others
        assert len(top) == 2
    assert c.versions_source == source
    assert [(s.start, s.end) for s in c.weight_versions] == [(0, 5)]
    assert c.version == ("default" if source == "server" else "v0")
    assert c.token_versions == [c.version] * 5
    assert c.latency > 0
    assert not c.retokenized


@pytest.mark.asyncio
async def test_auto_route_falls_back_once_and_remembers(fake32: FakeVLLMServer) -> None:
    fake32.scale_out = False
    async with az.AsyncVLLMClient(fake32.url) as client:
        for _ in range(3):
            c = await client.generate(PROMPT, max_tokens=2, temperature=0.0)
            assert c.route == "/v1/completions"
    assert len(fake32.requests_to("/inference/v1/generate")) == 1  # the 403, then remembered
    assert len(fake32.requests_to("/v1/completions")) == 3
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.ServerError, match="enable-scale-out") as info:
            await client.generate(PROMPT, route="generate")
    assert info.value.status == 403


@pytest.mark.asyncio
async def test_request_body_on_each_route(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        await client.generate(
            PROMPT, max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, logprobs=1,
            stop_token_ids=[7], seed=3, cache_salt="salt", ignore_eos=True,
        )  # fmt: skip
        await client.generate(PROMPT, max_tokens=3, route="completions", logprobs=0)
    gen = fake32.requests_to("/inference/v1/generate")[0].json
    assert gen == {
        "token_ids": PROMPT,
        "sampling_params": {
            "n": 1, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "logprobs": 1, "stop_token_ids": [7], "seed": 3, "ignore_eos": True,
        },
        "cache_salt": "salt",
    }  # fmt: skip
    cmpl = fake32.requests_to("/v1/completions")[0].json
    assert cmpl["prompt"] == PROMPT
    assert cmpl["return_token_ids"] is True
    assert cmpl["return_tokens_as_token_ids"] is True
    assert cmpl["logprobs"] == 0


@pytest.mark.parametrize(
    ("fields", "keywords"),
    [
        ({}, {}),
        ({"max_tokens": 3, "temperature": 0.0, "logprobs": 2, "seed": 7}, {}),
        ({"stop_token_ids": [7, 8], "cache_salt": "s", "min_tokens": 2}, {"model": "m"}),
        ({"top_p": 0.5, "top_k": 3}, {"request_id": "r-1", "timeout": 9.0, "route": "generate"}),
    ],
)
def test_every_option_lands_in_its_field_and_in_the_body(
    fields: dict[str, Any], keywords: dict[str, Any]
) -> None:
    from asyncsync._core import encoding as _json
    from asyncsync._wire.generation.bodies import request_body
    from asyncsync._wire.generation.options import (
        generation_request,
        resolve_sampling,
        send_options,
    )

    chosen = resolve_sampling(None, fields, where="generate")
    assert chosen == az.Sampling(**fields)
    req = generation_request(
        chosen, n=2, request_id=keywords.get("request_id"), model=keywords.get("model")
    )
    send = send_options(timeout=keywords.get("timeout"), route=keywords.get("route", "auto"))
    sampling: dict[str, Any] = {"n": 2, "max_tokens": 16, "temperature": 1.0}
    top: dict[str, Any] = {key: keywords[key] for key in ("model", "request_id") if key in keywords}
    for key, value in fields.items():
        if key == "cache_salt":
            assert req.cache_salt == value
            top[key] = value
        else:
            sampling[key] = value
    assert (send.route, send.timeout) == (keywords.get("route", "auto"), keywords.get("timeout"))
    prompt = [1, 2, 3]
    got = _json.loads(request_body(GENERATE_ROUTE, prompt, req))
    assert got == {"token_ids": prompt, "sampling_params": sampling, **top}
    got = _json.loads(request_body(COMPLETIONS_ROUTE, prompt, req, stream=True))
    assert got == {
        "prompt": prompt, **sampling, "return_token_ids": True,
        "return_tokens_as_token_ids": True, **top, "stream": True,
    }  # fmt: skip


def test_options_are_validated_and_misplaced_ones_named() -> None:
    from asyncsync._wire.generation.options import (
        generation_request,
        resolve_sampling,
        send_options,
    )

    req = generation_request(resolve_sampling(None, {"temperature": 1}, where="generate"))
    assert req.temperature == 1
    assert type(req.temperature) is int  # sent as given
    with pytest.raises(ValueError, match="n must be an int"):
        generation_request(az.Sampling(), n=True)
    with pytest.raises(TypeError, match="max_tokens"):
        resolve_sampling(None, {"max_tokens": [4]}, where="generate")
    with pytest.raises(ValueError, match="max_tokens"):
        resolve_sampling(None, {"max_tokens": 0}, where="generate")
    with pytest.raises(ValueError, match="route must be one of"):
        send_options(route="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'stream' cannot be passed"):
        az.Sampling(extra_params={"stream": True})
    with pytest.raises(TypeError, match="session_id: routing options belong to Fleet"):
        resolve_sampling(None, {"session_id": "s"}, where="generate")
    with pytest.raises(TypeError, match="'max_tokns'; did you mean 'max_tokens'"):
        resolve_sampling(None, {"max_tokns": 3}, where="generate", routed=True)
    with pytest.raises(TypeError, match="'sesion_id'; did you mean 'session_id'"):
        resolve_sampling(None, {"sesion_id": "s"}, where="generate", routed=True)
    send = send_options(session_id="s", min_version="v1")
    assert (send.session_id, send.min_version) == ("s", "v1")


def test_fleet_and_client_take_the_same_generation_options() -> None:
    """A client's generation keywords are exactly a fleet's minus routing, the same
    kind and default each, and both take `Sampling`'s fields as ``**fields``."""
    import inspect

    routing = {"session_id", "session_ids", "min_version", "admission_timeout", "lora"}
    for name in ("generate", "generate_n", "generate_batch", "stream", "score"):
        client_params = inspect.signature(getattr(az.AsyncVLLMClient, name)).parameters
        fleet_params = inspect.signature(getattr(az.Fleet, name)).parameters
        assert set(client_params) == set(fleet_params) - routing, name
        for pname, param in client_params.items():
            assert fleet_params[pname].kind == param.kind, (name, pname)
            assert fleet_params[pname].default == param.default, (name, pname)
            assert fleet_params[pname].annotation == param.annotation, (name, pname)


def test_prompt_checks_name_the_offending_position() -> None:
    from asyncsync._wire.generation.options import check_prompt, check_prompts

    assert check_prompt([0, 5, 511], vocab_size=512) == [0, 5, 511]
    with pytest.raises(ValueError, match=r"ids\[2\] = 512 is outside .*vocab_size=512"):
        check_prompt([0, 5, 512], vocab_size=512)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = -3 is negative"):
        check_prompt([4, -3])
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\] is True, not an int"):
        check_prompt([4, True])
    with pytest.raises(TypeError, match=r"prompt_token_ids\[0\] is '7'"):
        check_prompt(["7"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must not be empty"):
        check_prompt([])
    assert check_prompt((3, 4), vocab_size=5) == [3, 4]  # any sequence, a new list
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids\[0\] = 9 is outside"):
        check_prompts([[1], [9, 1]], vocab_size=8)
    with pytest.raises(TypeError, match=r"prompts\[0\] is a str"):
        check_prompts(["abc"])  # type: ignore[list-item]


@pytest.mark.asyncio
async def test_out_of_vocabulary_prompts_are_refused_before_anything_is_sent(
    fake32: FakeVLLMServer,
) -> None:
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        az.Fleet([fake32.url], vocab_size=0)
    oov = [1, 2, 600]
    async with az.Fleet([fake32.url], vocab_size=512) as fleet:
        client = fleet.client(fake32.url)
        assert client.vocab_size == 512  # clients the fleet builds inherit it
        attempts = [
            fleet.generate(oov, max_tokens=2),
            fleet.generate_batch([[1], oov], max_tokens=2),
            fleet.score(oov),
            client.generate(oov, max_tokens=2),
            client.generate_batch([oov], max_tokens=2),
            client.score(oov),
        ]
        for attempt in attempts:
            with pytest.raises(ValueError, match=r"\[2\] = 600 is outside the model's vocab"):
                await attempt
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            async with fleet.stream(oov, max_tokens=2):
                pass
        assert not fake32.requests_to("/inference/v1/generate")
        assert not fake32.requests_to("/v1/completions")
        ok = await fleet.generate([1, 2, 511], max_tokens=2)
        assert len(ok.token_ids) == 2


@pytest.mark.asyncio
async def test_both_routes_give_identical_token_ids(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        a = await client.generate(PROMPT, max_tokens=8, temperature=1.0, seed=11, logprobs=0)
        b = await client.generate(
            PROMPT, max_tokens=8, temperature=1.0, seed=11, logprobs=0, route="completions"
        )
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs


@pytest.mark.asyncio
async def test_n_samples_and_batch(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        samples = await client.generate_n(PROMPT, n=4, max_tokens=6, seed=5, logprobs=0)
        batch = await client.generate_batch([PROMPT, [3, 4], [9]], max_tokens=2, temperature=0)
    assert [c.index for c in samples] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in samples}) > 1  # sampled, not copies
    assert all(len(c.logprobs or []) == 6 for c in samples)
    assert [b[0].token_ids for b in batch] == [
        expected_greedy(PROMPT, 2),
        expected_greedy([3, 4], 2),
        expected_greedy([9], 2),
    ]


@pytest.mark.asyncio
async def test_stop_token_ends_with_it_included(fake32: FakeVLLMServer) -> None:
    expected = expected_greedy(PROMPT, 6)
    async with az.AsyncVLLMClient(fake32.url) as client:
        c = await client.generate(PROMPT, max_tokens=6, temperature=0, stop_token_ids=[expected[2]])
    assert c.token_ids == expected[:3]
    assert c.finish_reason == "stop"
    assert c.stop_reason == expected[2]


# ---------------------------------------------------------------- fallback: never silent
@pytest.mark.asyncio
async def test_missing_token_ids_without_tokenizer_is_an_error() -> None:
    async with (
        FakeVLLMServer(scale_out=False, return_token_ids=False) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        with pytest.raises(az.GenerationError, match="pass tokenizer=") as info:
            await client.generate(PROMPT, max_tokens=3)
    assert info.value.server == fake.url
    assert info.value.route == "/v1/completions"


class WordTokenizer:
    """Inverts the fake's text ("t<id> " per token)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [int(word[1:]) for word in text.split()]


@pytest.mark.asyncio
async def test_retokenize_fallback_warns_once_per_server_and_is_flagged() -> None:
    async with (
        FakeVLLMServer(scale_out=False, return_token_ids=False) as a,
        FakeVLLMServer(scale_out=False, return_token_ids=False) as b,
        az.Fleet([a.url, b.url], tokenizer=WordTokenizer()) as fleet,
    ):
        with pytest.warns(az.RetokenizedWarning) as record:
            got = await fleet.generate_batch([PROMPT] * 6, max_tokens=3, temperature=0)
    assert sorted({str(w.message).split("/v1")[0] for w in record}) == sorted([a.url, b.url])
    assert len(record) == 2  # once per server
    for (c,) in got:
        assert c.retokenized is True
        assert c.token_ids == expected_greedy(PROMPT, 3)


@pytest.mark.asyncio
async def test_token_id_logprobs_recover_exact_ids_without_retokenizing() -> None:
    """A server that ignores return_token_ids but keys logprobs "token_id:N" still gives
    the exact ids: no tokenizer needed, nothing re-tokenized."""
    async with (
        FakeVLLMServer(scale_out=False, return_token_ids=False) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        c = await client.generate(PROMPT, max_tokens=4, temperature=0, logprobs=0)
    assert c.token_ids == expected_greedy(PROMPT, 4)
    assert c.retokenized is False


def test_retokenize_accepts_common_tokenizer_shapes() -> None:
    class Encoding:
        ids = (4, 5)

    class RustLike:
        def encode(self, text: str) -> Encoding:
            return Encoding()

    assert retokenize(WordTokenizer(), "t1 t2 ") == [1, 2]
    assert retokenize(RustLike(), "x") == [4, 5]
    assert retokenize(lambda text: [len(text)], "abc") == [3]
    with pytest.raises(TypeError):
        retokenize(object(), "x")


# ---------------------------------------------------------------- malformed answers
@pytest.mark.parametrize(
    "body",
    [
        b"<html>oops</html>",
        b'{"choices": "no"}',
        b'{"choices": [{"index": 0, "token_ids": [1, "x"]}]}',
        b'{"choices": [{"index": 0, "token_ids": [1, 2], "weight_versions": '
        b'[{"version": "v", "start": 0, "end": 1}]}]}',
        b'{"choices": [{"index": 0, "token_ids": [1], "logprobs": null}]}',
        b'{"choices": []}',
    ],
)
@pytest.mark.asyncio
async def test_malformed_responses_are_generation_errors_naming_the_server(
    fake32: FakeVLLMServer, body: bytes
) -> None:
    fake32.inject("/inference/v1/generate", Fault.malformed(body, "application/json"))
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.GenerationError) as info:
            await client.generate(PROMPT, max_tokens=1, logprobs=0)
    err = info.value
    assert err.server == fake32.url
    assert err.route == "/inference/v1/generate"
    assert err.status == 200
    assert fake32.url in str(err)


@pytest.mark.asyncio
async def test_http_errors_keep_their_type(fake32: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake32.url) as client:
        raw: Call[None] = Call(
            "generate", "POST", GENERATE_ROUTE, "generate", lambda _d: None, "a completion"
        )
        with pytest.raises(az.ServerError, match="too_short") as info:
            await client._endpoint.request(  # an empty prompt, which the client itself refuses
                raw, b'{"token_ids": [], "sampling_params": {}}'
            )
        assert info.value.status == 400
        with pytest.raises(ValueError, match="must not be empty"):
            await client.generate([])
        with pytest.raises(TypeError):
            await client.generate("hello")  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="n must be"):
            await client.generate_n(PROMPT, n=0)
        fake32.inject("/inference/v1/generate", Fault.hang())
        with pytest.raises(az.ServerTimeout):
            await client.generate(PROMPT, timeout=0.2)


# ---------------------------------------------------------------- abort and keep
@pytest.mark.asyncio
async def test_pause_abort_gives_a_retryable_outcome_with_the_tokens_so_far() -> None:
    async with FakeVLLMServer(token_delay=0.01) as fake, az.Fleet([fake.url]) as fleet:
        task = asyncio.create_task(
            fleet.generate(PROMPT, max_tokens=200, temperature=0, logprobs=0)
        )
        await wait_until(lambda: fake.tokens_generated >= 3)  # mid-generation: 3 of 200
        await fleet.client(fake.url).pause("abort")
        with pytest.raises(az.GenerationAborted) as info:
            await task
        await fleet.client(fake.url).resume()
    err = info.value
    assert err.retryable is True
    assert isinstance(err, az.GenerationError)
    partial = err.completion
    assert partial.aborted
    assert 0 < len(partial.token_ids) < 200
    assert partial.token_ids == expected_greedy(PROMPT, len(partial.token_ids))
    assert len(partial.logprobs or []) == len(partial.token_ids)
    clone = pickle.loads(pickle.dumps(err))
    assert clone.completion.token_ids == partial.token_ids


@pytest.mark.asyncio
async def test_keep_pause_across_an_update_reports_two_spans() -> None:
    # 20 ms a token: the pause lands within the 1.1 s the other 57 tokens take.
    async with FakeVLLMServer(token_delay=0.02) as fake, az.Fleet([fake.url]) as fleet:
        task = asyncio.create_task(fleet.generate(PROMPT, max_tokens=60, temperature=0))
        await wait_until(lambda: fake.tokens_generated >= 3)  # mid-generation: 3 of 60
        await fleet.pause("keep")
        await fleet.start_weight_update()
        await fleet.update_weights({"names": []})
        await fleet.finish_weight_update("v1")
        await fleet.resume()
        c = await task
    spans = c.weight_versions
    assert [s.version for s in spans] == ["default", "v1"]
    assert spans[0].start == 0
    assert spans[0].end == spans[1].start
    assert spans[1].end == 60
    assert all(s.source == "server" for s in spans)
    cut = spans[0].end
    # tokens after the update follow the new weights (generation 1)
    assert c.token_ids[:cut] == expected_greedy(PROMPT, cut)
    ctx = PROMPT + c.token_ids[:cut]
    assert c.token_ids[cut] == LM.greedy(ctx, 1)
    assert c.version is None
    assert c.token_versions[cut - 1 : cut + 1] == ["default", "v1"]


# ---------------------------------------------------------------- score
@pytest.mark.asyncio
async def test_score_matches_the_model_and_position_zero_is_none(fake32: FakeVLLMServer) -> None:
    ids = [1, *expected_greedy([1], 3), 300]
    async with az.AsyncVLLMClient(fake32.url) as client:
        for route in ("generate", "completions"):
            s = await client.score(ids, top_k=2, route=route)  # type: ignore[arg-type]
            assert s.logprobs[0] is None
            want = [LM.logprob(ids[:i], ids[i]) for i in range(1, len(ids))]
            assert s.logprobs[1:] == pytest.approx(want)
            assert s.ranks[1:] == [LM.rank(ids[:i], ids[i]) for i in range(1, len(ids))]
            assert s.top_logprobs[0] is None
            assert all(ids[i] in (s.top_logprobs[i] or {}) for i in range(1, len(ids)))
            assert len(s) == len(ids)


def test_prompt_logprobs_string_and_int_keys_and_missing_token() -> None:
    as_json = [None, {"5": {"logprob": -1.5, "rank": 2}, "9": {"logprob": -0.2, "rank": 1}}]
    as_ints = [None, {5: -1.5, 9: -0.2}]
    for data in (as_json, as_ints):
        lps, tops, _ranks = parse_prompt_logprobs(data, [1, 5])
        assert lps == [None, -1.5]
        assert tops[1] == {5: -1.5, 9: -0.2}
    with pytest.raises(Malformed, match="no entry for the given token 7"):
        parse_prompt_logprobs(as_json, [1, 7])
    with pytest.raises(Malformed):
        parse_prompt_logprobs([None], [1, 2])


@pytest.mark.asyncio
async def test_score_missing_token_raises(fake32: FakeVLLMServer) -> None:
    body = (
        b'{"choices": [{"index": 0, "token_ids": [1]}], '
        b'"prompt_logprobs": [null, {"3": {"logprob": -1.0, "rank": 1}}]}'
    )
    fake32.inject("/inference/v1/generate", Fault.malformed(body, "application/json"))
    async with az.AsyncVLLMClient(fake32.url) as client:
        with pytest.raises(az.GenerationError, match="no entry for the given token 8"):
            await client.score([1, 8])


# ---------------------------------------------------------------- parsers, 0.23 shapes
def test_parse_023_generate_shape() -> None:
    data = {
        "request_id": "r",
        "choices": [
            {
                "index": 0,
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:7",
                            "logprob": -0.5,
                            "bytes": None,
                            "top_logprobs": [
                                {"token": "token_id:7", "logprob": -0.5, "bytes": None},
                                {"token": "token_id:3", "logprob": -1.5, "bytes": None},
                            ],
                        }
                    ]
                },
                "finish_reason": "length",
                "token_ids": [7],
            }
        ],
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    choice = parse_answer(data, GENERATE_ROUTE, 1, 1)[0]
    assert choice.token_ids == [7]
    assert choice.logprobs == [-0.5]
    assert choice.top_logprobs == [{7: -0.5, 3: -1.5}]
    assert choice.weight_versions == ()  # 0.23 reports none: the client's spans go here


def test_parse_legacy_logprobs_by_string_keeps_text_keys() -> None:
    data = {
        "text_offset": [0],
        "token_logprobs": [-0.1],
        "tokens": [" bl"],
        "top_logprobs": [{" bl": -0.1, "5": -2.0}],
    }
    lps, by_id, by_text, named = parse_legacy_logprobs(data, 1)
    assert lps == [-0.1]
    assert by_id is None
    assert by_text == [{" bl": -0.1, "5": -2.0}]
    assert named is None
    parsed = parse_answer(
        {"choices": [{"index": 0, "text": " bl", "token_ids": [346], "logprobs": data}]},
        COMPLETIONS_ROUTE,
        1,
        2,
    )
    assert parsed[0].top_logprobs_text == [{" bl": -0.1, "5": -2.0}]


def test_parse_spans_must_tile_the_output() -> None:
    assert parse_spans(None, 3) is None
    spans = parse_spans(
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3}], 3
    )
    assert spans is not None
    assert [(s.version, len(s)) for s in spans] == [("a", 2), ("b", 1)]
    with pytest.raises(Malformed):
        parse_spans([{"version": "a", "start": 1, "end": 3}], 3)


# ---------------------------------------------------------------- streaming
@pytest.mark.parametrize("version", ["0.32.0", "0.23.0"])
@pytest.mark.asyncio
async def test_stream_deltas_add_up_to_the_completion(version: str) -> None:
    async with FakeVLLMServer(version=version) as fake, az.Fleet([fake.url]) as fleet:
        plain = await fleet.generate(PROMPT, max_tokens=7, temperature=0, logprobs=1)
        async with fleet.stream(PROMPT, max_tokens=7, temperature=0, logprobs=1) as stream:
            deltas = [delta async for delta in stream]
        assert fleet.state(fake.url).outstanding == 0
    assert [t for d in deltas for t in d.token_ids] == plain.token_ids
    assert deltas[-1].finish_reason == "length"
    assert stream.completion.token_ids == plain.token_ids
    assert stream.completion.logprobs == plain.logprobs
    if version == "0.32.0":
        assert deltas[-1].weight_versions == plain.weight_versions


def _event_sizes(n_tokens: int, tokens_per_event: int | tuple[int, ...]) -> list[int]:
    sizes = (tokens_per_event,) if isinstance(tokens_per_event, int) else tokens_per_event
    out: list[int] = []
    while sum(out) < n_tokens:
        out.append(min(sizes[min(len(out), len(sizes) - 1)], n_tokens - sum(out)))
    return out


def _content(c: az.Completion) -> tuple[Any, ...]:
    """Everything the server decides about a sample (not latency or request ids)."""
    return (
        c.index,
        c.prompt_token_ids,
        c.token_ids,
        c.logprobs,
        c.top_logprobs,
        c.top_logprobs_text,
        c.finish_reason,
        c.stop_reason,
        c.weight_versions,
        c.text,
        c.retokenized,
    )


@pytest.mark.parametrize("tokens_per_event", [2, 3, 7, 100, (1, 4, 2)])
@pytest.mark.parametrize("route", ["generate", "completions"])
@pytest.mark.parametrize("version", ["0.32.0", "0.23.0"])
@pytest.mark.asyncio
async def test_stream_accepts_events_of_several_tokens(
    version: str, route: str, tokens_per_event: int | tuple[int, ...]
) -> None:
    """vLLM coalesces the tokens of several engine steps into one event when its HTTP
    writer falls behind (a loaded machine): however the tokens are split, the stream
    assembles the same completions as the one-token-per-event stream and as the plain
    call, and hands each event's tokens over as one delta."""
    kwargs: dict[str, Any] = {
        "n": 2,
        "max_tokens": 7,
        "temperature": 1.0,
        "seed": 5,
        "logprobs": 2,
        "route": route,
    }
    async with FakeVLLMServer(version=version) as fake, az.AsyncVLLMClient(fake.url) as client:
        plain = await client.generate_n(PROMPT, **kwargs)
        async with client.stream(PROMPT, **kwargs) as one_per_event:
            assert {len(d.token_ids) async for d in one_per_event} == {1}
        fake.tokens_per_event = tokens_per_event
        async with client.stream(PROMPT, **kwargs) as stream:
            deltas = [d async for d in stream]
    for index in range(2):
        mine = [d for d in deltas if d.index == index]
        assert [len(d.token_ids) for d in mine] == _event_sizes(7, tokens_per_event)
        assert [d.finish_reason for d in mine][-1] == "length"
        assert all(d.finish_reason is None for d in mine[:-1])
        assert [t for d in mine for t in d.token_ids] == plain[index].token_ids
        assert [x for d in mine for x in d.logprobs or []] == plain[index].logprobs
        assert [x for d in mine for x in d.top_logprobs or []] == plain[index].top_logprobs
        if version == "0.32.0" and route == "generate":
            assert mine[-1].weight_versions == plain[index].weight_versions
            assert [(s.start, s.end) for s in mine[-1].weight_versions] == [(0, 7)]
    assert [_content(c) for c in stream.completions] == [_content(c) for c in plain]
    assert [_content(c) for c in one_per_event.completions] == [_content(c) for c in plain]


@pytest.mark.asyncio
async def test_coalesced_final_event_carries_the_spans_of_two_versions() -> None:
    """A keep-pause and a weight update in the middle of a stream whose events carry
    several tokens: the final event's spans cover tokens that arrived in earlier events
    too, and the assembled completion has both versions, split where the update was."""
    # Slow tokens until the pause is in place (the pause has 200 x 50 ms to land), then
    # fast ones: the test does not depend on how quickly the pause gets there.
    async with (
        FakeVLLMServer(token_delay=0.05, tokens_per_event=3) as fake,
        az.Fleet([fake.url]) as fleet,
        fleet.stream(PROMPT, max_tokens=200, temperature=0) as stream,
    ):
        deltas = [await anext(stream)]
        await fleet.pause("keep")
        fake.token_delay = 0.0
        await fleet.start_weight_update()
        await fleet.update_weights({"names": []})
        await fleet.finish_weight_update("v1")
        await fleet.resume()
        deltas += [d async for d in stream]
    c = stream.completion
    assert [len(d.token_ids) for d in deltas[:-1]] == [3] * (len(deltas) - 1)
    assert len(deltas[-1].token_ids) == 200 - 3 * (len(deltas) - 1)
    assert [t for d in deltas for t in d.token_ids] == c.token_ids
    first, second = c.weight_versions
    assert (first.version, second.version) == ("default", "v1")
    assert first.start == 0
    assert 3 <= first.end == second.start < 200
    assert second.end == 200
    assert deltas[-1].weight_versions == c.weight_versions
    cut = first.end
    assert c.token_ids[:cut] == expected_greedy(PROMPT, cut)
    assert c.token_ids[cut] == LM.greedy(PROMPT + c.token_ids[:cut], 1)


@pytest.mark.parametrize(
    ("version", "route"),
    [("0.32.0", "completions"), ("0.32.0", "generate"), ("0.27.1", "generate")],
)
@pytest.mark.asyncio
async def test_stream_abort_ends_with_every_token_so_far(version: str, route: str) -> None:
    """An abort lands after the last token went out, so its event carries no tokens: vLLM
    0.32 sends it (finish reason "abort"), vLLM < 0.32's generate route skips it and ends
    the stream with [DONE] and no finish reason (CI saw this on 0.27.1). Either way the
    stream raises GenerationAborted with every token so far."""
    async with (
        FakeVLLMServer(version=version, token_delay=0.01) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        got: list[int] = []

        async def consume() -> None:
            stream = client.stream(PROMPT, max_tokens=100, temperature=0, route=route)
            async with stream:
                async for delta in stream:
                    got.extend(delta.token_ids)
                    if len(got) == 5:
                        await client.pause("abort")

        with pytest.raises(az.GenerationAborted) as info:
            await consume()
        await client.resume()
        path = "/v1/completions" if route == "completions" else "/inference/v1/generate"
        assert len(fake.requests_to(path)) == 1
    assert got == info.value.completion.token_ids == expected_greedy(PROMPT, len(got))
    assert 5 <= len(got) < 100
    assert info.value.completion.finish_reason == "abort"


@pytest.mark.parametrize(
    ("version", "ending", "message"),
    [
        # 0.32 always sends a sample's last event: an unfinished one at [DONE] is malformed
        ("0.32.0", b"data: [DONE]\n\n", "ended (data: [DONE]) before every sample finished"),
        # a connection closed without [DONE] broke off, whatever the version
        ("0.27.1", b"", "closed without data: [DONE] before every sample finished"),
    ],
)
@pytest.mark.asyncio
async def test_generate_stream_unfinished_sample_is_an_error(
    version: str, ending: bytes, message: str
) -> None:
    """Only vLLM < 0.32's silent abort reads an unfinished sample as aborted; anything
    else that leaves one unfinished is a GenerationError naming how the stream ended."""
    events = [
        {"request_id": "r", "choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + ending

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    async def version_route(request: web.Request) -> web.Response:
        return web.json_response({"version": version})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", answer)
    app.router.add_get("/version", version_route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with az.AsyncVLLMClient(f"http://127.0.0.1:{port}") as client:

            async def consume() -> None:
                async with client.stream(PROMPT, max_tokens=4, route="generate") as stream:
                    async for _ in stream:
                        pass

            with pytest.raises(az.GenerationError, match=re.escape(message)) as info:
                await consume()
    finally:
        await runner.cleanup()
    assert not isinstance(info.value, az.GenerationAborted)
    assert "unfinished: [0]" in str(info.value)


@pytest.mark.asyncio
async def test_stream_closed_early_releases_the_server(fake32: FakeVLLMServer) -> None:
    fake32.token_delay = 0.01
    async with az.Fleet([fake32.url]) as fleet:
        async with fleet.stream(PROMPT, max_tokens=100, temperature=0) as stream:
            async for _delta in stream:
                break
        assert fleet.state(fake32.url).outstanding == 0
        assert stream.completions == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("version", "path"), [("0.27.1", "/v1/completions"), ("0.32.0", "/inference/v1/generate")]
)
async def test_auto_route_sends_n_samples_where_no_choice_is_lost(version: str, path: str) -> None:
    """vLLM < 0.29's plain generate route loses choices of n > 1 (0.27.1 answered 3 of
    4): route "auto" sends those to /v1/completions, reading the version once; n = 1
    keeps the generate route."""
    async with FakeVLLMServer(version=version) as fake, az.Fleet([fake.url]) as fleet:
        samples = await fleet.generate_n([1, 2, 3], n=4, max_tokens=3, seed=1)
        assert len(samples) == 4
        await fleet.generate([1, 2, 3], max_tokens=3)
        await fleet.generate_n([1, 2, 3], n=2, max_tokens=3)
        paths = [r.path for r in fake.requests]
        assert paths.count("/version") == 1
        # The server's limits are asked once, before its first generation.
        assert paths.count("/v1/models") == paths.count("/collective_rpc") == 1
        generations = [p for p in paths if p not in ("/version", "/v1/models", "/collective_rpc")]
        assert generations == [path, "/inference/v1/generate", path]


# ---------------------------------------------------------------- a plain request and a pause
# The three orders in which a plain (non-streamed) request and pause(mode="abort") can meet
# on vLLM (read in 0.27.1's and 0.32's EngineCore.pause_scheduler: "abort" ends the
# requests the engine holds, with finish reason "abort", and queues new adds until resume),
# each forced here; tests/test_generation_vllm.py meets them on real servers.
PAUSE_ORDERS = [
    ("0.32.0", "generate"),
    ("0.32.0", "completions"),
    ("0.27.1", "completions"),  # what route="auto" takes for n > 1 on 0.27.1
]


@pytest.mark.parametrize(("version", "route"), PAUSE_ORDERS)
@pytest.mark.asyncio
async def test_a_pause_mid_request_aborts_every_unfinished_sample(version: str, route: str) -> None:
    """The pause lands while the engine runs the samples: GenerationAborted carries every
    sample, the aborted ones with their tokens so far and aligned logprobs."""
    async with (
        FakeVLLMServer(version=version, token_delay=0.01) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        task = asyncio.create_task(
            client.generate_n(PROMPT, n=8, max_tokens=200, logprobs=0, route=route)
        )
        await wait_until(lambda: fake.tokens_generated >= 8 * 3)  # mid-generation
        await client.pause("abort")
        with pytest.raises(az.GenerationAborted) as info:
            await task
        await client.resume()
    completions = info.value.completions
    assert len(completions) == 8
    assert all(c.aborted and c.finish_reason == "abort" for c in completions)
    assert all(0 < len(c.token_ids) < 200 for c in completions)
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in completions)


@pytest.mark.parametrize(("version", "route"), PAUSE_ORDERS)
@pytest.mark.asyncio
async def test_a_request_that_reaches_a_paused_server_runs_whole_after_resume(
    version: str, route: str
) -> None:
    """The pause landed before the request reached the engine: the server holds it and
    runs it after resume, so it ends with every token and is not aborted (the real
    server's race in test_abort_pause_is_a_retryable_outcome_with_tokens)."""
    async with (
        FakeVLLMServer(version=version, token_delay=0.001) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        await client.pause("abort")
        task = asyncio.create_task(
            client.generate_n(PROMPT, n=8, max_tokens=20, logprobs=0, route=route)
        )
        path = "/v1/completions" if route == "completions" else "/inference/v1/generate"
        await wait_until(lambda: len(fake.requests_to(path)) == 1)
        await client.is_paused()  # a round trip on the loop: the held request did not end
        assert not task.done()
        assert fake.tokens_generated == 0
        await client.resume()
        completions = await task
    assert [(c.finish_reason, len(c.token_ids)) for c in completions] == [("length", 20)] * 8


@pytest.mark.parametrize(("version", "route"), PAUSE_ORDERS)
@pytest.mark.asyncio
async def test_a_request_that_finished_before_the_pause_is_returned_whole(
    version: str, route: str
) -> None:
    """The pause landed after the last token: nothing was aborted."""
    async with (
        FakeVLLMServer(version=version) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        completions = await client.generate_n(PROMPT, n=8, max_tokens=20, route=route)
        await client.pause("abort")
        await client.resume()
    assert [(c.finish_reason, len(c.token_ids)) for c in completions] == [("length", 20)] * 8
