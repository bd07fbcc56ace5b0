"""The version gate of a fleet (``Fleet.wait_for_version``) and the check of a
concurrency limit."""

from __future__ import annotations

import time

from asyncsync._core.errors import GenerationError
from asyncsync._core.ledger import Ledger

__all__ = ["check_limit", "holds", "wait_for_version"]


def holds(ledger: Ledger, url: str, version: str) -> bool:
    """``url`` holds ``version`` or a newer published one and is fit to serve."""
    record = ledger.record(url)
    return (
        record.unfit() is None
        and record.health == "healthy"
        and ledger.history().at_least(record.weight_version, version)
    )


async def wait_for_version(
    ledger: Ledger,
    urls: list[str],
    version: str,
    count: int | None,
    timeout: float | None,  # noqa: ASYNC109 - a gate with a deadline
) -> list[str]:
    """Wait until ``count`` of ``urls`` (default: all of them) hold ``version`` or a
    newer published one and are fit to serve; see `asyncsync.Fleet.wait_for_version`."""
    need = len(urls) if count is None else count
    if not 1 <= need <= max(len(urls), 1):
        raise ValueError(f"count must be between 1 and {len(urls)}, got {count!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    ready: list[str] = []

    def reached() -> bool:
        ready[:] = [u for u in urls if u in ledger and holds(ledger, u, version)]
        return len(ready) >= need

    if not await ledger.wait_until(reached, deadline):
        raise GenerationError(
            f"only {len(ready)} of {need} server(s) reached version {version!r} "
            f"within {timeout:g} s"
        )
    return ready


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"a concurrency limit must be an int >= 1 or None, got {limit!r}")
