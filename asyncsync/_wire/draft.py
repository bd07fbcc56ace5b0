"""vLLM's speculative draft model on the wire (vLLM 0.32), as planned calls.

- ``POST /start_draft_weight_update`` (no body): starts a weight update whose chunks
  the worker's weight-transfer engine loads into the *draft* model (vLLM retargets the
  engine with ``set_weight_update_target(draft_model, draft_model_config)`` for that
  update); ``/update_weights`` and ``/finish_weight_update`` then run as in any round.
  vLLM refuses it (a worker failure, HTTP 500) when the engine does not declare
  ``supports_draft_weight_update`` or the server has no draft model. Its finish does not
  drop LoRA adapters (a base round's does).
- ``GET /server_info?config_format=json`` (dev mode): ``vllm_config.speculative_config``
  says whether the server runs a draft model (``method`` and ``model``, the draft's
  directory) and how many tokens it proposes (`DraftModel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncsync._wire.control import Call, Malformed

__all__ = ["DRAFT_START_ROUTE", "DraftModel", "plan_server_draft"]

DRAFT_START_ROUTE = "/start_draft_weight_update"


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A server's speculative decoding configuration (``/server_info``).

    Attributes:
        method: vLLM's speculative method (``"draft_model"``, ``"eagle"``, ``"ngram"``...),
            None without speculative decoding.
        model: the draft model's directory or name (None when the method has none).
        num_speculative_tokens: tokens proposed per step.
        dtype: the dtype the draft computes in (``draft_model_config.dtype``), when said.
    """

    method: str | None
    model: str | None = None
    num_speculative_tokens: int | None = None
    dtype: str | None = None

    @property
    def has_draft_model(self) -> bool:
        """Whether a separate draft model runs (what a draft round loads into)."""
        return self.model is not None and self.method not in (None, "ngram", "suffix")


def _parse_draft(data: Any) -> DraftModel:
    if not isinstance(data, dict) or not isinstance(data.get("vllm_config"), dict):
        raise Malformed("'vllm_config' missing or not an object")
    spec = data["vllm_config"].get("speculative_config")
    if spec is None:
        return DraftModel(method=None)
    if not isinstance(spec, dict):
        raise Malformed("'speculative_config' is not an object")
    method, model = spec.get("method"), spec.get("model")
    tokens = spec.get("num_speculative_tokens")
    config = spec.get("draft_model_config")
    dtype = config.get("dtype") if isinstance(config, dict) else None
    return DraftModel(
        method=method if isinstance(method, str) else None,
        model=model if isinstance(model, str) else None,
        num_speculative_tokens=tokens if isinstance(tokens, int) else None,
        dtype=str(dtype).removeprefix("torch.") if isinstance(dtype, str) else None,
    )


def plan_server_draft() -> Call[DraftModel]:
    return Call(
        "server_info", "GET", "/server_info", "update", _parse_draft,
        '{"vllm_config": {"speculative_config": ...}}', params=(("config_format", "json"),),
        idempotent=True,
    )  # fmt: skip
