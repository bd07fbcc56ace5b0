"""The gloo group's lifecycle between two real processes (no vLLM): a broadcast is exact,
a wait never outlives its deadline or the generation, and a worker leaves a dead
generation for a new one."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from asyncsync._transport.gloo_group import (
    GlooAborted,
    GlooGroup,
    GlooTimeout,
    graveyard_size,
    master_address_for,
)

SIZE = 1 << 20


def _worker(conn: Connection) -> None:
    """Rank 1: join each generation it is told about and report each receive."""
    group: GlooGroup | None = None
    conn.send(("ready",))  # torch is imported: joins are not slowed by the start-up
    while True:
        msg: Any = conn.recv()
        if msg[0] == "exit":
            if group is not None:
                group.destroy()
            return
        try:
            if msg[0] == "join":
                _, port, gen = msg
                if group is not None:
                    group.destroy()
                group = GlooGroup(
                    host="127.0.0.1", port=port, rank=1, world_size=2, generation=gen,
                    op_timeout_s=120.0, create_timeout_s=20.0,
                )  # fmt: skip
                group.connect(time.monotonic() + 20)
                conn.send(("joined", gen))
            elif msg[0] == "recv":
                assert group is not None
                buf = torch.zeros(SIZE, dtype=torch.uint8)
                began = time.monotonic()
                group.wait(group.broadcast_async(buf), time.monotonic() + 25)
                conn.send(("ok", int(buf.sum()), time.monotonic() - began))
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))


def _trainer_group(gen: int) -> GlooGroup:
    return GlooGroup(
        host="127.0.0.1", port=0, rank=0, world_size=2, generation=gen,
        op_timeout_s=120.0, create_timeout_s=20.0,
    )  # fmt: skip


def _join(conn: Connection, gen: int) -> GlooGroup:
    group = _trainer_group(gen)
    conn.send(("join", group.port, gen))
    group.connect(time.monotonic() + 20)
    assert conn.recv() == ("joined", gen)
    return group


def _start_worker() -> tuple[Connection, Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(there,), daemon=True)
    proc.start()
    assert here.poll(300), "the worker process did not start"
    assert here.recv() == ("ready",)
    return here, proc


def _stop_worker(here: Connection, proc: Any) -> None:
    here.send(("exit",))
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_abort_releases_a_blocked_receiver_and_a_new_generation_works() -> None:
    here, proc = _start_worker()
    try:
        group = _join(here, 1)
        data = torch.full((SIZE,), 3, dtype=torch.uint8)
        here.send(("recv",))
        group.wait(group.broadcast_async(data), time.monotonic() + 20)
        status, total, _ = here.recv()
        assert (status, total) == ("ok", 3 * SIZE)

        # The worker waits for a broadcast that never comes; the trainer ends the
        # generation and the worker leaves within a few polls, not at gloo's 30 s.
        here.send(("recv",))
        time.sleep(0.5)
        began = time.monotonic()
        group.abort_generation()
        assert here.poll(60)
        answer = here.recv()
        assert answer[:2] == ("error", "GlooAborted"), answer
        assert time.monotonic() - began < 60  # not gloo's own 120 s op timeout
        assert graveyard_size() >= 1

        # Generation 2 on a new port: the worker drops the old group and joins.
        group = _join(here, 2)
        here.send(("recv",))
        data = torch.full((SIZE,), 5, dtype=torch.uint8)
        group.wait(group.broadcast_async(data), time.monotonic() + 20)
        assert here.recv()[:2] == ("ok", 5 * SIZE)
        group.close()
    finally:
        _stop_worker(here, proc)


def test_a_trainer_wait_ends_at_its_deadline_and_on_cancel() -> None:
    here, proc = _start_worker()
    try:
        group = _join(here, 1)
        # The worker never joins this broadcast: the trainer gives up at its deadline.
        began = time.monotonic()
        with pytest.raises(GlooTimeout):
            group.wait(group.broadcast_async(torch.zeros(SIZE, dtype=torch.uint8)), began + 1.0)
        assert time.monotonic() - began < 60  # not gloo's own 120 s op timeout
        group.abort_generation()
        group = _join(here, 2)
        with pytest.raises(GlooAborted, match="cancelled"):
            group.wait(
                group.broadcast_async(torch.zeros(SIZE, dtype=torch.uint8)),
                time.monotonic() + 20,
                cancelled=lambda: True,
            )
        group.abort_generation()
    finally:
        _stop_worker(here, proc)


def test_master_address_is_loopback_for_local_servers() -> None:
    assert master_address_for(["http://127.0.0.1:8000", "http://localhost:9"]) == "127.0.0.1"
