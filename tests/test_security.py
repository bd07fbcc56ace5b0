"""Security (issue 12, item 9): asyncsync's own payloads are plain JSON (never pickle),
and the bearer token is sent on every request but never logged or put in an error."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._transport.wire import ShmInitFields, ShmUpdateFields
from asyncsync._wire.served import describe_payload
from asyncsync.testing import Fault
from tests.publish_fakes import shm_fakes
from tests.waiting import HANG

TOKEN = "sk-test-0123456789abcdef-SECRET"
WEIGHTS = {f"model.layers.{i}.w": torch.full((256,), float(i)) for i in range(6)}
PACKAGE = Path(az.__file__).parent
#: A string that could carry a pickle: base64 (what a pickle would travel as in JSON).
BASE64 = re.compile(r"[A-Za-z0-9+/]{8,}={0,2}")


def _strict_json(body: bytes) -> Any:
    """``body`` parsed as RFC 8259 JSON: UTF-8, no NaN or Infinity, no repeated key
    (Python's json accepts both; a server's parser may read them differently)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"a key is repeated: {keys}"
        return dict(pairs)

    return json.loads(body.decode("utf-8"), parse_constant=refuse, object_pairs_hook=unique)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _pickled(text: str) -> bool:
    """Whether ``text`` is base64 of a pickle (protocols 2 and later start with 0x80)."""
    if not BASE64.fullmatch(text) or len(text) % 4:
        return False
    return base64.b64decode(text)[:1] == b"\x80"


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.asyncio
async def test_shm_round_payloads_are_plain_json() -> None:
    """Every body a publish sends (init, each chunk, finish; 0.32's start has none) is
    strict UTF-8 JSON with exactly the fields of the wire type the worker reads, and no
    string in it is a base64 pickle: nothing a server would have to unpickle."""
    async with (
        shm_fakes(1) as fakes,
        az.Fleet([fakes[0].url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1", pause="keep")
        bodies = [r for r in fakes[0].requests if r.body]
    paths = [r.path for r in bodies]
    assert sorted(set(paths)) == [
        "/collective_rpc", "/finish_weight_update", "/init_weight_transfer_engine",
        "/update_weights",
    ]  # fmt: skip
    assert paths.count("/update_weights") > 1  # several chunks
    for request in bodies:
        assert request.headers.get("Content-Type", "").startswith("application/json")
        parsed = _strict_json(request.body)
        assert b"\x80\x04\x95" not in request.body  # a pickle protocol 4+ header
        assert [s for s in _strings(parsed) if _pickled(s)] == [], request.path
        # Each body holds exactly the fields of the wire type the worker reads, and
        # reads back as what was sent.
        if request.path == "/init_weight_transfer_engine":
            assert set(parsed) == {"init_info"}
            assert set(parsed["init_info"]) == _fields(ShmInitFields)
            assert ShmInitFields(**parsed["init_info"]).to_json() == parsed["init_info"]
        elif request.path == "/update_weights":
            assert set(parsed) == {"update_info"}
            info = parsed["update_info"]
            # ``delta`` only in chunk 0 of a delta chain's round (this one is full)
            assert set(info) == _fields(ShmUpdateFields) - {"delta"}
            assert json.loads(json.dumps(ShmUpdateFields.parse(info).to_json())) == info
        elif request.path == "/collective_rpc":  # the checkpoint question, once
            assert parsed == describe_payload(checkpoint=True)
        else:
            assert parsed == {"weight_version": "v1"}


#: The one module that pickles: CUDA IPC handles for vLLM's ipc engine, behind the
#: ``allow_insecure_serialization=True`` opt-in (it never unpickles).
IPC_HANDLES = PACKAGE / "backends" / "_ipc_handles.py"


def test_no_pickle_on_asyncsyncs_own_paths() -> None:
    """No module of the package (the trainer side, the wire, the vLLM plugin, the test
    helpers) imports pickle or torch's pickle-based loaders: a source guard, since a
    payload could only be unpickled by code that imports it. The IPC handle encoder is
    the one exception, checked below."""
    guarded = sorted(p for p in PACKAGE.rglob("*.py") if p != IPC_HANDLES)
    assert len(guarded) > 80  # the whole package, wherever its modules live
    pattern = re.compile(r"\b(import pickle|cloudpickle|torch\.load|pickle\.loads?|marshal)\b")
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in guarded
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_only_the_ipc_backend_pickles_and_nothing_unpickles() -> None:
    """vLLM's ipc engine takes its handles only pickled: the encoder pickles (dumps),
    never loads, and only the ipc backend imports it (after its opt-in)."""
    source = IPC_HANDLES.read_text()
    assert "pickle.dumps" in source
    assert not re.search(r"\b(loads?|torch\.load|marshal|Unpickler)\b", source)
    importers = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path != IPC_HANDLES
        and re.search(r"^\s*(from|import) \S*_ipc_handles\b", path.read_text(), re.MULTILINE)
    )
    assert importers == ["backends/ipc.py"]
    with pytest.raises(ValueError, match="allow_insecure_serialization=True"):
        az.AsyncWeightPublisher(None, backend="ipc", rank=1, world_size=2)


def _texts_of(error: BaseException) -> list[str]:
    """str and repr of an error and of everything it was caused by."""
    texts: list[str] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        texts += [str(exc), repr(exc), repr(getattr(exc, "args", ()))]
        stack += [exc.__cause__, exc.__context__]
        stack += [getattr(o, "error", None) for o in getattr(exc, "outcomes", {}).values()]
    return texts


@pytest.mark.asyncio
async def test_bearer_token_sent_on_every_request_and_never_logged_or_in_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    # Deadlines that only catch a hang; the hung /weight_info is asked through a client
    # of its own with a short one (its version given: that is the one call it sends),
    # so that no answer races a deadline on a loaded machine.
    generous = az.Timeouts.uniform(HANG)
    async with shm_fakes(1) as fakes:
        fake = fakes[0]
        async with (
            az.Fleet([fake.url], api_key=TOKEN, timeouts=generous, retry=None) as fleet,
            az.AsyncVLLMClient(
                fake.url,
                api_key=TOKEN,
                timeouts=az.Timeouts(control=0.3),
                retry=None,
                vllm_version="0.32.0",
            ) as hung,
        ):
            client = fleet.client(fake.url)
            await client.health()
            await client.vllm_version(refresh=True)
            await fleet.generate([1, 2, 3], max_tokens=3)
            async with client.stream([1, 2], max_tokens=3) as stream:
                async for _ in stream:
                    pass
            publisher = az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096))
            await publisher.publish(WEIGHTS, version="v1", pause="wait")
            # Failures of every kind: an error answer, a malformed one, no answer, a
            # dropped connection, a failed round.
            faults = {
                "/pause": Fault.error(401, f"bad token {TOKEN[:4]}", shape="detail"),
                "/is_paused": Fault.malformed(),
                "/weight_info": Fault.hang(),
                "/health": Fault.drop(),
                "/update_weights": Fault.error(500),
            }
            for route, fault in faults.items():
                fake.inject(route, fault, times=None)  # retries meet the fault too
            for call in (
                lambda: client.pause("wait"),
                client.is_paused,
                hung.weight_info,
                client.health,
                lambda: publisher.publish(WEIGHTS, version="v2"),
            ):
                with pytest.raises(az.AsyncSyncError) as info:
                    await call()
                errors.append(info.value)
            fake.clear_faults()
            await publisher.aclose()
        sent = fake.requests
    assert len(sent) > 15
    unauthorized = [r.path for r in sent if r.headers.get("Authorization") != f"Bearer {TOKEN}"]
    assert unauthorized == []
    texts = [t for error in errors for t in _texts_of(error)]
    assert len(errors) == 5
    assert not [t for t in texts if TOKEN in t]
    logged = [record.getMessage() + repr(record.args) for record in caplog.records]
    assert not [line for line in logged if TOKEN in line]
    assert TOKEN not in repr(fleet)
    assert TOKEN not in repr(client)
