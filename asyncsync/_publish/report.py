"""What a round reports: its named phases, each server's outcome, the round's figures."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import AsyncSyncError, PublishError, WeightsModifiedError
from asyncsync._publish.verify import VerifyResult

__all__ = ["SECONDS_ORDER", "Phase", "PublishReport", "ServerOutcome", "cause", "publish_error"]

#: vLLM's worker failures wrap the cause: "Call to collective_rpc method failed: Worker
#: failed with error '<cause>', please check the stack trace above for the root cause".
_WORKER_CAUSE = re.compile(r"Worker failed with error '(.*)', please check", re.S)

#: The order of ``PublishReport.seconds`` (optional phases only when they ran).
SECONDS_ORDER = (
    "init",
    "probe",
    "pause",
    "start",
    "pack",
    "transfer",
    "finish",
    "reset_prefix_cache",
    "verify",
    "resume",
)


class Phase(StrEnum):
    """The named phases of a round (``ServerOutcome.phase`` holds one)."""

    INIT = "init"
    PROBE = "probe"
    PAUSE = "pause"
    START = "start"
    UPDATE = "update"
    FINISH = "finish"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    VERIFY = "verify"
    RESUME = "resume"

    @property
    def seconds_key(self) -> str:
        """Its key in ``PublishReport.seconds`` (the update fan-outs are "transfer")."""
        return "transfer" if self is Phase.UPDATE else self.value


@dataclass
class ServerOutcome:
    """What happened on one server during a round.

    Attributes:
        url: the server.
        ok: it went through the whole round (it holds the round's weights).
        phase: the phase it failed in (None when ok).
        error: why (None when ok).
        dirty: it holds weights of no published version and serves nothing until a
            later round finishes there.
        reached: False when nothing of the round reached it: every call it was sent
            failed to connect (refused, or no connection in time). It is still
            ``dirty``: a round resyncs it once it answers.
    """

    url: str
    ok: bool
    phase: str | None = None
    error: BaseException | None = None
    dirty: bool = False
    reached: bool = True

    def __repr__(self) -> str:
        if self.ok:
            return f"<ServerOutcome {self.url} ok>"
        never = "" if self.reached else " never reached,"
        return f"<ServerOutcome {self.url}{never} failed at {self.phase}: {self.error!s}>"


@dataclass
class PublishReport:
    """The figures of one published round.

    Attributes:
        version: the version published.
        servers: the servers that hold it now, in fleet order.
        lost: the servers that dropped out of the round, in fleet order (their errors
            are in ``outcomes``); each is dirty until a later round reaches it.
        bytes: payload bytes sent (of the last attempt).
        chunks: payloads sent (of the last attempt).
        params: tensors published.
        seconds: per phase (``init``, ``probe``, ``pause``, ``start``, ``pack``,
            ``transfer``, ``finish``, ``reset_prefix_cache``, ``verify``, ``resume``,
            as they ran) and ``total``.
        outcomes: every targeted server's `ServerOutcome`.
        verified: what ``verify=`` found on each server (empty when the round did not
            verify).
        attempts: 2 when a collective transport (gloo, nccl) lost a server and the round
            was sent again to the others in a new group; else 1.
        delta: a round of ``publish(..., delta=True)``: whether it was a delta or a full
            one and what changed (a ``DeltaStats``); None otherwise.
        into: what the round loaded into: ``"main"`` (the served model) or
            ``"draft"`` (its speculative draft model; ``version`` is then the draft's,
            and the servers' served versions did not change).
        ceiling_gb_per_s: the rate the hardware allows this transport, in GB/s: shm
            this host's memcpy, ipc a device-to-device copy on the trainer's GPU, gloo
            and nccl the link (``link_gb_per_s=`` when given; gloo measures loopback
            or reads the interface's rate). Measured once per publisher, before its
            first round, off the event loop; None when unknown (nccl without a given
            rate).
        ceiling_basis: what ``ceiling_gb_per_s`` is, in words (None with it).
    """

    version: str
    servers: list[str]
    bytes: int
    chunks: int
    params: int
    seconds: dict[str, float]
    outcomes: dict[str, ServerOutcome] = field(default_factory=dict)
    verified: dict[str, VerifyResult] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    attempts: int = 1
    delta: Any = None
    into: str = "main"
    ceiling_gb_per_s: float | None = None
    ceiling_basis: str | None = None

    @property
    def target(self) -> str:
        """Deprecated: `into`."""
        warn_deprecated("PublishReport.target", "PublishReport.into")
        return self.into

    @property
    def never_reached(self) -> list[str]:
        """The lost servers nothing of the round reached (it could not connect to
        them), in fleet order."""
        return [url for url in self.lost if url in self.outcomes and not self.outcomes[url].reached]

    @property
    def total_seconds(self) -> float:
        return self.seconds.get("total", 0.0)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes per second of the whole round (pack + transfer + finish)."""
        total = self.total_seconds
        return self.bytes / total / 1e9 if total > 0 else 0.0

    @property
    def efficiency(self) -> float | None:
        """How close the round came to the hardware's limit: `gb_per_s` over
        ``ceiling_gb_per_s`` (None without a ceiling). A slow round on a fast machine
        shows as a low value; a round at the machine's limit as one near 1."""
        if not self.ceiling_gb_per_s:
            return None
        return self.gb_per_s / self.ceiling_gb_per_s

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.seconds.items())
        never = self.never_reached
        lost = ", ".join(f"{u} (never reached)" if u in never else u for u in self.lost)
        lost = f"; lost {lost}" if lost else ""
        draft = " (draft model)" if self.into == "draft" else ""
        limit = ""
        if self.efficiency is not None and self.ceiling_gb_per_s is not None:
            limit = (
                f", {self.efficiency:.3f} of the ceiling "
                f"({_rate(self.ceiling_gb_per_s)}: {self.ceiling_basis or 'given'})"
            )
        return (
            f"published {self.version!r}{draft} to {len(self.servers)} server(s){lost}: "
            f"{self.bytes / 1e6:.1f} MB in {self.chunks} chunk(s), {_rate(self.gb_per_s)}"
            f"{limit} ({phases})"
        )


def _rate(gb_per_s: float) -> str:
    return f"{gb_per_s:.2f} GB/s" if gb_per_s >= 0.1 else f"{gb_per_s * 1000:.1f} MB/s"


def publish_error(
    version: str,
    published_version: str | None,
    outcomes: Mapping[str, ServerOutcome],
    exc: BaseException,
) -> PublishError:
    """The error of a round that could not be published: each failed server's cause
    first, the version that stays, the servers left dirty."""
    failed = [o for o in outcomes.values() if not o.ok]
    dirty = [o.url for o in outcomes.values() if o.dirty]
    never = [o.url for o in failed if not o.reached]
    lines = "; ".join(f"{o.url} failed at {o.phase}: {cause(o.error)}" for o in failed)
    message = (
        f"publishing version {version!r} failed ({lines or cause(exc)}); "
        f"published version stays {published_version!r}"
    )
    if isinstance(exc, WeightsModifiedError):  # the trainer's fault, typed as such
        return WeightsModifiedError(
            message, parameters=exc.parameters, version=version, outcomes=outcomes,
            needs_resync=dirty, never_reached=never,
        )  # fmt: skip
    return PublishError(
        message, version=version, outcomes=outcomes, needs_resync=dirty, never_reached=never
    )


def cause(error: BaseException | None) -> str:
    """An error in a sentence that leads with its cause: vLLM's worker failures are
    unwrapped (the wrapper stays in the error itself)."""
    if error is None:
        return "unknown error"
    text = error.message if isinstance(error, AsyncSyncError) else str(error)
    found = _WORKER_CAUSE.search(text)
    if found is None:
        return str(error)
    where = f" [{error.server} {error.route}]" if isinstance(error, AsyncSyncError) else ""
    return f"{found[1]}{where} (the worker's error; vLLM's full text is in the outcome)"
