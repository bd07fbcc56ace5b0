"""A transport written the way a third party would write one: from public names alone.

This file imports nothing of asyncsync but ``asyncsync``, ``asyncsync.backends``,
``asyncsync.backends.contract`` and ``asyncsync.testing`` (tests/test_layers.py checks
that), so the public contract is shown to be enough to write, register, test and run a
real backend. The transport is made up: each payload carries its tensors' raw bytes
base64-encoded inside the update_info itself, so the fake server records exactly what
a worker would have loaded.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

import asyncsync as az
from asyncsync.backends import register_backend
from asyncsync.backends.contract import (
    BackendOptions,
    Ceiling,
    InitInfo,
    RoundCancelled,
    SendControl,
    SendStats,
    SyncFleetClient,
    TrainerApi,
    TrainerBackend,
    UpdateInfo,
    WeightSource,
    check_tensor,
)
from asyncsync.testing import FakeVLLMServer

#: The vLLM weight-transfer backend the made-up transport's servers would run.
SERVER_BACKEND = "inline_b64"


@dataclass(frozen=True, kw_only=True)
class Inline(BackendOptions):
    """The made-up transport's options: the most raw bytes one payload carries."""

    name: ClassVar[str] = "inline"
    max_chunk_bytes: int = 1 << 16

    def __post_init__(self) -> None:
        if not isinstance(self.max_chunk_bytes, int) or self.max_chunk_bytes < 1:
            raise ValueError(
                f"Inline.max_chunk_bytes must be an int >= 1, got {self.max_chunk_bytes!r}"
            )


def _nbytes(dtype: Any, shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * int(dtype.itemsize)


class InlineBackend(TrainerBackend):
    """Tensors as base64 in the update_info, in payloads of at most ``max_chunk_bytes``
    raw bytes (a tensor is never split)."""

    name = "inline"
    server_backend = SERVER_BACKEND
    options_class = Inline
    #: every instance, newest last: how a test reaches the one a publisher created
    created: ClassVar[list[InlineBackend]] = []

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        api: TrainerApi = "engine",
        max_chunk_bytes: int = 1 << 16,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, api=api)
        self.max_chunk_bytes = max_chunk_bytes
        self.events: list[str] = []
        self.controls: list[SendControl] = []
        self.closed = False
        InlineBackend.created.append(self)

    def init_info(self) -> InitInfo:
        return lambda url: {"codec": "base64", "trainer_world_size": self.world_size, "url": url}

    def check(self, source: WeightSource) -> None:
        for name, dtype, shape in source.metadata() or ():
            if _nbytes(dtype, shape) > self.max_chunk_bytes:
                raise ValueError(
                    f"parameter {name!r} ({_nbytes(dtype, shape)} bytes) does not fit one "
                    f"payload of max_chunk_bytes={self.max_chunk_bytes}"
                )

    def ceiling(self, urls: Sequence[str]) -> Ceiling | None:
        return Ceiling(gb_per_s=0.5, basis=f"base64 over HTTP to {len(urls)} server(s)")

    def send(
        self, source: WeightSource, client: SyncFleetClient | None, control: SendControl
    ) -> SendStats:
        self.controls.append(control)
        stats = SendStats()
        if client is None:  # another rank: iterate in lockstep, send nothing
            for _ in source:
                pass
            return stats
        batch: dict[str, list[Any]] = {"names": [], "dtypes": [], "shapes": [], "data": []}
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if control.cancel.is_set():
                self.events.append("cancelled")
                raise RoundCancelled
            if stats.chunks == 0:
                client.start_weight_update()  # the first payload is known good
            client.update_weights(batch)
            stats.chunks += 1
            stats.bytes += size
            if control.on_chunk is not None:
                control.on_chunk(stats.chunks, stats.bytes)
            batch = {"names": [], "dtypes": [], "shapes": [], "data": []}
            size = 0

        for name, tensor in source:
            check_tensor(name, tensor)
            raw = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
            if batch["names"] and size + len(raw) > self.max_chunk_bytes:
                flush()
            batch["names"].append(name)
            batch["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
            batch["shapes"].append(list(tensor.shape))
            batch["data"].append(base64.b64encode(raw).decode())
            size += len(raw)
            stats.params += 1
        if batch["names"]:
            flush()
        client.finish_weight_update()
        self.events.append("sent")
        return stats

    def close(self) -> None:
        self.closed = True


register_backend("inline", InlineBackend, replace=True)


@pytest.fixture(autouse=True)
def forget_backends() -> Iterator[None]:
    yield
    InlineBackend.created.clear()


def received(fake: FakeVLLMServer) -> dict[str, torch.Tensor]:
    """The tensors a worker of ``fake`` would have loaded, decoded from its updates (the
    abort update that ends a failed round carries none)."""
    out: dict[str, torch.Tensor] = {}
    for info in fake.updates:
        for name, dtype, shape, data in zip(
            info.get("names", ()), info.get("dtypes", ()), info.get("shapes", ()),
            info.get("data", ()), strict=True,
        ):  # fmt: skip
            raw = bytearray(base64.b64decode(data))
            out[name] = torch.frombuffer(raw, dtype=getattr(torch, dtype)).reshape(shape)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def model() -> dict[str, torch.Tensor]:
    """Dtypes of every width, and values a float comparison would get wrong."""
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 3.5], dtype=torch.float32)
    return {
        "embed.weight": torch.arange(96, dtype=torch.float32).reshape(8, 12) / 7,
        "layers.0.special": special,
        "layers.0.norm": torch.linspace(-1, 1, 40).to(torch.bfloat16),
        "layers.1.ids": torch.arange(-5, 11, dtype=torch.int64),
        "layers.1.mask": torch.tensor([True, False, True]),
        "head.bias": torch.full((30,), 0.1, dtype=torch.float16),
    }


@pytest.mark.asyncio
async def test_a_backend_written_from_public_names_publishes_exact_weights() -> None:
    weights = model()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    async with (
        FakeVLLMServer(backend=SERVER_BACKEND, world_size=2) as first,
        FakeVLLMServer(backend=SERVER_BACKEND, world_size=1) as second,
        az.Fleet([first.url, second.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=Inline(max_chunk_bytes=400)) as publisher,
    ):
        backend = InlineBackend.created[-1]
        assert backend.max_chunk_bytes == 400
        assert publisher.vllm_backend == SERVER_BACKEND

        report = await publisher.publish(weights, version="v1")

        assert report.version == "v1" == publisher.version
        assert report.servers == [first.url, second.url]
        assert report.lost == []
        assert (report.params, report.bytes) == (len(weights), total)
        # 384 + 20 bytes do not fit 400; 20 + 80 + 128 + 3 + 60 do: two payloads.
        assert report.chunks == 2
        for fake in (first, second):
            assert [u["names"] for u in fake.updates] == [list(weights)[:1], list(weights)[1:]]
        assert (report.ceiling_gb_per_s, report.ceiling_basis) == (
            0.5,
            "base64 over HTTP to 2 server(s)",
        )
        assert report.efficiency == report.gb_per_s / 0.5
        assert backend.events == ["sent"]
        # Each server got its own init_info (a function of its URL), once.
        assert first.init_infos == [{"codec": "base64", "trainer_world_size": 1, "url": first.url}]
        assert second.init_infos == [
            {"codec": "base64", "trainer_world_size": 1, "url": second.url}
        ]
        for fake in (first, second):
            got = received(fake)
            assert list(got) == list(weights)
            for name, tensor in weights.items():
                assert same_bits(got[name], tensor), name
            assert fake.weight_version == "v1"
            assert not fake.update_active
        assert [s.weight_version for s in fleet.servers] == ["v1", "v1"]

        # The backend's own check refuses a tensor it cannot carry before any server
        # is touched.
        starts = len(first.requests_to("/start_weight_update"))
        with pytest.raises(ValueError, match=r"'big' \(4096 bytes\) does not fit"):
            await publisher.publish({"big": torch.zeros(1024)}, version="v2")
        assert len(first.requests_to("/start_weight_update")) == starts
        assert publisher.version == "v1"
    assert backend.closed


@pytest.mark.asyncio
async def test_the_registered_name_selects_the_backend_with_its_default_options() -> None:
    async with (
        FakeVLLMServer(backend=SERVER_BACKEND) as fake,
        az.Fleet([fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend="inline") as publisher,
    ):
        assert publisher.vllm_backend == SERVER_BACKEND
        assert InlineBackend.created[-1].max_chunk_bytes == Inline().max_chunk_bytes
        weights = model()
        report = await publisher.publish(weights, version="v1")
        assert report.chunks == 1  # everything fits one default payload
        assert all(same_bits(received(fake)[n], t) for n, t in weights.items())


@pytest.mark.asyncio
async def test_a_cancelled_publish_stops_the_backend_at_a_payload_boundary() -> None:
    """Cancelling ``publish`` sets the send's ``control.cancel``; the backend stops with
    `RoundCancelled` before its next payload, and the round ends the servers' update."""
    loop = asyncio.get_running_loop()
    weights = {f"layers.{i}.w": torch.full((100,), float(i)) for i in range(5)}  # 400 B each
    async with (
        # Like a real engine, the fake refuses the default abort_info's unknown key,
        # which clears its active update.
        FakeVLLMServer(backend=SERVER_BACKEND, reject_update_keys=["asyncsync_abort"]) as fake,
        az.Fleet([fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=Inline(max_chunk_bytes=400)) as publisher,
    ):
        backend = InlineBackend.created[-1]
        task: asyncio.Task[az.PublishReport] | None = None

        def cancel_after_the_first(chunks: int, nbytes: int) -> None:  # worker thread
            assert task is not None
            if chunks == 1:
                loop.call_soon_threadsafe(task.cancel)
                # Wait until the round has passed the cancel on to the send.
                assert backend.controls[-1].cancel.wait(timeout=60)

        task = asyncio.create_task(
            publisher.publish(weights, version="v1", progress=cancel_after_the_first)
        )
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.events == ["cancelled"]
        assert list(received(fake)) == ["layers.0.w"]  # one payload, then nothing more
        # The round ended the server's update with the backend's abort_info.
        sent = [r.json["update_info"] for r in fake.requests_to("/update_weights")]
        assert sent[-1] == backend.abort_info() == {"asyncsync_abort": True}
        assert not fake.update_active
        assert publisher.version is None


class RecordingClient:
    """A `SyncFleetClient` of the test's own: a backend can be unit-tested without a
    fleet, against the protocol alone."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _done(self) -> Future[None]:
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def begin_init(self, init_info: InitInfo) -> Future[None]:
        self.calls.append(("init", init_info))
        return self._done()

    def begin_update(self, update_info: UpdateInfo) -> Future[None]:
        self.calls.append(("update", update_info))
        return self._done()

    def init_weight_transfer_engine(self, init_info: InitInfo) -> None:
        self.begin_init(init_info).result()

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: UpdateInfo) -> None:
        self.begin_update(update_info).result()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def world_sizes(self) -> dict[str, int]:
        return {"http://a": 1}

    def servers(self) -> list[str]:
        return ["http://a"]

    def lane(self, urls: Sequence[str]) -> SyncFleetClient:
        return self

    def update_deadline(self) -> float | None:
        return None

    def settle(self) -> None:
        pass


def test_a_backend_runs_against_a_client_of_its_own() -> None:
    client: SyncFleetClient = RecordingClient()  # mypy: the protocol is satisfied
    backend = InlineBackend(max_chunk_bytes=8)
    weights = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3], dtype=torch.int32)}
    seen: list[tuple[int, int]] = []
    control = SendControl(cancel=threading.Event(), on_chunk=lambda c, b: seen.append((c, b)))

    backend.init(client)
    stats = backend.send(WeightSource(weights), client, control)

    assert isinstance(client, RecordingClient)
    kinds = [kind for kind, _ in client.calls]
    assert kinds == ["init", "start", "update", "update", "finish"]
    assert (stats.chunks, stats.params, stats.bytes) == (2, 2, 12)
    assert seen == [(1, 8), (2, 12)]

    # Other ranks iterate in lockstep and send nothing.
    other = InlineBackend(rank=1, world_size=2)
    assert other.send(WeightSource(weights), None, control) == SendStats()

    # A cancel before the first payload: nothing is started.
    cancelled = SendControl(cancel=threading.Event())
    cancelled.cancel.set()
    idle = RecordingClient()
    with pytest.raises(RoundCancelled):
        backend.send(WeightSource(weights), idle, cancelled)
    assert idle.calls == []

    # What check_tensor refuses reaches the caller naming the parameter.
    with pytest.raises(TypeError, match="'bad' is a list"):
        backend.send(WeightSource(iter([("bad", [1, 2])])), RecordingClient(), control)
