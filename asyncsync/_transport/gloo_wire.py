"""Wire types of the ``asyncsync_gloo`` backend (plain JSON, no pickle, no torch).

``/init_weight_transfer_engine`` gets `GlooInitFields`: where the trainer's store
listens, this server's first rank in the group (``rank_offset``: 1 + the world sizes of
the servers before it), the group's size, its generation and its timeouts. Every init
with a new generation makes the worker drop its old group and join the new one.

Each ``/update_weights`` is one chunk, `GlooUpdateFields`: the fields of
`ShmUpdateFields` (round, chunk, names, dtype_names,
shapes, 64-byte aligned offsets, the round's manifest in chunk 0, ``last``) with
``segment_size`` = the bytes the trainer broadcasts for this chunk, and ``gen``, the
generation whose group carries them. The worker validates everything, then joins the
broadcast into a reused receive buffer and loads views of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from asyncsync._transport.wire import PROTOCOL_VERSION, ShmFormatError, ShmUpdateFields, nbytes

__all__ = [
    "AUTO_BACKEND_NAME",
    "GLOO_BACKEND_NAME",
    "GlooInitFields",
    "GlooUpdateFields",
    "chunk_extent",
]

#: vLLM ``--weight-transfer-config`` backend name of the worker engine.
GLOO_BACKEND_NAME = "asyncsync_gloo"
#: The worker engine that takes either transport, chosen by each init (``backend="auto"``).
AUTO_BACKEND_NAME = "asyncsync_auto"


@dataclass
class GlooInitFields:
    """The ``asyncsync_gloo`` init_info."""

    protocol: int = PROTOCOL_VERSION
    gen: int = 0
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 2
    create_timeout_s: float = 60.0
    op_timeout_s: float = 600.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        """Refuse another protocol version or an impossible group."""
        if self.protocol != PROTOCOL_VERSION:
            raise ValueError(
                f"{GLOO_BACKEND_NAME}: trainer speaks protocol {self.protocol}, this worker "
                f"speaks {PROTOCOL_VERSION}; install the same asyncsync on both sides"
            )
        if not self.master_address or not 0 < int(self.master_port) < 65536:
            raise ValueError(
                f"{GLOO_BACKEND_NAME}: init_info needs master_address and master_port, got "
                f"{self.master_address!r}:{self.master_port!r}"
            )
        if not 1 <= int(self.rank_offset) < int(self.world_size):
            raise ValueError(
                f"{GLOO_BACKEND_NAME}: rank_offset {self.rank_offset} outside the group of "
                f"{self.world_size} (rank 0 is the trainer)"
            )


@dataclass
class GlooUpdateFields(ShmUpdateFields):
    """One ``asyncsync_gloo`` chunk (an shm chunk without a segment, plus ``gen``)."""

    gen: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "gen": self.gen}

    @classmethod
    def parse(cls, info: Mapping[str, Any] | ShmUpdateFields) -> GlooUpdateFields:
        base = ShmUpdateFields.parse(info)
        raw = info.get("gen", 0) if isinstance(info, Mapping) else getattr(info, "gen", 0)
        try:
            gen = int(raw)
        except (TypeError, ValueError) as exc:
            raise ShmFormatError(f"malformed update_info: gen {raw!r}") from exc
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        return cls(**fields, gen=gen)


def chunk_extent(dtype_names: list[str], shapes: list[Any], offsets: list[int]) -> int:
    """The bytes a chunk spans: the end of its last tensor (what is broadcast)."""
    ends = [o + nbytes(d, s) for d, s, o in zip(dtype_names, shapes, offsets, strict=True)]
    return max(ends, default=0)
