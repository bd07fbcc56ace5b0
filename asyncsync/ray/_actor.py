"""The Ray actor that runs one vLLM server as a subprocess.

vLLM's own Ray executor does not run on the CPU platform, and verl, SkyRL and the like
run each server under an actor as a plain process (vLLM's multiprocessing executor)
too. The server runs in a session of its own, which Ray does not kill with the actor;
its watchdog (``LocalVLLMServer(watchdog=True)``) does: when the actor's process dies,
however it dies, the server's process group is terminated and its ring buffers removed.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from asyncsync._fleet.hosts import this_host
from asyncsync.testing import LocalVLLMServer

__all__ = ["ServerActor"]


class ServerActor:
    """One vLLM server (a `LocalVLLMServer` with a watchdog) owned by a Ray actor.

    Every method is a coroutine: Ray runs them on the actor's event loop, so `stop` can
    be called while a `start` is still waiting for the server.
    """

    def __init__(self, model_dir: str, index: int, options: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.index = index
        self.options = dict(options)
        self.server: LocalVLLMServer | None = None

    async def start(self) -> dict[str, Any]:
        """Start the server (on this node's address unless ``host`` was given) and
        answer `server_info`."""
        if self.server is not None:
            raise RuntimeError("this actor's server is already started")
        options = dict(self.options)
        host = options.pop("host", None) or ray.util.get_node_ip_address()
        if options.get("cpu_cores") is not None:
            # Ray sets OMP_NUM_THREADS=1 in actors; the server's own core list decides.
            os.environ.pop("OMP_NUM_THREADS", None)
        self.server = LocalVLLMServer(self.model_dir, host=host, watchdog=True, **options)
        await self.server.astart()
        return await self.server_info()

    async def server_info(self) -> dict[str, Any]:
        """``url``, ``host`` (the host identity: same machine and network stack as
        another process iff equal), Ray's ``node_id``, the server's process group
        ``pgid``, this actor's ``pid``, ``cpu_cores``, ``log_path``, its vLLM ring
        buffers in /dev/shm (``ring_buffers``), ``index``."""
        server = self.server
        if server is None or server.process is None:
            raise RuntimeError("this actor's server is not running")
        return {
            "url": server.url,
            "host": this_host(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pgid": server.process.pid,
            "pid": os.getpid(),
            "cpu_cores": server.cpu_cores,
            "log_path": str(server.log_path),
            "ring_buffers": sorted(server.ring_buffers),
            "index": self.index,
        }

    async def stop(self) -> None:
        """Stop the server and wait until none of its processes is left."""
        server, self.server = self.server, None
        if server is not None:
            await server.astop()
