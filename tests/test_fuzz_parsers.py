"""Parsers under fuzz (issue 12, item 8): hypothesis-generated bodies for every control
route and every generation shape (plain and streamed, 0.32's generate route and 0.23's
/v1/completions, finished, stopped and aborted). A well-formed body parses to exactly
what it carries; anything else raises a typed error (``ServerError`` from the
transport, ``Malformed``/``StreamFailed`` inside the generation parsers, which the
generation engine maps to ``ServerError``), never another exception."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync._core.errors import ServerError
from asyncsync._http.transport import parse_answer as parse_control
from asyncsync._wire import control as wire
from asyncsync._wire import routes
from asyncsync._wire.control import Malformed
from asyncsync._wire.generation.bodies import parse_answer
from asyncsync._wire.generation.options import COMPLETIONS_ROUTE, GENERATE_ROUTE
from asyncsync._wire.generation.stream import StreamAssembler, StreamFailed

URL = "http://fuzz"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(
        st.sampled_from(
            ["status", "version", "is_paused", "aborted", "weight_version", "world_size",
             "checksums", "match", "mismatches", "success", "new_version", "message",
             "choices", "token_ids", "index", "finish_reason", "logprobs", "text",
             "prompt_token_ids", "request_id", "weight_versions", "error"]
        )
        | st.text(max_size=6),
        inner,
        max_size=5,
    ),
    max_leaves=20,
)  # fmt: skip

#: Values of strict JSON (RFC 8259: no NaN or Infinity, 64-bit integers).
strict_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)


def _encode(value: Any) -> bytes:
    """JSON as any server might write it (big ints and Infinity included)."""
    return json.dumps(value).encode()


#: Every control route's plan, per protocol generation where it differs.
CALLS: dict[str, wire.Call[Any]] = {
    "health": wire.plan_health(),
    "version": wire.plan_version(),
    "pause": routes.PAUSE.plan("0.32", URL, "wait", None),
    "resume": routes.RESUME.plan("0.32", URL),
    "is_paused": routes.IS_PAUSED.plan("0.32", URL),
    "abort_requests": routes.ABORT_REQUESTS.plan("0.32", URL, None),
    "weight_info": routes.WEIGHT_INFO.plan("0.32", URL),
    "update_weight_version": routes.UPDATE_WEIGHT_VERSION.plan("0.32", URL, "v7"),
    "weight_checksums": routes.WEIGHT_CHECKSUMS.plan("0.32", URL),
    "compare_weights": routes.COMPARE_WEIGHTS.plan("0.32", URL, {"a": "x"}),
    "get_world_size": routes.GET_WORLD_SIZE.plan("0.32", URL, True),
    "reset_prefix_cache 0.32": routes.RESET_PREFIX_CACHE.plan("0.32", URL, False, False),
    "reset_prefix_cache 0.23": routes.RESET_PREFIX_CACHE.plan("0.23", URL, False, False),
    "init_weight_transfer_engine": routes.INIT_WEIGHT_TRANSFER_ENGINE.plan("0.32", URL, {"x": 1}),
    "start_weight_update 0.32": routes.START_WEIGHT_UPDATE.plan("0.32", URL, None),
    "start_weight_update 0.23": routes.START_WEIGHT_UPDATE.plan("0.23", URL, None),
    "start_draft_weight_update": routes.START_DRAFT_WEIGHT_UPDATE.plan("0.32", URL),
    "update_weights 0.32": routes.UPDATE_WEIGHTS.plan("0.32", URL, {"x": 1}, None),
    "update_weights 0.23": routes.UPDATE_WEIGHTS.plan("0.23", URL, {"x": 1}, None),
    "finish_weight_update 0.32": routes.FINISH_WEIGHT_UPDATE.plan("0.32", URL, "v7"),
    "finish_weight_update 0.23": routes.FINISH_WEIGHT_UPDATE.plan("0.23", URL, None),
    "shutdown_weight_transfer_engine": routes.SHUTDOWN_WEIGHT_TRANSFER_ENGINE.plan("0.32", URL),
}


def test_every_route_of_the_table_is_fuzzed() -> None:
    assert set(routes.ROUTES) <= {name.split()[0] for name in CALLS}


def _parses_or_server_error(call: wire.Call[Any], body: bytes) -> tuple[bool, Any]:
    try:
        return True, parse_control(call, "http://fuzz", 200, body)
    except ServerError as exc:
        error = exc
    assert "malformed 200 response" in str(error)
    assert error.route == call.route
    return False, None


@pytest.mark.parametrize("name", list(CALLS))
@FUZZ
@given(body=st.one_of(json_values.map(_encode), st.binary(max_size=64)))
def test_control_answers_parse_or_raise_server_error(name: str, body: bytes) -> None:
    _parses_or_server_error(CALLS[name], body)


#: A well-formed answer per route (a strategy) and what it must parse to.
VALID: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], Any]]] = {
    "version": (st.fixed_dictionaries({"version": st.text()}), lambda b: b["version"]),
    "is_paused": (st.fixed_dictionaries({"is_paused": st.booleans()}), lambda b: b["is_paused"]),
    "abort_requests": (
        st.fixed_dictionaries({"status": st.just("aborted"), "aborted": st.integers(0, 2**63 - 1)}),
        lambda b: b["aborted"],
    ),
    "weight_info": (
        st.fixed_dictionaries({"weight_version": st.text()}),
        lambda b: b["weight_version"],
    ),
    "weight_checksums": (
        st.fixed_dictionaries({"checksums": st.dictionaries(st.text(), st.text())}),
        lambda b: b["checksums"],
    ),
    "get_world_size": (
        st.fixed_dictionaries({"world_size": st.integers(1, 1 << 20)}),
        lambda b: b["world_size"],
    ),
    "reset_prefix_cache 0.32": (
        st.fixed_dictionaries({"success": st.booleans()}),
        lambda b: b["success"],
    ),
}


@pytest.mark.parametrize("name", list(VALID))
@FUZZ
@given(data=st.data())
def test_well_formed_control_answers_parse_to_what_they_carry(name: str, data: Any) -> None:
    strategy, expected = VALID[name]
    body = data.draw(strategy)
    extra = data.draw(st.dictionaries(st.text(max_size=5), strict_json, max_size=2))
    answer = {**extra, **body}  # unknown fields are ignored
    ok, value = _parses_or_server_error(CALLS[name], json.dumps(answer).encode())
    assert ok
    assert value == expected(body)


# ----------------------------------------------------------------------- generation
ROUTES = [GENERATE_ROUTE, COMPLETIONS_ROUTE]
token_lists = st.lists(st.integers(0, 200_000), min_size=1, max_size=12)
reasons = st.sampled_from(["length", "stop", "abort"])


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(data=json_values, n=st.integers(1, 3), logprobs=st.sampled_from([None, 0, 2]))
def test_plain_generation_answers_parse_or_raise_malformed(
    path: str, data: Any, n: int, logprobs: int | None
) -> None:
    try:
        completions = parse_answer(data, path, n, logprobs)
    except Malformed:
        return
    assert len(completions) == n


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            json_values.map(lambda v: b"data: " + _encode(v)),
            st.binary(max_size=40),
            st.just(b"data: [DONE]"),
            st.just(b""),
        ),
        max_size=6,
    ),
    n=st.integers(1, 2),
    logprobs=st.sampled_from([None, 1]),
)
def test_streamed_events_parse_or_raise_malformed(
    path: str, lines: list[bytes], n: int, logprobs: int | None
) -> None:
    assembler = StreamAssembler(n, logprobs, path)
    try:
        for line in lines:
            assembler.feed(line)
        completions = assembler.completions([1, 2])
    except (Malformed, StreamFailed):
        return
    assert len(completions) == n


def _choice(path: str, index: int, ids: list[int], reason: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "token_ids": ids, "finish_reason": reason}
    if path == COMPLETIONS_ROUTE:
        choice |= {"text": "", "logprobs": None, "stop_reason": None}
    return choice


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(samples=st.lists(st.tuples(token_lists, reasons), min_size=1, max_size=3))
def test_well_formed_plain_answers_carry_their_exact_tokens(
    path: str, samples: list[tuple[list[int], str]]
) -> None:
    choices = [_choice(path, i, ids, reason) for i, (ids, reason) in enumerate(samples)]
    body = {"request_id" if path == GENERATE_ROUTE else "id": "r-1", "choices": choices[::-1]}
    completions = parse_answer(json.loads(json.dumps(body)), path, len(samples), None)
    assert [c.token_ids for c in completions] == [ids for ids, _ in samples]
    assert [c.finish_reason for c in completions] == [reason for _, reason in samples]
    assert [c.index for c in completions] == list(range(len(samples)))


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(
    ids=token_lists,
    reason=reasons,
    cuts=st.lists(st.integers(0, 12), max_size=5),
    separators=st.booleans(),
)
def test_well_formed_streams_carry_their_exact_tokens_however_split(
    path: str, ids: list[int], reason: str, cuts: list[int], separators: bool
) -> None:
    """Any split of the tokens across events (vLLM coalesces under load), with blank
    separator lines and comments, assembles to the same tokens; an aborted stream ends
    with finish_reason "abort"."""
    bounds = sorted({0, len(ids), *(c for c in cuts if c < len(ids))})
    pieces = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    assembler = StreamAssembler(1, None, path)
    deltas = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        event = {"id": "r-1", "choices": [_choice(path, 0, piece, reason if last else None)]}
        deltas += assembler.feed(b"data: " + json.dumps(event).encode())
        if separators:
            assert assembler.feed(b"") == []
            assert assembler.feed(b": keep-alive") == []
    assembler.feed(b"data: [DONE]")
    (completion,) = assembler.completions([5, 6])
    assert completion.token_ids == ids
    assert completion.finish_reason == reason
    assert [t for d in deltas for t in d.token_ids] == ids
    assert completion.prompt_token_ids == [5, 6]


@pytest.mark.parametrize("path", ROUTES)
@given(message=st.text(max_size=30), code=st.integers(400, 599))
@FUZZ
def test_an_error_event_is_a_stream_failure(path: str, message: str, code: int) -> None:
    assembler = StreamAssembler(1, None, path)
    event = {"error": {"message": message, "code": code}}
    with pytest.raises(StreamFailed):
        assembler.feed(b"data: " + json.dumps(event).encode())
