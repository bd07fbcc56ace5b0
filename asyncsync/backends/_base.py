"""What every trainer-side transport shares: its send statistics and cancellation."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoundCancelled", "SendStats"]


class RoundCancelled(Exception):
    """The round was cancelled at a chunk boundary (nothing more is sent)."""


@dataclass
class SendStats:
    """What one send moved, for reports."""

    chunks: int = 0
    bytes: int = 0
    params: int = 0
    pack_seconds: float = 0.0
