"""Trainer-side transports, behind a registry: name -> backend class.

``AsyncWeightPublisher(fleet, backend="shm", **options)`` looks the name up here and
creates the class with the publisher's rank, world size and API style plus the
backend's own options. Adding a transport means adding a module with a
`TrainerBackend` subclass and one `register_backend` line; the publish round
does not change. Classes are registered by module path and imported on first use, so
importing this package (the vLLM plugin does, inside every vLLM process) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncsync._publish.bridge import InitInfo
from asyncsync.backends._base import (
    RoundCancelled,
    SendControl,
    SendStats,
    TrainerApi,
    TrainerBackend,
)

__all__ = [
    "InitInfo",
    "RoundCancelled",
    "SendControl",
    "SendStats",
    "TrainerApi",
    "TrainerBackend",
    "backend_class",
    "create_backend",
    "register_backend",
    "registered_backends",
]

#: name -> backend class, or ``"module:Class"`` until first used.
_REGISTRY: dict[str, type[TrainerBackend] | str] = {
    "shm": "asyncsync.backends.shm:ShmBackend",
    "gloo": "asyncsync.backends.gloo:GlooBackend",
    "nccl": "asyncsync.backends.nccl:NcclBackend",
    "ipc": "asyncsync.backends.ipc:IpcBackend",
}


def register_backend(
    name: str, backend: type[TrainerBackend] | str, *, replace: bool = False
) -> None:
    """Register ``backend`` (a class, or ``"module:Class"``) under ``name``."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = backend


def registered_backends() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def backend_class(name: str) -> type[TrainerBackend]:
    """The class registered under ``name``; ValueError listing the registered ones."""
    try:
        entry = _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(n) for n in registered_backends())
        raise ValueError(
            f"backend {name!r} is not available in this build; registered backends: {known}"
        ) from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return entry


def create_backend(
    name: str, *, rank: int, world_size: int, api: TrainerApi, options: dict[str, Any]
) -> TrainerBackend:
    """A ``name`` backend; TypeError naming what it accepts for an unknown option."""
    cls = backend_class(name)
    accepted = cls.option_names()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "no options"
        raise TypeError(
            f"backend {name!r} got unknown option(s) {', '.join(unknown)}; it takes: {takes}"
        )
    return cls(rank=rank, world_size=world_size, api=api, **options)
