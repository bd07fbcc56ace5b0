"""vLLM's control routes, one description each: the table the control surface is made of.

Each `Route` says everything about one control route once: its name (the method's name
on `AsyncVLLMClient`, `Fleet` and both blocking facades, and the operation a
`FleetResult` and the ledger name), its HTTP method and path, the body builder (the
method's arguments, and the server's protocol generation where the body depends on
it, into a JSON payload and query parameters), the parser of the 2xx answer, the retry
class (``"idempotent"``: retried by the client's `RetryPolicy`; ``"never"``: sent once),
the timeout class (the `Timeouts` phase whose deadline applies) and the docstring all
four methods carry.

The methods are written once per facade as one-line delegations with the real
signature (for mypy, IDEs and the API reference, which reads the source): the
decorator ``@PAUSE.describes`` gives the method the route's docstring (and checks its name),
the client sends ``PAUSE.plan(...)`` to its server, the fleet fans it out, and the
blocking facades wrap the async methods (`asyncsync._core.portal.blocking_method`).
``tests/test_routes.py`` checks every route of `ROUTES` on all four classes: the same
signature and docstring, and the HTTP call it makes against a `FakeVLLMServer`.
``scripts/griffe_extensions.py`` (``RouteDocstrings``) gives the docs site the same
docstrings. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar

from asyncsync._core.errors import ProtocolError
from asyncsync._core.types import PAUSE_MODES, PauseMode, Phase, ProtocolGeneration
from asyncsync._wire.control import (
    _MESSAGE,
    NO_BODY,
    Call,
    WeightComparison,
    _needs_current,
    _parse_aborted,
    _parse_checksums,
    _parse_comparison,
    _parse_is_paused,
    _parse_message,
    _parse_weight_version,
    _parse_world_size,
    _reset_cache_parser,
    _status_parser,
    _version_parser,
    check_version_arg,
)
from asyncsync._wire.draft import DRAFT_START_ROUTE

__all__ = ["ROUTES", "Body", "Retry", "Route"]

P = ParamSpec("P")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: A route's retry class: ``"idempotent"`` calls are retried by the client's
#: `RetryPolicy`; ``"never"`` calls change the server and are sent once.
Retry = Literal["idempotent", "never"]


@dataclass(frozen=True, slots=True)
class Body(Generic[T]):
    """What a body builder makes of a call's arguments: the JSON payload (`NO_BODY`:
    none), the query parameters, and a parser where the answer's check depends on the
    arguments (None: the route's)."""

    payload: Any = NO_BODY
    params: tuple[tuple[str, str], ...] = ()
    parse: Callable[[Any], T] | None = None


@dataclass(frozen=True, slots=True)
class Route(Generic[P, T]):
    """One control route (see the module docstring). ``P`` are the arguments of its
    methods (without ``targets`` and ``require``, which a fleet adds), ``T`` what one
    server's answer parses to."""

    name: str
    method: Literal["GET", "POST"]
    path: str
    #: The body builder: the protocol generation, the server's URL (named in errors),
    #: then the method's arguments. It raises TypeError/ValueError for bad arguments,
    #: ProtocolError for arguments this generation does not take.
    build: Callable[Concatenate[ProtocolGeneration, str, P], Body[T]]
    parse: Callable[[Any], T] | None
    #: The answer's shape, named when a 2xx answer does not have it.
    expect: str
    retry: Retry
    timeout: Phase
    doc: str
    #: ``"0.32"``: servers of the 0.23 protocol lack the route (a ProtocolError per server).
    since: Literal["0.32"] | None = None
    #: The body or parser depends on the server's protocol generation, which the client
    #: then learns first (``GET /version``, once). Other routes are built the same way
    #: for every generation.
    by_protocol: bool = False
    json_response: bool = True
    not_found_hint: str | None = None

    @property
    def needs_protocol(self) -> bool:
        """Whether the call depends on the server's protocol generation (its body or
        parser, or whether the server has the route at all)."""
        return self.by_protocol or self.since is not None

    def plan(
        self, protocol: ProtocolGeneration, server: str, /, *args: P.args, **kwargs: P.kwargs
    ) -> Call[T]:
        """The `Call` for a server of ``protocol`` at ``server``, with these arguments
        (a route that does not `needs_protocol` is built the same for any ``protocol``)."""
        if self.since is not None:
            _needs_current(self.path, protocol, server)
        body = self.build(protocol, server, *args, **kwargs)
        parse = body.parse if body.parse is not None else self.parse
        if parse is None:  # pragma: no cover - a table entry without a parser
            raise TypeError(f"route {self.name} has no parser")
        return Call(
            self.name, self.method, self.path, self.timeout, parse, self.expect,
            payload=body.payload, params=body.params, idempotent=self.retry == "idempotent",
            json_response=self.json_response, not_found_hint=self.not_found_hint,
        )  # fmt: skip

    def describes(self, fn: F) -> F:
        """Decorator of a facade's method for this route: the route's docstring."""
        if fn.__name__ != self.name:
            raise TypeError(f"{fn.__qualname__} is not the method of route {self.name}")
        fn.__doc__ = self.doc
        return fn


# ------------------------------------------------------------------ body builders
# Each takes the protocol generation and the server's URL (for its errors), then the
# method's arguments; the arguments are checked here, before anything is sent.


def _pause(
    _protocol: ProtocolGeneration, _server: str, mode: PauseMode, clear_cache: bool | None
) -> Body[None]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    params: tuple[tuple[str, str], ...] = (("mode", mode),)
    if clear_cache is not None:
        params += (("clear_cache", "true" if clear_cache else "false"),)
    return Body(params=params)


def _nothing(_protocol: ProtocolGeneration, _server: str) -> Body[Any]:
    return Body()


def _abort_requests(
    _protocol: ProtocolGeneration, _server: str, request_ids: Sequence[str] | None
) -> Body[int]:
    if isinstance(request_ids, str):
        raise TypeError("request_ids must be a sequence of ids, not one string")
    return Body({} if request_ids is None else {"request_ids": list(request_ids)})


def _update_weight_version(
    _protocol: ProtocolGeneration, _server: str, new_version: str
) -> Body[None]:
    check_version_arg(new_version)
    return Body({"new_version": new_version}, parse=_version_parser(new_version))


def _weight_checksums(_protocol: ProtocolGeneration, _server: str) -> Body[dict[str, str]]:
    return Body({"action": "checksum"})


def _compare_weights(
    _protocol: ProtocolGeneration, _server: str, baseline: Mapping[str, str]
) -> Body[WeightComparison]:
    return Body({"action": "compare", "baseline": dict(baseline)})


def _get_world_size(_protocol: ProtocolGeneration, _server: str, include_dp: bool) -> Body[int]:
    return Body(params=(("include_dp", "true" if include_dp else "false"),))


def _reset_prefix_cache(
    protocol: ProtocolGeneration, _server: str, reset_running_requests: bool, reset_external: bool
) -> Body[bool]:
    params: tuple[tuple[str, str], ...] = ()
    if reset_running_requests:
        params += (("reset_running_requests", "true"),)
    if reset_external:
        params += (("reset_external", "true"),)
    parse: Callable[[Any], bool] = _reset_cache_parser(protocol)
    return Body(params=params, parse=parse)


def _init_weight_transfer_engine(
    _protocol: ProtocolGeneration, _server: str, init_info: Mapping[str, Any]
) -> Body[None]:
    if not isinstance(init_info, Mapping):
        raise TypeError(f"init_info must be a mapping, got {type(init_info).__name__}")
    return Body({"init_info": init_info})


def _start_weight_update(
    protocol: ProtocolGeneration, server: str, is_checkpoint_format: bool | None
) -> Body[None]:
    if protocol == "0.23":
        fmt = True if is_checkpoint_format is None else is_checkpoint_format
        return Body({"is_checkpoint_format": fmt})
    if is_checkpoint_format is not None:
        raise ProtocolError(
            "is_checkpoint_format is a vLLM 0.23 option; vLLM >= 0.32 takes no body on "
            "/start_weight_update",
            server=server,
            route="/start_weight_update",
        )
    return Body()


def _update_weights(
    protocol: ProtocolGeneration,
    server: str,
    update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    packed: bool | None,
) -> Body[None]:
    route = "/update_weights"
    info: Any
    if isinstance(update_info, Mapping):
        info = update_info
    elif isinstance(update_info, (list, tuple)):
        if not all(isinstance(item, Mapping) for item in update_info):
            raise TypeError("update_info list items must be mappings (one per worker rank)")
        if protocol == "0.23":
            raise ProtocolError(
                "a per-rank update_info list needs vLLM >= 0.32; vLLM 0.23 takes one dict",
                server=server,
                route=route,
            )
        info = list(update_info)
    else:
        raise TypeError(
            f"update_info must be a mapping or a list of mappings, got {type(update_info).__name__}"
        )
    if packed is not None:
        if protocol == "0.32":
            raise ProtocolError(
                "packed belongs in init_info on vLLM >= 0.32 (an update_info with 'packed' "
                "is rejected there); pass packed only to vLLM 0.23 servers",
                server=server,
                route=route,
            )
        info = {**info, "packed": packed}
    return Body({"update_info": info})


def _finish_weight_update(
    protocol: ProtocolGeneration, _server: str, weight_version: str | None
) -> Body[None]:
    if weight_version is not None:
        check_version_arg(weight_version)
    if protocol == "0.32" and weight_version is not None:
        return Body({"weight_version": weight_version})
    return Body()


# ------------------------------------------------------------------------- the table

PAUSE = Route(
    "pause", "POST", "/pause", _pause, _status_parser("paused"), '{"status": "paused"}',
    retry="never", timeout="control",
    doc="""``POST /pause?mode=...``: stop scheduling; the server is recorded as paused.
        ``mode`` (required): ``"abort"`` drops in-flight requests, ``"wait"`` drains
        them, ``"keep"`` freezes them until `resume`. ``clear_cache`` is deprecated
        upstream and only sent when given.""",
)  # fmt: skip

RESUME: Route[[], None] = Route(
    "resume", "POST", "/resume", _nothing, _status_parser("resumed"), '{"status": "resumed"}',
    retry="never", timeout="control",
    doc="""``POST /resume``: scheduling resumes; the server is recorded as not paused.""",
)  # fmt: skip

IS_PAUSED: Route[[], bool] = Route(
    "is_paused", "GET", "/is_paused", _nothing, _parse_is_paused, '{"is_paused": bool}',
    retry="idempotent", timeout="control",
    doc="""``GET /is_paused``: whether the server is paused (the answer is recorded).""",
)  # fmt: skip

ABORT_REQUESTS = Route(
    "abort_requests", "POST", "/abort_requests", _abort_requests, _parse_aborted,
    '{"status": "aborted", "aborted": int}', retry="never", timeout="control",
    not_found_hint="on vLLM 0.23 /abort_requests exists only with --tokens-only; "
    "vLLM >= 0.32 always serves it",
    doc="""``POST /abort_requests``: abort the given requests (all when None), without
        pausing. Returns the number of requests aborted.""",
)  # fmt: skip

WEIGHT_INFO: Route[[], str] = Route(
    "weight_info", "GET", "/weight_info", _nothing, _parse_weight_version,
    '{"weight_version": str}', retry="idempotent", timeout="control", since="0.32",
    doc="""``GET /weight_info``: the server's weight version, as it reports it (vLLM >=
        0.32; starts as ``"default"``; on 0.23 servers read `weight_version`). Taken as
        the recorded version while nothing is recorded and nothing was published; a
        version that contradicts the record makes the server suspect (a restart, a
        server loaded by someone else), then stale unless a probe finds it is the same
        process holding the recorded version.""",
)  # fmt: skip

UPDATE_WEIGHT_VERSION = Route(
    "update_weight_version", "POST", "/update_weight_version", _update_weight_version, None,
    '{"success": true, "new_version": str}', retry="never", timeout="control", since="0.32",
    doc="""``POST /update_weight_version``: set the version without loading weights
        (vLLM >= 0.32). A client records it as its server's version; a fleet, once
        every target set it, publishes it (`Fleet.current_version`) and records it on
        them. A server a publish round holds is left to the round.""",
)  # fmt: skip

WEIGHT_CHECKSUMS = Route(
    "weight_checksums", "POST", "/weight_checker", _weight_checksums, _parse_checksums,
    '{"checksums": {str: str}}', retry="never", timeout="update", since="0.32",
    doc="""``POST /weight_checker {"action": "checksum"}``: a checksum per
        ``"dp0:pp0:pcp0:tp0:<param>"`` (vLLM >= 0.32).""",
)  # fmt: skip

COMPARE_WEIGHTS = Route(
    "compare_weights", "POST", "/weight_checker", _compare_weights, _parse_comparison,
    '{"match": bool, "mismatches": [str]}', retry="never", timeout="update", since="0.32",
    doc="""``POST /weight_checker {"action": "compare", "baseline": ...}``: the
        server's checksums against ``baseline`` (vLLM >= 0.32).""",
)  # fmt: skip

GET_WORLD_SIZE = Route(
    "get_world_size", "GET", "/get_world_size", _get_world_size, _parse_world_size,
    '{"world_size": int}', retry="idempotent", timeout="control",
    doc="""``GET /get_world_size``: TP*PP (times DP when ``include_dp``) worker count.""",
)  # fmt: skip

RESET_PREFIX_CACHE = Route(
    "reset_prefix_cache", "POST", "/reset_prefix_cache", _reset_prefix_cache, None,
    '{"success": bool}', retry="never", timeout="control", by_protocol=True,
    json_response=False,
    doc="""``POST /reset_prefix_cache``. Returns False when vLLM could not reset now
        (blocks still held by running requests; not a failure): callers may retry.
        Needed after a weight update: cached KV from old weights is otherwise reused.""",
)  # fmt: skip

INIT_WEIGHT_TRANSFER_ENGINE = Route(
    "init_weight_transfer_engine", "POST", "/init_weight_transfer_engine",
    _init_weight_transfer_engine, _parse_message, _MESSAGE, retry="never", timeout="update",
    doc="""``POST /init_weight_transfer_engine {"init_info": ...}`` (backend specific).
        For NCCL this must be in flight while the trainer's ``trainer_init`` runs. A
        fleet also takes a function of the server URL (NCCL: per-server rank offset).""",
)  # fmt: skip

START_WEIGHT_UPDATE = Route(
    "start_weight_update", "POST", "/start_weight_update", _start_weight_update,
    _parse_message, _MESSAGE, retry="never", timeout="update", by_protocol=True,
    doc="""``POST /start_weight_update``; marks the started servers ``updating``. vLLM
        0.23 gets ``{"is_checkpoint_format": ...}`` (default True); vLLM >= 0.32 no body
        (passing the option there is an error).""",
)  # fmt: skip

START_DRAFT_WEIGHT_UPDATE: Route[[], None] = Route(
    "start_draft_weight_update", "POST", DRAFT_START_ROUTE, _nothing, _parse_message,
    _MESSAGE, retry="never", timeout="update", since="0.32",
    not_found_hint="vLLM >= 0.32 serves it (in dev mode)",
    doc="""``POST /start_draft_weight_update`` (vLLM >= 0.32, a server running a
        speculative draft model): the update that follows loads into the draft model;
        marks the started servers ``updating``. Low level: ``publish(...,
        into="draft")`` runs a draft round.""",
)  # fmt: skip

UPDATE_WEIGHTS = Route(
    "update_weights", "POST", "/update_weights", _update_weights, _parse_message, _MESSAGE,
    retry="never", timeout="update", by_protocol=True,
    doc="""``POST /update_weights {"update_info": ...}``: one chunk of weights.

        ``update_info`` is the backend's metadata (shapes as lists of ints, dtype names
        like ``"bfloat16"``; ``torch.Size``/``torch.dtype`` are converted). vLLM >= 0.32
        also takes a list with one dict per worker rank. ``packed`` is added inside
        ``update_info`` for vLLM 0.23 servers only. A server that fails here after a
        start is marked ``dirty`` (vLLM drops its active update). A fleet sends the
        payload encoded once; its ``expect_failure=True`` sends an update the servers
        are meant to reject, to make vLLM clear an active update (a cancelled round):
        an HTTP error answer is then the successful outcome (the server is no longer
        ``updating``), while a 2xx answer or a transport failure is a failed one.
        """,
)  # fmt: skip

FINISH_WEIGHT_UPDATE = Route(
    "finish_weight_update", "POST", "/finish_weight_update", _finish_weight_update,
    _parse_message, _MESSAGE, retry="never", timeout="update", by_protocol=True,
    doc="""``POST /finish_weight_update``. On success the server is clean, on failure
        ``dirty``. vLLM >= 0.32 is sent ``weight_version`` and stores it; on 0.23 only
        asyncsync records it (`weight_version`). A client records it as its server's
        version; a fleet, when every target finished, publishes it
        (`Fleet.current_version`) and records it on them, unless a publish round holds
        them (the round records its version itself, once it has decided).""",
)  # fmt: skip

SHUTDOWN_WEIGHT_TRANSFER_ENGINE: Route[[], None] = Route(
    "shutdown_weight_transfer_engine", "POST", "/shutdown_weight_transfer_engine", _nothing,
    _parse_message, _MESSAGE, retry="never", timeout="update", since="0.32",
    doc="""``POST /shutdown_weight_transfer_engine`` (vLLM >= 0.32; 500 during an
        update).""",
)  # fmt: skip

#: Every route of the table, by name: each is a method of `AsyncVLLMClient`, `Fleet`,
#: ``blocking.VLLMClient`` and ``blocking.Fleet`` (``tests/test_routes.py``).
ROUTES: dict[str, Route[..., Any]] = {
    route.name: route
    for route in (
        PAUSE, RESUME, IS_PAUSED, ABORT_REQUESTS, WEIGHT_INFO, UPDATE_WEIGHT_VERSION,
        WEIGHT_CHECKSUMS, COMPARE_WEIGHTS, GET_WORLD_SIZE, RESET_PREFIX_CACHE,
        INIT_WEIGHT_TRANSFER_ENGINE, START_WEIGHT_UPDATE, START_DRAFT_WEIGHT_UPDATE,
        UPDATE_WEIGHTS, FINISH_WEIGHT_UPDATE, SHUTDOWN_WEIGHT_TRANSFER_ENGINE,
    )
}  # fmt: skip
