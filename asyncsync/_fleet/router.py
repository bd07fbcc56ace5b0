"""Generations through an OpenAI-compatible router in front of a fleet's servers.

With ``Fleet(control_urls, router_url=...)`` every control call and weight round still
goes to every server (a router would forward a weight call to one replica only), while
generations go to the router, which picks the replica. asyncsync cannot choose the
server then, so routing by server state becomes two rules by version:

- admission waits while a round holds any server mid-update (``updating``): a router
  must not be handed a request that could land on a server whose layers are being
  replaced;
- the staleness bound applies to the answer: the weight versions come from the server
  that answered (``weight_versions`` of ``/inference/v1/generate``), and a completion
  more than ``max_staleness`` published versions behind is sent again, up to once per
  server, before `GenerationError` names the versions it got.

Prompts are checked against the limits of the servers behind the router, not asked of
the router (which may not forward ``/collective_rpc``): `ServersBehind` learns each
server's vocabulary size and context length through its own client and keeps the
smallest of each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence, Set

from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError, GenerationError
from asyncsync._core.ledger import ServerRecord
from asyncsync._fleet.dispatch import Dispatcher, RoutingPolicy
from asyncsync._fleet.members import Members
from asyncsync._fleet.routing import contradicts
from asyncsync._generation.engine import GenerationEngine
from asyncsync._generation.served import ServedLookup
from asyncsync._http.transport import Endpoint
from asyncsync._wire.generation.options import GenerationRequest, SendOptions
from asyncsync.client import AsyncVLLMClient

__all__ = ["RouterDispatcher", "ServersBehind"]


class RouterDispatcher(Dispatcher):
    """A `Dispatcher` whose every generation goes to one router (see the module)."""

    def __init__(self, members: Members, policy: RoutingPolicy, router: AsyncVLLMClient) -> None:
        super().__init__(members, policy)
        self.router = router
        given = router.vocab_size, router.max_model_len
        limits = ServersBehind(router._endpoint, members, given)
        router._served = router._generator.served = limits

    async def admit(self, send: SendOptions, exclude: Set[str] = frozenset()) -> ServerRecord:
        """Wait until no server is mid-update, then count the request on the router."""
        if send.lora is not None:
            raise TypeError(
                "Fleet.generate(..., lora=...) is not supported through a router "
                "(router_url): the fleet cannot choose a server holding the adapter; "
                "use a Fleet without router_url for LoRA generations"
            )
        limit = self.policy.admission_timeout
        limit = limit if send.admission_timeout is None else send.admission_timeout
        deadline = None if limit is None else time.monotonic() + limit
        updating: list[str] = []

        def idle() -> bool:
            updating[:] = [r.url for r in self.ledger.records() if r.updating]
            return not updating

        if not await self.ledger.wait_until(idle, deadline):
            raise GenerationError(
                f"no generation through the router within {limit:g} s: a round holds "
                f"{', '.join(updating)} mid-update"
            )
        record = self.router._endpoint.record
        self.router._endpoint.ledger.admitted(record)
        return record

    def engine(self, record: ServerRecord) -> GenerationEngine:
        return self.router._generator

    def release(self, record: ServerRecord) -> None:
        self.router._endpoint.ledger.released(record)

    def contradicted(
        self, record: ServerRecord, completions: Sequence[Completion], published: int
    ) -> bool:
        return False  # the router's answers: the staleness bound below applies to them

    def failed_over(self, send: SendOptions, record: ServerRecord, err: AsyncSyncError) -> bool:
        return False  # the router is the only way in: its failure is the caller's

    async def generate(
        self, prompt: list[int], req: GenerationRequest, send: SendOptions
    ) -> list[Completion]:
        """One generation through the router; sent again while its answer carries
        versions the fleet does not accept (staler than the bound, or never published:
        a restarted server's), at most once per server."""
        bound, history = self.ledger.max_staleness, self.ledger.history()
        tries = max(1, len(self.members))
        seen: list[str] = []
        for _ in range(tries):
            published = len(history)
            out = await super().generate(prompt, req, send)
            bad = [v for c in out for v in contradicts(history, bound, c, published=published)]
            if not bad:
                return out
            seen.append(", ".join(repr(v) for v in bad))
        raise GenerationError(
            f"the router's answers carried versions the fleet does not accept ({'; '.join(seen)}) "
            f"in {tries} tries (max_staleness={bound}): a server behind the router is stale "
            "(a partial round lost it, it restarted); publish again or take it out of the router"
        )


class ServersBehind(ServedLookup):
    """The prompt limits of a router's answers: the smallest vocabulary size and
    context length among the servers behind it, each learned by the server's own client
    (`ServedLookup`); the router itself is never asked."""

    def __init__(
        self, endpoint: Endpoint, members: Members, given: tuple[int | None, int | None]
    ) -> None:
        super().__init__(endpoint, vocab_size=given[0], max_model_len=given[1])
        self.members = members

    async def learn(self) -> None:
        async with self._lock:
            if self.known:
                return
            lookups = [self.members.client(url)._served for url in self.members.urls]
            await asyncio.gather(*(lookup.learn() for lookup in lookups))
            if self._ask_vocab:
                self.vocab_size = _smallest(lookup.vocab_size for lookup in lookups)
            if self._ask_len:
                self.max_model_len = _smallest(lookup.max_model_len for lookup in lookups)
            self.known = bool(lookups) and all(lookup.known for lookup in lookups)


def _smallest(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None
