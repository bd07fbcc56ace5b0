"""Measure the per-round cost of three ways to hand a trainer's shared memory to servers.

- ``named-reused``: a /dev/shm file created once and reused every round (the name stays
  in /dev/shm for the trainer's life: a SIGKILL leaks it).
- ``named-fresh``: a fresh /dev/shm file per round, unlinked once every server mapped it
  (a SIGKILL between create and unlink leaks it; every round pays allocation and faults).
- ``memfd-reused``: an anonymous memfd created once, opened by servers through
  ``/proc/<pid>/fd/<fd>``; never has a name in /dev/shm, freed by the kernel when the
  last mapping goes.

Per round: the trainer writes the buffer, one "server" maps (or reuses its mapping) and
reads every byte. Prints a Markdown table. ``python scripts/measure_shm_handoff.py``
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
import uuid

import numpy as np

MIB = 1024 * 1024


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _create_named(size: int) -> tuple[str, mmap.mmap]:
    path = f"/dev/shm/measure-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    mm = _map(fd, size, populate=True)
    os.close(fd)
    return path, mm


def _server_map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _round(trainer: mmap.mmap, server: mmap.mmap, payload: np.ndarray) -> None:
    np.frombuffer(trainer, dtype=np.uint8)[:] = payload
    total = int(np.frombuffer(server, dtype=np.uint8)[::4096].sum())
    assert total >= 0


def named_reused(size: int, rounds: int, payload: np.ndarray) -> list[float]:
    path, trainer = _create_named(size)
    server = _server_map(path, size)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        _round(trainer, server, payload)
        times.append(time.perf_counter() - began)
    server.close()
    trainer.close()
    os.unlink(path)
    return times


def named_fresh(size: int, rounds: int, payload: np.ndarray) -> list[float]:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        path, trainer = _create_named(size)
        server = _server_map(path, size)
        os.unlink(path)  # every server has it mapped
        _round(trainer, server, payload)
        server.close()
        trainer.close()
        times.append(time.perf_counter() - began)
    return times


def memfd_reused(size: int, rounds: int, payload: np.ndarray) -> list[float]:
    fd = os.memfd_create("asyncsync-measure", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    trainer = _map(fd, size, populate=True)
    server = _server_map(f"/proc/{os.getpid()}/fd/{fd}", size)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        _round(trainer, server, payload)
        times.append(time.perf_counter() - began)
    server.close()
    trainer.close()
    os.close(fd)
    return times


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print("| buffer | named-reused ms | named-fresh ms | memfd-reused ms |")
    print("|---|---|---|---|")
    for mib in (16, 64, 256):
        size = mib * MIB
        payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        cells = []
        for method in (named_reused, named_fresh, memfd_reused):
            times = method(size, rounds, payload)
            cells.append(f"{statistics.median(times) * 1000:.1f}")
        print(f"| {mib} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
