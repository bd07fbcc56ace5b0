"""How one publish round runs, besides its weights, version and servers: `RoundOptions`,
built once from ``publish()``'s keywords (or by the catch-up round), validated when
built, and passed through to the round as one value."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from asyncsync._publish.draft import Target, check_target
from asyncsync._publish.progress import ProgressFn
from asyncsync._publish.round import PauseMode
from asyncsync._publish.verify import Verify

__all__ = ["PAUSE_MODES", "RoundOptions", "servers_needed"]

#: ``publish(pause=...)``: None (no pause) or one of vLLM's pause modes.
PAUSE_MODES: tuple[PauseMode | None, ...] = (None, "keep", "wait", "abort")


@dataclass(frozen=True, slots=True)
class RoundOptions:
    """One round's options (``publish()``'s keywords, read once).

    Attributes:
        pause: how the servers pause generation during the update (None: not paused).
        reset_prefix_cache: whether the servers' prefix caches are reset after it.
        progress: a progress bar (True/False/None: automatic) or a callback.
        verify: the checks every server passes once it finished (None: none).
        min_servers: how many targets the round needs (``"all"``: every one).
        delta: send only what changed since the version every target acknowledged.
        into: the main model or the speculative draft model.
        catch_up: the round resends the published weights to stale servers (the main
            model, whole, checked by no one: never a caller's round).

    Raises:
        ValueError/TypeError naming the field, when built with a bad value.
    """

    pause: PauseMode | None = None
    reset_prefix_cache: bool = True
    progress: bool | ProgressFn | None = None
    verify: Verify | None = None
    min_servers: int | Literal["all"] = 1
    delta: bool = False
    into: Target = "main"
    catch_up: bool = False

    def __post_init__(self) -> None:
        check_target(self.into, verify=self.verify)
        if self.pause not in PAUSE_MODES:
            raise ValueError(f"pause must be None, 'keep', 'wait' or 'abort', got {self.pause!r}")
        min_servers = self.min_servers
        if min_servers != "all" and (
            not isinstance(min_servers, int) or isinstance(min_servers, bool) or min_servers < 1
        ):
            raise ValueError(f"min_servers must be an int >= 1 or 'all', got {min_servers!r}")
        for name in ("reset_prefix_cache", "delta", "catch_up"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if self.catch_up and (self.delta or self.into != "main" or self.verify is not None):
            raise ValueError(
                "a catch-up round resends the main model's published weights whole: "
                "no delta, draft target or verify"
            )

    def need(self, targets: Sequence[str]) -> int:
        """How many of ``targets`` the round needs, or ValueError (`servers_needed`)."""
        return servers_needed(self.min_servers, targets)


def servers_needed(min_servers: object, targets: Sequence[str]) -> int:
    """How many of ``targets`` a round needs (``min_servers``: an int >= 1 or
    ``"all"``), or ValueError naming what is wrong."""
    if min_servers == "all":
        return len(targets)
    if not isinstance(min_servers, int) or isinstance(min_servers, bool) or min_servers < 1:
        raise ValueError(f"min_servers must be an int >= 1 or 'all', got {min_servers!r}")
    if min_servers > len(targets):
        raise ValueError(
            f"min_servers={min_servers} but the round targets {len(targets)} server(s)"
        )
    return min_servers
