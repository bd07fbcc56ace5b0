"""LoRA adapter rounds: ``AsyncWeightPublisher.publish_lora`` and the adapters' lifetime.

A round writes the adapter once (per host: a tmpfs directory private to the publisher,
or ``shared_dir`` for servers on other hosts) into a directory of its own, loads it on
every targeted server at once under the version's served name
(`asyncsync._fleet.adapters.served_name`), and commits the version when at least
``min_servers`` loaded it, like a weight round: a server that fails drops out (its base
weights are untouched, it is not dirty; for this adapter it keeps what it held), fewer
than ``min_servers``: `PublishError`, the version unchanged, the new version unloaded
again where it loaded.

Directory lifetime is correctness, not housekeeping: vLLM's ``finish_weight_update``
drops every adapter on the worker and reloads it lazily from its path, and a generation
with an adapter whose directory is gone kills the engine core. So a version's directory
is removed only when (a) the version is outside the kept window (the adapter's last
``max_staleness + 1`` published versions; 2 when the fleet has no staleness bound), (b)
no generation of this fleet is using it, and (c) every server that loaded it answered
its unload. A server that does not answer keeps the directory alive until it does.
After a base round, servers that lost their adapters (a restart: ``/v1/models`` no
longer lists them) get them loaded again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from asyncsync._core.errors import PublishError, UnsupportedVLLMError
from asyncsync._fleet.adapters import served_name
from asyncsync._publish.lora_adapter import Adapter, check_adapter, resolve_adapter, write_adapter
from asyncsync._publish.report import PublishReport, ServerOutcome, publish_error
from asyncsync._publish.round import run_to_the_end
from asyncsync._wire.lora import LoraLimits, is_already_loaded, is_not_found

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = ["LoraRounds", "is_local_url"]

logger = logging.getLogger("asyncsync.publish")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LOOPBACK = ("localhost", "127.", "::1", "[::1]")
#: The outcome phase of a server that failed to load a round's adapter.
LOAD_PHASE = "load_lora"


def is_local_url(url: str) -> bool:
    """Whether ``url``'s server runs on this host (a loopback address, this host's name)."""
    host = urlsplit(url).hostname or ""
    if host.startswith(_LOOPBACK) or host == "0.0.0.0":
        return True
    import socket

    return host in (socket.gethostname(), socket.getfqdn())


def default_root() -> Path:
    """A tmpfs directory private to this process (``/dev/shm`` where it exists)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"asyncsync_lora-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class LoraRounds:
    """One publisher's adapters: rounds, the directories, their collection."""

    def __init__(self, fleet: Fleet, executor: Executor) -> None:
        self.fleet = fleet
        self.ledger = fleet.ledger
        self.executor = executor
        self._root: Path | None = None
        #: (name, version) -> its directory (alive until collected)
        self.dirs: dict[tuple[str, str], Path] = {}
        #: name -> the servers its last round targeted (re-loaded after a base round)
        self.targets: dict[str, list[str]] = {}
        self._limits: dict[str, LoraLimits] = {}

    # ------------------------------------------------------------------ a round
    async def publish(
        self,
        name: str,
        adapter: Any,
        *,
        version: str,
        targets: list[str],
        need: int,
        config: Any,
        base: Any,
        shared_dir: str | os.PathLike[str] | None,
    ) -> PublishReport:
        began = time.perf_counter()
        _check_round(name, version, self.ledger.adapter_history(name).versions)
        loop = asyncio.get_running_loop()
        # off the loop: a host name may be looked up, the tmpfs is looked at
        where = await loop.run_in_executor(self.executor, self._where, targets, shared_dir)
        limits = await self._lora_limits(targets)
        max_rank = min((x.max_lora_rank for x in limits if x.max_lora_rank), default=None)
        # Read, checked and written off the loop, before any server is touched.
        resolved = await loop.run_in_executor(
            self.executor, _prepare, adapter, config, base, max_rank
        )
        directory = where / _safe(name) / f"{_safe(version)}-{uuid.uuid4().hex[:8]}"
        written = await loop.run_in_executor(self.executor, write_adapter, directory, resolved)
        self.dirs[(name, version)] = directory
        seconds = {"write": time.perf_counter() - began}
        loaded = await run_to_the_end(self._load(name, version, directory, targets))
        seconds["load"] = time.perf_counter() - began - seconds["write"]
        ok = [u for u in targets if loaded[u].ok]
        outcomes = {u: _outcome(u, loaded[u]) for u in targets}
        if len(ok) < need:
            await run_to_the_end(self._unload(name, version, ok))
            await self.collect(name)
            raise _lora_error(name, version, self.ledger.adapter_current(name), outcomes, need)
        self.ledger.adapter_published(name, version)
        self.targets[name] = list(targets)
        lost = [u for u in targets if u not in ok]
        if lost:
            logger.warning("adapter %r %r: lost %s", name, version, ", ".join(lost))
        await self.collect(name)
        seconds["total"] = time.perf_counter() - began
        return PublishReport(
            version=version, servers=ok, bytes=written, chunks=1, params=len(resolved.tensors),
            seconds=seconds, outcomes=outcomes, lost=lost,
        )  # fmt: skip

    def _where(self, targets: Sequence[str], shared_dir: str | os.PathLike[str] | None) -> Path:
        """The directory the round's servers can all read: ``shared_dir``, or this
        host's tmpfs when every target runs here."""
        if shared_dir is not None:
            return Path(shared_dir)
        remote = [u for u in targets if not is_local_url(u)]
        if remote:
            raise ValueError(
                f"publish_lora: {', '.join(remote)} run(s) on another host, which cannot read "
                "this host's tmpfs: pass shared_dir= (a directory every server and this "
                "trainer can read, e.g. a shared filesystem mount)"
            )
        if self._root is None:
            self._root = default_root()
        return self._root

    async def _lora_limits(self, targets: list[str]) -> list[LoraLimits]:
        """Each target's LoRA configuration (read once): refused before anything is
        written when a server cannot load adapters at runtime."""
        unknown = [u for u in targets if u not in self._limits]
        if unknown:
            result = await self.fleet.lora_limits(targets=unknown, require="none")
            for url in unknown:
                outcome = result[url]
                if outcome.error is None:
                    self._limits[url] = outcome.unwrap()
        for url in targets:
            found = self._limits.get(url)
            if found is not None and not (found.enabled and found.runtime_updates):
                missing = "--enable-lora" if not found.enabled else ""
                if not found.runtime_updates:
                    missing += (" and " if missing else "") + "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
                raise UnsupportedVLLMError(
                    self.fleet.state(url).vllm_version or "this vLLM",
                    f"runtime LoRA adapters (start the server with {missing})",
                    server=url,
                )
        return [self._limits[u] for u in targets if u in self._limits]

    async def _load(
        self, name: str, version: str, directory: Path, urls: list[str]
    ) -> dict[str, _Loaded]:
        """Load the version on ``urls`` at once; a name already loaded there counts."""
        out: dict[str, _Loaded] = {}
        if not urls:
            return out
        served = served_name(name, version)
        result = await self.fleet.load_lora_adapter(
            served, str(directory), targets=urls, require="none"
        )
        for url in urls:
            error = result[url].error
            if error is None or is_already_loaded(error):
                self.ledger.adapter_loaded(url, name, version)
                out[url] = _Loaded(True, None)
            else:
                out[url] = _Loaded(False, error)
        return out

    async def _unload(self, name: str, version: str, urls: list[str]) -> None:
        """Unload the version where it is loaded; an unknown name counts as unloaded."""
        if not urls:
            return
        result = await self.fleet.unload_lora_adapter(
            served_name(name, version), targets=urls, require="none"
        )
        for url in urls:
            error = result[url].error
            if error is None or is_not_found(error):
                self.ledger.adapter_unloaded(url, name, version)
            else:
                logger.warning(
                    "adapter %r %r: %s did not unload (%s); its directory is kept",
                    name, version, url, error,
                )  # fmt: skip

    # ------------------------------------------------------------------ lifetime
    def window(self, name: str) -> set[str]:
        """The versions of ``name`` kept: its last ``max_staleness + 1`` published."""
        keep = self.fleet.max_staleness
        versions = self.ledger.adapter_history(name).versions
        return set(versions[-((keep if keep is not None else 1) + 1) :])

    async def collect(self, name: str | None = None) -> None:
        """Unload and remove the versions outside the window that nothing uses."""
        names = [name] if name is not None else sorted({n for n, _ in self.dirs})
        for adapter in names:
            kept = self.window(adapter)
            for key in [k for k in self.dirs if k[0] == adapter and k[1] not in kept]:
                await self._retire(*key)

    async def _retire(self, name: str, version: str, *, force: bool = False) -> None:
        if self.ledger.adapter_in_use(name, version) and not force:
            return  # a generation runs with it: the next collection tries again
        await run_to_the_end(
            self._unload(name, version, self.ledger.adapter_servers_with(name, version))
        )
        if self.ledger.adapter_servers_with(name, version):
            return  # a server that did not answer may still need the directory
        directory = self.dirs.pop((name, version))
        await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: shutil.rmtree(directory, ignore_errors=True)
        )
        logger.debug("adapter %r %r: directory %s removed", name, version, directory)

    async def after_base_round(self, servers: Sequence[str]) -> None:
        """A base round went through on ``servers``: vLLM reloads their adapters lazily
        from their directories, which are alive; a server that lost them (restarted:
        ``/v1/models`` no longer lists them) gets each adapter's newest version again."""
        wanted = {
            name: [u for u in urls if u in servers]
            for name, urls in self.targets.items()
            if self.ledger.adapter_current(name) is not None
        }
        urls = sorted({u for us in wanted.values() for u in us})
        if not urls:
            return
        listed = await self.fleet.models(targets=urls, require="none")
        for name, targets in wanted.items():
            version = self.ledger.adapter_current(name)
            assert version is not None
            missing = []
            for url in targets:
                if listed[url].error is not None:
                    continue  # unknown: the next base round looks again
                models = set(listed[url].unwrap())
                for held in self.ledger.adapter_versions_on(url, name):
                    if served_name(name, held) not in models:
                        self.ledger.adapter_unloaded(url, name, held)  # gone with a restart
                if served_name(name, version) not in models:
                    missing.append(url)
            if missing and (name, version) in self.dirs:
                logger.info("adapter %r %r: loading it again on %s", name, version, missing)
                await self._load(name, version, self.dirs[(name, version)], missing)

    async def close(self) -> None:
        """Unload every adapter version from the servers that answer and remove the
        directories no server can still need (the others are left, with a warning)."""
        for name, version in list(self.dirs):
            await self._retire(name, version, force=True)
        if self.dirs:
            logger.warning(
                "LoRA directories kept (a server did not answer its unload): %s",
                ", ".join(str(d) for d in self.dirs.values()),
            )
        elif self._root is not None:
            # off the loop, in the publisher's worker thread, like every file operation
            await asyncio.get_running_loop().run_in_executor(
                self.executor, functools.partial(shutil.rmtree, self._root, ignore_errors=True)
            )


class _Loaded:
    __slots__ = ("error", "ok")

    def __init__(self, ok: bool, error: BaseException | None) -> None:
        self.ok, self.error = ok, error


def _outcome(url: str, loaded: _Loaded) -> ServerOutcome:
    if loaded.ok:
        return ServerOutcome(url, ok=True)
    return ServerOutcome(url, ok=False, phase=LOAD_PHASE, error=loaded.error)


def _prepare(adapter: Any, config: Any, base: Any, max_rank: int | None) -> Adapter:
    resolved = resolve_adapter(adapter, config, base)
    check_adapter(resolved, max_rank)
    return resolved


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _check_round(name: object, version: object, published: Sequence[str]) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"adapter name must be letters, digits, '.', '_' or '-' (not starting with "
            f"one of the last three), got {name!r}"
        )
    if not isinstance(version, str) or not version:
        raise ValueError(f"version must be a non-empty string, got {version!r}")
    if version in published:
        raise ValueError(
            f"adapter {name!r} version {version!r} is already published; every round "
            "needs a new version"
        )


def _lora_error(
    name: str,
    version: str,
    current: str | None,
    outcomes: dict[str, ServerOutcome],
    need: int,
) -> PublishError:
    ok = sum(o.ok for o in outcomes.values())
    why = RuntimeError(
        f"adapter {name!r}: {ok} of {len(outcomes)} server(s) loaded it, {need} needed"
    )
    return publish_error(f"{name}@{version}", current, outcomes, why)
