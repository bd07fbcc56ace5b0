"""Routers in front of test servers: ``vllm-router`` when it is installed and runs, else
a small round-robin proxy of asyncsync's own (aiohttp, in this process).

Both forward every request to one backend at a time, as a router does: what goes
through them is what a fleet with ``router_url=...`` sends (generations), never a
weight call (which a router would give to one replica only).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import aiohttp
from aiohttp import web

from asyncsync.testing._server import free_port

__all__ = ["RoundRobinProxy", "VllmRouter", "router_for"]

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


class RoundRobinProxy:
    """An HTTP proxy that sends each request to the next backend in turn (streams too).

    ``async with RoundRobinProxy(urls) as proxy: proxy.url``; ``proxy.forwarded`` counts
    the requests each backend got.
    """

    kind = "asyncsync round-robin proxy"

    def __init__(self, backends: Sequence[str], *, timeout: float = 600.0) -> None:
        if not backends:
            raise ValueError("a router needs at least one backend")
        self.backends = [b.rstrip("/") for b in backends]
        self.forwarded = dict.fromkeys(self.backends, 0)
        self._next = itertools.cycle(self.backends)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        #: why this proxy stands in for vllm-router (`router_for`), if it does
        self.fallback_reason: str | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        backend = next(self._next)
        self.forwarded[backend] += 1
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method, backend + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    response.headers[key] = value
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def __aenter__(self) -> RoundRobinProxy:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


class VllmRouter:
    """The ``vllm-router`` package's router (Rust) as a subprocess, round robin."""

    kind = "vllm-router"

    def __init__(self, backends: Sequence[str], *, startup_timeout: float = 60.0) -> None:
        self.backends = [b.rstrip("/") for b in backends]
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.url = ""

    @staticmethod
    def executable() -> str | None:
        """The ``vllm-router`` console script beside this Python, or on PATH."""
        here = Path(sys.executable).with_name("vllm-router")
        return str(here) if here.exists() else shutil.which("vllm-router")

    async def __aenter__(self) -> VllmRouter:
        exe = self.executable()
        if exe is None:
            raise FileNotFoundError("vllm-router is not installed")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __aexit__
        self.process = await asyncio.to_thread(
            subprocess.Popen,
            [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--worker-urls", *self.backends, "--log-level", "warning",
             # its metrics exporter listens too (default 29000): a free port of its own
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    await self.__aexit__(None, None, None)
                    raise RuntimeError(f"vllm-router exited with {code}: {self._tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.url + "/version") as resp:
                        if resp.status == 200:
                            return self
                if time.monotonic() > deadline:
                    await self.__aexit__(None, None, None)
                    raise TimeoutError(f"vllm-router not ready within {self.startup_timeout} s")
                await asyncio.sleep(0.2)

    def _tail(self) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self.process = self.process, None
        log, self.log = self.log, None
        if log is not None:
            log.close()
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.to_thread(process.wait)


@contextlib.asynccontextmanager
async def router_for(backends: Sequence[str]) -> AsyncIterator[VllmRouter | RoundRobinProxy]:
    """``vllm-router`` in front of ``backends`` where it is installed and runs, else the
    round-robin proxy (``router.kind`` says which)."""
    router: VllmRouter | RoundRobinProxy
    try:
        router = await VllmRouter(backends).__aenter__()
    except (OSError, RuntimeError, TimeoutError) as exc:
        router = await RoundRobinProxy(backends).__aenter__()
        router.fallback_reason = f"vllm-router unavailable: {exc}"
    try:
        yield router
    finally:
        await asyncio.shield(router.__aexit__(None, None, None))
