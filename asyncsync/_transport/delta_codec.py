"""The delta codec both sides share: per-tensor patches and checksums (torch, zstd optional).

A delta round sends, for each tensor whose bytes changed since the version the servers
hold (the chain's base), one payload: a uint8 tensor that starts with `HEADER`
(``magic, kind, flags, gap width, element size, count, crc32, len A, len B``) and
carries

- ``KIND_SPARSE``: the changed elements' positions as gaps (``index - previous - 1``,
  uint16 when every gap fits, else uint32; A) and their new bits XOR the old (B), each
  zstd-compressed when ``zstandard`` is installed and that is smaller (``FLAG_ZSTD_A``,
  ``FLAG_ZSTD_B``). Compared as bits, never as floats: NaN, -0.0 and every rounding are
  exact;
- ``KIND_DENSE``: the tensor's new bytes (when a patch would not be smaller);
- ``KIND_SAME``: nothing but the tensor's checksum (a round with no change still
  carries one entry, which checks the chain).

``crc`` is zlib's CRC-32 of the tensor's bytes after the patch: the receiver computes it
again over its patched copy and refuses a mismatch (`DeltaChainError`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncsync._transport.wire import ShmFormatError

__all__ = [
    "HEADER",
    "KIND_DENSE",
    "KIND_SAME",
    "KIND_SPARSE",
    "DeltaChainError",
    "Encoded",
    "apply_payload",
    "changed_positions",
    "combined_digest",
    "digest",
    "encode",
    "zstd_available",
]

HEADER = struct.Struct("<4sBBBBQIQQ")
MAGIC = b"ASD1"
KIND_DENSE, KIND_SPARSE, KIND_SAME = 0, 1, 2
FLAG_ZSTD_A, FLAG_ZSTD_B = 1, 2
#: A patch is sent when it is at most this fraction of the dense bytes.
SPARSE_LIMIT = 0.8
_ZSTD_LEVEL = 3


class DeltaChainError(ShmFormatError):
    """A delta that does not apply: computed against another version than the one the
    receiver holds (dropped, duplicated or out of order), or whose result does not
    match the trainer's checksum. Never applied."""


def zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def _bytes_of(tensor: Any) -> Any:
    """The tensor's bytes as a flat uint8 numpy array (no copy for a contiguous one)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


def digest(tensor: Any) -> int:
    """CRC-32 of a contiguous tensor's bytes (zlib; the GIL is released meanwhile)."""
    return zlib.crc32(memoryview(_bytes_of(tensor)))


def combined_digest(digests: Iterable[int]) -> int:
    """One checksum of many tensors' checksums, in order."""
    crc = 0
    for d in digests:
        crc = zlib.crc32(d.to_bytes(4, "little"), crc)
    return crc


_INT_VIEWS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_ints(tensor: Any) -> Any:
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(getattr(torch, _INT_VIEWS[flat.element_size()]))


def changed_positions(a: Any, b: Any) -> Any:
    """The positions where ``a`` and ``b`` (flat integer views of one shape) differ, in
    ascending order, as an int64 numpy array. Compared 8 bytes at a time, then element by
    element only inside the words that differ: at RL learning rates a few percent of the
    words change, and a scan of 8-byte words with numpy's `flatnonzero` is several times
    faster than torch's ``ne(a, b).nonzero()`` over every element (docs/delta.md)."""
    import numpy as np
    import torch

    per = 8 // a.element_size()
    whole = a.numel() - a.numel() % per
    an, bn = a.numpy(), b.numpy()
    if per == 1 or whole == 0:
        return np.flatnonzero(an != bn)
    try:  # torch's compare runs on its threads; a view needs 8-byte-aligned storage
        words_differ = torch.ne(a[:whole].view(torch.int64), b[:whole].view(torch.int64)).numpy()
    except RuntimeError:
        words_differ = an[:whole].view(np.int64) != bn[:whole].view(np.int64)
    words = np.flatnonzero(words_differ)
    candidates = (words[:, None] * per + np.arange(per)).reshape(-1)
    found = candidates[an[candidates] != bn[candidates]]
    if whole < a.numel():
        tail = np.flatnonzero(an[whole:] != bn[whole:]) + whole
        found = np.concatenate([found, tail])
    return found.astype(np.int64, copy=False)


@dataclass
class Encoded:
    """One tensor's payload (None: unchanged) and what it counts for the report."""

    payload: Any
    kind: int
    changed: int
    numel: int
    crc: int


def _pack(
    kind: int, flags: int, gap: int, elem: int, count: int, crc: int, a: bytes, b: bytes
) -> Any:
    import numpy as np
    import torch

    head = HEADER.pack(MAGIC, kind, flags, gap, elem, count, crc, len(a), len(b))
    out = np.empty(len(head) + len(a) + len(b), dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[len(head) : len(head) + len(a)] = np.frombuffer(a, dtype=np.uint8)
    out[len(head) + len(a) :] = np.frombuffer(b, dtype=np.uint8)
    return torch.from_numpy(out)


def _squeeze(data: bytes, flag: int, compress: bool) -> tuple[bytes, int]:
    if not compress or len(data) < 256:
        return data, 0
    import zstandard

    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    return (packed, flag) if len(packed) < len(data) else (data, 0)


def encode(old: Any, new: Any, *, compress: bool = True, always: bool = False) -> Encoded:
    """The payload that turns ``old`` (the base's bytes) into ``new``, and updates ``old``
    in place to ``new`` (the trainer's record of what the servers will hold). None when
    nothing changed (``always``: a ``KIND_SAME`` payload then)."""
    import numpy as np

    a, b = _as_ints(old), _as_ints(new)
    elem, numel = a.element_size(), a.numel()
    idx = changed_positions(a, b)
    count = int(idx.size)
    if count == 0:
        crc = digest(old)
        payload = _pack(KIND_SAME, 0, 0, elem, 0, crc, b"", b"") if always else None
        return Encoded(payload, KIND_SAME, 0, numel, crc)
    an, bn = a.numpy(), b.numpy()  # numpy's fancy indexing: a fraction of torch's time
    gaps = np.diff(idx, prepend=-1) - 1
    width = 2 if int(gaps.max()) < 1 << 16 else 4
    values = bn[idx]
    xor = np.bitwise_xor(an[idx], values)
    an[idx] = values  # the record now holds the new bytes
    crc = digest(old)
    compress = compress and zstd_available()
    gap_bytes = gaps.astype("<u2" if width == 2 else "<u4").tobytes()
    part_a, flag_a = _squeeze(gap_bytes, FLAG_ZSTD_A, compress)
    part_b, flag_b = _squeeze(xor.tobytes(), FLAG_ZSTD_B, compress)
    if len(part_a) + len(part_b) <= SPARSE_LIMIT * numel * elem:
        payload = _pack(KIND_SPARSE, flag_a | flag_b, width, elem, count, crc, part_a, part_b)
        return Encoded(payload, KIND_SPARSE, count, numel, crc)
    raw = _bytes_of(old).tobytes()
    return Encoded(
        _pack(KIND_DENSE, 0, 0, elem, numel, crc, raw, b""), KIND_DENSE, count, numel, crc
    )


def _unsqueeze(data: Any, compressed: bool) -> bytes:
    raw = bytes(data)
    if not compressed:
        return raw
    import zstandard

    return bytes(zstandard.ZstdDecompressor().decompress(raw))


def apply_payload(name: str, target: Any, payload: Any) -> int:
    """Apply ``payload`` (a uint8 tensor) to ``target`` (the receiver's copy) in place,
    then check the result's CRC-32; returns it. Raises `DeltaChainError` (or
    `ShmFormatError` for a malformed payload) naming ``name``."""
    import numpy as np
    import torch

    raw = payload.numpy()
    if raw.size < HEADER.size:
        raise ShmFormatError(f"delta for {name!r}: {raw.size} bytes, no header")
    magic, kind, flags, width, elem, count, crc, len_a, len_b = HEADER.unpack_from(
        raw[: HEADER.size].tobytes()
    )
    ints = _as_ints(target)
    if magic != MAGIC or elem != ints.element_size() or HEADER.size + len_a + len_b != raw.size:
        raise ShmFormatError(f"delta for {name!r}: malformed payload header")
    body_a = raw[HEADER.size : HEADER.size + len_a]
    body_b = raw[HEADER.size + len_a :]
    if kind == KIND_DENSE:
        if count != ints.numel() or len_a != count * elem:
            raise ShmFormatError(f"delta for {name!r}: dense payload of the wrong size")
        ints.copy_(
            torch.from_numpy(np.frombuffer(bytes(body_a), dtype=np.uint8).copy()).view(ints.dtype)
        )
    elif kind == KIND_SPARSE:
        gaps = np.frombuffer(
            _unsqueeze(body_a, bool(flags & FLAG_ZSTD_A)), dtype="<u2" if width == 2 else "<u4"
        )
        xor = np.frombuffer(_unsqueeze(body_b, bool(flags & FLAG_ZSTD_B)), dtype=ints.numpy().dtype)
        if gaps.size != count or xor.size != count:
            raise ShmFormatError(f"delta for {name!r}: patch lengths do not match its count")
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if count and int(idx[-1]) >= ints.numel():
            raise ShmFormatError(f"delta for {name!r}: patch index outside the tensor")
        target_ints = ints.numpy()  # numpy's fancy indexing: a fraction of torch's time
        target_ints[idx] = np.bitwise_xor(target_ints[idx], xor)
    elif kind != KIND_SAME:
        raise ShmFormatError(f"delta for {name!r}: unknown payload kind {kind}")
    found = digest(target)
    if found != crc:
        raise DeltaChainError(
            f"parameter {name!r}: checksum {found:08x} after the delta, the trainer's is "
            f"{crc:08x} (the delta was computed against other bytes than this server holds)"
        )
    return found
