"""LoRA adapters across a fleet: the routing of a generation with ``lora=name`` and the
tagging of its completions (no I/O; the facts are the ledger's).

Every version of an adapter is loaded on a server under its own served name
(`served_name`: ``"<name>@<version>"``), from its own directory: a generation admitted
with one version runs to its end with that version (vLLM keys its prefix cache on the
adapter's name and path, so no KV block of another version is reused), and a
completion's adapter version is exact, not a guess from before and after. The fleet's
ledger (`asyncsync._core.ledger.Ledger`) is the one writer of these facts:
``adapter_loaded`` / ``adapter_unloaded`` after each load or unload answer,
``adapter_published`` when a LoRA round commits a version, and
``adapter_use_began`` / ``adapter_use_ended`` around each generation (so that a version
in use is never unloaded nor its directory removed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from asyncsync._core.completion import Completion, WeightVersionSpan
from asyncsync._core.errors import GenerationAborted, GenerationError
from asyncsync._core.ledger import Ledger, ServerRecord
from asyncsync._core.state import Reason
from asyncsync._generation.engine import GenerationEngine
from asyncsync._wire.generation.options import GenerationRequest, SendOptions

__all__ = ["bind", "served_name", "skipped", "tag"]


def served_name(name: str, version: str) -> str:
    """The name version ``version`` of adapter ``name`` is loaded under on a server."""
    return f"{name}@{version}"


def ineligibility(
    ledger: Ledger, name: str, record: ServerRecord, max_staleness: int | None
) -> Reason | None:
    """Why ``record``'s server cannot take a generation with adapter ``name`` (the
    base-model checks are `routing.ineligibility`'s)."""
    version = ledger.adapter_held(record.url, name)
    if version is None:
        return "no_adapter"
    lag = ledger.adapter_history(name).behind(version)
    if max_staleness is not None and (lag is None or lag > max_staleness):
        return "stale_adapter"
    return None


def skipped(
    ledger: Ledger, name: str, records: Iterable[ServerRecord], max_staleness: int | None
) -> dict[str, Reason]:
    """The servers a generation with ``name`` must skip, with the reason."""
    out: dict[str, Reason] = {}
    for record in records:
        reason = ineligibility(ledger, name, record, max_staleness)
        if reason is not None:
            out[record.url] = reason
    return out


def bind(ledger: Ledger, name: str) -> Callable[..., Awaitable[list[Completion]]]:
    """`GenerationEngine.generate` with the newest version of ``name`` that the
    engine's server holds: sent as that version's served name, counted in use while
    it runs, and each completion tagged with the adapter and its version."""

    async def with_adapter(
        engine: GenerationEngine, prompt: list[int], req: GenerationRequest,
        send: SendOptions,
    ) -> list[Completion]:  # fmt: skip
        url = engine.endpoint.url
        version = ledger.adapter_held(url, name)
        if version is None:  # unloaded between admission and now: never silently
            raise GenerationError(f"adapter {name!r} is not loaded on {url}", server=url)
        ledger.adapter_use_began(url, name, version)
        try:
            model = served_name(name, version)
            out = await engine.generate(prompt, req._replace(model=model), send)
        except GenerationAborted as err:
            tag(err.completions, name, version)
            raise
        finally:
            ledger.adapter_use_ended(url, name, version)
        tag(out, name, version)
        return out

    return with_adapter


def tag(completions: Sequence[Completion], name: str, version: str) -> None:
    """Each completion's tokens came from adapter ``name`` at ``version``."""
    for c in completions:
        c.lora = name
        c.lora_versions = (WeightVersionSpan(version, 0, len(c.token_ids), "client"),)
