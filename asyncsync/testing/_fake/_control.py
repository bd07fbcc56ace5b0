"""The fake's control routes: health, version, pausing, aborts, world size, the served
model (``/v1/models``) and dev mode's ``/collective_rpc``."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from asyncsync._wire.served import (
    ASYNCSYNC_ENGINES,
    DESCRIBE_METHOD,
    DESCRIBE_QUERY,
    CheckpointTable,
    ServedModel,
)
from asyncsync.testing._fake._responses import (
    openai_error,
    read_json,
    validation_error,
    worker_failure,
)
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._state import PAUSE_MODES, FakeState


def _engine_class(backend: str) -> str:
    """The class name vLLM's error names for a backend's engine."""
    known = {"nccl": "NCCLWeightTransferEngine", "ipc": "IPCWeightTransferEngine"}
    return known.get(backend, f"{backend.title().replace('_', '')}WeightTransferEngine")


def _serves_abort(state: FakeState) -> bool:
    return state.protocol == "0.32" or state.tokens_only


class ControlRoutes(RouteGroup):
    """The routes that neither change weights nor generate. ``/abort_requests`` exists
    on 0.32, and on 0.23 with ``--tokens-only``."""

    @route("GET", "/health")
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    @route("GET", "/version")
    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.state.version})

    @route("GET", "/server_info", served=lambda state: state.server_info)
    async def _server_info(self, request: web.Request) -> web.Response:
        """Dev mode's ``/server_info?config_format=json``: the parts asyncsync reads
        (the config's ``instance_id``; no LoRA, no speculative decoding)."""
        config = {
            "instance_id": self.state.instance_id, "lora_config": None,
            "speculative_config": None, "model_config": {"model": self.state.model},
        }  # fmt: skip
        return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    @route("GET", "/get_world_size")
    async def _get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.state.world_size})

    @route("POST", "/reset_prefix_cache")
    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    @route("POST", "/pause")
    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return validation_error(
                "query.mode",
                "literal_error",
                "Input should be 'abort', 'wait' or 'keep'",
                mode,
                "'abort', 'wait' or 'keep'",
            )
        self.state._pause(mode)
        return web.json_response({"status": "paused"})

    @route("POST", "/resume")
    async def _resume(self, request: web.Request) -> web.Response:
        self.state._resume()
        return web.json_response({"status": "resumed"})

    @route("GET", "/is_paused")
    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.state.paused})

    @route("POST", "/abort_requests", served=_serves_abort)
    async def _abort_requests(self, request: web.Request) -> web.Response:
        # vLLM parses this body itself (json.loads), with its own error messages.
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return openai_error(400, "Invalid JSON format", "Bad Request")
        if not isinstance(body, dict):
            return openai_error(400, "Request body must be a JSON object", "Bad Request")
        ids = body.get("request_ids")
        return web.json_response({"status": "aborted", "aborted": len(ids) if ids else 0})

    @route("GET", "/v1/models")
    async def _models(self, request: web.Request) -> web.Response:
        state = self.state
        card = {
            "id": state.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": state.model, "parent": None,
            "max_model_len": state.max_model_len, "permission": [],
        }  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    @route("POST", "/collective_rpc")
    async def _collective_rpc(self, request: web.Request) -> web.Response:
        """Dev mode's ``/collective_rpc``, as vLLM runs it: ``getattr(worker,
        method)(*args, **kwargs)`` on every worker. Only ``weight_transfer_engine`` is
        an attribute here: asyncsync's engines answer `DESCRIBE_QUERY`, every other
        engine is not callable (vLLM's worker failure)."""
        ok, body = await read_json(request)
        if not ok:
            return openai_error(400, "JSON decode error", "Bad Request")
        if not isinstance(body, dict):
            return openai_error(400, "Request body must be a JSON object", "Bad Request")
        method = body.get("method")
        if method is None:
            return openai_error(400, "Missing 'method' in request body", "Bad Request")
        if method != DESCRIBE_METHOD:
            return worker_failure(f"Method {method!r} is not implemented.")
        backend = self.state.backend
        if backend not in ASYNCSYNC_ENGINES:
            name = "NoneType" if backend is None else _engine_class(backend)
            return worker_failure(f"'{name}' object is not callable")
        args, kwargs = body.get("args", []), body.get("kwargs", {})
        if list(args) != [DESCRIBE_QUERY]:
            return worker_failure(f"{backend}: unknown question {args!r}")
        answer = self._described(backend, kwargs)
        return web.json_response({"results": [answer] * self.state.world_size})

    def _described(self, backend: str, kwargs: Any) -> dict[str, Any]:
        """What asyncsync's engine answers (`ServedModel`), from the fake's settings."""
        state = self.state
        table, unknown = None, None
        if isinstance(kwargs, dict) and kwargs.get("checkpoint") == "1":
            if state.checkpoint is None:
                unknown = f"{backend}: the fake was given no checkpoint"
            else:
                entries = {n: (d, tuple(s)) for n, (d, s) in state.checkpoint.items()}
                table = CheckpointTable(entries, state.dtype)
        served = ServedModel(
            backend=backend, model=state.model, vocab_size=state.lm.vocab_size,
            max_model_len=state.max_model_len, checkpoint=table, checkpoint_unknown=unknown,
        )  # fmt: skip
        return served.to_json()
