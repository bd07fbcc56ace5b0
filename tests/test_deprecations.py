"""Every spelling of 0.1 renamed for 0.2 still works for one release, and warns with a
DeprecationWarning naming its replacement (CHANGELOG.md lists them)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync.testing import FakeVLLMServer

PROMPT = [1, 2, 3]


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer() as server:
        yield server


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ServerUnavailable", "ServerUnavailableError"),
        ("UnsupportedVLLM", "UnsupportedVLLMError"),
        ("WeightMismatch", "WeightMismatchError"),
    ],
)
def test_renamed_exceptions_are_the_same_classes(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"asyncsync\.{old} is deprecated.*{new}"):
        alias = getattr(az, old)
    assert alias is getattr(az, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        az.NoSuchName  # noqa: B018 - the module's __getattr__ for unknown names


@pytest.mark.asyncio
async def test_version_methods(fake: FakeVLLMServer) -> None:
    async with az.AsyncVLLMClient(fake.url) as client:
        with pytest.warns(DeprecationWarning, match=r"server_version\(\).*vllm_version\(\)"):
            assert await client.server_version() == await client.vllm_version()
        with pytest.warns(DeprecationWarning, match=r"version\(\).*vllm_version\(refresh=True\)"):
            assert await client.version() == await client.vllm_version(refresh=True)
    async with az.Fleet([fake.url]) as fleet:
        with pytest.warns(DeprecationWarning, match=r"Fleet\.version\(\).*vllm_version\(\)"):
            old = await fleet.version()
        assert old.values_by_url == (await fleet.vllm_version()).values_by_url


@pytest.mark.asyncio
async def test_generate_with_n_returns_the_list_generate_n_returns(fake: FakeVLLMServer) -> None:
    async with az.Fleet([fake.url]) as fleet:
        client = fleet.client(fake.url)
        for where in (client, fleet):
            with pytest.warns(
                DeprecationWarning, match=r"generate\(\.\.\., n=\.\.\.\).*generate_n"
            ):
                old = await where.generate(PROMPT, n=2, max_tokens=3, seed=1)  # type: ignore[call-arg]
            new = await where.generate_n(PROMPT, n=2, max_tokens=3, seed=1)
            assert isinstance(old, list)
            assert [c.token_ids for c in old] == [c.token_ids for c in new]
            with pytest.warns(DeprecationWarning, match="generate_n"):  # n=1: one, as in 0.1
                one = await where.generate(PROMPT, n=1, max_tokens=3)  # type: ignore[call-arg]
            assert isinstance(one, az.Completion)


@pytest.mark.asyncio
async def test_pause_without_a_mode_is_abort(fake: FakeVLLMServer) -> None:
    async with az.Fleet([fake.url]) as fleet:
        with pytest.warns(DeprecationWarning, match=r"pause\(\) without a mode.*pause\('keep'\)"):
            await fleet.pause()
        assert fake.requests_to("/pause")[-1].query["mode"] == "abort"
        await fleet.resume()
        with pytest.warns(DeprecationWarning, match=r"AsyncVLLMClient\.pause\(\) without"):
            await fleet.client(fake.url).pause()


def test_timeouts_none_means_the_defaults() -> None:
    with pytest.warns(DeprecationWarning, match=r"timeouts=None.*the defaults"):
        client = az.AsyncVLLMClient("http://127.0.0.1:1", timeouts=None)  # type: ignore[arg-type]
    assert client.timeouts == az.Timeouts()
    with pytest.warns(DeprecationWarning, match=r"Fleet\(timeouts=None\)"):
        az.Fleet(["http://127.0.0.1:1"], timeouts=None)  # type: ignore[arg-type]


def test_backend_options_as_publisher_keywords_become_the_typed_options() -> None:
    with pytest.warns(DeprecationWarning, match=r"backend=asyncsync\.backends\.Shm\(buffer_bytes"):
        publisher = az.AsyncWeightPublisher(None, rank=1, world_size=2, buffer_bytes=1 << 20)
    assert publisher.options == az.backends.Shm(buffer_bytes=1 << 20)
    with pytest.warns(DeprecationWarning, match=r"AsyncWeightPublisher\(api=\.\.\.\)"):
        publisher = az.AsyncWeightPublisher(None, rank=1, world_size=2, api="callback")
    assert publisher.api == "callback"
    with pytest.raises(TypeError, match=r"unknown option\(s\) master_port; it takes: buffer_bytes"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, master_port=29500)
