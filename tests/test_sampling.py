"""`asyncsync.Sampling`: checked when built, printable, replaceable, hashable; and every
generation method of the client, the fleet and the blocking facades takes it as
``sampling=`` or as flat keywords, sending the same body either way."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

import asyncsync as az
from asyncsync import blocking
from asyncsync.testing import FakeVLLMServer, RecordedRequest

# --------------------------------------------------------------------- the value


def test_sampling_fields_mirror_the_dataclass() -> None:
    """The flat keywords (`SamplingFields`) are exactly `Sampling`'s fields, typed alike."""
    fields = [f.name for f in dataclasses.fields(az.Sampling)]
    assert list(az.SamplingFields.__annotations__) == fields
    assert typing.get_type_hints(az.SamplingFields) == typing.get_type_hints(az.Sampling)
    assert az.SamplingFields.__optional_keys__ == frozenset(fields)


def test_defaults_are_todays() -> None:
    s = az.Sampling()
    assert (s.max_tokens, s.temperature) == (16, 1.0)
    assert all(
        getattr(s, f.name) is None
        for f in dataclasses.fields(s)
        if f.name not in ("max_tokens", "temperature")
    )


#: ``(field, bad value, error type)``: each must be refused naming the field and value.
BAD: list[tuple[str, Any, type[Exception]]] = [
    ("max_tokens", 0, ValueError),
    ("max_tokens", 2.5, TypeError),
    ("max_tokens", True, TypeError),
    ("temperature", -0.1, ValueError),
    ("temperature", math.inf, ValueError),
    ("temperature", "hot", TypeError),
    ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_k", -2, ValueError),
    ("top_k", 1.0, TypeError),
    ("min_p", 1.1, ValueError),
    ("logprobs", -1, ValueError),
    ("logprobs", "3", TypeError),
    ("stop_token_ids", "abc", TypeError),
    ("stop_token_ids", [1, -2], ValueError),
    ("seed", 1.5, TypeError),
    ("ignore_eos", 1, TypeError),
    ("min_tokens", -1, ValueError),
    ("presence_penalty", 2.5, ValueError),
    ("frequency_penalty", -3, ValueError),
    ("repetition_penalty", 0, ValueError),
    ("stop", "", ValueError),
    ("stop", ["end", 3], TypeError),
    ("include_stop_str_in_output", "yes", TypeError),
    ("skip_special_tokens", 0, TypeError),
    ("spaces_between_special_tokens", "no", TypeError),
    ("logit_bias", [1, 2], TypeError),
    ("logit_bias", {"x": 1.0}, TypeError),
    ("allowed_token_ids", [1.5], TypeError),
    ("bad_words", ["ok", ""], ValueError),
    ("truncate_prompt_tokens", 0, ValueError),
    ("extra_args", {1: 2}, TypeError),
    ("cache_salt", "", ValueError),
    ("cache_salt", 3, TypeError),
    ("extra_params", {"n": 2}, ValueError),
    ("extra_params", {"top_p": 0.5}, ValueError),
]


def test_every_field_has_a_bad_value_here() -> None:
    assert {name for name, _, _ in BAD} == {f.name for f in dataclasses.fields(az.Sampling)}


@pytest.mark.parametrize(("field", "value", "error"), BAD)
def test_a_bad_value_is_refused_naming_the_field(
    field: str, value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field) as info:
        az.Sampling(**{field: value})
    if isinstance(value, (int, float)) or (isinstance(value, str) and value):
        assert repr(value) in str(info.value)
    with pytest.raises(error, match=field):  # replace checks alike
        az.Sampling().replace(**{field: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        az.Sampling(max_tokens=4, min_tokens=5)
    assert az.Sampling(max_tokens=None, min_tokens=5).min_tokens == 5


def test_good_values_are_kept_and_containers_frozen() -> None:
    s = az.Sampling(
        max_tokens=None, temperature=0, top_p=1, top_k=-1, min_p=0.0, logprobs=0,
        stop_token_ids=[1, 2], seed=-3, ignore_eos=True, min_tokens=0,
        presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1.2, stop=["a", "b"],
        logit_bias={"5": -1.0, 6: 2}, allowed_token_ids=range(3), bad_words=["x"],
        truncate_prompt_tokens=-1, extra_args={"k": [1]}, cache_salt="salt",
        extra_params={"structured_outputs": {"json": {}}},
    )  # fmt: skip
    assert s.stop_token_ids == (1, 2)
    assert s.stop == ("a", "b")
    assert s.allowed_token_ids == (0, 1, 2)
    assert s.logit_bias == {5: -1.0, 6: 2}
    assert az.Sampling(top_k=0).top_k == 0
    assert az.Sampling(stop="end").stop == "end"
    with pytest.raises(TypeError):
        s.logit_bias[7] = 1.0  # type: ignore[index]  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 0.5  # type: ignore[misc]


def test_repr_lists_only_what_differs_from_the_defaults() -> None:
    assert repr(az.Sampling()) == "Sampling()"
    s = az.Sampling(temperature=0.0, max_tokens=8, logprobs=1)
    assert repr(s) == "Sampling(max_tokens=8, temperature=0.0, logprobs=1)"
    assert repr(az.Sampling(max_tokens=None)) == "Sampling(max_tokens=None)"
    assert repr(az.Sampling(stop_token_ids=[3])) == "Sampling(stop_token_ids=(3,))"


def test_replace_makes_a_checked_copy() -> None:
    s = az.Sampling(max_tokens=8)
    t = s.replace(temperature=0.0, seed=1)
    assert (t.max_tokens, t.temperature, t.seed) == (8, 0.0, 1)
    assert s == az.Sampling(max_tokens=8)  # unchanged
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        s.replace(temprature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        s.replace(top_p=2)


def test_equal_values_are_equal_and_hash_alike() -> None:
    a = az.Sampling(stop_token_ids=[1, 2], logit_bias={3: 1.0}, extra_args={"k": [1]})
    b = az.Sampling(stop_token_ids=(1, 2), logit_bias={3: 1.0}, extra_args={"k": [1]})
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, az.Sampling()}) == 2
    assert a != a.replace(seed=1)
    assert az.Sampling() == az.Sampling(max_tokens=16, temperature=1.0)


# --------------------------------------------------------------------- the methods
PROMPT = [1, 2, 3]
SAMPLING = az.Sampling(max_tokens=3, temperature=0.0, logprobs=1, seed=7, stop_token_ids=[9])
FIELDS: dict[str, Any] = {
    "max_tokens": 3, "temperature": 0.0, "logprobs": 1, "seed": 7, "stop_token_ids": [9]
}  # fmt: skip


class Bodies:
    """The generation bodies a fake received (its ``on_request``), taken in turns."""

    def __init__(self) -> None:
        self.got: list[Any] = []

    def __call__(self, request: RecordedRequest) -> None:
        if request.method == "POST" and "generate" in request.path:
            self.got.append(request.json)

    def take(self) -> list[Any]:
        out, self.got = self.got, []
        return out

    def sent(self) -> list[Any]:
        out = self.take()
        assert out, "nothing was sent"
        assert all(b["sampling_params"]["max_tokens"] == 3 for b in out)
        return out


async def _async_calls(target: Any) -> AsyncIterator[tuple[str, Callable[..., Any]]]:
    """Each generation method of ``target`` (a client or a fleet), as a coroutine
    function of ``(sampling, **fields)``."""

    async def generate(s: Any, **kw: Any) -> Any:
        return await target.generate(PROMPT, s, **kw)

    async def generate_n(s: Any, **kw: Any) -> Any:
        return await target.generate_n(PROMPT, s, n=2, **kw)

    async def generate_batch(s: Any, **kw: Any) -> Any:
        return await target.generate_batch([PROMPT, PROMPT], s, **kw)

    async def stream(s: Any, **kw: Any) -> Any:
        async with target.stream(PROMPT, s, **kw) as st:
            async for _ in st:
                pass
        return st.completion

    for name, call in (
        ("generate", generate),
        ("generate_n", generate_n),
        ("generate_batch", generate_batch),
        ("stream", stream),
    ):
        yield name, call


@pytest.mark.asyncio
@pytest.mark.parametrize("on", ["client", "fleet"])
async def test_sampling_and_keywords_send_the_same_body(on: str) -> None:
    bodies = Bodies()
    async with (
        FakeVLLMServer(on_request=bodies) as fake,
        az.AsyncVLLMClient(fake.url) as client,
        az.Fleet([fake.url]) as fleet,
    ):
        target = client if on == "client" else fleet
        async for name, call in _async_calls(target):
            bodies.take()
            by_value = await call(SAMPLING)
            with_value = bodies.sent()
            by_keywords = await call(None, **FIELDS)
            with_keywords = bodies.sent()
            assert with_value == with_keywords, name
            for body in with_value:
                params = body["sampling_params"]
                assert params["max_tokens"] == 3, name
                assert params["temperature"] == 0.0, name
                assert params["logprobs"] == 1, name
                assert params["stop_token_ids"] == [9], name
                assert params["seed"] == 7, name
            assert type(by_value) is type(by_keywords), name


@pytest.mark.asyncio
async def test_a_field_both_in_sampling_and_as_a_keyword_is_refused() -> None:
    bodies = Bodies()
    async with (
        FakeVLLMServer(on_request=bodies) as fake,
        az.AsyncVLLMClient(fake.url) as client,
        az.Fleet([fake.url]) as fleet,
    ):
        for target in (client, fleet):
            async for name, call in _async_calls(target):
                with pytest.raises(TypeError, match="max_tokens both in sampling="):
                    await call(SAMPLING, max_tokens=4)
                with pytest.raises(TypeError, match="did you mean 'temperature'"):
                    await call(None, temprature=0.0)
                with pytest.raises(TypeError, match=r"must be an asyncsync\.Sampling"):
                    await call({"max_tokens": 3})
                assert not bodies.take(), name
        with pytest.raises(TypeError, match="routing options belong to Fleet"):
            await client.generate(PROMPT, session_id="s")  # type: ignore[call-arg]
        with pytest.raises(ValueError, match="top_p"):
            await fleet.generate(PROMPT, top_p=0)


@pytest.mark.asyncio
async def test_model_and_request_id_are_request_keywords() -> None:
    bodies = Bodies()
    async with (
        FakeVLLMServer(on_request=bodies) as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        await client.generate(PROMPT, SAMPLING, request_id="r-1", model=fake.model)
        (body,) = bodies.sent()
        assert (body["request_id"], body["model"]) == ("r-1", fake.model)
        assert "model" not in body["sampling_params"]
        await client.generate(PROMPT, az.Sampling(extra_params={"min_tokens_x": 1}))
        (body,) = bodies.take()
        assert body["sampling_params"]["min_tokens_x"] == 1


@pytest.fixture
def fake_portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as portal:
        yield portal


def test_the_blocking_facades_take_sampling_and_keywords(fake_portal: BlockingPortal) -> None:
    bodies = Bodies()
    fake = FakeVLLMServer(on_request=bodies)
    fake_portal.call(fake.start)
    try:
        with blocking.VLLMClient(fake.url) as client, blocking.Fleet([fake.url]) as fleet:
            for target in (client, fleet):
                for name, call in _blocking_calls(target):
                    bodies.take()
                    call(SAMPLING)
                    with_value = bodies.sent()
                    call(None, **FIELDS)
                    assert bodies.sent() == with_value, name
                    with pytest.raises(TypeError, match="max_tokens both in sampling="):
                        call(SAMPLING, max_tokens=4)
    finally:
        fake_portal.call(fake.stop)


def _blocking_calls(target: Any) -> list[tuple[str, Callable[..., Any]]]:
    """Each generation method of a blocking ``target``, as a function of
    ``(sampling, **fields)``."""
    return [
        ("generate", lambda s, **kw: target.generate(PROMPT, s, **kw)),
        ("generate_n", lambda s, **kw: target.generate_n(PROMPT, s, n=2, **kw)),
        ("generate_batch", lambda s, **kw: target.generate_batch([PROMPT], s, **kw)),
        ("stream", lambda s, **kw: _drain(target.stream(PROMPT, s, **kw))),
    ]


def _drain(stream: Any) -> Any:
    with stream as s:
        for _ in s:
            pass
    return s.completion
