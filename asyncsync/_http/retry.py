"""Retries for idempotent calls, as small pure functions.

Only calls that are safe to repeat are retried: the GET routes (``/health``,
``/version``, ``/weight_info``, ``/is_paused``, ``/get_world_size``, ``/v1/models``,
``/server_info``; a plan marks them ``idempotent``). Weight updates, pause, resume,
generations and every other POST are sent exactly once. The decision and the delay are
pure functions of the error, the attempt number and a random draw, so they are tested
without a network and without sleeping.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncsync._core.errors import ServerError, ServerTimeout, ServerUnavailableError

__all__ = [
    "NO_RETRY",
    "RetryPolicy",
    "backoff_delay",
    "is_retryable",
    "parse_retry_after",
    "retry_delay",
]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How idempotent calls are retried.

    Attributes:
        attempts: total attempts including the first one (1 = no retries).
        base_delay: the delay before the first retry, in seconds; it doubles per retry.
        max_delay: cap on the exponential delay.
        jitter: fraction of the delay drawn at random (0 = none, 1 = "full jitter"),
            so that many clients do not retry in lock step.
        retry_statuses: HTTP statuses worth retrying (overload and gateway errors).
        retry_timeouts: also retry a call that ran past its deadline. Off by default:
            a hung server would otherwise cost ``attempts`` deadlines.
        max_retry_after: cap, in seconds, on a server's ``Retry-After`` header.
    """

    attempts: int = 3
    base_delay: float = 0.1
    max_delay: float = 2.0
    jitter: float = 1.0
    retry_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    retry_timeouts: bool = False
    max_retry_after: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts!r}")
        if self.base_delay < 0 or self.max_delay < 0 or self.max_retry_after < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be within [0, 1], got {self.jitter!r}")

    @classmethod
    def off(cls) -> RetryPolicy:
        """A policy that never retries (one attempt)."""
        return NO_RETRY


NO_RETRY = RetryPolicy(attempts=1)


def is_retryable(error: BaseException, policy: RetryPolicy) -> bool:
    """Whether ``error`` from an idempotent call is worth another attempt under ``policy``."""
    if isinstance(error, ServerTimeout):
        return policy.retry_timeouts
    if isinstance(error, ServerUnavailableError):
        return True
    if isinstance(error, ServerError):
        return error.status is not None and error.status in policy.retry_statuses
    return False


def backoff_delay(retry: int, policy: RetryPolicy, rand: float) -> float:
    """Delay before retry number ``retry`` (1-based): capped exponential with jitter.

    ``rand`` is a uniform draw in [0, 1); a fraction ``policy.jitter`` of the capped delay
    is scaled by it.
    """
    if retry < 1:
        raise ValueError(f"retry is 1-based, got {retry!r}")
    capped = min(policy.max_delay, policy.base_delay * (2.0 ** (retry - 1)))
    return capped * (1.0 - policy.jitter) + capped * policy.jitter * rand


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date).

    Returns ``None`` when the header is absent or unreadable; never negative.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        current = time.time() if now is None else now
        seconds = when.timestamp() - current
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def retry_delay(
    retry: int,
    error: BaseException,
    policy: RetryPolicy,
    rand: Callable[[], float] = random.random,
) -> float:
    """The delay before retry ``retry`` after ``error``: the server's ``Retry-After``
    (capped by ``policy.max_retry_after``) when it sent one, else `backoff_delay`."""
    retry_after = getattr(error, "retry_after", None)
    if isinstance(retry_after, (int, float)) and not isinstance(retry_after, bool):
        return min(float(retry_after), policy.max_retry_after)
    return backoff_delay(retry, policy, rand())
