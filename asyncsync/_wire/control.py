"""vLLM's RL control routes as data: planned calls, payloads and response parsers.

Pure wire knowledge, no I/O: a `Call` carries the method, route, deadline phase, JSON
payload and the parser of the 2xx answer. The control routes that `AsyncVLLMClient`
and `Fleet` both serve are described once each in `asyncsync._wire.routes` (its
`Route.plan` makes their calls, with the parsers below); the routes with one caller are
planned here by ``plan_*`` functions (health, version, identity, a router's workers,
the served model, ``/v1/models``). A fleet plans and
encodes a call once per protocol generation and sends the same bytes to every server;
`asyncsync._http.transport` sends it.

The two generations of vLLM's RL protocol:

- vLLM 0.23-style servers: ``/start_weight_update`` needs a JSON body with
  ``is_checkpoint_format``; ``packed`` travels inside ``update_info``; ``update_info`` is
  one dict; ``/finish_weight_update`` ignores its body, so the client records the weight
  version itself; ``/weight_info``, ``/update_weight_version``, ``/weight_checker`` and
  ``/shutdown_weight_transfer_engine`` do not exist.
- vLLM 0.32-style servers: no body on start; ``update_info`` may be a list with one dict
  per worker rank; the version goes to the server with finish.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import urlsplit

from asyncsync._core import encoding as _json
from asyncsync._core.errors import ProtocolError, UnsupportedVLLMError
from asyncsync._core.types import Phase, ProtocolGeneration
from asyncsync._wire.served import ServedModel, describe_payload, parse_described

__all__ = [
    "NO_BODY",
    "Call",
    "Malformed",
    "WeightComparison",
    "check_version_arg",
    "describe_error_body",
    "normalize_url",
    "protocol_for_version",
]

T = TypeVar("T")
U = TypeVar("U")

_MIN_SUPPORTED = (0, 23)
_CURRENT = (0, 32)
_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)")


#: Marker for "this request has no body" (distinct from a JSON ``null``).
NO_BODY: Any = object()


class Malformed(Exception):
    """Raised by a response parser: the 2xx body is not what the route promises."""


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One planned request: everything but the server and the encoded body.

    A call is planned once per vLLM protocol generation and sent to many servers; its
    payload is encoded once by the caller and the bytes are shared.
    """

    op: str
    method: Literal["GET", "POST"]
    route: str
    phase: Phase
    parse: Callable[[Any], T]
    expect: str
    payload: Any = NO_BODY
    params: tuple[tuple[str, str], ...] = ()
    idempotent: bool = False
    json_response: bool = True
    #: A hint added to the message when the server answers 404.
    not_found_hint: str | None = None

    def encode(self) -> bytes | None:
        """The request body as JSON bytes, or ``None`` when the call has no body."""
        if self.payload is NO_BODY:
            return None
        return _json.dumps(self.payload)

    def project(self, view: Callable[[T], U]) -> Call[U]:
        """The same request, its parsed answer passed through ``view``: one plan per
        route, and each caller takes the part of the answer it needs."""
        parse = self.parse
        call: Call[Any] = self
        return replace(call, parse=lambda data: view(parse(data)))


def describe_error_body(body: bytes) -> str | None:
    """The human message inside a vLLM error body, for all shapes vLLM uses.

    1. ``{"error": "<string>"}`` (pause, resume, is_paused, abort_requests);
    2. OpenAI style ``{"error": {"message", "type", "param", "code"}}`` (validation
       errors, HTTPException, worker failures "Call to collective_rpc method failed: ...");
    3. FastAPI's own ``{"detail": "..."}`` for unknown routes and methods (404, 405).

    Returns ``None`` when the body is none of these (e.g. a proxy's HTML page).
    """
    try:
        data = _json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if not isinstance(message, str):
            return None
        kind = error.get("type")
        param = error.get("param")
        text = f"{kind}: {message}" if isinstance(kind, str) and kind else message
        if isinstance(param, str) and param:
            text = f"{text} (param {param})"
        return text
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
    return None


def protocol_for_version(version: str, *, server: str | None = None) -> ProtocolGeneration:
    """The protocol generation of a server reporting ``version`` (``GET /version``).

    vLLM >= 0.32 speaks the current protocol; 0.23 up to 0.32 the 0.23 one. Older servers
    have no weight-transfer routes: `UnsupportedVLLMError` (docs/versions.md), naming
    ``server``.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        raise ProtocolError(f"cannot read the vLLM version {version!r}", server=server)
    parsed = (int(match.group(1)), int(match.group(2)))
    if parsed < _MIN_SUPPORTED:
        raise UnsupportedVLLMError(
            version, "it has no weight-transfer routes (vLLM >= 0.23 has)", server=server
        )
    return "0.32" if parsed >= _CURRENT else "0.23"


#: The first vLLM whose non-streamed ``/inference/v1/generate`` answers every one of
#: ``n > 1`` choices (0.27.1 was seen answering 1 or 3 of 4: docs/versions.md).
_GENERATE_KEEPS_ALL_CHOICES = (0, 29)


def _major_minor(version: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a reported vLLM version; None when absent or unreadable."""
    match = None if version is None else _VERSION_RE.match(version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def generate_keeps_all_choices(version: str | None) -> bool:
    """Whether a server reporting ``version`` answers ``n > 1`` on the generate route
    with all its choices (unknown versions are assumed to)."""
    parsed = _major_minor(version)
    return parsed is None or parsed >= _GENERATE_KEEPS_ALL_CHOICES


#: The first vLLM whose streamed ``/inference/v1/generate`` always sends a sample's last
#: event: 0.27.1 skips events without new token ids, so an abort that lands between two
#: tokens ends the stream with ``[DONE]`` and no finish reason (read in its
#: ``serve_tokens_stream_generator``; 0.32 emits every terminal output).
_STREAM_SENDS_EVERY_FINISH = (0, 32)


def stream_drops_silent_aborts(version: str | None) -> bool:
    """Whether a server reporting ``version`` leaves an aborted sample's finish reason out
    of a generate stream when the abort brought no new tokens (unknown versions are
    assumed not to)."""
    parsed = _major_minor(version)
    return parsed is not None and parsed < _STREAM_SENDS_EVERY_FINISH


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
# plans (and encodes) a call once per generation and sends the same bytes to every server
# (the table's routes: asyncsync._wire.routes).

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


def _parse_identity(data: Any) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("vllm_config"), dict):
        raise Malformed("expected a JSON object with a 'vllm_config' object")
    found = data["vllm_config"].get("instance_id")
    if isinstance(found, int | str) and not isinstance(found, bool) and str(found):
        return str(found)
    return None  # a vLLM whose config carries no instance id


def plan_identity() -> Call[str | None]:
    """The server process's identity: vLLM's ``instance_id`` (``GET /server_info``,
    dev mode; vLLM 0.27 and 0.32 set it from the clock when the server's config is
    built, once per process start), so a restarted server answers with a new one.
    None when the config carries none."""
    return Call(
        "identity", "GET", "/server_info", "control", _parse_identity,
        '{"vllm_config": {"instance_id": str, ...}}', params=(("config_format", "json"),),
        idempotent=True,
        not_found_hint="/server_info needs VLLM_SERVER_DEV_MODE=1, like the RL routes",
    )  # fmt: skip


def _parse_workers(data: Any) -> list[str]:
    urls = data.get("urls") if isinstance(data, dict) else None
    if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
        raise Malformed("expected a JSON object with 'urls', a list of URLs")
    return list(urls)


def plan_list_workers() -> Call[list[str]]:
    """A vllm-router's worker list (``GET /list_workers``: ``{"urls": [...]}``)."""
    return Call(
        "list_workers", "GET", "/list_workers", "control", _parse_workers,
        '{"urls": [str, ...]}', idempotent=True,
        not_found_hint="is this a vllm-router? (it lists its workers at /list_workers)",
    )  # fmt: skip


def _malformed_as(parse: Callable[[Any], T]) -> Callable[[Any], T]:
    def parsed(data: Any) -> T:
        try:
            return parse(data)
        except ValueError as exc:
            raise Malformed(str(exc)) from exc

    return parsed


def plan_describe(*, checkpoint: bool) -> Call[ServedModel]:
    """Ask the server's weight-transfer engine what it serves (``POST /collective_rpc``,
    dev mode; answered by asyncsync's engines only, see `asyncsync._wire.served`):
    vocabulary size and context length, and with ``checkpoint`` the checkpoint's table.
    Lookups are not retried: a server that cannot be reached now is asked again when
    it is next needed (and a generation fails over without waiting for retries)."""
    return Call(
        "describe", "POST", "/collective_rpc", "control", _malformed_as(parse_described),
        '{"results": [asyncsync engine answer]}', payload=describe_payload(checkpoint=checkpoint),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One entry of ``GET /v1/models``: a name the server serves (its model's, or a LoRA
    adapter's) and its context length."""

    id: str
    max_model_len: int | None


def parse_model_entries(data: Any) -> list[ModelEntry]:
    """``GET /v1/models``'s answer, the one parser of that route."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise Malformed("expected {'data': [models]}")
    out = []
    for entry in data["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise Malformed("a model entry has no string 'id'")
        length = entry.get("max_model_len")
        valid = type(length) is int and length >= 1
        out.append(ModelEntry(entry["id"], length if valid else None))
    if not out:
        raise Malformed("the server lists no model")
    return out


def context_length(entries: Sequence[ModelEntry]) -> int | None:
    """The served model's ``max_model_len``: the first entry's that gives one."""
    lengths = [m.max_model_len for m in entries if m.max_model_len]
    return lengths[0] if lengths else None


@functools.cache
def plan_models() -> Call[list[ModelEntry]]:
    """``GET /v1/models``, the one plan of that route: the names the server serves and
    their context length. Callers project the part they need (`Call.project`): the
    context length (`context_length`), the names (LoRA), the entries (chat)."""
    return Call(
        "models", "GET", "/v1/models", "control", parse_model_entries,
        '{"data": [{"id": str, "max_model_len": int}]}', idempotent=True,
    )  # fmt: skip


def check_version_arg(version: str) -> None:
    """A weight version is a non-empty string (TypeError otherwise)."""
    if not isinstance(version, str) or not version:
        raise TypeError(f"a weight version must be a non-empty string, got {version!r}")


def normalize_url(base_url: str) -> str:
    """``base_url`` without a trailing slash; ValueError unless it is an http(s) URL with
    a host (and a port in range), no whitespace, query or fragment."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    parts = urlsplit(base_url)
    try:
        port = parts.port  # ValueError when out of range or not a number
    except ValueError:
        port = -1
    if (
        not parts.hostname
        or port == -1
        or parts.query
        or parts.fragment
        or any(c.isspace() for c in base_url)
    ):
        raise ValueError(
            f"base_url must be http(s)://host[:port][/path] with no spaces, query or "
            f"fragment, got {base_url!r}"
        )
    url = base_url.rstrip("/")
    if url.endswith(("/v1", "/v2", "/inference/v1")):
        # OpenAI clients take ".../v1"; asyncsync calls routes outside /v1 as well (the RL
        # routes, /inference/v1/generate), so it takes the server's root.
        root = url.rsplit("/inference/v1", 1)[0] if url.endswith("/inference/v1") else url[:-3]
        raise ValueError(
            f"base_url must be the server's root URL, without {url[len(root) :]}: use "
            f"{root!r}, not {base_url!r} (asyncsync calls routes outside /v1 too)"
        )
    return url
