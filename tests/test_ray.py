"""``asyncsync.ray`` without a cluster: the extra is optional and imported lazily, and
every bad argument is refused with an error that says what to do, before anything is
launched. (Real servers on a real Ray cluster: tests/test_ray_vllm.py.) The first two
tests run without Ray installed too (``nox -s unit`` does not install the extra), and so
do those of `Fleet.from_ray`, with stand-in actors answering ``server_info``."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync.testing import FakeVLLMServer


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_import_asyncsync_never_imports_ray() -> None:
    done = run("""
        import sys
        import asyncsync, asyncsync.fleet, asyncsync.publisher, asyncsync.backends.auto
        assert "ray" not in sys.modules, "asyncsync imported ray"
    """)
    assert done.returncode == 0, done.stderr


def test_without_the_extra_the_import_error_names_it() -> None:
    done = run("""
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        try:
            import asyncsync.ray
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("imported")
    """)
    assert done.returncode == 0, done.stderr
    assert "pip install -e '.[ray]' in asyncsync's clone" in done.stdout


def test_launch_before_ray_init_says_to_call_it(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    done = run(f"""
        import asyncsync.ray
        try:
            asyncsync.ray.launch_servers({str(tmp_path)!r}, num_servers=1)
        except asyncsync.ray.RayNotInitializedError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "call ray.init() first" in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_servers": 0}, ValueError, "num_servers must be an int >= 1, got 0"),
        ({"num_servers": 1.5}, ValueError, "num_servers must be an int >= 1"),
        ({"num_servers": 2, "placement": "TIGHT"}, ValueError, "placement must be one of PACK"),
        ({"num_servers": 2, "bundle_indices": [0, 1]}, ValueError, "needs your own placement"),
        ({"num_servers": 2, "num_cpus": 0}, ValueError, "needs resources"),
        ({"num_servers": 2, "num_cpus": -1}, ValueError, "num_cpus must be >= 0"),
        ({"num_servers": 2, "cpu_cores": ["0"]}, ValueError, "one core set per server"),
        ({"num_servers": 1, "startup_timeout": 0}, ValueError, "startup_timeout must be"),
        ({"num_servers": 1, "gpu_ids": [0]}, TypeError, "unknown server option.*gpu_ids"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    pytest.importorskip("ray")
    import asyncsync.ray as azray

    with pytest.raises(error, match=match):
        azray.launch_servers(tmp_path, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------- Fleet.from_ray, with stand-in actors
class _Remote:
    """A stand-in for a Ray actor method: ``.remote()`` is awaitable, as Ray's refs are."""

    def __init__(self, answer: dict[str, str], delay: float = 0.0) -> None:
        self.answer, self.delay = answer, delay

    async def _call(self) -> dict[str, str]:
        await asyncio.sleep(self.delay)
        return self.answer

    def remote(self) -> Awaitable[dict[str, str]]:
        return self._call()


class _Actor:
    """A stand-in for a server actor's handle (asyncsync.ray's ``server_info``)."""

    def __init__(self, url: str, host: str, delay: float = 0.0) -> None:
        self.server_info = _Remote({"url": url, "host": host}, delay)


@dataclass
class _Group:
    """A stand-in for `asyncsync.ray.ServerGroup`: what from_ray reads of it."""

    urls: tuple[str, ...]
    hosts: tuple[str, ...]


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeVLLMServer()) for _ in range(2)]


@pytest.mark.asyncio
async def test_from_ray_opens_the_fleet_over_the_actors_and_closes_it(
    fakes: list[FakeVLLMServer],
) -> None:
    actors = (_Actor(f.url, f"host-{i}") for i, f in enumerate(fakes))  # one-shot: listed
    async with az.Fleet.from_ray(actors, timeout=5) as fleet:
        assert fleet.urls == tuple(f.url for f in fakes)
        assert [fleet.state(u).host for u in fleet.urls] == ["host-0", "host-1"]
        assert "state=open" in repr(fleet)
        assert (await fleet.health()).ok
    assert "state=closed" in repr(fleet)


@pytest.mark.asyncio
async def test_from_ray_takes_a_group_and_fleet_options(fakes: list[FakeVLLMServer]) -> None:
    group = _Group(tuple(f.url for f in fakes), ("a", "b"))
    async with az.Fleet.from_ray(group, max_staleness=2) as fleet:
        assert fleet.urls == group.urls
        assert [fleet.state(u).host for u in fleet.urls] == ["a", "b"]
        assert fleet.max_staleness == 2


@pytest.mark.parametrize(
    ("servers", "match"),
    [
        ("http://127.0.0.1:8000", "from_ray takes a ServerGroup.*got str"),
        (3, "from_ray takes a ServerGroup.*got int"),
        ([object()], "is not a server actor"),
    ],
)
def test_from_ray_refuses_what_is_not_actors_at_the_call(servers: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        az.Fleet.from_ray(servers)


@pytest.mark.asyncio
async def test_from_ray_bounds_the_actors_answers_by_timeout() -> None:
    slow = [_Actor("http://127.0.0.1:9", "h", delay=10.0)]
    with pytest.raises(TimeoutError):
        async with az.Fleet.from_ray(slow, timeout=0.05):
            pytest.fail("entered without the actors' answers")


@pytest.mark.asyncio
async def test_from_ray_is_entered_once(fakes: list[FakeVLLMServer]) -> None:
    opening = az.Fleet.from_ray([_Actor(fakes[0].url, "h")])
    async with opening:
        with pytest.raises(RuntimeError, match="entered once"):
            await opening.__aenter__()
