"""Every spelling renamed for 0.2 still works for one release, and warns with a
DeprecationWarning naming its replacement; the shims of 0.1 removed in 0.2 fail with
an error naming theirs (CHANGELOG.md lists both)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

import asyncsync as az
import asyncsync.blocking
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
        ("Outcome", "CallOutcome"),
        ("Verification", "VerifyResult"),
    ],
)
def test_renamed_names_are_the_same_objects(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"asyncsync\.{old} is deprecated.*{new}"):
        alias = getattr(az, old)
    assert alias is getattr(az, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        az.NoSuchName  # noqa: B018 - the module's __getattr__ for unknown names


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


class _Group:
    """What `Fleet.from_ray` reads of an `asyncsync.ray.ServerGroup`."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.hosts = urls, ["here"] * len(urls)


@pytest.mark.asyncio
async def test_awaiting_from_ray_is_the_unopened_fleet(fake: FakeVLLMServer) -> None:
    with pytest.warns(DeprecationWarning, match=r"await Fleet\.from_ray.*async with Fleet"):
        fleet = await az.Fleet.from_ray(_Group([fake.url]))  # type: ignore[misc]
    assert isinstance(fleet, az.Fleet)
    assert "state=unopened" in repr(fleet)
    async with fleet:
        assert fleet.urls == (fake.url,)
        assert fleet.state(fake.url).host == "here"


@pytest.mark.asyncio
async def test_mark_dirty_with_dirty_false_is_mark_clean(fake: FakeVLLMServer) -> None:
    async with az.Fleet([fake.url]) as fleet:
        fleet.mark_dirty([fake.url])
        assert fleet.state(fake.url).dirty
        with pytest.warns(DeprecationWarning, match=r"dirty=False\).*Fleet\.mark_clean\(urls\)"):
            fleet.mark_dirty([fake.url], dirty=False)
        assert not fleet.state(fake.url).dirty
        with pytest.warns(DeprecationWarning, match=r"dirty=True\).*Fleet\.mark_dirty\(urls\)"):
            fleet.mark_dirty([fake.url], dirty=True)
        assert fleet.state(fake.url).dirty
        fleet.mark_clean([fake.url])
        assert not fleet.state(fake.url).dirty


def test_publisher_backend_name_is_vllm_backend() -> None:
    publisher = az.AsyncWeightPublisher(None, rank=1, world_size=2)
    assert publisher.backend == "shm"
    assert publisher.vllm_backend == "asyncsync_shm"
    with pytest.warns(DeprecationWarning, match=r"backend_name is deprecated.*\.vllm_backend"):
        assert publisher.backend_name == "asyncsync_shm"


def test_blocking_publisher_backend_name_is_vllm_backend() -> None:
    publisher = asyncsync.blocking.WeightPublisher(None, rank=1, world_size=2)
    try:
        assert publisher.vllm_backend == "asyncsync_shm"
        with pytest.warns(DeprecationWarning, match=r"WeightPublisher\.vllm_backend"):
            assert publisher.backend_name == "asyncsync_shm"
        with pytest.raises(TypeError, match=r"backend=asyncsync\.backends\.Shm\(zero_copy"):
            asyncsync.blocking.WeightPublisher(None, rank=1, world_size=2, zero_copy=True)  # type: ignore[call-arg]
    finally:
        publisher.close()


def test_publish_report_target_is_into() -> None:
    report = az.PublishReport("v1", [], 0, 0, 0, {}, into="draft")
    with pytest.warns(DeprecationWarning, match=r"PublishReport\.target.*PublishReport\.into"):
        assert report.target == "draft"


@pytest.mark.asyncio
async def test_publish_target_keyword_is_into(fake: FakeVLLMServer) -> None:
    """``target=`` still reaches the round as ``into=`` (here a draft round, refused
    before anything is sent: the fake has no ``/server_info``), and warns."""
    async with (
        az.Fleet([fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        weights = {"w": torch.ones(4)}
        with (
            pytest.warns(DeprecationWarning, match=r"publish\(\.\.\., target=\.\.\.\).*into="),
            pytest.raises(az.ProtocolError, match="/server_info"),  # a draft round's check
        ):
            await publisher.publish(weights, version="d1", target="draft")
        with (
            pytest.warns(DeprecationWarning, match="into="),
            pytest.raises(TypeError, match="pass into= only"),
        ):
            await publisher.publish(weights, version="d1", into="draft", target="main")
        assert not any(r.path.endswith("weight_update") for r in fake.requests)


# ---------------------------------------------------------------- removed in 0.2.0
@pytest.mark.asyncio
async def test_generate_with_n_names_generate_n(fake: FakeVLLMServer) -> None:
    async with az.Fleet([fake.url]) as fleet:
        for where, owner in ((fleet.client(fake.url), "AsyncVLLMClient"), (fleet, "Fleet")):
            with pytest.raises(TypeError, match=rf"takes no n=.*{owner}\.generate_n\(prompt, n="):
                await where.generate(PROMPT, n=2, max_tokens=3)  # type: ignore[call-arg]
        assert not fake.requests_to("/inference/v1/generate")
        assert not fake.requests_to("/v1/completions")


@pytest.mark.asyncio
async def test_the_version_methods_are_gone(fake: FakeVLLMServer) -> None:
    async with az.Fleet([fake.url]) as fleet:
        client = fleet.client(fake.url)
        for gone in ("version", "server_version"):
            assert not hasattr(client, gone)
        assert not hasattr(fleet, "version")
        versions = await fleet.vllm_version()
        assert versions.values_by_url == {fake.url: await client.vllm_version(refresh=True)}
    for cls in (az.blocking.VLLMClient, az.blocking.Fleet):
        assert not hasattr(cls, "version")
    assert not hasattr(az.blocking.VLLMClient, "server_version")


def test_backend_options_as_publisher_keywords_name_the_typed_options() -> None:
    typed = r"backend=asyncsync\.backends\.Shm\(buffer_bytes=\.\.\.\)"
    with pytest.raises(TypeError, match=rf"buffer_bytes=\.\.\.\) was removed.*{typed}"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, buffer_bytes=1 << 20)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"AsyncWeightPublisher\(api=\.\.\.\) was removed"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, api="callback")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unknown option\(s\) master_port; it takes: buffer_bytes"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, master_port=29500)  # type: ignore[call-arg]
