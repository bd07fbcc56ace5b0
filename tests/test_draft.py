"""Draft-model rounds without a server: what a draft round does to a server's state (its
draft dirty, never its served model), the ``/server_info`` parser, and the input checks
(the real rounds are in test_draft_vllm.py)."""

from __future__ import annotations

import pytest
import torch

import asyncsync as az
from asyncsync._core.ledger import Ledger
from asyncsync._publish.draft import check_target
from asyncsync._wire.control import Malformed
from asyncsync._wire.draft import DraftModel, _parse_draft


def test_a_failed_draft_round_dirties_the_draft_only_and_a_draft_round_repairs_it() -> None:
    ledger = Ledger()
    state = ledger.join("http://a")
    url = [state.url]
    ledger.round_committed("v3", url, url)
    ledger.observed(state, "start_draft_weight_update", "update", None)
    assert state.updating
    assert state.update_target == "draft"
    ledger.observed(state, "update_weights", "update", az.ServerError("boom", status=500))
    assert (state.dirty, state.dirty_draft, state.updating) == (False, True, False)
    assert state.unfit() == "dirty_draft"  # speculative decoding would run it
    assert state.weight_version == "v3"
    assert ledger.snapshot(state.url).health == "stale"

    # A round of the served model does not repair the draft ...
    ledger.observed(state, "start_weight_update", "update", None)
    assert state.update_target == "main"
    ledger.observed(state, "finish_weight_update", "update", None)
    ledger.round_committed("v4", url, url)
    assert (state.dirty, state.dirty_draft) == (False, True)
    assert state.weight_version == "v4"
    # ... a draft round does, and leaves the served version alone.
    ledger.observed(state, "start_draft_weight_update", "update", None)
    ledger.observed(state, "finish_weight_update", "update", None)
    ledger.round_committed("d1", url, url, target="draft")
    assert (state.dirty, state.dirty_draft, state.updating) == (False, False, False)
    assert (state.weight_version, state.draft_version) == ("v4", "d1")
    assert ledger.snapshot(state.url).available
    assert ledger.current() == "v4"
    assert ledger.current("draft") == "d1"


def test_a_failed_round_of_the_served_model_leaves_the_draft_clean() -> None:
    ledger = Ledger()
    state = ledger.join("http://a")
    ledger.observed(state, "start_weight_update", "update", None)
    ledger.observed(state, "update_weights", "update", az.ServerError("boom", status=500))
    assert (state.dirty, state.dirty_draft) == (True, False)
    assert state.unfit() == "dirty"


def test_server_info_says_whether_a_draft_model_runs() -> None:
    none = _parse_draft({"vllm_config": {"speculative_config": None}})
    assert (none.method, none.has_draft_model) == (None, False)
    spec = {
        "method": "draft_model",
        "model": "/models/draft",
        "num_speculative_tokens": 3,
        "draft_model_config": {"dtype": "torch.bfloat16"},
    }
    draft = _parse_draft({"vllm_config": {"speculative_config": spec}})
    assert draft == DraftModel(
        method="draft_model", model="/models/draft", num_speculative_tokens=3, dtype="bfloat16"
    )
    assert draft.has_draft_model
    ngram = _parse_draft({"vllm_config": {"speculative_config": {"method": "ngram"}}})
    assert not ngram.has_draft_model
    for bad in ({}, {"vllm_config": 3}, {"vllm_config": {"speculative_config": [1]}}):
        with pytest.raises(Malformed):
            _parse_draft(bad)


def test_the_target_and_verify_are_checked() -> None:
    check_target("main", verify="checksum")
    check_target("draft", verify=None)
    with pytest.raises(ValueError, match="into must be 'main' or 'draft', got 'eagle'"):
        check_target("eagle", verify=None)
    with pytest.raises(ValueError, match="takes no verify"):
        check_target("draft", verify="probe")


@pytest.mark.asyncio
async def test_a_server_without_server_info_is_named_before_a_draft_round() -> None:
    """A server that cannot say whether it runs a draft model (no dev mode, so no
    ``/server_info``: the fake has none) is refused with a ProtocolError naming it and
    the flag, before any round touches a server."""
    async with (
        az.testing.FakeVLLMServer() as fake,
        az.Fleet([fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet, backend="shm") as publisher,
    ):
        weights = {"w": torch.ones(4)}
        with pytest.raises(az.ProtocolError, match="VLLM_SERVER_DEV_MODE") as info:
            await publisher.publish(weights, version="d1", into="draft")
        assert info.value.server == fake.url
        assert not any(r.path.endswith("weight_update") for r in fake.requests)
        assert publisher.draft_version is None


@pytest.mark.asyncio
async def test_the_client_starts_a_draft_update_on_its_route() -> None:
    """``AsyncVLLMClient.start_draft_weight_update`` posts to the draft route (the fake
    serves none: a 404 is a ProtocolError naming the version that serves it) and refuses
    a 0.23 server before sending (the route is new in 0.32)."""
    async with (
        az.testing.FakeVLLMServer(version="0.32.0") as fake,
        az.AsyncVLLMClient(fake.url) as client,
    ):
        with pytest.raises(az.ProtocolError, match=r"vLLM >= 0\.32 serves it") as info:
            await client.start_draft_weight_update()
        assert info.value.route == "/start_draft_weight_update"
        assert [r.path for r in fake.requests][-1] == "/start_draft_weight_update"
    async with (
        az.testing.FakeVLLMServer(version="0.23.0") as old,
        az.AsyncVLLMClient(old.url) as client,
    ):
        with pytest.raises(az.ProtocolError, match=r"needs vLLM >= 0\.32; this server speaks"):
            await client.start_draft_weight_update()
        assert not any(r.path == "/start_draft_weight_update" for r in old.requests)
