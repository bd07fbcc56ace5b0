"""The progress of a publish round: a user callback or a tqdm bar (when available)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Progress", "ProgressFn", "in_notebook", "progress_enabled", "progress_reporter"]

#: Called after each chunk is announced with ``(chunks so far, bytes so far)``.
ProgressFn = Callable[[int, int], None]


def progress_enabled(progress: bool | None) -> bool:
    """Whether to draw a bar: as asked, else in a Jupyter kernel or on a terminal, and
    never in CI (``CI``) or when ``ASYNCSYNC_NO_PROGRESS`` is set."""
    if progress is not None:
        return progress
    if os.environ.get("CI") or os.environ.get("ASYNCSYNC_NO_PROGRESS"):
        return False
    return in_notebook() or sys.stderr.isatty()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (its stderr is no terminal, yet
    ``tqdm.auto`` draws a notebook bar there)."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return shell is not None and hasattr(shell, "kernel")


class Progress:
    """A tqdm bar over the round's bytes (silent when disabled or without tqdm)."""

    def __init__(self, enabled: bool, total_bytes: int | None, version: str) -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"publish {version}")
        self._last = 0

    def __call__(self, chunks: int, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes - self._last)
            self._last = nbytes

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_reporter(
    progress: bool | ProgressFn | None,
    total_bytes: Callable[[], int | None] | None,
    version: str,
) -> tuple[ProgressFn, Progress | None]:
    """The per-chunk reporter for ``publish(progress=...)`` and the bar to close after
    the round (None when the caller passed its own callback). ``total_bytes`` is asked
    only when a bar is drawn."""
    if callable(progress):
        return progress, None
    enabled = progress_enabled(progress)
    total = total_bytes() if enabled and total_bytes is not None else None
    bar = Progress(enabled, total, version)
    return bar, bar
