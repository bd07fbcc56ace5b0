"""Publisher pieces that need no server: argument checks, sources, progress."""

from __future__ import annotations

import pytest
import torch

import asyncsync as az
from asyncsync._publish.options import RoundOptions
from asyncsync._publish.progress import Progress, progress_enabled
from asyncsync._publish.round import is_stale_round_error
from asyncsync._publish.weights import resolve
from asyncsync.backends import register_backend, registered_backends


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backend 'rdma' is not available"):
        az.AsyncWeightPublisher(None, backend="rdma", rank=1, world_size=2)
    with pytest.raises(TypeError, match="backend 'nccl' got unknown option"):
        az.AsyncWeightPublisher(None, backend="nccl", rank=1, world_size=2, buffer_bytes=1)
    with pytest.raises(ValueError, match="rank must be in"):
        az.AsyncWeightPublisher(None, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank 0 needs a fleet"):
        az.AsyncWeightPublisher(None)
    with pytest.raises(ValueError, match="if_busy"):
        az.AsyncWeightPublisher(None, rank=1, world_size=2, if_busy="later")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_publish_rejects_bad_version_and_pause() -> None:
    async with az.AsyncWeightPublisher(None, rank=1, world_size=2) as pub:
        with pytest.raises(ValueError, match="version must be a non-empty string"):
            await pub.publish({}, version="")
        with pytest.raises(ValueError, match="pause must be"):
            await pub.publish({}, version="v", pause="forever")  # type: ignore[arg-type]


def test_round_options_are_checked_once_when_built() -> None:
    options = RoundOptions(pause="keep", min_servers="all", delta=True)
    assert options.need(["a", "b", "c"]) == 3
    assert RoundOptions(min_servers=2).need(["a", "b"]) == 2
    with pytest.raises(ValueError, match=r"min_servers=3 but the round targets 2 server\(s\)"):
        RoundOptions(min_servers=3).need(["a", "b"])
    with pytest.raises(AttributeError):
        options.delta = False  # type: ignore[misc]  # frozen
    bad: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"pause": "forever"}, ValueError, "pause must be"),
        ({"min_servers": 0}, ValueError, "min_servers must be an int >= 1 or 'all', got 0"),
        ({"min_servers": True}, ValueError, "min_servers must be an int"),
        ({"min_servers": "most"}, ValueError, "min_servers must be an int"),
        ({"delta": "yes"}, TypeError, "delta must be a bool, got 'yes'"),
        ({"reset_prefix_cache": None}, TypeError, "reset_prefix_cache must be a bool"),
        ({"into": "eagle"}, ValueError, "into must be 'main' or 'draft'"),
        ({"into": "draft", "verify": az.Verify(checksum=True)}, ValueError, "takes no verify"),
        ({"catch_up": True, "delta": True}, ValueError, "a catch-up round resends"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            RoundOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_publish_refuses_bad_round_options_before_the_round() -> None:
    async with az.AsyncWeightPublisher(None, rank=1, world_size=2) as pub:
        with pytest.raises(ValueError, match="min_servers must be"):
            await pub.publish({}, version="v", min_servers=0)
        with pytest.raises(TypeError, match="delta must be a bool"):
            await pub.publish({}, version="v", delta="yes")  # type: ignore[arg-type]


def test_sources_describe_themselves() -> None:
    module = torch.nn.Linear(3, 2)
    assert [m[0] for m in resolve(module).metadata() or []] == ["weight", "bias"]
    pairs = [("a", torch.zeros(2)), ("b", torch.ones(3, 1))]
    assert resolve(pairs).metadata() == [("a", torch.float32, (2,)), ("b", torch.float32, (3, 1))]
    assert resolve(dict(pairs)).metadata() == resolve(pairs).metadata()
    generator = (p for p in pairs)
    assert resolve(generator).metadata() is None  # streamed: validated chunk by chunk
    assert [n for n, _ in resolve(lambda: pairs)] == ["a", "b"]  # factories are called
    with pytest.raises(TypeError, match="takes a torch module"):
        resolve(42)


def test_progress_is_off_in_ci_and_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert progress_enabled(None) is False
    assert progress_enabled(True) is True
    monkeypatch.delenv("CI")
    monkeypatch.setenv("ASYNCSYNC_NO_PROGRESS", "1")
    assert progress_enabled(None) is False
    bar = Progress(False, 100, "v")
    bar(1, 50)  # a disabled bar accepts updates silently
    bar.close()
    assert bar.bar is None


def test_an_unknown_backend_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"registered backends: .*'shm'"):
        az.AsyncWeightPublisher(None, backend="pigeon", rank=1, world_size=2)
    assert "shm" in registered_backends()
    with pytest.raises(ValueError, match="already registered"):
        register_backend("shm", "asyncsync.backends.shm:ShmBackend")


def test_a_stale_round_is_recognised_by_vllms_message() -> None:
    vllm_says = (
        "Call to collective_rpc method failed: start_weight_update called while a weight "
        "update is already active. Call finish_weight_update first."
    )
    assert is_stale_round_error(az.ServerError(vllm_says, status=500))
    assert not is_stale_round_error(az.ServerError("out of memory", status=500))
    assert not is_stale_round_error(None)
