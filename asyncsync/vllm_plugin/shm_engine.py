"""Worker side of the ``asyncsync_shm`` weight-transfer backend (runs inside vLLM).

The trainer packs tensors into POSIX shared-memory segments that it owns; this engine
maps a segment read-only-in-effect (a private mapping, never written), builds zero-copy
tensor views at the announced offsets and hands them to ``model.load_weights``.

Guarantees:
- Every update is validated before it is loaded: unknown parameter names, shape or dtype
  mismatches against the served checkpoint, duplicates, out-of-bounds or overlapping
  offsets fail the call with an error naming the parameter. Chunk 0 carries the manifest
  of the whole round, so a bad round is refused before anything is loaded, and the model
  keeps its previous weights.
- Layerwise reload runs once per round (``start ... every chunk ... finish``).
- A round must deliver every checkpoint parameter exactly once; an incomplete round is
  never reported as a success.
- Tensors that vLLM's layerwise loader keeps pending across chunks are copied out of the
  segment, so the trainer may reuse its buffers as soon as a chunk was acknowledged.
- Zero-copy chunks (``segments``) are read in place from the trainer's own tensors (its
  ``asyncsync.share_weights`` memfd or torch ``share_memory_()`` files); their mappings
  are kept across rounds (the trainer's parameters stay where they are) and dropped at
  the end of a round that no longer uses them, or when their owner is gone.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncsync._transport.wire import (
    BACKEND_NAME,
    Manifest,
    SegmentRef,
    ShmFormatError,
    ShmUpdateFields,
    nbytes,
    segment_links,
    validate_chunk_layout,
    validate_segments_layout,
)
from asyncsync._wire.served import DESCRIBE_QUERY, ServedModel, quoted_names
from asyncsync._wire.served import CheckpointTable as _WireTable
from asyncsync.vllm_plugin._mirror import Mirror

logger = logging.getLogger("asyncsync.vllm_plugin")

__all__ = ["BufferViews", "CheckpointTable", "ShmReceiver", "describe", "read_checkpoint"]

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class CheckpointTable(_WireTable):
    """Names, dtypes and shapes of the checkpoint the server loaded (from the
    safetensors headers: a few KB read, no tensor data); the rule is
    `asyncsync._wire.served.CheckpointTable`'s, which the trainer checks a round with
    before it sends anything."""

    @classmethod
    def from_model_path(cls, model_path: str, served_dtype: str | None) -> CheckpointTable | None:
        table, why = read_checkpoint(model_path, served_dtype)
        if table is None:
            logger.warning(
                "asyncsync_shm: %s; updates are checked for consistency but not against "
                "the checkpoint's names and shapes",
                why,
            )
        return table

    def check(self, name: str, dtype_name: str, shape: tuple[int, ...]) -> None:
        found = self.problem(name, dtype_name, shape)
        if found is not None:
            raise ShmFormatError(found)


def read_checkpoint(
    model_path: str, served_dtype: str | None
) -> tuple[CheckpointTable | None, str]:
    """The table of the checkpoint at ``model_path`` (a directory, or a hub name in the
    local cache), or None and why it could not be read."""
    path = Path(model_path)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model_path, local_files_only=True))
        except Exception as exc:  # the hub cache may be absent: validation degrades, loudly
            return None, f"cannot read the checkpoint of {model_path!r} ({type(exc).__name__})"
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"].lower())
            entries[name] = (dtype, tuple(int(d) for d in meta["shape"]))
    if not entries:
        return None, f"no safetensors checkpoint in {str(path)!r}"
    return CheckpointTable(entries, served_dtype), ""


def describe(
    backend: str,
    table: CheckpointTable | None,
    model_config: Any,
    query: str,
    checkpoint: str = "0",
) -> dict[str, Any]:
    """An engine's answer to the trainer's question (vLLM's ``/collective_rpc`` calls
    the engine: see `asyncsync._wire.served`): the served model's vocabulary size and
    context length, and with ``checkpoint="1"`` the checkpoint's table."""
    if query != DESCRIBE_QUERY:
        raise ValueError(f"{backend}: unknown question {query!r} (asks {DESCRIBE_QUERY!r})")
    vocab = max_len = model = None
    if model_config is not None:
        model = str(getattr(model_config, "model", "")) or None
        max_len = getattr(model_config, "max_model_len", None)
        get_vocab = getattr(model_config, "get_vocab_size", None)
        vocab = int(get_vocab()) if callable(get_vocab) else None
    unknown = None
    if checkpoint == "1" and table is None:
        unknown = (
            f"{backend} could not read the served checkpoint of {model!r}; its updates are "
            "checked for consistency only"
        )
    return ServedModel(
        backend=backend,
        model=model,
        vocab_size=vocab,
        max_model_len=int(max_len) if isinstance(max_len, int) else None,
        checkpoint=table if checkpoint == "1" else None,
        checkpoint_unknown=unknown,
    ).to_json()


@dataclass
class _Round:
    round_id: str
    manifest: Manifest | None
    next_chunk: int = 0
    received: set[str] = field(default_factory=set)
    loaded_any: bool = False
    complete: bool = False
    #: a delta chain's round: ``"mirror"`` (a full round kept in the mirror) or ``"delta"``
    delta: str | None = None


class BufferViews:
    """Tensor views into one flat uint8 buffer (a segment mapping, a receive buffer)."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.size = int(base.numel())
        self.ptr = int(base.data_ptr())

    def view(self, offset: int, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        count = nbytes(dtype_name, shape)
        flat = self.base[offset : offset + count]
        return flat.view(_TORCH_DTYPES[dtype_name]).view(shape)

    def owns(self, tensor: torch.Tensor) -> bool:
        try:
            ptr = int(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return False
        return self.ptr <= ptr < self.ptr + self.size


class _Mapping(BufferViews):
    """A private mapping of a trainer-owned shm segment (never written here; the trainer
    owns its lifetime). The segment is opened through the trainer's descriptor
    (``/proc/<owner_pid>/fd/<fd>``), which must link to ``memfd:<segment>`` (or, for a
    zero-copy segment of torch's, to the deleted ``/dev/shm/<segment>``) and be
    owner-only."""

    def __init__(self, where: ShmUpdateFields | SegmentRef) -> None:
        ref = (
            where
            if isinstance(where, SegmentRef)
            else SegmentRef(where.segment, where.segment_size, where.owner_pid, where.fd)
        )
        segment, size = ref.segment, ref.segment_size
        path = ref.path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ShmFormatError(
                f"cannot open segment {segment!r} at {path} ({exc.strerror}): is the trainer "
                "process alive, on this machine, in this PID namespace and of this user?"
            ) from exc
        try:
            target = os.readlink(path)
            if target not in segment_links(segment):
                raise ShmFormatError(f"{path} is {target!r}, not segment {segment!r}")
            stat = os.fstat(fd)
            if stat.st_mode & 0o077:
                raise ShmFormatError(
                    f"segment {segment!r} has mode {stat.st_mode & 0o777:o}: shared memory "
                    "the trainer hands over must be owner-only (0600)"
                )
            actual = stat.st_size
            if actual < size:
                raise ShmFormatError(
                    f"segment {segment!r} has {actual} bytes, update_info says {size}"
                )
            self.mm = mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        self.owner_pid = ref.owner_pid
        super().__init__(torch.frombuffer(self.mm, dtype=torch.uint8, count=size))

    def close(self) -> None:
        del self.base
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced somewhere: let GC close it
            logger.debug("asyncsync_shm: mapping still referenced; left to GC")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class ShmReceiver:
    """Version-neutral receive logic shared by the vLLM 0.32 and 0.23 engine adapters."""

    #: mappings kept across rounds (the trainer reuses its segments between rounds)
    max_cached_mappings = 4
    #: the update_info fields this receiver parses, and the backend named in errors
    fields_cls: type[ShmUpdateFields] = ShmUpdateFields
    backend_name = BACKEND_NAME
    #: whether chunks may point at the trainer's own shared memory (``segments``)
    accepts_zero_copy = True

    def __init__(self, model: torch.nn.Module, table: CheckpointTable | None) -> None:
        self.model = model
        self.table = table
        self.round: _Round | None = None
        self._mappings: dict[tuple[str, int], _Mapping] = {}
        self._used_this_round: set[tuple[str, int]] = set()
        #: the checkpoint copy of delta rounds (`asyncsync.vllm_plugin._mirror`)
        self.mirror = Mirror()

    def retarget(
        self, model: torch.nn.Module, table: CheckpointTable | None, mirror: Mirror
    ) -> None:
        """Receive the next round into ``model`` (vLLM's speculative draft model for a
        draft round, the served model otherwise): validated against its own
        checkpoint's ``table``, its delta rounds chained on its own ``mirror``. The
        segment mappings (and a gloo receiver's group) are the transport's, shared."""
        self.model, self.table, self.mirror = model, table, mirror

    # ------------------------------------------------------------------ rounds
    def begin_round(self) -> None:
        self.round = None
        self._used_this_round.clear()
        for key, mapping in list(self._mappings.items()):
            if not _alive(mapping.owner_pid):  # a dead trainer's memory: free it now
                self._mappings.pop(key).close()

    def receive(
        self,
        info: Mapping[str, Any] | ShmUpdateFields,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
        restore: Callable[[], None] | None,
    ) -> None:
        """Validate one update and load it. On failure: restore the previous weights
        when nothing was loaded yet this round, and raise with the reason."""
        try:
            self._receive(self.fields_cls.parse(info), load_weights)
        except BaseException as exc:
            loaded = self.round is not None and self.round.loaded_any
            self.round = None
            self.mirror.abandon()
            if restore is not None:
                restore()
            self.release_after_failure()
            state = (
                "the model is partially updated; publish a full round to repair it"
                if loaded
                else "nothing was loaded; the model keeps its previous weights"
            )
            raise RuntimeError(f"{self.backend_name}: {exc} ({state})") from exc

    def _receive(
        self,
        update: ShmUpdateFields,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        """An abort is refused; otherwise the chunk must be the round's next one, every
        parameter is validated (and, at the last chunk, the round's completeness) before
        anything of the chunk is loaded."""
        if update.abort:
            raise ShmFormatError(f"round {update.round!r} aborted by the trainer")
        rnd = self._place_in_round(update)
        self._validate(rnd, update)
        if update.last:
            self._check_complete(rnd, update.names)
        self._load(rnd, update, load_weights)
        rnd.received.update(update.names)
        rnd.next_chunk += 1
        rnd.complete = update.last

    def _place_in_round(self, update: ShmUpdateFields) -> _Round:
        """The round ``update`` continues; chunk 0 opens one (and validates its manifest
        against the checkpoint before anything loads)."""
        if self.round is None:
            if update.chunk != 0:
                raise ShmFormatError(
                    f"chunk {update.chunk} of round {update.round!r} arrived before chunk 0 "
                    "(was start_weight_update called, or did an earlier chunk fail?)"
                )
            manifest = update.round_manifest()
            delta_manifest = self.mirror.begin(update.delta)  # a refused delta: no change
            manifest = delta_manifest or manifest
            if manifest is not None:
                self._check_manifest(manifest)
            self.round = _Round(update.round, manifest, delta=self.mirror.mode)
        rnd = self.round
        if update.round != rnd.round_id:
            raise ShmFormatError(
                f"update belongs to round {update.round!r} but round {rnd.round_id!r} is active"
            )
        if update.chunk != rnd.next_chunk:
            raise ShmFormatError(f"expected chunk {rnd.next_chunk}, got chunk {update.chunk}")
        return rnd

    def _validate(self, rnd: _Round, update: ShmUpdateFields) -> None:
        """The chunk's layout in its segment(s), then each parameter against the round's
        manifest (or, without one, the served checkpoint)."""
        if update.segments is not None:
            if not self.accepts_zero_copy:
                raise ShmFormatError(
                    f"{self.backend_name} carries its own bytes: a zero-copy chunk "
                    "(segments) is not accepted"
                )
            validate_segments_layout(
                update.names,
                update.dtype_names,
                update.shapes,
                update.offsets,
                update.segments,
                update.segment_of,
            )
        else:
            validate_chunk_layout(
                update.names,
                update.dtype_names,
                update.shapes,
                update.offsets,
                update.segment_size,
            )
        for name, dtype_name, shape in zip(
            update.names, update.dtype_names, update.shapes, strict=True
        ):
            if name in rnd.received:
                raise ShmFormatError(f"parameter {name!r} sent twice in round {rnd.round_id!r}")
            if rnd.delta == "delta":  # a patch payload of a tensor the manifest names
                if rnd.manifest is None or name not in rnd.manifest:
                    raise ShmFormatError(f"parameter {name!r} is not in the delta's manifest")
                continue
            if rnd.manifest is not None:
                if name not in rnd.manifest:
                    raise ShmFormatError(f"parameter {name!r} is not in the round's manifest")
                if rnd.manifest.entry(name) != (dtype_name, tuple(shape)):
                    raise ShmFormatError(f"parameter {name!r} differs from the round's manifest")
            elif self.table is not None:
                self.table.check(name, dtype_name, tuple(shape))

    def _check_complete(self, rnd: _Round, names: list[str]) -> None:
        """At the last chunk, before it loads anything: every expected parameter came
        (a delta round sends only what changed: the mirror holds the rest)."""
        if rnd.delta == "delta":
            return
        pending = rnd.received | set(names)
        expected: list[str] = (
            list(rnd.manifest.names)
            if rnd.manifest is not None
            else (list(self.table.entries) if self.table is not None else [])
        )
        missing = [n for n in expected if n not in pending]
        if missing:
            raise ShmFormatError(f"round is incomplete: missing {quoted_names(missing)}")

    def _load(
        self,
        rnd: _Round,
        update: ShmUpdateFields,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        """Zero-copy views into the segment, handed to vLLM's loader; views its
        layerwise loader keeps pending are copied out (the trainer reuses segments)."""
        if not update.names:
            return
        if update.segments is not None:
            assert update.segment_of is not None  # validated
            mappings: list[BufferViews] = [self._mapping(ref) for ref in update.segments]
            where = [mappings[i] for i in update.segment_of]
        else:
            mappings = [self._chunk_bytes(update)]
            where = mappings * len(update.names)
        views = [
            (name, mapping.view(offset, dtype_name, tuple(shape)))
            for name, dtype_name, shape, offset, mapping in zip(
                update.names,
                update.dtype_names,
                update.shapes,
                update.offsets,
                where,
                strict=True,
            )
        ]
        if rnd.delta == "delta":  # patch the mirror; the last chunk reloads all of it
            for name, payload in views:
                self.mirror.apply(name, payload)
            del views, where
            if update.last:
                rnd.loaded_any = True
                load_weights(self.mirror.views())
            return
        if rnd.delta == "mirror":
            for name, view in views:
                self.mirror.keep(name, view)
        rnd.loaded_any = True
        load_weights(views)
        del views, where
        for mapping in mappings:
            self._pin_pending(mapping)

    def _chunk_bytes(self, update: ShmUpdateFields) -> BufferViews:
        """The chunk's bytes: the trainer's segment, mapped."""
        return self._mapping(
            SegmentRef(update.segment, update.segment_size, update.owner_pid, update.fd)
        )

    def round_summary(self) -> str:
        """The active round as the server's log names it: ``round 'R': N chunk(s), T
        tensor(s)`` (how many arrived so far), or ``no update``."""
        rnd = self.round
        if rnd is None:
            return "no update"
        return f"round {rnd.round_id!r}: {rnd.next_chunk} chunk(s), {len(rnd.received)} tensor(s)"

    def end_round(self) -> None:
        """Called at finish: the round must be complete."""
        rnd = self.round
        self.round = None
        self._drop_unused_mappings()
        if rnd is None:
            if self.table is not None:
                raise ShmFormatError("finish_weight_update called but no update arrived")
            return
        if not rnd.complete:
            self.mirror.abandon()
            raise ShmFormatError(
                f"round {rnd.round_id!r} finished before its last chunk "
                f"({len(rnd.received)} parameters received)"
            )
        self.mirror.commit()

    # ------------------------------------------------------------------ helpers
    def _check_manifest(self, manifest: Manifest) -> None:
        if self.table is None:
            return
        problems = self.table.problems(
            zip(manifest.names, manifest.dtype_names, manifest.shapes, strict=True)
        )
        if problems:  # every one, as the trainer's own check lists them
            raise ShmFormatError("; ".join(problems))

    def _mapping(self, ref: SegmentRef) -> _Mapping:
        """The mapping of ``ref``, cached: a segment is mapped once and reused by later
        chunks and rounds; the cache holds at most `max_cached_mappings` beyond the
        ones this round uses (a zero-copy round may read many files)."""
        key = (ref.segment, ref.segment_size)
        mapping = self._mappings.get(key)
        if mapping is None:
            if len(self._mappings) >= self.max_cached_mappings:
                self._close_unused_mappings()
            mapping = _Mapping(ref)
            self._mappings[key] = mapping
        self._used_this_round.add(key)
        return mapping

    def _close_unused_mappings(self) -> None:
        for key in list(self._mappings):
            if key not in self._used_this_round:
                self._mappings.pop(key).close()

    def _drop_unused_mappings(self) -> None:
        """At a round's end: close what it did not use, and start counting afresh."""
        self._close_unused_mappings()
        self._used_this_round.clear()

    def _pin_pending(self, mapping: BufferViews) -> None:
        """Copy out any segment view that vLLM's layerwise loader still buffers (a layer
        whose weights are not complete yet), since the trainer reuses the segment."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        except ImportError:  # pragma: no cover - older vLLM without layerwise reload
            return
        for info in LAYERWISE_INFO.values():
            for _, bound in getattr(info, "loaded_weights", ()):
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and mapping.owns(value):
                        bound.arguments[key] = value.clone()

    def release_after_failure(self) -> None:
        """What a failed update lets go of: every mapping (its trainer may be gone)."""
        self.close()

    def close(self) -> None:
        for mapping in self._mappings.values():
            mapping.close()
        self._mappings.clear()


def send_from_trainer(iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
    """The engines' static ``trainer_send_weights`` (abstract on vLLM's worker-side base
    class up to 0.27): the shm backend's trainer-side send."""
    from asyncsync.backends.shm import trainer_send_weights

    trainer_send_weights(iterator, trainer_args)
