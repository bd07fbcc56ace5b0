"""LoRA adapters across a fleet: which versions each server holds, and the routing of a
generation with ``lora=name`` (pure bookkeeping, no I/O).

Every version of an adapter is loaded on a server under its own served name
(`served_name`: ``"<name>@<version>"``), from its own directory: a generation admitted
with one version runs to its end with that version (vLLM keys its prefix cache on the
adapter's name and path, so no KV block of another version is reused), and a
completion's adapter version is exact, not a guess from before and after. `AdapterTable`
is the one writer of these facts: `AdapterTable.loaded` / `unloaded` / `forget` after
each load or unload answer, `published` when a LoRA round commits a version, and
`begin_use` / `end_use` around each generation (so that a version in use is never
unloaded nor its directory removed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence

from asyncsync._core.completion import Completion, WeightVersionSpan
from asyncsync._core.errors import GenerationAborted, GenerationError
from asyncsync._core.state import Reason, ServerState
from asyncsync._fleet.routing import VersionHistory
from asyncsync._generation.engine import GenerationEngine
from asyncsync._wire.generation import GenerationRequest, SendOptions

__all__ = ["AdapterTable", "served_name"]


def served_name(name: str, version: str) -> str:
    """The name version ``version`` of adapter ``name`` is loaded under on a server."""
    return f"{name}@{version}"


class AdapterTable:
    """Published adapter versions and what each server holds (see the module docstring)."""

    def __init__(self) -> None:
        self._history: dict[str, VersionHistory] = {}
        #: (url, name) -> versions loaded there (vLLM knows their served names)
        self._loaded: dict[tuple[str, str], set[str]] = {}
        #: (url, name, version) -> generations in flight with it
        self._uses: Counter[tuple[str, str, str]] = Counter()

    # ------------------------------------------------------------------ facts
    def names(self) -> list[str]:
        return list(self._history)

    def history(self, name: str) -> VersionHistory:
        return self._history.setdefault(name, VersionHistory())

    def current(self, name: str) -> str | None:
        """The newest published version of adapter ``name``."""
        history = self._history.get(name)
        return None if history is None else history.current

    def versions_on(self, url: str, name: str) -> set[str]:
        return set(self._loaded.get((url, name), ()))

    def servers_with(self, name: str, version: str) -> list[str]:
        return [u for (u, n), vs in self._loaded.items() if n == name and version in vs]

    def in_use(self, name: str, version: str) -> bool:
        return any(k[1:] == (name, version) and c > 0 for k, c in self._uses.items())

    def held(self, url: str, name: str) -> str | None:
        """The newest published version of ``name`` loaded on ``url``."""
        history = self._history.get(name)
        loaded = self._loaded.get((url, name))
        if history is None or not loaded:
            return None
        known = [v for v in loaded if v in history]
        return max(known, key=lambda v: history.index(v) or 0) if known else None

    # ------------------------------------------------------------------ transitions
    def loaded(self, url: str, name: str, version: str) -> None:
        self._loaded.setdefault((url, name), set()).add(version)

    def unloaded(self, url: str, name: str, version: str) -> None:
        versions = self._loaded.get((url, name))
        if versions is not None:
            versions.discard(version)
            if not versions:
                del self._loaded[(url, name)]

    def forget(self, url: str) -> None:
        """``url`` holds no adapter we know of (it restarted, or left the fleet)."""
        for key in [k for k in self._loaded if k[0] == url]:
            del self._loaded[key]

    def published(self, name: str, version: str) -> None:
        self.history(name).record(version)

    def begin_use(self, url: str, name: str, version: str) -> None:
        self._uses[(url, name, version)] += 1

    def end_use(self, url: str, name: str, version: str) -> None:
        key = (url, name, version)
        self._uses[key] -= 1
        if self._uses[key] <= 0:
            del self._uses[key]

    # ------------------------------------------------------------------ routing
    def ineligibility(
        self, name: str, state: ServerState, max_staleness: int | None
    ) -> Reason | None:
        """Why ``state``'s server cannot take a generation with adapter ``name`` (the
        base-model checks are `routing.ineligibility`'s)."""
        version = self.held(state.url, name)
        if version is None:
            return "no_adapter"
        lag = self.history(name).behind(version)
        if max_staleness is not None and (lag is None or lag > max_staleness):
            return "stale_adapter"
        return None

    def skipped(
        self, name: str, states: Iterable[ServerState], max_staleness: int | None
    ) -> dict[str, Reason]:
        """The servers a generation with ``name`` must skip, with the reason."""
        out: dict[str, Reason] = {}
        for state in states:
            reason = self.ineligibility(name, state, max_staleness)
            if reason is not None:
                out[state.url] = reason
        return out

    def bind(self, name: str) -> Callable[..., Awaitable[list[Completion]]]:
        """`GenerationEngine.generate` with the newest version of ``name`` that the
        engine's server holds: sent as that version's served name, counted in use while
        it runs, and each completion tagged with the adapter and its version."""

        async def with_adapter(
            engine: GenerationEngine, prompt: list[int], req: GenerationRequest,
            send: SendOptions,
        ) -> list[Completion]:  # fmt: skip
            url = engine.endpoint.url
            version = self.held(url, name)
            if version is None:  # unloaded between admission and now: never silently
                raise GenerationError(f"adapter {name!r} is not loaded on {url}", server=url)
            self.begin_use(url, name, version)
            try:
                model = served_name(name, version)
                out = await engine.generate(prompt, req._replace(model=model), send)
            except GenerationAborted as err:
                tag(err.completions, name, version)
                raise
            finally:
                self.end_use(url, name, version)
            tag(out, name, version)
            return out

        return with_adapter


def tag(completions: Sequence[Completion], name: str, version: str) -> None:
    """Each completion's tokens came from adapter ``name`` at ``version``."""
    for c in completions:
        c.lora = name
        c.lora_versions = (WeightVersionSpan(version, 0, len(c.token_ids), "client"),)
