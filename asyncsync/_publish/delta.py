"""Delta rounds, trainer side: ``publish(weights, *, version, delta=True)``.

The trainer keeps a record of what the servers of the chain hold: a snapshot of every
tensor's bytes as last published (one model's bytes of CPU memory, in the published
dtype) with each tensor's CRC-32, the version it is, and which server acknowledged it.
A round is a *delta* when every targeted server acknowledged the snapshot's version
(the chain rule: a delta applies only on the version it was computed against): each
tensor is compared with the snapshot bit for bit, an unchanged one sends nothing, a
changed one a sparse patch (positions and new bits, zstd-compressed with the ``delta``
extra) or its dense bytes when that is smaller (`asyncsync._transport.delta_codec`), and
the snapshot is updated as it goes. Otherwise (the chain's first round, a server that is
new, restarted or lost a round) the round is a *full* one that the servers also keep in
their mirror. The worker side is `asyncsync.vllm_plugin._mirror`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from asyncsync._publish.report import PublishReport
from asyncsync._transport.delta_codec import (
    KIND_DENSE,
    KIND_SPARSE,
    combined_digest,
    digest,
    encode,
)
from asyncsync.backends.contract import TrainerBackend, WeightSource

__all__ = ["ChainRound", "DeltaChain", "DeltaSource", "DeltaStats", "chain_round"]


@dataclass
class DeltaStats:
    """What one round of a delta chain sent (``PublishReport.delta``).

    Attributes:
        kind: ``"delta"`` (patches against the servers' version) or ``"full"`` (the
            chain's first round, or a server off the chain: every tensor).
        base: the version a delta was computed against (None for a full round).
        tensors: tensors in the model.
        unchanged: tensors that sent nothing.
        sparse: tensors sent as patches.
        dense: tensors sent whole.
        changed_elements: elements whose bits changed.
        elements: elements in the model.
        full_bytes: what a full round would have sent.
        direct: servers that took the round whole and keep no mirror (shm servers, on
            the trainer's host, where copying the model costs less than comparing it;
            ``az.backends.Shm(send_deltas=True)`` sends them patches too). When every
            target is one, the round is a plain full round: the counts are those of
            the tensors sent.
    """

    kind: str
    base: str | None = None
    tensors: int = 0
    unchanged: int = 0
    sparse: int = 0
    dense: int = 0
    changed_elements: int = 0
    elements: int = 0
    full_bytes: int = 0
    direct: tuple[str, ...] = ()

    @property
    def changed_fraction(self) -> float:
        """Changed elements over all elements (1.0 for a full round)."""
        if self.kind == "full":
            return 1.0
        return self.changed_elements / self.elements if self.elements else 0.0


class DeltaChain:
    """A publisher's record of the chain (see the module docstring)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}
        self.digests: dict[str, int] = {}
        #: the version the snapshot is, once a round of the chain committed it
        self.version: str | None = None
        #: server -> the chain version it acknowledged
        self.acked: dict[str, str] = {}
        self._pending: str | None = None

    @property
    def nbytes(self) -> int:
        """Trainer memory the record holds (the snapshot; the digests are 4 bytes each)."""
        return sum(int(t.numel()) * int(t.element_size()) for t in self.snapshot.values())

    def kind_for(self, targets: Sequence[str]) -> str:
        """``"delta"`` when every target acknowledged the snapshot's version."""
        on_chain = self.version is not None and all(
            self.acked.get(u) == self.version for u in targets
        )
        return "delta" if on_chain else "full"

    def source(self, inner: WeightSource, version: str, kind: str) -> DeltaSource:
        self._pending = version
        if kind == "full":
            self.version = None  # rewritten as the round goes
        return DeltaSource(self, inner, version, kind)

    def committed(self, version: str, servers: Sequence[str]) -> None:
        """The round was published on ``servers``: they hold ``version``; every other
        server is off the chain until a full round reaches it."""
        self.version = version
        self.acked = dict.fromkeys(servers, version)

    def failed(self) -> None:
        """The round failed: the snapshot may hold half of it; the next round is full."""
        self.version = None
        self.acked.clear()

    def drop(self) -> None:
        """A round outside the chain: forget it (the servers drop their mirrors too)."""
        self.snapshot.clear()
        self.digests.clear()
        self.failed()


class ChainRound:
    """One ``delta=True`` round: delta or full for the chain's servers (decided when its
    send begins, from what they acknowledged) and what it sent; the ``direct`` servers
    take it whole. A collective round sent again after it lost a server is a full one
    (the survivors ended the first attempt's update, which left their mirrors without a
    version). Without chain servers (``chain`` None) the round is a plain full one."""

    def __init__(
        self, chain: DeltaChain | None, version: str, targets: Sequence[str],
        direct: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.chain, self.version, self.targets = chain, version, list(targets)
        self.direct = tuple(direct)
        self.attempts = 0
        self.last: DeltaSource | None = None

    def source(self, inner: WeightSource) -> WeightSource:
        """Called in the worker thread at each attempt of the send."""
        self.attempts += 1
        if self.chain is None:
            return inner
        kind = self.chain.kind_for(self.targets) if self.attempts == 1 else "full"
        self.last = self.chain.source(inner, self.version, kind)
        return self.last

    def done(self, report: PublishReport) -> None:
        if self.chain is not None:
            chained = set(self.targets)
            self.chain.committed(self.version, [s for s in report.servers if s in chained])
        if self.last is not None:
            stats = self.last.stats
        else:  # every target took it whole: what was sent
            stats = DeltaStats("full", tensors=report.params, full_bytes=report.bytes)
        stats.direct = tuple(s for s in self.direct if s in report.servers)
        report.delta = stats

    def failed(self) -> None:
        if self.chain is not None:
            self.chain.failed()


def chain_round(
    chain: DeltaChain | None,
    delta: bool,
    backend: TrainerBackend,
    targets: Sequence[str],
    version: str,
) -> tuple[DeltaChain | None, ChainRound | None]:
    """A publisher's chain (made on first use) and the round of it that ``publish``
    runs, or None outside the chain (after which the chain starts over: the servers
    drop their mirrors with a round that does not ask for one). The chain's servers
    are those the backend sends patches to (`TrainerBackend.delta_servers`); with none,
    the round is a plain full one and the chain is dropped too."""
    patched = backend.delta_servers(targets) if delta else frozenset()
    if patched is None:
        raise ValueError(f"delta=True needs the shm, gloo or auto backend, not {backend.name!r}")
    if not patched:
        if chain is not None:
            chain.drop()
        direct = list(targets) if delta else []
        return chain, ChainRound(None, version, [], direct) if delta else None
    chain = chain if chain is not None else DeltaChain()
    ordered = [u for u in targets if u in patched]
    direct = [u for u in targets if u not in patched]
    return chain, ChainRound(chain, version, ordered, direct)


def _materialize(tensor: Any) -> Any:
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach()


class DeltaSource(WeightSource):
    """The weights of one round of the chain, as the backends send them: the tensors
    themselves (a full round, recorded in the snapshot as they pass) or the patch
    payloads of the changed ones (a delta). ``round_fields`` is what chunk 0 carries."""

    def __init__(self, chain: DeltaChain, inner: WeightSource, version: str, kind: str) -> None:
        super().__init__(inner.weights)
        self.chain, self.inner, self.version = chain, inner, version
        self.stats = DeltaStats(kind=kind, base=chain.version if kind == "delta" else None)
        self._fields: dict[str, Any]
        if kind == "delta":
            assert chain.version is not None
            names = list(chain.snapshot)
            manifest = {
                "names": names,
                "dtype_names": [str(chain.snapshot[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(chain.snapshot[n].shape) for n in names],
            }
            self._fields = {
                "mode": "delta", "version": version, "base": chain.version,
                "base_digest": combined_digest(chain.digests[n] for n in names),
                "manifest": manifest,
            }  # fmt: skip
        else:
            self._fields = {"mode": "mirror", "version": version}

    def round_fields(self) -> dict[str, Any]:
        return self._fields

    def metadata(self) -> Any:
        # a delta's payloads are known only once computed: a stream
        return self.inner.metadata() if self.stats.kind == "full" else None

    @property
    def reiterable(self) -> bool:
        return False

    def whole(self) -> WeightSource:
        return self.inner

    def __iter__(self) -> Iterator[Any]:
        if self.stats.kind == "full":
            return self._full()
        return self._delta()

    def _full(self) -> Iterator[Any]:
        chain, stats = self.chain, self.stats
        chain.snapshot.clear()
        chain.digests.clear()
        for name, raw in self.inner:
            tensor = _materialize(raw)
            kept = tensor.contiguous().clone()
            chain.snapshot[name] = kept
            chain.digests[name] = digest(kept)
            stats.tensors += 1
            stats.elements += int(kept.numel())
            stats.changed_elements += int(kept.numel())
            stats.full_bytes += int(kept.numel()) * int(kept.element_size())
            yield name, tensor

    def _delta(self) -> Iterator[Any]:
        chain, stats = self.chain, self.stats
        seen: set[str] = set()
        for name, raw in self.inner:
            old = chain.snapshot.get(name)
            tensor = _materialize(raw)
            if old is None or old.dtype != tensor.dtype or tuple(old.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"parameter {name!r} is not in the delta chain's record with its dtype "
                    "and shape: publish a full round (delta=False) for a changed model"
                )
            if name in seen:
                raise ValueError(f"parameter {name!r} appears twice in the weights")
            seen.add(name)
            encoded = encode(old, tensor, always=len(seen) == 1)
            chain.digests[name] = encoded.crc
            stats.tensors += 1
            stats.elements += encoded.numel
            stats.changed_elements += encoded.changed
            stats.full_bytes += int(old.numel()) * int(old.element_size())
            if encoded.payload is None:
                stats.unchanged += 1
                continue
            stats.sparse += encoded.kind == KIND_SPARSE
            stats.dense += encoded.kind == KIND_DENSE
            stats.unchanged += encoded.changed == 0
            yield name, encoded.payload
        missing = [n for n in chain.snapshot if n not in seen]
        if missing:
            raise ValueError(
                f"the weights lack {len(missing)} tensor(s) of the chain: {missing[:5]}"
            )
