"""Trainer-side transports, behind a registry: name -> backend class.

``AsyncWeightPublisher(fleet, backend=Shm(buffer_bytes=...))`` (or the name alone,
``backend="shm"``, for the defaults) looks the backend up here and creates it with the
publisher's rank, world size and API style plus the options: `Shm`, `Gloo`,
`NCCL` and `IPC` are the built-in transports' typed options. Adding a transport means
adding a module with a `TrainerBackend` subclass (and its options class), written
against `asyncsync.backends.contract` alone, and one `register_backend` line; the
publish round does not change. Classes are registered by
module path and imported on first use, so importing this package (the vLLM plugin does,
inside every vLLM process) stays cheap.
"""

from __future__ import annotations

import importlib

from asyncsync.backends._options import IPC, NCCL, Auto, Gloo, Shm
from asyncsync.backends.contract import (
    BackendOptions,
    Ceiling,
    InitInfo,
    RoundCancelled,
    SendControl,
    SendStats,
    TrainerApi,
    TrainerBackend,
)

__all__ = [
    "IPC",
    "NCCL",
    "Auto",
    "BackendOptions",
    "Ceiling",
    "Gloo",
    "InitInfo",
    "RoundCancelled",
    "SendControl",
    "SendStats",
    "Shm",
    "TrainerApi",
    "TrainerBackend",
    "backend_class",
    "create_backend",
    "options_for",
    "register_backend",
    "registered_backends",
]

#: name -> backend class, or ``"module:Class"`` until first used.
_REGISTRY: dict[str, type[TrainerBackend] | str] = {
    "shm": "asyncsync.backends.shm:ShmBackend",
    "gloo": "asyncsync.backends.gloo:GlooBackend",
    "nccl": "asyncsync.backends.nccl:NcclBackend",
    "ipc": "asyncsync.backends.ipc:IpcBackend",
    "auto": "asyncsync.backends.auto:AutoBackend",
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


def options_for(backend: str | BackendOptions) -> tuple[str, BackendOptions]:
    """The registered name and the options ``backend`` stands for: options name their
    backend; a name stands for its backend's default options."""
    if isinstance(backend, BackendOptions):
        name = getattr(type(backend), "name", None)
        if not isinstance(name, str):
            raise TypeError(f"{type(backend).__name__} options name no backend (a 'name')")
        backend_class(name)  # nothing registered under that name: ValueError
        return name, backend
    if not isinstance(backend, str):
        raise TypeError(
            "backend must be a registered name or its options (e.g. "
            f"asyncsync.backends.Shm(...)), got {type(backend).__name__}"
        )
    return backend, backend_class(backend).options_class()


def create_backend(
    name: str, options: BackendOptions, *, rank: int, world_size: int, api: TrainerApi
) -> TrainerBackend:
    """The backend registered as ``name``, built with ``options``."""
    cls = backend_class(name)
    if not isinstance(options, cls.options_class):
        raise TypeError(
            f"backend {name!r} takes {cls.options_class.__name__} options, got "
            f"{type(options).__name__}"
        )
    return cls(rank=rank, world_size=world_size, api=api, **options.as_kwargs())
