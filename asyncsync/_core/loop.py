"""`asyncsync.run`'s event loop: uvloop when installed, unless opted out. Nothing else in
asyncsync chooses or changes the event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run", "uvloop_enabled"]

T = TypeVar("T")

#: Set to 1/true/yes to use the standard asyncio loop even when uvloop is installed.
NO_UVLOOP_ENV = "ASYNCSYNC_NO_UVLOOP"


def uvloop_enabled(use_uvloop: bool | None = None) -> bool:
    """Whether `run` will use uvloop: ``use_uvloop`` if given, else installed and
    not disabled by ``ASYNCSYNC_NO_UVLOOP``."""
    if use_uvloop is None:
        use_uvloop = os.environ.get(NO_UVLOOP_ENV, "").strip().lower() not in {"1", "true", "yes"}
    if not use_uvloop:
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None, debug: bool = False) -> T:
    """Run ``main`` to completion in a new event loop, like `asyncio.run`, on uvloop when
    it is installed (the ``[fast]`` extra).

    This is how asyncsync uses uvloop: importing asyncsync never changes the event loop
    policy, so ``asyncio.run`` keeps the standard loop. Call ``asyncsync.run(main())``
    (or ``uvloop.run(main())``) in your script's entry point to get uvloop.

    Args:
        main: the coroutine to run.
        use_uvloop: ``True`` or ``False`` to decide; ``None`` (the default) uses uvloop
            when it is importable and the environment variable ``ASYNCSYNC_NO_UVLOOP`` is
            not set to ``1``, ``true`` or ``yes``.
        debug: run the loop in asyncio's debug mode.

    Returns:
        What ``main`` returns.

    Inside a running loop (a notebook cell) use ``await`` or `asyncsync.blocking`
    instead.
    """
    if uvloop_enabled(use_uvloop):
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop, debug=debug) as runner:
            return runner.run(main)
    with asyncio.Runner(debug=debug) as runner:
        return runner.run(main)
