"""Bad input (issue 12, item 6): each case is a typed error naming what is wrong,
raised before anything is sent, with nothing changed on the servers."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync.backends._shm_pack import ShmBuffers, manifest_of, stream_chunks
from asyncsync.backends.contract import WeightSource
from asyncsync.testing import FakeVLLMServer
from asyncsync.vllm_plugin.shm_engine import CheckpointTable, ShmReceiver
from tests.publish_fakes import shm_fakes

WEIGHTS = {f"model.layers.{i}.w": torch.full((64,), float(i)) for i in range(4)}
ROUND = ("/start_weight_update", "/update_weights", "/finish_weight_update", "/pause")
#: The round's health probe (health, identity): read-only, before anything else is sent
#: (a stream or a factory is checked as the send reads it, after the probe).
PROBE = ("/health", "/server_info")


class Published:
    """A publisher whose fleet (one fake) holds version "v1"."""

    def __init__(self, publisher: az.AsyncWeightPublisher, fake: FakeVLLMServer) -> None:
        self.publisher = publisher
        self.fake = fake
        self.mark = len(fake.requests)

    def sent(self) -> list[str]:
        """Routes the fake received since version "v1" was published, but the round's
        read-only health probe."""
        return [r.path for r in self.fake.requests[self.mark :] if r.path not in PROBE]

    def round_calls(self) -> list[str]:
        return [path for path in self.sent() if path in ROUND]


@pytest_asyncio.fixture
async def published() -> AsyncIterator[Published]:
    async with (
        shm_fakes(1) as fakes,
        az.Fleet([fakes[0].url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=1 << 16)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")
        yield Published(publisher, fakes[0])


def _stream(pairs: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    yield from pairs


def _nan_first() -> dict[str, torch.Tensor]:
    return {"embed.w": torch.tensor([1.0, math.inf]), **WEIGHTS}


BAD_WEIGHTS: dict[str, tuple[Any, type[Exception], str]] = {
    "empty mapping": ({}, ValueError, "no weights to publish"),
    "empty list": ([], ValueError, "no weights to publish"),
    "empty stream": (_stream([]), ValueError, "the source yielded nothing"),
    "duplicate names": (
        [("a", torch.ones(2)), ("a", torch.ones(2))],
        ValueError,
        "'a' appears twice",
    ),
    "duplicate names in a stream": (
        _stream([("a", torch.ones(2)), ("a", torch.ones(2))]),
        ValueError,
        "'a' appears twice|sent twice",
    ),
    "a name that is not a string": ({3: torch.ones(2)}, TypeError, "non-empty strings, got 3"),
    "a value that is not a tensor": ({"a": [1.0]}, TypeError, "'a' is a list, not a torch"),
    "a tensor in a stream that is not one": (
        _stream([("a", 1.0)]),
        TypeError,
        "'a' is a float, not a torch",
    ),
    "not pairs": ([torch.ones(2)], TypeError, r"\(name, tensor\) pairs"),
    "a meta tensor": ({"a": torch.empty(2, device="meta")}, ValueError, "'a' is on the meta"),
    "a sparse tensor": ({"a": torch.ones(2).to_sparse()}, TypeError, "'a' is a torch.sparse"),
    "a dtype the wire cannot carry": (
        {"a": torch.ones(2, dtype=torch.complex64)},
        TypeError,
        "cannot be sent over asyncsync_shm",
    ),
    "a tensor larger than the buffer": (
        {"a": torch.ones(1 << 15)},
        ValueError,
        "'a' needs 131072 bytes",
    ),
    "not weights at all": (42, TypeError, "publish\\(weights=...\\) takes"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
async def test_bad_weights_are_refused_before_anything_is_sent(
    published: Published, case: str
) -> None:
    publisher, fake = published.publisher, published.fake
    weights, error, message = BAD_WEIGHTS[case]
    with pytest.raises(error, match=message):
        await publisher.publish(weights, version="v2")
    assert publisher.version == "v1"
    assert published.sent() == []
    assert fake.weight_version == "v1"
    assert not fake.update_active
    assert not any(s.dirty for s in publisher.fleet.servers)  # type: ignore[union-attr]


BAD_VERSIONS: dict[str, tuple[Any, str]] = {
    "an int": (3, "non-empty string, got 3"),
    "None": (None, "non-empty string, got None"),
    "empty": ("", "non-empty string, got ''"),
    "the current version": ("v1", "'v1' is already published"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BAD_VERSIONS))
async def test_bad_versions_are_refused_before_anything_is_sent(
    published: Published, case: str
) -> None:
    publisher = published.publisher
    version, message = BAD_VERSIONS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        await publisher.publish(WEIGHTS, version=version)
    assert published.sent() == []
    assert publisher.version == "v1"


def _module_with_inf() -> torch.nn.Module:
    module = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        module.weight[1, 2] = -math.inf
    return module


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["mapping", "module", "factory", "stream"])
async def test_non_finite_weights_are_refused_when_asked(published: Published, kind: str) -> None:
    publisher, fake = published.publisher, published.fake
    weights: Any = {
        "mapping": {**WEIGHTS, "model.layers.9.w": torch.tensor([0.0, math.nan])},
        "module": _module_with_inf(),
        "factory": _nan_first,
        "stream": _stream(list(_nan_first().items())),
    }[kind]
    with pytest.raises(ValueError, match=r"holds 1 NaN or Inf value"):
        await publisher.publish(weights, version="v2", check_finite=True)
    assert published.sent() == []
    assert publisher.version == "v1"
    assert fake.weight_version == "v1"


@pytest.mark.asyncio
async def test_finite_check_is_opt_in(
    published: Published,
) -> None:
    publisher = published.publisher
    nan = {**WEIGHTS, "model.layers.0.w": torch.full((64,), math.nan)}
    report = await publisher.publish(nan, version="v2")  # NaN is a value like any other
    assert report.version == "v2"
    report = await publisher.publish(WEIGHTS, version="v3", check_finite=True)
    assert report.version == "v3"


def test_non_contiguous_and_conjugate_views_are_packed_exactly() -> None:
    """What the shm backend accepts beyond plain CPU tensors is sent exactly: strided
    views, transposes and lazily negated tensors are copied element by element."""
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    params = [
        ("t", base.t()),
        ("stride", base[::2, 1::3]),
        ("neg", torch.arange(4.0).neg()),
        ("bf16", base.to(torch.bfloat16).t()),
    ]
    table = CheckpointTable(
        {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params}
    )
    receiver = ShmReceiver(torch.nn.Module(), table)
    loaded: dict[str, torch.Tensor] = {}

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((name, view.clone()) for name, view in weights)

    with ShmBuffers(buffer_bytes=1 << 16) as buffers:
        stream_chunks(
            iter(params),
            manifest_of(WeightSource(params)),
            buffers,
            lambda info: receiver.receive(info, load, None),
        )
    receiver.end_round()
    receiver.close()
    for name, tensor in params:
        assert torch.equal(loaded[name], tensor.contiguous()), name


BAD_URLS = ["localhost:8000", "ftp://host", "http://", "http://a b", "http://h:99999", ""]


@pytest.mark.parametrize("url", BAD_URLS)
def test_invalid_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="base_url must"):
        az.Fleet([url])
    with pytest.raises(ValueError, match="base_url must"):
        az.AsyncVLLMClient(url)


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://host/prefix/v1", "https://host/prefix"),
        ("http://h:1/inference/v1", "http://h:1"),
    ],
)
def test_an_openai_style_v1_url_is_refused_naming_the_root(url: str, root: str) -> None:
    """OpenAI clients take ``.../v1``; asyncsync takes the server's root (it calls
    routes outside /v1): the error says which URL to pass instead."""
    with pytest.raises(ValueError, match=rf"without /.*use '{re.escape(root)}'"):
        az.Fleet([url])
    with pytest.raises(ValueError, match=rf"use '{re.escape(root)}'"):
        az.AsyncVLLMClient(url)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be an int >= 1"),
        ({"max_tokens": -3}, ValueError, "max_tokens must be an int >= 1"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int >= 1"),
    ],
)
async def test_bad_generation_options_send_nothing(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    async with FakeVLLMServer() as fake, az.Fleet([fake.url], vocab_size=100) as fleet:
        with pytest.raises(error, match=message):
            await fleet.generate([1, 2], **options)
        for prompt, text in [([], "must not be empty"), ([1, 100], r"\[1\] = 100 is outside")]:
            with pytest.raises(ValueError, match=text):
                await fleet.generate(prompt, max_tokens=2)
        assert [r.path for r in fake.requests if "generate" in r.path] == []


@pytest.mark.asyncio
async def test_prompt_that_fills_the_context_is_refused_before_sending() -> None:
    async with FakeVLLMServer() as fake:
        async with az.Fleet([fake.url], max_model_len=8) as fleet:
            with pytest.raises(ValueError, match=r"prompt has 8 tokens.*max_model_len=8"):
                await fleet.generate(list(range(8)), max_tokens=2)
            with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt has 9 tokens"):
                await fleet.generate_batch([[1], list(range(9))], max_tokens=2)
            with pytest.raises(ValueError, match="max_model_len=8"):
                await fleet.score(list(range(8)))
            assert (await fleet.generate(list(range(7)), max_tokens=1)).token_ids
        async with az.AsyncVLLMClient(fake.url, max_model_len=4) as client:
            with pytest.raises(ValueError, match="max_model_len=4"):
                await client.generate([1, 2, 3, 4], max_tokens=1)
        generated = [r for r in fake.requests if "generate" in r.path or "completions" in r.path]
        assert len(generated) == 1  # only the prompt that fits was sent
    with pytest.raises(ValueError, match="max_model_len must be an int >= 1"):
        az.Fleet(["http://127.0.0.1:1"], max_model_len=0)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"check_every": 0}, "check_every"),
        ({"check_every": 2.0}, "check_every"),
        ({"cache_size": -1}, "cache_size"),
        ({"cache_size": True}, "cache_size"),
        ({"cache_seconds": 0}, "cache_seconds"),
        ({"cache_seconds": float("inf")}, "cache_seconds"),
        ({"cache_seconds": float("nan")}, "cache_seconds"),
        ({"cache_seconds": "60"}, "cache_seconds"),
    ],
)
def test_bad_chat_renderer_settings_are_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=rf"^{named} must be"):
        az.ChatRenderer("model", **kwargs)
    with pytest.raises(TypeError, match="server_args must be strings"):
        az.ChatRenderer("model", 5)  # type: ignore[arg-type]
