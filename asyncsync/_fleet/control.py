"""The fleet's control routes: each one call fanned out to the targeted servers.

`FleetControl` is the part of `Fleet` that wraps vLLM's RL,
cache and health routes; every method plans its call (`asyncsync._wire.control`), sends
it to every target at once (`fan_out`) and applies the
partial-failure policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from asyncsync._core.deprecation import warn_deprecated
from asyncsync._core.errors import ProtocolError, ServerError
from asyncsync._core.types import (
    FleetResult,
    Outcome,
    PauseMode,
    Require,
    check_require,
    pause_mode,
)
from asyncsync._fleet.fanout import Plan, fan_out
from asyncsync._fleet.members import Members
from asyncsync._fleet.routing import VersionHistory
from asyncsync._http.transport import Transport
from asyncsync._wire import control as wire
from asyncsync._wire import draft as draft_wire
from asyncsync._wire import lora as lora_wire
from asyncsync._wire.control import WeightComparison
from asyncsync._wire.draft import DraftModel
from asyncsync._wire.lora import LoraLimits

__all__ = ["FleetControl"]

T = TypeVar("T")
_Targets = Iterable[str] | None


class FleetControl:
    """Control routes of a fleet (mixed into `Fleet`)."""

    require: Require
    _members: Members
    _transport: Transport
    _history: VersionHistory
    #: `Fleet._published`: the one writer of a published version
    _published: Callable[[str, Iterable[str]], None]

    async def _fan(
        self, op: str, plan: Plan[T], targets: _Targets, require: Require | None, **kw: bool
    ) -> FleetResult[T]:
        """``op`` on every target at once; argument errors raise before anything is
        sent; then the partial-failure policy decides whether the result raises."""
        require = check_require(self.require if require is None else require)
        self._transport.open()
        result = await fan_out(self._members, op, plan, self._members.resolve(targets), **kw)
        result.raise_on_failure(require)
        return result

    async def health(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``GET /health`` on every target; updates each server's ``healthy``."""
        return await self._fan("health", lambda _p, _u: wire.plan_health(), targets, require)

    async def vllm_version(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[str]:
        """``GET /version`` on every target: each server's vLLM version, read now."""
        return await self._fan("vllm_version", lambda _p, _u: wire.plan_version(), targets, require)

    async def version(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[str]:
        """Deprecated: `vllm_version`."""
        warn_deprecated("Fleet.version()", "Fleet.vllm_version()")
        return await self.vllm_version(targets=targets, require=require)

    async def pause(
        self, mode: PauseMode | None = None, *, clear_cache: bool | None = None,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /pause?mode=...`` on every target; marks them paused. ``mode`` (required):
        ``"abort"``, ``"wait"`` or ``"keep"`` (see `AsyncVLLMClient.pause`)."""
        plan = wire.plan_pause(pause_mode(mode, "Fleet"), clear_cache)
        return await self._fan("pause", lambda _p, _u: plan, targets, require)

    async def resume(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /resume`` on every target; marks them not paused."""
        return await self._fan("resume", lambda _p, _u: wire.plan_resume(), targets, require)

    async def is_paused(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[bool]:
        """``GET /is_paused`` on every target; records the answers."""
        return await self._fan("is_paused", lambda _p, _u: wire.plan_is_paused(), targets, require)

    async def abort_requests(
        self, request_ids: Sequence[str] | None = None, *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[int]:  # fmt: skip
        """``POST /abort_requests`` on every target (all requests when ids is None)."""
        plan = wire.plan_abort_requests(request_ids)
        return await self._fan("abort_requests", lambda _p, _u: plan, targets, require)

    async def weight_info(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[str]:
        """``GET /weight_info`` on every target (vLLM >= 0.32); records the versions."""
        return await self._fan("weight_info", wire.plan_weight_info, targets, require)

    async def update_weight_version(
        self, new_version: str, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /update_weight_version`` on every target (vLLM >= 0.32)."""
        result: FleetResult[None] = await self._fan(
            "update_weight_version",
            lambda p, u: wire.plan_update_weight_version(p, new_version, u),
            targets,
            require,
        )
        self._record_if_all(result, new_version)
        return result

    async def weight_checksums(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[dict[str, str]]:
        """``POST /weight_checker {"action": "checksum"}`` on every target."""
        return await self._fan("weight_checksums", wire.plan_weight_checksums, targets, require)

    async def compare_weights(
        self, baseline: Mapping[str, str], *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[WeightComparison]:  # fmt: skip
        """``POST /weight_checker {"action": "compare"}`` on every target."""
        plan: Plan[WeightComparison] = lambda p, u: wire.plan_compare_weights(p, baseline, u)  # noqa: E731
        return await self._fan("compare_weights", plan, targets, require)

    async def get_world_size(
        self, *, include_dp: bool = True, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[int]:  # fmt: skip
        """``GET /get_world_size`` on every target."""
        plan = wire.plan_get_world_size(include_dp)
        return await self._fan("get_world_size", lambda _p, _u: plan, targets, require)

    async def reset_prefix_cache(
        self, *, reset_running_requests: bool = False, reset_external: bool = False,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[bool]:  # fmt: skip
        """``POST /reset_prefix_cache`` on every target. A ``False`` value means that
        server could not reset now (blocks still held); it is not a failure."""
        return await self._fan(
            "reset_prefix_cache",
            lambda p, _u: wire.plan_reset_prefix_cache(p, reset_running_requests, reset_external),
            targets,
            require,
        )

    async def init_weight_transfer_engine(
        self, init_info: Mapping[str, Any] | Callable[[str], Mapping[str, Any]], *,
        targets: _Targets = None, require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /init_weight_transfer_engine`` on every target. ``init_info`` is one
        mapping for all, or a function of the server URL (NCCL: per-server rank offset)."""
        per_server = init_info if callable(init_info) else (lambda _u: init_info)
        return await self._fan(
            "init_weight_transfer_engine",
            lambda _p, u: wire.plan_init_weight_transfer_engine(per_server(u)),
            targets,
            require,
            per_server=callable(init_info),
        )

    async def start_weight_update(
        self, *, is_checkpoint_format: bool | None = None, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /start_weight_update`` on every target (version-aware body); marks
        the started servers ``updating``."""
        return await self._fan(
            "start_weight_update",
            lambda p, u: wire.plan_start_weight_update(p, is_checkpoint_format, u),
            targets,
            require,
        )

    async def start_draft_weight_update(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /start_draft_weight_update`` on every target (vLLM >= 0.32, a server
        running a speculative draft model): an update whose chunks load into the draft
        model; marks the started servers ``updating``. Low level: a round of
        ``publish(..., target="draft")`` runs it."""
        return await self._fan(
            "start_draft_weight_update",
            draft_wire.plan_start_draft_weight_update,
            targets,
            require,
        )

    async def draft_models(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[DraftModel]:
        """Each target's speculative decoding configuration (``GET /server_info``, dev
        mode): its method, draft model and tokens proposed per step."""
        plan = draft_wire.plan_server_draft()
        return await self._fan("server_info", lambda _p, _u: plan, targets, require)

    async def update_weights(
        self, update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
        packed: bool | None = None, targets: _Targets = None, require: Require | None = None,
        expect_failure: bool = False,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /update_weights`` on every target, the payload encoded once. A server
        that fails here after a start is marked ``dirty`` (vLLM drops its active update).

        ``expect_failure=True`` sends an update the servers are meant to reject, to make
        vLLM clear an active update (a cancelled round): an HTTP error answer is then the
        successful outcome (the server is no longer ``updating``), while a 2xx answer or
        a transport failure is a failed one.
        """
        plan: Plan[None] = lambda p, u: wire.plan_update_weights(p, update_info, packed, u)  # noqa: E731
        if not expect_failure:
            return await self._fan("update_weights", plan, targets, require)
        # The rejection is the answer asked for, not a failure: each server's last_error
        # keeps what went wrong before (the cause of the round that is being ended).
        targets = self._members.resolve(targets)
        before = {u: self._members.state(u).last_error for u in targets}
        result = await self._fan("update_weights", plan, targets, "none")
        result = FleetResult(result.operation, {u: _rejected(o) for u, o in result.items()})
        for url, outcome in result.items():
            if outcome.ok and url in before:
                self._members.state(url).last_error = before[url]
        result.raise_on_failure(check_require(self.require if require is None else require))
        return result

    async def finish_weight_update(
        self, weight_version: str | None = None, *, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /finish_weight_update`` on every target. On success the server is clean
        and records ``weight_version``; on failure it is marked ``dirty``. When every
        target finished, ``weight_version`` is published (`Fleet.current_version`)."""
        result = await self._finish(weight_version, targets=targets, require=require)
        self._record_if_all(result, weight_version)
        return result

    async def _finish(
        self, weight_version: str | None, *, targets: _Targets = None,
        require: Require | None = "none",
    ) -> FleetResult[None]:  # fmt: skip
        """The finish fan-out alone: a publish round publishes its version itself, once
        the whole round went through (`Fleet._published`)."""
        return await self._fan(
            "finish_weight_update",
            lambda p, _u: wire.plan_finish_weight_update(p, weight_version),
            targets,
            require,
        )

    async def shutdown_weight_transfer_engine(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /shutdown_weight_transfer_engine`` on every target (vLLM >= 0.32)."""
        return await self._fan(
            "shutdown_weight_transfer_engine",
            wire.plan_shutdown_weight_transfer_engine,
            targets,
            require,
        )

    async def load_lora_adapter(
        self, name: str, path: str, *, load_inplace: bool = False, targets: _Targets = None,
        require: Require | None = None,
    ) -> FleetResult[None]:  # fmt: skip
        """``POST /v1/load_lora_adapter`` on every target: load the peft adapter in
        directory ``path`` (readable by the servers) under ``name``. Low level:
        `AsyncWeightPublisher.publish_lora` writes, versions and collects adapters."""
        plan = lora_wire.plan_load_lora_adapter(name, path, load_inplace=load_inplace)
        return await self._fan("load_lora_adapter", lambda _p, _u: plan, targets, require)

    async def unload_lora_adapter(
        self, name: str, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[None]:
        """``POST /v1/unload_lora_adapter`` on every target."""
        plan = lora_wire.plan_unload_lora_adapter(name)
        return await self._fan("unload_lora_adapter", lambda _p, _u: plan, targets, require)

    async def models(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[list[str]]:
        """``GET /v1/models`` on every target: the served model and loaded adapters."""
        return await self._fan("models", lambda _p, _u: lora_wire.plan_models(), targets, require)

    async def lora_limits(
        self, *, targets: _Targets = None, require: Require | None = None
    ) -> FleetResult[LoraLimits]:
        """Each target's LoRA configuration (``GET /server_info``, dev mode)."""
        plan = lora_wire.plan_server_lora_limits()
        return await self._fan("server_info", lambda _p, _u: plan, targets, require)

    def _record_if_all(self, result: FleetResult[Any], version: str | None) -> None:
        """A version every targeted server now holds is published (by hand: the control
        routes called directly, not by a round)."""
        if result.ok and version is not None:
            self._published(version, result.succeeded)


def _rejected(outcome: Outcome[Any]) -> Outcome[Any]:
    """The outcome of an update sent to be rejected: an HTTP error answer means the
    server dropped its active update (success); a 2xx or no answer is a failure."""
    error = outcome.error
    if isinstance(error, ServerError) and error.status is not None:
        return Outcome(outcome.url, value=None, seconds=outcome.seconds)
    if error is None:
        return Outcome(
            outcome.url,
            error=ProtocolError(
                "the server accepted an update that was sent to be rejected "
                "(expect_failure=True): its update may still be active",
                server=outcome.url,
                route="/update_weights",
            ),
            seconds=outcome.seconds,
        )
    return outcome
