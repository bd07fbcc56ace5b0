"""Per-phase deadlines for every network call."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

__all__ = ["Deadline", "Phase", "Timeouts"]

#: The phase a route belongs to; each phase has its own deadline.
Phase = Literal["control", "update", "generate"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds, one per phase of a call. ``None`` means no limit.

    Attributes:
        connect: establishing the TCP connection (counted inside the phase deadline too).
        control: light routes: health, version, pause, resume, is_paused, abort,
            weight_info, update_weight_version, weight_checker, get_world_size,
            reset_prefix_cache.
        update: weight-sync routes, which are blocking collective RPCs on every worker:
            init/start/update/finish weight update, shutdown of the transfer engine.
            NCCL's init and update stay in flight for as long as the trainer's
            broadcast runs, so this one is long.
        generate: generation requests (prefill plus decode of a whole completion).

    Each deadline covers the whole call: connecting, sending, waiting, reading the body.
    A call that passes its deadline raises :class:`asyncsync.ServerTimeout`.
    """

    connect: float | None = 10.0
    control: float | None = 30.0
    update: float | None = 600.0
    generate: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("connect", "control", "update", "generate"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Timeouts.{name} must be a number of seconds or None, got {value!r}"
                )
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Timeouts.{name} must be > 0 and finite, got {value!r}")

    def for_phase(self, phase: Phase) -> float | None:
        """The deadline of ``phase`` in seconds (``None``: no limit)."""
        value: float | None = getattr(self, phase)
        return value

    @classmethod
    def uniform(cls, seconds: float | None) -> Timeouts:
        """The same deadline for every phase (handy in tests)."""
        return cls(connect=seconds, control=seconds, update=seconds, generate=seconds)


class Deadline:
    """``asyncio.timeout(delay)`` for a loop the caller already holds.

    The same semantics as the standard library's (the task is cancelled when the delay
    passes and ``TimeoutError`` is raised from the ``CancelledError``; a cancellation
    from anywhere else propagates untouched), without looking the loop up three times
    per use: on Python 3.11 every ``asyncio.get_running_loop()`` is a ``getpid()``
    system call, and this runs once per request.
    """

    __slots__ = ("_cancelling", "_delay", "_expired", "_handle", "_loop", "_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float | None) -> None:
        self._loop = loop
        self._delay = delay
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False

    async def __aenter__(self) -> None:
        if self._delay is None:
            return
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("a Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._loop.call_later(self._delay, self._on_timeout)

    def _on_timeout(self) -> None:
        assert self._task is not None
        self._handle = None
        self._expired = True
        self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired:
            assert self._task is not None
            self._expired = False
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
