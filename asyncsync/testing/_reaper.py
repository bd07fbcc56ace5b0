"""A server's watchdog: stops a vLLM server when the process that started it dies.

``LocalVLLMServer(..., watchdog=True)`` starts this beside the server, in a session of
its own (so that nothing that kills the owner's process group kills it too), reading a
pipe whose only writer is the owner. The owner writes ``ring <name>`` for each vLLM ring
buffer it saw and ``done`` when it stopped the server itself. End of file without
``done`` means the owner died (a ``ray.kill`` of its actor, SIGKILL, a lost node's
raylet taking its workers): the watchdog then terminates the server's process group
(SIGTERM, then SIGKILL after the grace period), waits until no member is left, and
removes the ring buffers (~400 MiB of /dev/shm per server) a killed vLLM leaves.

The watchdog is not the owner's child: the process the owner starts forks it and exits
at once, before importing anything. Ray kills the direct children of an actor that dies
(the server's API process among them, not its engine and workers, which are
grandchildren); a child watchdog would die with them.

    python .../asyncsync/testing/_reaper.py PGID [GRACE_SECONDS]
"""

from __future__ import annotations

import os

if __name__ == "__main__" and os.fork() != 0:  # the owner's child: gone at once
    os._exit(0)

import contextlib
import signal
import sys
import time

from asyncsync.testing._server import (
    process_group_members,
    remove_ring_buffers,
    ring_buffers_of,
)

__all__ = ["main", "reap"]


def reap(pgid: int, rings: set[str], grace: float) -> None:
    """Terminate process group ``pgid``, wait until it is empty, remove ``rings``."""
    rings |= ring_buffers_of(process_group_members(pgid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while process_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    while process_group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.05)
    remove_ring_buffers(rings)


def main(argv: list[str]) -> int:
    pgid = int(argv[0])
    grace = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner's terminal is not ours
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    rings: set[str] = set()
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "done":
            return 0
        if word == "ring" and rest:
            rings.add(rest)
    reap(pgid, rings, grace)  # end of file without "done": the owner is gone
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
