"""Per-phase deadlines for every network call."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.types import Phase

__all__ = ["DEFAULT_TIMEOUTS", "Timeouts", "check_timeouts"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds, one per phase of a call. ``None`` means no limit.

    Attributes:
        connect: establishing the TCP connection (counted inside the phase deadline too).
        control: light routes: health, version, pause, resume, is_paused, abort,
            weight_info, update_weight_version, get_world_size, reset_prefix_cache.
        update: weight-sync routes, which are blocking collective RPCs on every worker:
            init/start/update/finish weight update, shutdown of the transfer engine,
            and the weight checker (it hashes every parameter on every worker).
            NCCL's init and update stay in flight for as long as the trainer's
            broadcast runs, so this one is long.
        generate: generation requests (prefill plus decode of a whole completion).
        liveness: not a deadline: while a weight-sync call (the ``update`` phase) is
            in flight, the server's ``/health`` is asked every this many seconds. A
            server that answers it with an error (vLLM's engine died: HTTP 503) or
            refuses the connection (its process is gone) fails the call then
            (`asyncsync.ServerUnavailableError`), instead of at the ``update``
            deadline: vLLM leaves a weight-sync call to a dead engine unanswered. A
            probe that gets no answer in time changes nothing (the ``update``
            deadline stands). ``None``: no probes.

    Each deadline covers the whole call: connecting, sending, waiting, reading the body.
    A call that passes its deadline raises `asyncsync.ServerTimeout`.
    """

    connect: float | None = 10.0
    control: float | None = 30.0
    update: float | None = 600.0
    generate: float | None = 600.0
    liveness: float | None = 5.0

    def __post_init__(self) -> None:
        for name in ("connect", "control", "update", "generate", "liveness"):
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

    def with_generate(self, seconds: float | None) -> Timeouts:
        """These deadlines with the generate phase's replaced (a per-call timeout)."""
        return replace(self, generate=seconds)

    @classmethod
    def uniform(cls, seconds: float | None) -> Timeouts:
        """The same deadline for every phase (handy in tests)."""
        return cls(connect=seconds, control=seconds, update=seconds, generate=seconds)


#: The default deadlines (frozen, so one object serves every client).
DEFAULT_TIMEOUTS = Timeouts()


def check_timeouts(timeouts: object, owner: str) -> Timeouts:
    """``timeouts`` itself; 0.1's ``timeouts=None`` (the defaults) with a
    DeprecationWarning (``None`` means "off" elsewhere); TypeError for anything else."""
    if timeouts is None:
        warn_deprecated(
            f"{owner}(timeouts=None)", "no timeouts argument (the defaults)", stacklevel=4
        )
        return DEFAULT_TIMEOUTS
    if not isinstance(timeouts, Timeouts):
        raise TypeError(f"timeouts must be a Timeouts, got {type(timeouts).__name__}")
    return timeouts
