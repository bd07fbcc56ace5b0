"""Shared memory never outlives its owner (issue 12, item 1).

Segments are anonymous memfds (never a name in /dev/shm, mode 0600) that the trainer
holds open; the kernel frees them once the trainer closed them (or died) and no server
maps them any more. These tests need no vLLM: the rounds run against fakes, and the
worker side is asyncsync's real receiver mapping the segments in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync.backends._segments import leaked_segments, open_segments
from asyncsync.backends._shm_pack import ShmBuffers
from tests.publish_fakes import shm_fakes

WEIGHTS = {f"model.layers.{i}.w": torch.full((4096,), float(i)) for i in range(8)}
#: Small buffers: every round uses both segments.
BUFFER = 64 * 1024


def mapped_anywhere(name_prefix: str) -> list[str]:
    """Processes (``pid: line``) that map a memfd whose name starts with
    ``name_prefix``: what still holds the memory."""
    found = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        found.extend(
            f"{maps.parent.name}: {line}"
            for line in text.splitlines()
            if f"/memfd:{name_prefix}" in line
        )
    return found


@pytest.mark.asyncio
async def test_closing_the_publisher_releases_its_segments() -> None:
    # Segments of earlier tests' publishers that only the cyclic collector frees are
    # freed first (the collector is paused while a round runs, so they can outlive it).
    gc.collect()
    before = set(open_segments())
    async with (
        shm_fakes() as fakes,
        az.Fleet([f.url for f in fakes]) as fleet,
    ):
        async with az.AsyncWeightPublisher(
            fleet, backend=az.backends.Shm(buffer_bytes=BUFFER)
        ) as publisher:
            await publisher.publish(WEIGHTS, version="v1")
            held = [name for name in open_segments() if name not in before]
            assert len(held) == 2
        assert set(open_segments()) & set(held) == set()
        # This publisher's segments, by name: real servers of earlier tests in this
        # process may still map other publishers' segments (until their next round).
        assert [m for name in held for m in mapped_anywhere(name)] == []


@pytest.mark.asyncio
async def test_closing_the_fleet_releases_a_publisher_never_closed() -> None:
    async with shm_fakes() as fakes:
        fleet = az.Fleet([f.url for f in fakes])
        async with fleet:
            publisher = az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=BUFFER))
            await publisher.publish(WEIGHTS, version="v1")
            assert len(open_segments()) == 2
        # The fleet closed; the publisher object is still referenced here, unclosed.
        assert open_segments() == []
        assert publisher.version == "v1"


@pytest.mark.asyncio
async def test_a_garbage_collected_publisher_releases_its_segments() -> None:
    async with shm_fakes() as fakes, az.Fleet([f.url for f in fakes]) as fleet:
        publisher = az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=BUFFER))
        await publisher.publish(WEIGHTS, version="v1")
        assert len(open_segments()) == 2
        del publisher
        gc.collect()
        assert open_segments() == []
        # The fleet holds its close hook weakly: closing it later is harmless.


def test_segments_are_owner_only_memfds_never_named_in_dev_shm() -> None:
    with ShmBuffers(buffer_bytes=8192) as buffers:
        segments = [buffers.get(0), buffers.get(1)]
        for segment in segments:
            assert os.fstat(segment.fd).st_mode & 0o777 == 0o600
            assert segment.name in open_segments()
        assert leaked_segments(pid=os.getpid()) == []


_EXITING_TRAINER = textwrap.dedent(
    """
    import sys
    from asyncsync.backends._segments import open_segments
    from asyncsync.backends._shm_pack import ShmBuffers

    buffers = ShmBuffers(buffer_bytes=8192)  # never closed
    buffers.get(0), buffers.get(1)
    print(" ".join(open_segments()), flush=True)
    """
)


def test_interpreter_exit_leaves_no_segment() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXITING_TRAINER],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    names = done.stdout.split()
    assert len(names) == 2
    trainer_pid = int(names[0].split("-")[1])
    assert leaked_segments(pid=trainer_pid) == []
    assert mapped_anywhere(names[0]) == []
    assert mapped_anywhere(names[1]) == []


_LOOPING_TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    import torch
    import asyncsync as az

    WEIGHTS = {f"model.layers.{i}.w": torch.full((4096,), float(i)) for i in range(8)}

    async def main(urls):
        async with az.Fleet(urls) as fleet:
            shm = az.backends.Shm(buffer_bytes=64 * 1024)
            publisher = az.AsyncWeightPublisher(fleet, backend=shm)
            n = 0
            while True:
                n += 1
                await publisher.publish(WEIGHTS, version=f"v{n}")
                print(n, flush=True)

    asyncio.run(main(sys.argv[1:]))
    """
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.asyncio
async def test_a_trainer_killed_at_any_point_leaves_nothing(seed: int) -> None:
    """SIGKILL at a random moment of a publishing loop: at no moment is anything of the
    trainer's in /dev/shm, and once it is dead no process maps its segments."""
    async with shm_fakes() as fakes:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _LOOPING_TRAINER,
            *(f.url for f in fakes),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            first = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
            assert first.strip() == b"1", "the trainer never finished a round"
            assert len(open_segments(proc.pid)) == 2
            until = time.monotonic() + random.Random(seed).uniform(0.0, 0.5)
            while time.monotonic() < until:
                assert leaked_segments(pid=proc.pid) == []
                await asyncio.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        assert leaked_segments(pid=proc.pid) == []
        assert mapped_anywhere(f"asyncsync-{proc.pid}-") == []


_READER = textwrap.dedent(
    """
    import json, sys
    import torch
    from asyncsync._transport.wire import ShmUpdateFields
    from asyncsync.vllm_plugin.shm_engine import _Mapping

    update = ShmUpdateFields.parse(json.loads(sys.argv[1]))
    mapping = _Mapping(update)
    view = mapping.view(update.offsets[0], update.dtype_names[0], tuple(update.shapes[0]))
    print(json.dumps(view.tolist()), flush=True)
    """
)


def test_another_process_maps_the_segment_through_the_trainers_descriptor() -> None:
    """What a vLLM worker does, in a separate process: open ``/proc/<pid>/fd/<fd>``,
    check the memfd's name, map it and read the tensor at its offset."""
    import json

    from asyncsync._transport.wire import ShmUpdateFields
    from asyncsync.backends._shm_pack import _pack

    tensor = torch.arange(16, dtype=torch.float32) * 1.5
    with ShmBuffers(buffer_bytes=8192) as buffers:
        segment = buffers.get(0)
        _pack(segment, 64, tensor)
        update = ShmUpdateFields(
            segment=segment.name,
            segment_size=segment.size,
            owner_pid=segment.owner_pid,
            fd=segment.fd,
            names=["t"],
            dtype_names=["float32"],
            shapes=[[16]],
            offsets=[64],
        )
        done = subprocess.run(
            [sys.executable, "-c", _READER, json.dumps(update.to_json())],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == tensor.tolist()


@pytest.mark.asyncio
async def test_zero_copy_allocates_nothing_and_its_memory_goes_with_the_parameters() -> None:
    """A zero-copy publisher creates no segments of its own; the one ``share_weights``
    made lives as long as the parameters, and a worker that mapped it lets go at the end
    of its next round that no longer reads it."""
    from asyncsync.backends.shm import send_round
    from asyncsync.vllm_plugin.shm_engine import ShmReceiver

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for _, view in weights:
            view.clone()

    with contextlib.suppress(ImportError):
        # What the receiver imports, imported before the round: importing vLLM keeps an
        # exception whose traceback would hold the round's frames (and the parameters).
        import vllm.model_executor.model_loader.reload.layerwise  # noqa: F401
    receiver = ShmReceiver(torch.nn.Module(), None)
    model = torch.nn.Linear(64, 64)
    az.share_weights(model)
    (segment,) = open_segments()
    async with (
        shm_fakes() as fakes,
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(zero_copy=True)) as publisher,
    ):
        await publisher.publish(model, version="v1")
        assert open_segments() == [segment]  # no buffers
    assert open_segments() == [segment]  # the parameters still use it

    def hook(info: dict[str, Any]) -> None:
        receiver.receive(info, load, None)

    receiver.begin_round()  # a worker reads the model in place
    # the trainer's side runs in a worker thread, as a publisher runs it
    params = list(model.named_parameters())
    await asyncio.to_thread(send_round, params, None, ShmBuffers(8192), hook, zero_copy=True)
    del params
    receiver.end_round()
    assert mapped_anywhere(segment)
    del model
    gc.collect()
    assert mapped_anywhere(segment)  # the parameters are gone; the worker maps them still
    receiver.begin_round()  # its next round reads other weights
    with ShmBuffers(buffer_bytes=BUFFER) as buffers:
        await asyncio.to_thread(send_round, iter(WEIGHTS.items()), None, buffers, hook)
        receiver.end_round()
        assert segment not in open_segments()
        assert mapped_anywhere(segment) == []  # dropped at the end of that round
        receiver.close()
    assert open_segments() == []
