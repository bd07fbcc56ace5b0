"""vLLM servers as Ray actors: launch, place, discover, clean up (the ``[ray]`` extra).

::

    import ray
    import asyncsync as az
    import asyncsync.ray

    ray.init()
    async with asyncsync.ray.launch_servers(model_dir, num_servers=2) as group:
        async with group.fleet() as fleet:
            async with az.AsyncWeightPublisher(fleet, backend="auto") as publisher:
                await publisher.publish(model, version="step-1")

``import asyncsync`` never imports Ray; ``import asyncsync.ray`` does, and says how to
install it when it is missing. See docs/ray.md.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401 - the extra's one dependency, checked here
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "asyncsync.ray needs Ray, which is not installed: install asyncsync's ray extra "
        "(pip install -e '.[ray]' in asyncsync's clone) into the environment that has "
        "your torch (a fresh one may resolve a CUDA torch)"
    ) from exc

from asyncsync._fleet.hosts import this_host
from asyncsync.ray._actor import ServerActor
from asyncsync.ray._group import (
    Launch,
    Placement,
    PlacementTimeoutError,
    RayNotInitializedError,
    ServerGroup,
    launch_servers,
)

__all__ = [
    "Launch",
    "Placement",
    "PlacementTimeoutError",
    "RayNotInitializedError",
    "ServerActor",
    "ServerGroup",
    "launch_servers",
    "this_host",
]
