"""asyncsync.blocking against FakeVLLMServers: the same calls from a plain thread (no
event loop) and from inside a running loop (a notebook cell), the same typed errors,
streams as iterators, publishing, and the facade's surface mirroring the async API.

The fakes run on a loop of their own (a portal thread of the test): the calling thread
blocks while the facade waits, as a notebook cell's loop does.
"""

from __future__ import annotations

import asyncio
import inspect
import pydoc
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

import asyncsync as az
from asyncsync import blocking
from asyncsync._core.portal import shared_portal
from asyncsync.testing import FakeVLLMServer, Fault, RecordedRequest
from tests.publish_fakes import like_the_shm_engine, round_calls
from tests.waiting import HANG, wait_until_blocking

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def fake_portal() -> Iterator[BlockingPortal]:
    """A loop for the fakes, on its own thread."""
    with start_blocking_portal() as portal:
        yield portal


@pytest.fixture
def fakes(fake_portal: BlockingPortal) -> Iterator[list[FakeVLLMServer]]:
    servers = [FakeVLLMServer(update_hook=like_the_shm_engine) for _ in range(2)]
    for server in servers:
        fake_portal.call(server.start)
    yield servers
    for server in servers:
        fake_portal.call(server.stop)


def _use_fleet(urls: list[str]) -> dict[str, Any]:
    """Every kind of call a script makes, through the blocking facade."""
    seen: dict[str, Any] = {}
    with blocking.Fleet(urls) as fleet:
        assert fleet.health().ok
        assert sorted(fleet.vllm_version().values_by_url) == sorted(fleet.urls)
        fleet.pause("keep")
        assert all(s.paused for s in fleet.servers)
        fleet.resume()
        one = fleet.generate(PROMPT, max_tokens=5, temperature=0.0, logprobs=1)
        two = fleet.generate_n(PROMPT, n=2, max_tokens=3, temperature=1.0, seed=1)
        batch = fleet.generate_batch([PROMPT, PROMPT[:2]], max_tokens=2, temperature=0.0)
        with fleet.stream(PROMPT, max_tokens=5, temperature=0.0, logprobs=1) as stream:
            deltas = list(stream)
        scores = fleet.score(PROMPT)
        fleet.mark_dirty([urls[0]])
        seen["reasons"] = fleet.routing_reasons()
        fleet.mark_clean()
        seen.update(one=one, two=two, batch=batch, deltas=deltas, stream=stream, scores=scores)
        seen["servers"] = fleet.urls
        seen["inside"] = fleet
    return seen


def _check_fleet_use(seen: dict[str, Any], urls: list[str]) -> None:
    one: az.Completion = seen["one"]
    assert len(one.token_ids) == 5
    assert one.logprobs is not None
    assert one.server in urls
    assert len(seen["two"]) == 2
    assert [len(c) for c in seen["batch"]] == [1, 1]
    streamed = [t for d in seen["deltas"] for t in d.token_ids]
    assert streamed == one.token_ids  # greedy: the same tokens as the plain call
    assert seen["stream"].completion.token_ids == one.token_ids
    assert seen["stream"].server in urls
    assert seen["scores"].logprobs[0] is None
    assert len(seen["scores"].logprobs) == len(PROMPT)
    assert seen["reasons"][urls[0]] == "dirty"
    assert seen["reasons"][urls[1]] is None
    assert seen["servers"] == tuple(urls)
    assert "closed" in repr(seen["inside"])


def test_fleet_from_a_thread_without_a_loop(fakes: list[FakeVLLMServer]) -> None:
    urls = [f.url for f in fakes]
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    _check_fleet_use(_use_fleet(urls), urls)


@pytest.mark.asyncio
async def test_fleet_from_inside_a_running_loop(fakes: list[FakeVLLMServer]) -> None:
    """A notebook cell: this thread runs an event loop, and the facade still blocks
    (asyncio.run would refuse here)."""
    assert asyncio.get_running_loop().is_running()
    urls = [f.url for f in fakes]
    _check_fleet_use(_use_fleet(urls), urls)


@pytest.mark.asyncio
async def test_the_facade_runs_on_its_own_loop(fakes: list[FakeVLLMServer]) -> None:
    """The async objects live on the portal's thread, never on the caller's loop."""
    with blocking.Fleet([fakes[0].url]) as fleet:
        owner = fleet._call(threading.current_thread)
    assert owner is shared_portal().thread
    assert owner is not threading.current_thread()


def test_the_same_typed_errors(fakes: list[FakeVLLMServer], fake_portal: BlockingPortal) -> None:
    urls = [f.url for f in fakes]
    fake_portal.call(fakes[1].stop)
    with blocking.Fleet(urls, retry=None) as fleet:
        with pytest.raises(az.FleetError) as info:
            fleet.pause("abort")
        assert info.value.failed == (urls[1],)
        assert isinstance(info.value.exceptions[0], az.ServerUnavailableError)
        with pytest.raises(ValueError, match="max_staleness"):
            blocking.Fleet(urls, max_staleness=-1)
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = -2 is negative"):
            fleet.generate([1, -2], max_tokens=1)
        with pytest.raises(KeyError, match="not in the fleet"):
            fleet.remove_server("http://127.0.0.1:9")
    with (
        blocking.VLLMClient(urls[1], retry=None) as client,
        pytest.raises(az.ServerUnavailableError),
    ):
        client.health()
    with pytest.raises(az.ClosedError, match="this AsyncVLLMClient is closed"):
        client.health()  # closed


def test_client_and_trajectory(fakes: list[FakeVLLMServer]) -> None:
    url = fakes[0].url
    with blocking.VLLMClient(url) as client:
        assert client.vllm_version() == "0.32.0"
        client.weight_version = "v0"
        assert client.weight_version == "v0"
        completion = client.generate(PROMPT, max_tokens=3, temperature=0.0)
        with client.stream(PROMPT, max_tokens=3, temperature=0.0) as stream:
            assert [t for d in stream for t in d.token_ids] == completion.token_ids
        traj = blocking.Trajectory(PROMPT)
        first = traj.generate(client, max_tokens=2, temperature=0.0, logprobs=0)
        traj.add_tool([9, 9])
        traj.generate(client, max_tokens=2, temperature=0.0, logprobs=0)
    assert traj.token_ids[: len(PROMPT) + 2] == PROMPT + first.token_ids
    assert traj.loss_mask == [0] * 4 + [1, 1] + [0, 0] + [1, 1]
    assert client.state == "closed"


def test_a_trajectory_keeps_its_session_on_one_server(fakes: list[FakeVLLMServer]) -> None:
    with blocking.Fleet([f.url for f in fakes]) as fleet:
        traj = blocking.Trajectory(PROMPT)
        for _ in range(3):
            traj.generate(fleet, max_tokens=2, temperature=0.0)
        servers = {c.server for c in traj.completions}
        assert servers == {fleet.session_server(traj.session_id)}


def test_a_fleet_takes_blocking_clients(fakes: list[FakeVLLMServer]) -> None:
    with blocking.VLLMClient(fakes[0].url) as client, blocking.Fleet([client]) as fleet:
        fleet.add_server(fakes[1].url, check=True)
        assert fleet.urls == (fakes[0].url, fakes[1].url)
        assert fleet.client(fakes[0].url).base_url == client.base_url
        assert fakes[1].url in fleet
        assert len(fleet) == 2


def test_publish_and_generate(fakes: list[FakeVLLMServer]) -> None:
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    with (
        blocking.Fleet([f.url for f in fakes]) as fleet,
        blocking.WeightPublisher(fleet, backend="shm") as publisher,
    ):
        report = publisher.publish(weights, version="v1", pause="keep", progress=False)
        assert report.version == "v1"
        assert publisher.version == "v1"
        assert publisher.last_report is report
        assert fleet.current_version == "v1"
        completion = fleet.generate(PROMPT, max_tokens=2, temperature=0.0)
        assert completion.staleness == 0
        with pytest.raises(ValueError, match="version must be a non-empty string"):
            publisher.publish(weights, version="")
    for fake in fakes:
        assert "/finish_weight_update" in round_calls(fake)
        assert fake.weight_version == "v1"


def test_a_failed_round_raises_publish_error(fakes: list[FakeVLLMServer]) -> None:
    fakes[1].inject("/update_weights", Fault.error(500, "worker failed"))
    weights = {"w": torch.zeros(4)}
    with (
        blocking.Fleet([f.url for f in fakes]) as fleet,
        blocking.WeightPublisher(fleet) as publisher,
    ):
        with pytest.raises(az.PublishError) as info:
            publisher.publish(weights, version="v1", progress=False, min_servers="all")
        assert info.value.outcomes[fakes[1].url].phase == "update"
        assert fakes[1].url in info.value.needs_resync
        assert publisher.version is None
        assert fleet.state(fakes[1].url).dirty


def test_an_interrupt_cancels_the_call_on_the_portal(fakes: list[FakeVLLMServer]) -> None:
    """Ctrl-C while a call waits: the interrupt reaches the caller at once, and the
    call is cancelled on the portal's loop: a generation the server holds forever is
    released (it would stay outstanding otherwise)."""
    fakes[0].inject("/inference/v1/generate", Fault.hang())
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    try:
        _interrupt_a_held_generation(fakes[0])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_the_hand_over_still_cancels_the_call(
    fakes: list[FakeVLLMServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window CI once hit on two busy cores: anyio's `start_task_soon` waits for
    the portal's loop to spawn the task, and the task may reach the server (which
    interrupts at once) before the calling thread is back from that wait. The interrupt
    then lands inside the hand-over, before any future of anyio's is in the caller's
    hands; the call must still be cancelled on the portal's loop."""
    portal = shared_portal().portal()
    hand_over = portal._spawn_task_from_thread
    armed, arrived = threading.Event(), threading.Event()

    def a_slow_hand_over(*args: Any) -> None:
        hand_over(*args)
        if not armed.is_set():  # the fleet's own calls, before the generation and after
            return
        armed.clear()  # the task is spawned: it runs while this thread is held here
        if not arrived.wait(HANG):
            raise AssertionError("the generation never reached the server")
        threading.Event().wait(HANG)  # a descheduled thread: the interrupt lands here

    monkeypatch.setattr(portal, "_spawn_task_from_thread", a_slow_hand_over)
    fakes[0].inject("/inference/v1/generate", Fault.hang())
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_held_generation(fakes[0], armed=armed, arrived=arrived)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_held_generation(
    fake: FakeVLLMServer,
    *,
    armed: threading.Event | None = None,
    arrived: threading.Event | None = None,
) -> None:
    main = threading.main_thread().ident
    assert main is not None
    assert main == threading.get_ident()

    def interrupt_once_it_arrives(request: RecordedRequest) -> None:
        if request.path == "/inference/v1/generate":  # held there: Ctrl-C now
            if arrived is not None:
                arrived.set()
            signal.pthread_kill(main, signal.SIGINT)

    with blocking.Fleet([fake.url], retry=None) as fleet:
        fake.on_request = interrupt_once_it_arrives
        if armed is not None:
            armed.set()
        try:
            with pytest.raises(KeyboardInterrupt):
                fleet.generate(PROMPT, max_tokens=2)
        finally:
            fake.on_request = None
        wait_until_blocking(lambda: fleet.state(fake.url).outstanding == 0)


# ---------------------------------------------------------------------- the surface
#: Each async class and its blocking facade: "the same names and arguments"
#: (docs/blocking.md, README).
PAIRS = [
    (az.Fleet, blocking.Fleet),
    (az.AsyncVLLMClient, blocking.VLLMClient),
    (az.AsyncWeightPublisher, blocking.WeightPublisher),
    (az.CompletionStream, blocking.CompletionStream),
    (az.Trajectory, blocking.Trajectory),
]
#: Public names of an async class the facade lacks on purpose, and why (the docs'
#: "differences" list says the same of ``session``).
NOT_MIRRORED = {
    "aclose": "close() instead",
    "session": "an aiohttp session belongs to one loop; the facade's objects live on the portal's",
    "openai": "an openai.AsyncOpenAI: its requests run on the caller's own loop",
    "admitted": "an async context manager of a client, used on the loop (the chat layer)",
    "ledger": "the fleet's record, written on the loop only: read state() and servers",
}
#: Constructor parameters of an async class the facade does not take, and why.
NOT_TAKEN = {
    (az.AsyncVLLMClient, "session"): "an aiohttp session belongs to one loop",
    (az.AsyncVLLMClient, "_owner"): "private: how a fleet's clients name their owner",
}
#: The facade's argument types name the facade's classes where the async ones name theirs.
FACADE_TYPES = {"AsyncVLLMClient": "VLLMClient", "AsyncWeightPublisher": "WeightPublisher"}
#: Constructors the facade does not define (it adopts objects the async API made).
ADOPTED = {az.CompletionStream}


def _as_facade(annotation: object) -> object:
    if not isinstance(annotation, str):
        return annotation
    for theirs, ours in FACADE_TYPES.items():
        annotation = re.sub(rf"\b{theirs}\b", ours, annotation)
    return annotation


def _same_parameters(
    ours: inspect.Signature, theirs: inspect.Signature, left_out: set[str], where: str
) -> None:
    """Names, order, kinds, defaults and (facade-typed) annotations agree."""
    want = [p for p in theirs.parameters.values() if p.name not in left_out]
    got = list(ours.parameters.values())
    assert [p.name for p in got] == [p.name for p in want], where
    for q, p in zip(got, want, strict=True):
        assert (q.kind, q.default) == (p.kind, p.default), f"{where}({p.name}): {q} vs {p}"
        assert q.annotation == _as_facade(p.annotation), f"{where}({p.name}): {q} vs {p}"
    assert ours.return_annotation == _as_facade(theirs.return_annotation), where


@pytest.mark.parametrize(("async_cls", "facade_cls"), PAIRS, ids=lambda c: c.__name__)
def test_constructors_take_the_async_arguments(async_cls: type, facade_cls: type) -> None:
    if async_cls in ADOPTED:
        return
    left_out = {name for (cls, name) in NOT_TAKEN if cls is async_cls}
    theirs, ours = inspect.signature(async_cls.__init__), inspect.signature(facade_cls.__init__)
    assert left_out <= set(theirs.parameters), f"{async_cls.__name__}: stale exceptions"
    _same_parameters(ours, theirs, left_out, f"blocking.{facade_cls.__name__}")


@pytest.mark.parametrize(("async_cls", "facade_cls"), PAIRS, ids=lambda c: c.__name__)
def test_every_public_method_is_mirrored_with_its_signature(
    async_cls: type, facade_cls: type
) -> None:
    names = {n for n in dir(async_cls) if not n.startswith("_")} - set(NOT_MIRRORED)
    missing = sorted(n for n in names if not hasattr(facade_cls, n))
    assert missing == []
    for name in names:
        ours, theirs = getattr(facade_cls, name), getattr(async_cls, name)
        if not inspect.isfunction(theirs):
            continue
        where = f"blocking.{facade_cls.__name__}.{name}"
        _same_parameters(inspect.signature(ours), inspect.signature(theirs), set(), where)
        assert not inspect.iscoroutinefunction(ours), where
        if name not in {"add_server", "client", "generate"}:  # written out, own docstrings
            assert ours.__doc__ == theirs.__doc__, where
    if hasattr(async_cls, "aclose"):
        assert facade_cls.close.__doc__


def test_every_public_attribute_is_mirrored() -> None:
    """What an object holds (attributes set in ``__init__``, not only class-level
    names): an unopened object of each class, built without a server."""
    url = "http://127.0.0.1:9"  # never contacted
    built = [
        (az.AsyncVLLMClient(url), blocking.VLLMClient(url)),
        (az.Fleet([url]), blocking.Fleet([url])),
        (
            az.AsyncWeightPublisher(None, rank=1, world_size=2),
            blocking.WeightPublisher(None, rank=1, world_size=2),
        ),
    ]
    try:
        for theirs, ours in built:
            public = {n for n in dir(theirs) if not n.startswith("_")} - set(NOT_MIRRORED)
            # by name (``dir``): reading a deprecated property would warn
            missing = sorted(public - set(dir(ours)))
            assert missing == [], f"blocking.{type(ours).__name__} lacks {missing}"
    finally:
        for theirs, ours in built:
            ours.close()
            shared_portal().call(theirs.aclose)


def test_help_shows_the_async_signature_and_docs() -> None:
    text = inspect.getdoc(blocking.Fleet.generate) or ""
    assert text == inspect.getdoc(az.Fleet.generate)
    assert "prompt_token_ids" in str(inspect.signature(blocking.Fleet.generate))
    publish = inspect.signature(blocking.WeightPublisher.publish).parameters
    assert publish["version"].kind is inspect.Parameter.KEYWORD_ONLY
    page = pydoc.render_doc(blocking.Fleet, renderer=pydoc.plaintext)
    assert "health(self, *, targets" in page
    assert "async health" not in page


_LEFT_OPEN = """
from anyio.from_thread import start_blocking_portal
from asyncsync import blocking
from asyncsync.testing import FakeVLLMServer

with start_blocking_portal() as portal:
    fake = FakeVLLMServer()
    portal.call(fake.start)
    fleet = blocking.Fleet([fake.url]).__enter__()  # never closed by the program
    print(fleet.generate([1, 2], max_tokens=2).token_ids)
    portal.call(fake.stop)
"""


def test_objects_left_open_are_closed_at_exit() -> None:
    """A script (or a notebook kernel) that ends with a facade still open exits at once,
    and the facade's session is closed (aiohttp reports unclosed sessions otherwise)."""
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Unclosed" not in done.stderr
    assert done.stdout.startswith("[")
