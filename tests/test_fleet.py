"""Fleet fan-out against FakeVLLMServers: outcomes, partial failure, state, cancellation."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import asyncsync as az
from asyncsync._core import encoding as _json
from asyncsync.testing import FakeVLLMServer, Fault
from tests.waiting import HANG, checked_out, wait_until

pytestmark = pytest.mark.asyncio

UPDATE_INFO = {
    "names": [f"layer.{i}.weight" for i in range(100)],
    "dtype_names": ["float32"] * 100,
    "shapes": [[64, 64]] * 100,
}


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeVLLMServer()) for _ in range(3)]


async def test_round_fans_out_and_tracks_state(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        assert fleet.urls == tuple(urls)
        assert len(fleet) == 3
        assert urls[0] in fleet
        paused = await fleet.pause("keep")
        assert paused.ok
        assert all(s.paused for s in fleet.servers)
        started = await fleet.start_weight_update()
        assert started.succeeded == tuple(urls)
        assert all(s.updating and not s.available for s in fleet.servers)
        updated = await fleet.update_weights(UPDATE_INFO)
        assert set(updated) == set(urls)
        finished = await fleet.finish_weight_update("step-1")
        assert finished.ok
        await fleet.resume()
        for state in fleet.servers:
            assert state.weight_version == "step-1"
            assert state.vllm_version == "0.32.0"
            assert state.protocol == "0.32"
            assert not state.updating
            assert not state.dirty
            assert not state.paused
            assert state.available
            assert state.outstanding == 0
        info = await fleet.weight_info()
        assert info.values_by_url == dict.fromkeys(urls, "step-1")
        assert all(o.ok and o.seconds > 0 for o in info.outcomes.values())
    for fake in fakes:
        assert fake.pause_modes == ["keep"]
        assert fake.weight_version == "step-1"
        assert fake.updates == [UPDATE_INFO]


async def test_payload_is_encoded_once_per_fanout(
    fakes: list[FakeVLLMServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    real_dumps = _json.dumps

    def counting(obj: Any) -> bytes:
        calls.append(obj)
        return real_dumps(obj)

    monkeypatch.setattr(_json, "dumps", counting)
    async with AsyncExitStack() as stack:
        old = await stack.enter_async_context(FakeVLLMServer(version="0.23.0"))
        async with az.Fleet([f.url for f in fakes]) as fleet:
            await fleet.start_weight_update()
            calls.clear()
            await fleet.update_weights(UPDATE_INFO)
            assert len(calls) == 1  # three servers, one encoding
            await fleet.add_server(old.url)
            await fleet.start_weight_update(targets=[old.url])
            calls.clear()
            await fleet.update_weights(UPDATE_INFO, targets=[fakes[0].url, old.url])
            # One encoding per protocol generation present.
            assert len(calls) == 2
            assert old.updates == [UPDATE_INFO]


async def test_a_payload_encoded_beforehand_is_sent_as_one_encoded_on_the_loop() -> None:
    """`encoded` makes a mapping's JSON in the thread that calls it (the trainer's worker
    thread); a body holding it has the same bytes as one holding the mapping, and reads
    as the mapping. What does not encode stays as it is: its error is raised where it is
    sent, naming the server and route."""
    torch = pytest.importorskip("torch")
    info = {"names": ["w", "é"], "dtype_names": [torch.bfloat16], "shapes": [torch.Size([4, 8])]}
    made = _json.encoded(info)
    assert isinstance(made, _json.Encoded)
    assert dict(made) == info
    assert len(made) == 3
    assert made["names"] == ["w", "é"]
    assert _json.dumps({"update_info": made}) == _json.dumps({"update_info": info})
    per_rank = _json.encoded([info, {"n": 1}])
    assert all(isinstance(item, _json.Encoded) for item in per_rank)
    assert _json.dumps({"update_info": per_rank}) == _json.dumps({"update_info": [info, {"n": 1}]})
    bad = {"names": {"w"}}
    assert _json.encoded(bad) is bad
    assert _json.encoded("not a mapping") == "not a mapping"


async def test_mixed_generations_get_their_own_payloads(fakes: list[FakeVLLMServer]) -> None:
    async with FakeVLLMServer(version="0.23.0") as old:
        async with az.Fleet([fakes[0].url, old.url]) as fleet:
            await fleet.start_weight_update()
            await fleet.update_weights(UPDATE_INFO)
            await fleet.finish_weight_update("v2")
            assert fleet.state(old.url).protocol == "0.23"
            assert fleet.state(old.url).weight_version == "v2"
            assert fleet.client(old.url).weight_version == "v2"
            result = await fleet.weight_info(require="none")
            assert result[fakes[0].url].value == "v2"
            assert isinstance(result[old.url].error, az.ProtocolError)
        assert old.start_bodies == [{"is_checkpoint_format": True}]
        assert fakes[0].requests_to("/start_weight_update")[0].body == b""
        assert fakes[0].requests_to("/finish_weight_update")[0].json == {"weight_version": "v2"}
        assert old.requests_to("/finish_weight_update")[0].body == b""


async def test_one_dead_server_of_three_raises_fleet_error(fakes: list[FakeVLLMServer]) -> None:
    dead = fakes[1]
    await dead.stop()
    urls = [f.url for f in fakes]
    async with az.Fleet(urls, retry=None) as fleet:
        with pytest.raises(az.FleetError) as info:
            await fleet.pause("abort")
        err = info.value
        assert isinstance(err, ExceptionGroup)
        assert isinstance(err, az.AsyncSyncError)
        assert err.operation == "pause"
        assert err.failed == (dead.url,)
        assert err.succeeded == (urls[0], urls[2])
        assert dead.url in str(err)  # the whole text: tests/test_client.py, as docs quote it
        assert len(err.exceptions) == 1
        assert isinstance(err.exceptions[0], az.ServerUnavailableError)
        assert err.exceptions[0].server == dead.url
        assert err.outcomes[urls[0]].ok
        assert err.outcomes[urls[2]].ok
        # The others did pause, and the fleet knows it.
        assert fleet.state(urls[0]).paused
        assert fleet.state(urls[2]).paused
        assert not fleet.state(dead.url).healthy
        assert not fleet.state(dead.url).paused
        assert fakes[0].paused
        assert fakes[2].paused


async def test_except_star_splits_by_error_type(fakes: list[FakeVLLMServer]) -> None:
    fakes[0].inject("/resume", Fault.hang())
    fakes[1].inject("/resume", Fault.error(500, "boom", shape="string"))
    # Only the hung server has a short deadline (its own client, its version given: the
    # hung /resume is the one call it sends); the 500 never races one on a loaded
    # machine (at a fleet-wide 0.3 s it once came late under CI, timed out too, and no
    # ServerError was left).
    short = az.Timeouts(control=0.3)
    hung = az.AsyncVLLMClient(fakes[0].url, timeouts=short, vllm_version="0.32.0")
    caught: dict[str, Any] = {}
    urls = [hung, fakes[1].url, fakes[2].url]
    async with hung, az.Fleet(urls, timeouts=az.Timeouts.uniform(HANG)) as fleet:
        try:
            await fleet.resume()
        except* az.ServerTimeout as group:
            caught["timeout"] = group
        except* az.ServerError as group:
            caught["error"] = group
    timeout_group, error_group = caught["timeout"], caught["error"]
    assert isinstance(timeout_group, az.FleetError)
    assert [e.server for e in timeout_group.exceptions] == [fakes[0].url]
    assert [e.server for e in error_group.exceptions] == [fakes[1].url]
    # Each subgroup keeps the successes and its own failures.
    assert timeout_group.succeeded == (fakes[2].url,)
    assert timeout_group.failed == (fakes[0].url,)


async def test_partial_failure_policies(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    fakes[0].inject("/pause", Fault.error(500, "nope", shape="string"), times=None)
    async with az.Fleet(urls, require="any") as fleet:
        result = await fleet.pause("abort")  # two of three is enough under "any"
        assert result.failed == (urls[0],)
        assert result.succeeded == (urls[1], urls[2])
        assert isinstance(result.errors[urls[0]], az.ServerError)
        assert not result.ok
        with pytest.raises(az.FleetError):
            await fleet.pause("abort", require="all")
        result = await fleet.pause("abort", require="none", targets=[urls[0]])
        assert result.failed == (urls[0],)
        with pytest.raises(az.FleetError):
            await fleet.pause("abort", targets=[urls[0]])  # "any" with every target failed
        with pytest.raises(az.FleetError):
            result.raise_on_failure("all")
        with pytest.raises(az.ServerError):
            result[urls[0]].unwrap()
        # Continue with the healthy subset.
        ok = fleet.where(lambda s: s.last_error is None)
        assert ok == urls[1:]
        assert (await fleet.resume(targets=ok, require="all")).ok
    with pytest.raises(ValueError, match="require"):
        az.Fleet(urls, require="most")  # type: ignore[arg-type]


async def test_update_failure_marks_dirty_and_finish_cleans(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    fakes[2].inject("/update_weights", Fault.error(500, "load failed"))
    async with az.Fleet(urls) as fleet:
        await fleet.start_weight_update()
        with pytest.raises(az.FleetError) as info:
            await fleet.update_weights(UPDATE_INFO)
        assert info.value.failed == (urls[2],)
        bad = fleet.state(urls[2])
        assert bad.dirty
        assert not bad.updating
        assert bad.healthy
        assert fleet.where(lambda s: s.dirty) == [urls[2]]
        await fleet.finish_weight_update("v1", targets=urls[:2])
        # A later round that succeeds on it makes it clean again.
        await fleet.start_weight_update(targets=[urls[2]])
        await fleet.update_weights(UPDATE_INFO, targets=[urls[2]])
        await fleet.finish_weight_update("v1", targets=[urls[2]])
        assert not fleet.state(urls[2]).dirty
        assert [s.weight_version for s in fleet.servers] == ["v1"] * 3


async def test_publisher_helpers(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        fleet.mark_dirty([urls[0]])
        assert fleet.where(lambda s: s.dirty) == [urls[0]]
        fleet.mark_clean()
        assert fleet.where(lambda s: s.dirty) == []
        fleet.mark_published(urls[1:], "v9")
        assert [s.weight_version for s in fleet.servers] == [None, "v9", "v9"]
        assert fleet.client(urls[1]).weight_version == "v9"
        fleet.set_weight_version("v10")
        assert {s.weight_version for s in fleet.servers} == {"v10"}
        with pytest.raises(KeyError):
            fleet.mark_dirty(["http://127.0.0.1:1"])
        with pytest.raises(TypeError):
            fleet.mark_dirty(urls[0])


async def test_expected_rejection_clears_active_update(fakes: list[FakeVLLMServer]) -> None:
    def reject_abort(info: Any) -> None:
        if isinstance(info, dict) and info.get("abort"):
            raise RuntimeError("round aborted")

    fake = FakeVLLMServer(update_hook=reject_abort)
    async with fake, az.Fleet([fake.url, fakes[0].url]) as fleet:
        await fleet.start_weight_update()
        result = await fleet.update_weights(
            {"abort": True}, targets=[fake.url], expect_failure=True
        )
        assert result.ok
        assert not fake.update_active
        assert not fleet.state(fake.url).updating
        # The plain fake accepts it: that is the failure under expect_failure.
        with pytest.raises(az.FleetError, match="accepted an update"):
            await fleet.update_weights({"abort": True}, targets=[fakes[0].url], expect_failure=True)


async def test_per_server_init_info(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        await fleet.init_weight_transfer_engine(lambda url: {"rank_offset": urls.index(url) + 1})
        await fleet.init_weight_transfer_engine({"shared": True}, targets=urls[:1])
    assert [f.init_infos for f in fakes] == [
        [{"rank_offset": 1}, {"shared": True}],
        [{"rank_offset": 2}],
        [{"rank_offset": 3}],
    ]


async def test_all_control_methods_fan_out(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls, api_key="k") as fleet:
        assert (await fleet.health()).ok
        assert (await fleet.vllm_version()).values_by_url == dict.fromkeys(urls, "0.32.0")
        assert (await fleet.is_paused()).values_by_url == dict.fromkeys(urls, False)
        assert (await fleet.abort_requests(["x"])).values_by_url == dict.fromkeys(urls, 1)
        assert (await fleet.get_world_size()).values_by_url == dict.fromkeys(urls, 1)
        assert (await fleet.reset_prefix_cache()).values_by_url == dict.fromkeys(urls, True)
        await fleet.update_weight_version("manual")
        assert {s.weight_version for s in fleet.servers} == {"manual"}
        sums = await fleet.weight_checksums()
        assert sums[urls[0]].value == fakes[0].checksums()
        cmp = await fleet.compare_weights(fakes[0].checksums())
        assert all(v.match for v in cmp.values_by_url.values())
        assert (await fleet.shutdown_weight_transfer_engine()).ok
    for fake in fakes:
        assert all(r.headers.get("Authorization") == "Bearer k" for r in fake.requests)


async def test_argument_errors_raise_before_sending(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([f.url for f in fakes]) as fleet:
        with pytest.raises(ValueError, match="pause mode"):
            await fleet.pause("soon")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="update_info"):
            await fleet.update_weights(42)  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="not in the fleet"):
            await fleet.resume(targets=["http://127.0.0.1:9"])
    assert all(f.requests == [] for f in fakes)


async def test_add_and_remove_servers_at_runtime(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([fakes[0].url]) as fleet:
        state = await fleet.add_server(fakes[1].url, check=True)
        assert state.vllm_version == "0.32.0"
        assert fleet.urls == (fakes[0].url, fakes[1].url)
        assert fleet.client(fakes[1].url).session is fleet.session
        with pytest.raises(ValueError, match="already"):
            await fleet.add_server(fakes[1].url + "/")
        async with az.AsyncVLLMClient(fakes[2].url) as own:
            await fleet.add_server(own)
            assert (await fleet.health()).ok
            removed = await fleet.remove_server(fakes[2].url)
            assert removed.url == fakes[2].url
            assert own.state == "open"  # a client passed in is not closed by the fleet
        removed_client = fleet.client(fakes[1].url)
        await fleet.remove_server(fakes[1].url)
        assert removed_client.state == "closed"
        assert fleet.urls == (fakes[0].url,)
        with pytest.raises(KeyError):
            fleet.state(fakes[1].url)
        await fakes[2].stop()
        with pytest.raises(az.FleetError):
            await fleet.add_server(fakes[2].url, check=True)
        assert fleet.urls == (fakes[0].url,)


async def test_fleet_lifecycle(fakes: list[FakeVLLMServer]) -> None:
    fleet = az.Fleet([f.url for f in fakes])
    client = fleet.client(fakes[0].url)
    with pytest.raises(az.ServerUnavailableError, match="open the Fleet first"):
        await client.health()
    async with fleet:
        session = fleet.session
        assert session is not None
        assert all(fleet.client(f.url).session is session for f in fakes)
        await fleet.health()
    assert session.closed
    assert fleet.session is None
    # docs/client.md quotes a closed client's message and says a fleet's names the fleet.
    text = " ".join(CLIENT_DOCS.read_text().split())
    quoted = re.search(r"A closed client raises `asyncsync\.ClosedError: ([^`]+)`", text)
    assert quoted is not None
    assert "`this Fleet is closed`" in text
    for call in (fleet.health(), fleet.generate([1, 2, 3], max_tokens=1), client.health()):
        with pytest.raises(az.ClosedError) as info:
            await call
        assert info.value.message == quoted[1].replace("AsyncVLLMClient", "Fleet")
    with pytest.raises(RuntimeError):
        async with fleet:
            pass
    with pytest.raises(TypeError):
        az.Fleet("http://one")
    with pytest.raises(ValueError, match="already"):
        az.Fleet(["http://a:1", "http://a:1/"])


async def test_empty_target_list_is_a_no_op(fakes: list[FakeVLLMServer]) -> None:
    async with az.Fleet([f.url for f in fakes]) as fleet:
        result = await fleet.pause("abort", targets=[])
        assert len(result) == 0
        assert result.ok


async def test_cancelled_fanout_leaves_no_tasks_and_no_connections(
    fakes: list[FakeVLLMServer],
) -> None:
    for fake in fakes:
        fake.inject("/update_weights", Fault.hang())
    async with az.Fleet([f.url for f in fakes]) as fleet:
        await fleet.start_weight_update()
        task = asyncio.create_task(fleet.update_weights(UPDATE_INFO))
        await wait_until(lambda: all(f.requests_to("/update_weights") for f in fakes))
        assert all(s.outstanding == 1 for s in fleet.servers)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Every per-server task is gone (the fakes' own server tasks run in this loop too).
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncsync:")] == []
        client_side = [t for t in asyncio.all_tasks() if "RequestHandler" not in repr(t.get_coro())]
        assert client_side == [asyncio.current_task()]
        assert all(s.outstanding == 0 for s in fleet.servers)
        # Servers cancelled mid-update hold weights of unknown version.
        assert all(s.dirty for s in fleet.servers)
        # Each server saw its client hang up: the in-flight connections were closed.
        await wait_until(lambda: all(f.cancelled == ["/update_weights"] for f in fakes))
        assert checked_out(fleet.session) == 0  # nothing still checked out of a pool
    await wait_until(lambda: all(f.open_connections == 0 for f in fakes))


async def test_cancelling_the_fleet_block_closes_the_session(fakes: list[FakeVLLMServer]) -> None:
    fakes[0].inject("/pause", Fault.hang())
    sessions: list[Any] = []

    async def run() -> None:
        async with az.Fleet([f.url for f in fakes]) as fleet:
            sessions.append(fleet.session)
            await fleet.pause("abort")

    task = asyncio.create_task(run())
    await wait_until(lambda: bool(fakes[0].requests_to("/pause")))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sessions[0].closed
    await wait_until(lambda: all(f.open_connections == 0 for f in fakes))


async def test_fanout_is_concurrent() -> None:
    """All eight calls are in flight at once: each server holds its /pause until every
    one of them has received its own, which a sequential fan-out would never get past
    (its first call would wait for control's 30 s deadline). No clock is read."""
    all_received = asyncio.Event()
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(FakeVLLMServer()) for _ in range(8)]
        for fake in fakes:
            fake.inject("/pause", Fault.until(all_received))
        async with az.Fleet([f.url for f in fakes], vllm_version="0.32.0") as fleet:
            pause = asyncio.create_task(fleet.pause("abort"))
            await wait_until(lambda: all(f.requests_to("/pause") for f in fakes))
            assert not pause.done()  # nobody has answered yet
            all_received.set()
            outcome = await pause
    assert outcome.ok
    assert all(len(f.requests_to("/pause")) == 1 for f in fakes)


#: docs/client.md, which says what a closed client and fleet raise (the fleet's surface
#: beside the client's: tests/test_routes.py).
CLIENT_DOCS = Path(__file__).resolve().parents[1] / "docs" / "client.md"
