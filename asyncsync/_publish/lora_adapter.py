"""What ``publish_lora`` accepts as an adapter, checked and written as a peft directory.

An adapter is a ``peft.PeftModel`` (its active LoRA adapter: config, tensors and the
base model they must fit) or a mapping of LoRA tensors in peft's names
(``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) with its config (a
``peft.LoraConfig`` or its dict), optionally with the ``base`` module they adapt. Bad
adapters are refused here, before any server is touched, with a ValueError/TypeError
naming the tensor: a tensor that is not a LoRA tensor, a module outside the config's
``target_modules`` or absent from the base model, a rank other than the config's (or over
the servers' ``max_lora_rank``), A and B that do not fit each other or the base layer,
a missing half of a pair, NaN/Inf.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Adapter", "check_adapter", "resolve_adapter", "write_adapter"]

#: peft's saved names: ``base_model.model.<module path>.lora_A.weight``.
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")


@dataclass
class Adapter:
    """An adapter ready to check and write: tensors (CPU, contiguous), peft config (a
    JSON-able dict), and the shapes ``(out, in)`` of the base layers by module path
    when the base model is known."""

    tensors: dict[str, Any]
    config: dict[str, Any]
    base_shapes: dict[str, tuple[int, int]] | None

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        out = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        out = dict(config.to_dict())
    else:
        raise TypeError(
            f"the adapter's config must be a peft.LoraConfig or a dict, got {type(config).__name__}"
        )
    for key, value in list(out.items()):  # sets (target_modules) and enums are not JSON
        if isinstance(value, set | frozenset):
            out[key] = sorted(value)
        elif isinstance(value, enum.Enum):
            out[key] = value.value
    out.setdefault("peft_type", "LORA")
    return out


def _base_shapes(module: Any) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of every 2-D ``weight`` of ``module``, by module
    path (peft's wrapped layers report their base layer's)."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, param in module.named_parameters():
        if not name.endswith(".weight") or param.dim() != 2:
            continue
        path = name.removesuffix(".weight").removesuffix(".base_layer")
        if ".lora_" in path:
            continue
        shapes[path] = (int(param.shape[0]), int(param.shape[1]))
    return shapes


def resolve_adapter(adapter: Any, config: Any = None, base: Any = None) -> Adapter:
    """Normalize what the caller passed (in the worker thread: peft's state dict copies
    tensors). A ``PeftModel``'s active adapter, or tensors + ``config``."""
    if callable(getattr(adapter, "get_base_model", None)) and hasattr(adapter, "peft_config"):
        from peft import get_peft_model_state_dict

        active = adapter.active_adapter
        name = active if isinstance(active, str) else active[0]
        cfg = _config_dict(config if config is not None else adapter.peft_config[name])
        state = get_peft_model_state_dict(adapter, adapter_name=name)
        base_module = base if base is not None else adapter.get_base_model()
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        return Adapter(tensors, cfg, _base_shapes(base_module))
    if not isinstance(adapter, Mapping):
        raise TypeError(
            "publish_lora(adapter=...) takes a peft.PeftModel or a mapping of LoRA tensors "
            f"(with config=...); got {type(adapter).__name__}"
        )
    if config is None:
        raise TypeError("publish_lora: a mapping of LoRA tensors needs config= (its LoraConfig)")
    tensors = {}
    for key, tensor in adapter.items():
        if not hasattr(tensor, "detach"):
            raise TypeError(f"LoRA tensor {key!r} is a {type(tensor).__name__}, not a tensor")
        tensors[str(key)] = tensor.detach().cpu().contiguous()
    return Adapter(tensors, _config_dict(config), _base_shapes(base) if base is not None else None)


def _targets(config: Mapping[str, Any]) -> Any:
    targets = config.get("target_modules")
    if targets is None:
        raise ValueError("the adapter's config has no target_modules")
    return targets


def _targeted(module: str, targets: Any) -> bool:
    """peft's rule: a regex string matches the whole path; a list matches the path or its
    last component (suffix)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _rank_for(module: str, config: Mapping[str, Any]) -> int:
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            return int(rank)
    return int(config["r"])


def check_adapter(adapter: Adapter, max_rank: int | None = None) -> None:
    """Refuse a bad adapter (see the module docstring), naming the tensor."""
    config = adapter.config
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"the adapter is a {config.get('peft_type')} adapter, not LoRA")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise ValueError(f"the adapter's config has rank r={config.get('r')!r}")
    if not adapter.tensors:
        raise ValueError("the adapter has no tensors")
    targets = _targets(config)
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in adapter.tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ValueError(
                f"LoRA tensor {key!r} is not a LoRA weight (peft names end in "
                "'.lora_A.weight' or '.lora_B.weight')"
            )
        module = match["module"]
        if not _targeted(module, targets):
            raise ValueError(
                f"LoRA tensor {key!r}: module {module!r} is not in the config's "
                f"target_modules {targets!r}"
            )
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(
                f"LoRA tensor {key!r} is a {tensor.dim()}-D {tensor.dtype} tensor; "
                "LoRA weights are 2-D floating-point matrices"
            )
        pairs.setdefault(module, {})[match["part"]] = (key, tensor)
    for module, parts in pairs.items():
        _check_pair(module, parts, adapter, max_rank)


def _check_pair(module: str, parts: dict[str, Any], adapter: Adapter, max_rank: int | None) -> None:
    import torch

    for part in ("lora_A", "lora_B"):
        if part not in parts:
            have = next(iter(parts.values()))[0]
            raise ValueError(f"LoRA tensor {have!r} has no {part} partner for module {module!r}")
    (a_key, a), (b_key, b) = parts["lora_A"], parts["lora_B"]
    rank = _rank_for(module, adapter.config)
    if a.shape[0] != rank or b.shape[1] != rank:
        bad = a_key if a.shape[0] != rank else b_key
        raise ValueError(
            f"LoRA tensor {bad!r}: rank {a.shape[0] if bad == a_key else b.shape[1]} "
            f"(shape {list(a.shape if bad == a_key else b.shape)}) is not the config's "
            f"rank {rank}"
        )
    if max_rank is not None and rank > max_rank:
        raise ValueError(
            f"LoRA tensor {a_key!r}: rank {rank} exceeds the servers' max_lora_rank {max_rank}"
        )
    base = adapter.base_shapes
    if base is not None:
        if module not in base:
            raise ValueError(
                f"LoRA tensor {a_key!r}: the base model has no 2-D layer {module!r} "
                "(unknown target module)"
            )
        out, inp = base[module]
        if a.shape[1] != inp:
            raise ValueError(
                f"LoRA tensor {a_key!r}: shape {list(a.shape)} does not fit layer "
                f"{module!r} ({inp} inputs)"
            )
        if b.shape[0] != out:
            raise ValueError(
                f"LoRA tensor {b_key!r}: shape {list(b.shape)} does not fit layer "
                f"{module!r} ({out} outputs)"
            )
    for key, tensor in ((a_key, a), (b_key, b)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"LoRA tensor {key!r} holds NaN or Inf values")


def write_adapter(directory: Path, adapter: Adapter) -> int:
    """Write ``adapter`` as a peft directory (``adapter_model.safetensors`` +
    ``adapter_config.json``), atomically: into a sibling first, then renamed, so that a
    server never sees half a directory. Returns the bytes written. Blocking: run it in a
    worker thread."""
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir(mode=0o700)
    try:
        save_file(adapter.tensors, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(adapter.config, default=str))
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sum(f.stat().st_size for f in directory.iterdir())
