"""Small shared types: literals every layer names, and the per-server outcome of a
fleet call.

A leaf module: it imports nothing from asyncsync but the exception tree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import AsyncSyncError, FleetError

__all__ = [
    "PAUSE_MODES",
    "REQUIRE",
    "CallOutcome",
    "FleetResult",
    "PauseMode",
    "Phase",
    "ProtocolGeneration",
    "Require",
    "Route",
    "check_require",
    "pause_mode",
]

T = TypeVar("T")

#: How in-flight requests are treated by ``/pause``: ``abort`` them, ``wait`` for them,
#: or ``keep`` them frozen until ``/resume``.
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")

#: The RL protocol generation a server speaks: ``"0.23"`` (vLLM 0.23 up to 0.32) or
#: ``"0.32"`` (vLLM >= 0.32). See `asyncsync._wire.control`.
ProtocolGeneration = Literal["0.23", "0.32"]

#: The phase a route belongs to; each phase has its own deadline (see ``Timeouts``).
Phase = Literal["control", "update", "generate"]

#: Which route a generation uses: ``"auto"`` (``/inference/v1/generate`` where the
#: server offers it, else ``/v1/completions``), ``"generate"`` or ``"completions"``.
Route = Literal["auto", "generate", "completions"]

#: Partial-failure policy of a fleet call: ``"all"`` targets must succeed (else
#: `FleetError`), ``"any"`` one success is enough (the call raises only
#: when every target failed), ``"none"`` never raises (inspect the result).
Require = Literal["all", "any", "none"]
REQUIRE: tuple[Require, ...] = ("all", "any", "none")


def pause_mode(mode: PauseMode | None, owner: str) -> PauseMode:
    """``mode`` itself, or 0.1's default when none was given (``"abort"``, which drops
    every request in flight) with a DeprecationWarning."""
    if mode is None:
        warn_deprecated(
            f"{owner}.pause() without a mode",
            "pause('abort'), pause('wait') or pause('keep')",
            stacklevel=4,
        )
        return "abort"
    return mode


def check_require(require: str) -> Require:
    """``require`` itself, or ValueError naming the accepted values."""
    if require not in REQUIRE:
        raise ValueError(f"require must be one of {REQUIRE}, got {require!r}")
    return require


@dataclass(frozen=True, slots=True)
class CallOutcome(Generic[T]):
    """One server's result of one fleet call (a `FleetResult` holds one per server): a
    value or an error, and how long it took. (A publish round's per-server outcome is
    `ServerOutcome`.) Was ``Outcome`` before 0.2.0."""

    url: str
    value: T | None = None
    error: Exception | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> T:
        """The value, or raise the error."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class FleetResult(Mapping[str, CallOutcome[T]]):
    """Per-server outcomes of one fleet call, keyed by URL in fleet order."""

    operation: str
    outcomes: dict[str, CallOutcome[T]] = field(default_factory=dict)

    def __getitem__(self, url: str) -> CallOutcome[T]:
        return self.outcomes[url]

    def __iter__(self) -> Iterator[str]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> bool:
        """Every targeted server succeeded."""
        return all(o.ok for o in self.outcomes.values())

    @property
    def values_by_url(self) -> dict[str, T]:
        """Successful servers' values, by URL in fleet order (``values()`` is the
        mapping's own: every outcome)."""
        return {u: o.value for u, o in self.outcomes.items() if o.ok}  # type: ignore[misc]

    @property
    def errors(self) -> dict[str, Exception]:
        """Failed servers' errors."""
        return {u: o.error for u, o in self.outcomes.items() if o.error is not None}

    @property
    def succeeded(self) -> tuple[str, ...]:
        return tuple(u for u, o in self.outcomes.items() if o.ok)

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(u for u, o in self.outcomes.items() if not o.ok)

    def raise_on_failure(self, require: Require = "all") -> None:
        """Raise `FleetError` if ``require`` is not met."""
        failed = self.failed
        if not failed or require == "none":
            return
        if require == "any" and len(failed) < len(self.outcomes):
            return
        raise self.error()

    def error(self) -> FleetError:
        """A `FleetError` of the failed servers' errors."""
        errors = self.errors
        parts = "; ".join(f"{url} ({_reason(err)})" for url, err in errors.items())
        message = f"{self.operation} failed on {len(errors)} of {len(self)} servers: {parts}"
        return FleetError(
            message, list(errors.values()), operation=self.operation, outcomes=self.outcomes
        )

    def __repr__(self) -> str:
        return (
            f"FleetResult({self.operation!r}, succeeded={len(self.succeeded)}, "
            f"failed={list(self.failed)})"
        )


def _reason(error: BaseException) -> str:
    text = error.message if isinstance(error, AsyncSyncError) else str(error)
    text = " ".join(text.split())
    if len(text) > 200:
        text = text[:200] + "..."
    status = f" HTTP {error.status}" if isinstance(error, AsyncSyncError) and error.status else ""
    return f"{type(error).__name__}{status}: {text}"
