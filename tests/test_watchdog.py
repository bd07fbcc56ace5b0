"""``LocalVLLMServer(watchdog=True)``'s watchdog (`asyncsync.testing._reaper`) without
vLLM: a stand-in server (a process group in a session of its own, with a ring buffer in
/dev/shm) is stopped and its ring buffer removed when the owner's pipe closes without
``done``, and left alone after ``done``. With real servers and ``ray.kill``:
tests/test_ray_vllm.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncsync.testing import process_group_members

SHM = Path("/dev/shm")


@pytest.fixture
def stand_in() -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A process group like a server's (a parent and a child, in their own session) and
    a ring buffer named like vLLM's."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    ring = SHM / f"psm_test{uuid.uuid4().hex[:8]}"
    ring.write_bytes(b"x" * 4096)
    code = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield proc, ring
    finally:
        for pid in process_group_members(proc.pid):
            os.kill(pid, 9)
        proc.wait()
        ring.unlink(missing_ok=True)


def watchdog(pgid: int) -> subprocess.Popen[bytes]:
    """The watchdog as LocalVLLMServer starts it (the started process forks it, exits)."""
    import asyncsync.testing._reaper as reaper

    return subprocess.Popen(
        [sys.executable, reaper.__file__, str(pgid), "5"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def wait_until_members(pgid: int, count: int, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while len(process_group_members(pgid)) != count:
        assert time.monotonic() < deadline, process_group_members(pgid)
        time.sleep(0.05)


def test_the_owner_gone_stops_the_group_and_removes_its_ring_buffers(
    stand_in: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, ring = stand_in
    wait_until_members(proc.pid, 2)
    dog = watchdog(proc.pid)
    assert dog.stdin is not None
    dog.stdin.write(f"ring {ring.name}\n".encode())
    dog.stdin.flush()
    assert dog.wait(timeout=60) == 0  # the forking parent: the watchdog is not its child
    dog.stdin.close()  # what the kernel does when the owner dies, however it dies
    wait_until_members(proc.pid, 0)
    deadline = time.monotonic() + 30
    while ring.exists():
        assert time.monotonic() < deadline, "the ring buffer was not removed"
        time.sleep(0.05)


def test_done_leaves_everything_to_the_owner(
    stand_in: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, ring = stand_in
    wait_until_members(proc.pid, 2)
    dog = watchdog(proc.pid)
    assert dog.stdin is not None
    dog.stdin.write(f"ring {ring.name}\ndone\n".encode())
    dog.stdin.close()
    assert dog.wait(timeout=60) == 0  # the forking parent
    # The watchdog itself (forked, in that process's group) exits on "done": once it is
    # gone, whatever it would have done to the stand-in is done.
    wait_until_members(dog.pid, 0)
    assert len(process_group_members(proc.pid)) == 2
    assert ring.exists()
