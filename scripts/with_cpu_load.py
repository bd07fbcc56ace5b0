"""Run a command while unrelated processes keep the CPU cores busy.

A test that passes on an idle machine may still depend on timing: a CI runner shared
with other jobs gives each process only part of a core. This wrapper reproduces that:
it starts ``--jobs`` busy processes (default: one per core) at normal priority, runs the
command, then stops them and reports how much CPU they actually took::

    python3 scripts/with_cpu_load.py -- python3 -m nox -R -s tests
    python3 scripts/with_cpu_load.py --repeat 3 -- python3 -m nox -R -s tests -- -x

The exit status is the command's (the first failing one with ``--repeat``). The busy
processes exit on their own if this wrapper dies (they watch their parent), so none is
left behind spinning.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

#: One busy process: pure-Python arithmetic (it holds a core, not memory bandwidth), and
#: every ~50 ms of work a check that the wrapper is still its parent.
_BURN = """
import os, sys
parent = int(sys.argv[1])
x = 0
while os.getppid() == parent:
    for i in range(200_000):
        x = (x * 31 + i) & 0xFFFF
"""


def _start_load(jobs: int) -> list[subprocess.Popen[bytes]]:
    me = str(os.getpid())
    return [subprocess.Popen([sys.executable, "-c", _BURN, me]) for _ in range(jobs)]


def _stop_load(procs: Sequence[subprocess.Popen[bytes]]) -> float:
    """Stop the busy processes; the CPU seconds they used."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for proc in procs:
        proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        usage="%(prog)s [--jobs N] [--repeat N] -- command [args...]",
    )
    parser.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=os.cpu_count() or 1,
        help="busy processes to run beside the command (default: one per core, %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the command this many times in a row, stopping at the first failure",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.jobs < 0 or args.repeat < 1:
        parser.error("--jobs must be >= 0 and --repeat >= 1")

    load = _start_load(args.jobs)
    started = time.monotonic()
    rc = 0
    try:
        for run in range(1, args.repeat + 1):
            t0 = time.monotonic()
            print(
                f"with_cpu_load: run {run}/{args.repeat} beside {args.jobs} busy processes: "
                f"{' '.join(command)}",
                file=sys.stderr,
                flush=True,
            )
            rc = subprocess.call(command)
            print(
                f"with_cpu_load: run {run}/{args.repeat} exited {rc} "
                f"after {time.monotonic() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            if rc != 0:
                break
    except KeyboardInterrupt:
        rc = 130
    finally:
        wall = time.monotonic() - started
        cpu = _stop_load(load)
        print(
            f"with_cpu_load: the {args.jobs} busy processes used {cpu:.0f} CPU-s "
            f"in {wall:.0f} s ({cpu / wall if wall else 0.0:.2f} cores on average)",
            file=sys.stderr,
            flush=True,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
