"""The registry behind `asyncsync.metrics`: which hooks are registered, and the
calls that report events to them (made by the publisher, clients and fleets).

Kept apart from `asyncsync.metrics` (the public protocol and the adapters) so that
the low layers that report events import nothing above them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from asyncsync._core.completion import Completion

__all__ = [
    "add",
    "generated",
    "health_changed",
    "publish_failed",
    "published",
    "registered",
    "remove",
]

logger = logging.getLogger("asyncsync.metrics")

_hooks: list[Any] = []


def add(hook: Any) -> None:
    if hook not in _hooks:
        _hooks.append(hook)


def remove(hook: Any) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def registered() -> tuple[Any, ...]:
    return tuple(_hooks)


def _notify(event: str, *args: object) -> None:
    for hook in tuple(_hooks):
        method = getattr(hook, event, None)
        if method is None:  # a hook written before this event existed
            continue
        try:
            method(*args)
        except Exception:  # a broken hook must not break a round or a generation
            logger.exception("metrics hook %r failed in %s", hook, event)


def published(report: object) -> None:
    """Report a successful round's ``PublishReport``."""
    if _hooks:
        _notify("on_publish", report)


def publish_failed(version: str, error: BaseException) -> None:
    """Report a failed round's version and ``PublishError``."""
    if _hooks:
        _notify("on_publish_failed", version, error)


def generated(completions: Iterable[Completion]) -> None:
    """Report completions, one call per completion."""
    if _hooks:
        for completion in completions:
            _notify("on_generation", completion)


def health_changed(url: str, old: str, new: str) -> None:
    """Report a server's move in the fleet's state machine (``healthy``, ``suspect``,
    ``stale``, ``dead``, ``retired``)."""
    if _hooks:
        _notify("on_server_health", url, old, new)
