"""The control routes' table (`asyncsync._wire.routes`) against the surface made of it.

Every route of the table is a method of `AsyncVLLMClient`, `Fleet`, ``blocking.VLLMClient``
and ``blocking.Fleet``: the four carry the route's docstring and one signature (the
fleet's adds ``targets`` and ``require`` and returns a `FleetResult` of the client's
result; the blocking ones are the async ones'), take the arguments its body builder
takes, and each sends the route's HTTP call, checked here against a `FakeVLLMServer`.
Then the rest of the client beside the fleet: every client method exists on the fleet,
with the differences docs/client.md states.
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import asyncsync as az
from asyncsync import blocking
from asyncsync._wire.routes import ROUTES, Route
from asyncsync.testing import FakeVLLMServer

#: docs/client.md, which says what the fleet offers of the client's methods.
CLIENT_DOCS = Path(__file__).resolve().parents[1] / "docs" / "client.md"
UPDATE_INFO = {
    "names": ["model.embed_tokens.weight", "lm_head.weight"],
    "dtype_names": ["float32", "bfloat16"],
    "shapes": [[512, 128], [512, 128]],
}


class Sample(NamedTuple):
    """A call of a route, and the request it must send to a vLLM 0.32 server."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - never changed
    query: dict[str, str] = {}  # noqa: RUF012
    body: Any = None
    #: The calls it needs before it (a weight update needs a start) and after it (the
    #: update ended, for the next facade's start).
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


SAMPLES: dict[str, Sample] = {
    "pause": Sample(("keep",), {"clear_cache": False}, {"mode": "keep", "clear_cache": "false"}),
    "resume": Sample(),
    "is_paused": Sample(),
    "abort_requests": Sample((["a", "b"],), body={"request_ids": ["a", "b"]}),
    "weight_info": Sample(),
    "update_weight_version": Sample(("v7",), body={"new_version": "v7"}),
    "weight_checksums": Sample(body={"action": "checksum"}),
    "compare_weights": Sample(({"a": "x"},), body={"action": "compare", "baseline": {"a": "x"}}),
    "get_world_size": Sample(kwargs={"include_dp": False}, query={"include_dp": "false"}),
    "reset_prefix_cache": Sample(
        kwargs={"reset_running_requests": True}, query={"reset_running_requests": "true"}
    ),
    "init_weight_transfer_engine": Sample(({"seg": "x"},), body={"init_info": {"seg": "x"}}),
    "start_weight_update": Sample(after=("finish_weight_update",)),
    "start_draft_weight_update": Sample(),
    "update_weights": Sample(
        (UPDATE_INFO,),
        body={"update_info": UPDATE_INFO},
        before=("start_weight_update",),
        after=("finish_weight_update",),
    ),
    "finish_weight_update": Sample(
        ("step-1",), body={"weight_version": "step-1"}, before=("start_weight_update",)
    ),
    "shutdown_weight_transfer_engine": Sample(),
}
#: Routes the fake does not serve (it answers 404): the call is still checked, and the
#: error is the one a server without the route gives.
NOT_SERVED = {"start_draft_weight_update": az.ProtocolError}
#: A fleet argument's type that is wider than the client's, on purpose (docs/client.md).
FLEET_WIDENS = {
    ("init_weight_transfer_engine", "init_info"): (
        "Mapping[str, Any] | Callable[[str], Mapping[str, Any]]"
    ),
}


def _own_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]


#: The client's methods that are not routes of the table, and why.
NOT_IN_THE_TABLE = {
    "aclose": "the client's lifecycle",
    "health": "the fleet's is the health probe: /health, then the identity (/server_info)",
    "vllm_version": "the client reads /version once and keeps it; the fleet asks each time",
    "protocol": "read from the cached /version; per server on a fleet (fleet.state(url))",
}


def test_every_route_method_of_the_client_is_in_the_table() -> None:
    """A new route of the client is a table entry, or listed above with its reason."""
    methods = set(_methods(az.AsyncVLLMClient)) - GENERATION_METHODS
    assert methods - set(ROUTES) == set(NOT_IN_THE_TABLE)


def test_the_table_is_every_route_once() -> None:
    assert set(SAMPLES) == set(ROUTES), "a route without a sample call here, or the reverse"
    paths = [(r.method, r.path, r.name) for r in ROUTES.values()]
    assert len({(m, p, n) for m, p, n in paths}) == len(paths)
    for route in ROUTES.values():
        assert route.doc.strip(), route.name
        assert (route.method == "GET") == (route.retry == "idempotent"), route.name


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_each_route_is_one_method_on_the_four_classes(name: str) -> None:
    """One docstring, one signature: the client's, the fleet's (``targets``, ``require``
    added, a `FleetResult` returned) and the blocking facades' (the async ones')."""
    route = ROUTES[name]
    client, fleet = getattr(az.AsyncVLLMClient, name), getattr(az.Fleet, name)
    sync_client, sync_fleet = getattr(blocking.VLLMClient, name), getattr(blocking.Fleet, name)
    for method in (client, fleet, sync_client, sync_fleet):
        assert method.__doc__ == route.doc, f"{method.__qualname__}'s docstring"
    assert inspect.iscoroutinefunction(client)
    assert inspect.iscoroutinefunction(fleet)
    assert not inspect.iscoroutinefunction(sync_client)
    assert inspect.signature(sync_client) == inspect.signature(client)
    assert inspect.signature(sync_fleet) == inspect.signature(fleet)

    # The body builder takes the client's arguments (after the protocol and the URL).
    builder = list(inspect.signature(route.build).parameters)[2:]
    assert builder == [p.name for p in _own_params(client)], f"{name}: the builder's arguments"

    ours = {p.name: p for p in _own_params(fleet)}
    extra = [p for p in _own_params(fleet) if p.name not in {q.name for q in _own_params(client)}]
    added = [p.name for p in extra if (name, p.name) not in FLEET_ADDS]
    assert added == ["targets", "require"], f"Fleet.{name} adds {added}"
    for p in extra:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"Fleet.{name}({p.name})"
    for p in _own_params(client):
        q = ours[p.name]
        assert (q.kind, q.default) == (p.kind, p.default), f"Fleet.{name}({p.name}): {q} vs {p}"
        want = FLEET_WIDENS.get((name, p.name), p.annotation)
        assert q.annotation == want, f"Fleet.{name}({p.name}): {q.annotation} vs {want}"
    returns = inspect.signature(client).return_annotation
    assert inspect.signature(fleet).return_annotation == f"FleetResult[{returns}]"


def _last(fake: FakeVLLMServer, route: Route[..., Any]) -> tuple[str, dict[str, str], Any]:
    """The last request on the route's path: its method, query and JSON body."""
    last = fake.requests_to(route.path)[-1]
    return last.method, last.query, last.json


def _expected(name: str) -> tuple[str, dict[str, str], Any]:
    sample = SAMPLES[name]
    return ROUTES[name].method, sample.query, sample.body


async def _call(obj: Any, name: str) -> Any:
    """The sample call of route ``name`` on ``obj`` (a client or a fleet), with the calls
    it needs around it; the fleet's `FleetResult`, the client's value."""
    sample = SAMPLES[name]
    for step in sample.before:
        await getattr(obj, step)()
    got = await getattr(obj, name)(*sample.args, **sample.kwargs)
    for step in sample.after:
        await getattr(obj, step)()
    return got


def _call_blocking(obj: Any, name: str) -> Any:
    """`_call` on a blocking facade."""
    sample = SAMPLES[name]
    for step in sample.before:
        getattr(obj, step)()
    got = getattr(obj, name)(*sample.args, **sample.kwargs)
    for step in sample.after:
        getattr(obj, step)()
    return got


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(ROUTES))
async def test_each_route_sends_its_http_call(name: str) -> None:
    """The client, the fleet and both blocking facades each send the route's request
    (method, path, query, JSON body) and read the same answer (or, where the fake does
    not serve the route, fail the same way)."""
    route, error = ROUTES[name], NOT_SERVED.get(name)
    values: list[Any] = []

    def answered(outcome: az.Outcome[Any]) -> None:
        if error is None:
            assert outcome.ok, outcome.error
            values.append(outcome.value)
        else:
            assert isinstance(outcome.error, error)

    def blocking_calls() -> None:
        with blocking.VLLMClient(fake.url) as sync_client:
            if error is None:
                values.append(_call_blocking(sync_client, name))
            else:
                with pytest.raises(error):
                    _call_blocking(sync_client, name)
        assert _last(fake, route) == _expected(name)
        with blocking.Fleet([fake.url], require="none") as sync_fleet:
            (outcome,) = _call_blocking(sync_fleet, name).values()
            answered(outcome)
        assert _last(fake, route) == _expected(name)

    async with FakeVLLMServer(version="0.32.0") as fake:
        async with az.AsyncVLLMClient(fake.url) as client:
            if error is None:
                values.append(await _call(client, name))
            else:
                with pytest.raises(error):
                    await _call(client, name)
        assert _last(fake, route) == _expected(name)
        async with az.Fleet([fake.url], require="none") as fleet:
            result = await _call(fleet, name)
        assert result.operation == name
        (outcome,) = result.values()
        answered(outcome)
        assert _last(fake, route) == _expected(name)
        await asyncio.to_thread(blocking_calls)
        assert len(fake.requests_to(route.path)) == 4  # once by each
    assert len(values) == (4 if error is None else 0)
    assert all(v == values[0] for v in values), values


# ------------------------------------------------- the rest of the client, on the fleet
#: The generation methods: routed to one server (routing options), not fanned out.
GENERATION_METHODS = {"generate", "generate_n", "generate_batch", "stream", "score"}
#: What a route method adds to the client's arguments: where to send, what must succeed.
FAN_OUT_ARGS = {"targets", "require"}
#: The routing options a generation method may add (as keywords or in ``**options``).
ROUTING_ARGS = {"session_id", "session_ids", "min_version", "admission_timeout", "lora"}
#: Deliberate differences, each one stated in docs/client.md (the test checks the names
#: appear there): a client method the fleet lacks, a client argument a fleet method
#: lacks, a fleet argument beyond the fan-out and routing ones.
NOT_ON_THE_FLEET = {"protocol": "per server: fleet.state(url).protocol"}
FLEET_LACKS = {("vllm_version", "refresh"): "the fleet asks every target each time"}
FLEET_ADDS = {("update_weights", "expect_failure"): "what a cancelled round sends"}


def _methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods of ``cls`` a user calls (deprecated aliases left out)."""
    found = {}
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name)
        if name.startswith("_") or not inspect.isfunction(attr):
            continue
        if (attr.__doc__ or "").startswith("Deprecated"):
            continue
        found[name] = attr
    return found


def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """``fn``'s parameters without ``self``, the keys of an ``**options: Unpack[...]``
    TypedDict spread out as keyword-only ones."""
    params = dict(list(inspect.signature(fn).parameters.items())[1:])
    for name, p in list(params.items()):
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            del params[name]
            hint = typing.get_type_hints(fn, include_extras=True)[name]
            (options,) = typing.get_args(hint)
            for key in typing.get_type_hints(options):
                params[key] = inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY)
    return params


def test_every_client_method_exists_on_the_fleet() -> None:
    client, fleet = _methods(az.AsyncVLLMClient), _methods(az.Fleet)
    assert set(NOT_ON_THE_FLEET) <= set(client), "an exception for a method the client lacks"
    for name, method in sorted(client.items()):
        if name in NOT_ON_THE_FLEET:
            assert name not in fleet, f"Fleet.{name} exists now: drop its exception"
            continue
        assert name in fleet, f"AsyncVLLMClient.{name} has no Fleet.{name}"
        assert inspect.iscoroutinefunction(fleet[name]) == inspect.iscoroutinefunction(method)
        ours, theirs = _params(fleet[name]), _params(method)
        for arg, p in theirs.items():
            if (name, arg) in FLEET_LACKS:
                assert arg not in ours, f"Fleet.{name} takes {arg} now: drop its exception"
                continue
            assert arg in ours, f"Fleet.{name} lacks the client's {arg!r}"
            q = ours[arg]
            assert (q.kind, q.default) == (p.kind, p.default), f"Fleet.{name}({arg}): {q} vs {p}"
        extra = set(ours) - set(theirs) - {arg for (m, arg) in FLEET_ADDS if m == name}
        if name in GENERATION_METHODS:
            assert extra <= ROUTING_ARGS, f"Fleet.{name} adds {extra - ROUTING_ARGS}"
        elif name != "aclose":
            assert extra == FAN_OUT_ARGS, f"Fleet.{name} adds {extra} (not targets, require)"
            for arg in FAN_OUT_ARGS:
                assert ours[arg].kind is inspect.Parameter.KEYWORD_ONLY
                assert ours[arg].default is None


def test_the_fleets_differences_are_the_documented_ones() -> None:
    text = " ".join(CLIENT_DOCS.read_text().split())
    start = text.index("Every route method of the client (the table above) exists on the fleet")
    passage = text[start : text.index("### Partial failure", start)]
    names = [*NOT_ON_THE_FLEET, *(arg for _, arg in FLEET_LACKS), *(arg for _, arg in FLEET_ADDS)]
    names += [method for method, _ in FLEET_WIDENS]
    names += sorted(GENERATION_METHODS | FAN_OUT_ARGS | ROUTING_ARGS)
    missing = [n for n in names if f"`{n}" not in passage]
    assert missing == [], f"docs/client.md's Fleet section does not mention {missing}"
