"""The fake's weight-update routes and the update lifecycle they enforce."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from asyncsync.testing._fake._responses import (
    openai_error,
    read_embedded,
    read_json,
    validation_error,
    worker_failure,
)
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._state import FakeState

_NOT_CONFIGURED = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)


def _is_032(state: FakeState) -> bool:
    return state.protocol == "0.32"


class WeightRoutes(RouteGroup):
    """``/init_weight_transfer_engine`` and one update's ``/start_weight_update`` ->
    ``/update_weights`` (any number) -> ``/finish_weight_update``, as vLLM's workers
    enforce it: a second start, an update or finish without a start, and a failed update
    are worker failures, and a failed update ends the active one. vLLM 0.32 adds
    ``/weight_info``, ``/update_weight_version``, ``/weight_checker`` and
    ``/shutdown_weight_transfer_engine``. Without a backend every weight call fails."""

    def _no_backend(self) -> web.Response | None:
        return worker_failure(_NOT_CONFIGURED) if self.state.backend is None else None

    @route("POST", "/init_weight_transfer_engine")
    async def _init(self, request: web.Request) -> web.Response:
        init_info, error = await read_embedded(request, "init_info")
        if error is not None:
            return error
        if not isinstance(init_info, dict):
            return validation_error(
                "body.init_info", "dict_type", "Input should be a valid dictionary", init_info
            )
        if (failure := self._no_backend()) is not None:
            return failure
        self.state.init_infos.append(init_info)
        return web.json_response({"message": "Weight transfer initialized"})

    @route("POST", "/start_weight_update")
    async def _start(self, request: web.Request) -> web.Response:
        state = self.state
        if state.protocol == "0.23":  # 0.23 requires a JSON body (is_checkpoint_format)
            ok, body = await read_json(request)
            if not ok or not isinstance(body, dict):
                return validation_error("body", "missing", "Field required", "None")
            state.start_bodies.append(body)
        if (failure := self._no_backend()) is not None:
            return failure
        if state.update_active:
            return worker_failure(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        state.update_active = True
        return web.json_response({"message": "Weight update started"})

    @route("POST", "/update_weights")
    async def _update(self, request: web.Request) -> web.Response:
        info, error = await read_embedded(request, "update_info")
        if error is not None:
            return error
        # 0.32 also takes a list with one update_info per worker rank.
        allowed_list = self.state.protocol == "0.32"
        valid = isinstance(info, dict) or (
            allowed_list and isinstance(info, list) and all(isinstance(i, dict) for i in info)
        )
        if not valid:
            return validation_error(
                "body.update_info", "dict_type", "Input should be a valid dictionary", info
            )
        if (failure := self._no_backend()) is not None:
            return failure
        if not self.state.update_active:
            return worker_failure("start_weight_update must be called before update_weights.")
        try:
            self._receive(info)
        except Exception as exc:
            self.state.update_active = False  # vLLM clears the active flag on a failed update
            return worker_failure(str(exc))
        self.state._accept_update(await request.read())
        return web.json_response({"message": "Weights updated"})

    def _receive(self, info: Any) -> None:
        """What the fake engine does with an ``update_info``; raises like a worker."""
        local = info[0] if isinstance(info, list) else info
        bad = sorted(self.state.reject_update_keys & set(local))
        if bad:
            raise TypeError(
                f"WeightTransferUpdateInfo.__init__() got an unexpected keyword argument '{bad[0]}'"
            )
        if self.state.update_hook is not None:
            self.state.update_hook(info)

    @route("POST", "/finish_weight_update")
    async def _finish(self, request: web.Request) -> web.Response:
        version: Any = None
        if self.state.protocol == "0.32":  # 0.23 ignores the body
            ok, body = await read_json(request)
            if ok and isinstance(body, dict):
                version = body.get("weight_version")
                if version is not None and not isinstance(version, str):
                    return validation_error(
                        "body.weight_version",
                        "string_type",
                        "Input should be a valid string",
                        version,
                    )
        if (failure := self._no_backend()) is not None:
            return failure
        if not self.state.update_active:
            return worker_failure(
                "finish_weight_update called without a matching start_weight_update."
            )
        self.state._finish_update(version)
        return web.json_response({"message": "Weight update finished"})

    @route("POST", "/shutdown_weight_transfer_engine", served=_is_032)
    async def _shutdown(self, request: web.Request) -> web.Response:
        if self.state.update_active:
            return worker_failure("Cannot release a trainer connection during a weight update")
        return web.json_response({"message": "Weight transfer shut down"})

    @route("GET", "/weight_info", served=_is_032)
    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.state.weight_version})

    @route("POST", "/update_weight_version", served=_is_032)
    async def _update_weight_version(self, request: web.Request) -> web.Response:
        value, error = await read_embedded(request, "new_version")
        if error is not None:
            return error
        self.state._finish_version(str(value))
        return web.json_response({"success": True, "new_version": self.state.weight_version})

    @route("POST", "/weight_checker", served=_is_032)
    async def _weight_checker(self, request: web.Request) -> web.Response:
        action, error = await read_embedded(request, "action")
        if error is not None:
            return error
        if action not in ("checksum", "reset", "compare"):
            return validation_error(
                "body.action",
                "literal_error",
                "Input should be 'checksum', 'reset' or 'compare'",
                action,
                "'checksum', 'reset' or 'compare'",
            )
        _ok, data = await read_json(request)
        baseline = data.get("baseline") if isinstance(data, dict) else None
        if action == "reset":
            self.state._zero_weights()
            return web.json_response({"status": "reset"})
        if action == "compare" and baseline is None:
            return openai_error(400, "action='compare' requires a 'baseline' object", "Bad Request")
        checksums = self.state.checksums()
        if action == "checksum":
            return web.json_response({"checksums": checksums})
        assert isinstance(baseline, dict)
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return web.json_response({"match": not mismatches, "mismatches": mismatches})
