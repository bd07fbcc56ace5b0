"""LoRA rounds without vLLM: bad adapters refused before any server is touched (naming
the tensor), remote servers without ``shared_dir`` refused, the adapter table's routing,
and the LoRA routes' parsers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._core.ledger import Ledger
from asyncsync._fleet.adapters import served_name, skipped
from asyncsync._publish.lora_adapter import check_adapter, resolve_adapter, write_adapter
from asyncsync._wire.control import Call, Malformed, ModelEntry, context_length, plan_models
from asyncsync._wire.lora import _parse_limits
from asyncsync.testing import FakeVLLMServer

HIDDEN, RANK = 32, 4
PREFIX = "base_model.model.model.layers.0.self_attn"
CONFIG = {"r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


class _Base(torch.nn.Module):
    """The shapes of the layers an adapter targets: ``model.layers.0.self_attn.*``."""

    def __init__(self) -> None:
        super().__init__()
        attn = torch.nn.Module()
        attn.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        attn.v_proj = torch.nn.Linear(HIDDEN, 16)
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


def _tensors(**changes: Any) -> dict[str, torch.Tensor]:
    out = {
        f"{PREFIX}.q_proj.lora_A.weight": torch.randn(RANK, HIDDEN),
        f"{PREFIX}.q_proj.lora_B.weight": torch.randn(HIDDEN, RANK),
        f"{PREFIX}.v_proj.lora_A.weight": torch.randn(RANK, HIDDEN),
        f"{PREFIX}.v_proj.lora_B.weight": torch.randn(16, RANK),
    }
    for key, value in changes.items():
        name = f"{PREFIX}.{key.replace('__', '.')}.weight"
        if value is None:
            del out[name]
        else:
            out[name] = value
    return out


@pytest.mark.parametrize(
    ("tensors", "config", "match"),
    [
        (_tensors(q_proj__lora_A=torch.randn(8, HIDDEN)), CONFIG, r"q_proj\.lora_A.*rank 8"),
        (_tensors(), {**CONFIG, "r": 8}, r"q_proj\.lora_A.*rank 4 .*config's rank 8"),
        (
            _tensors(q_proj__lora_A=torch.randn(RANK, 31)),
            CONFIG,
            r"q_proj\.lora_A.*31\].*32 inputs",
        ),
        (_tensors(v_proj__lora_B=torch.randn(32, RANK)), CONFIG, r"v_proj\.lora_B.*16 outputs"),
        (
            {**_tensors(), f"{PREFIX}.k_proj.lora_A.weight": torch.randn(RANK, HIDDEN)},
            CONFIG,
            r"k_proj\.lora_A.*not in the config's target_modules",
        ),
        (
            {
                **_tensors(),
                f"{PREFIX}.k_proj.lora_A.weight": torch.randn(RANK, HIDDEN),
                f"{PREFIX}.k_proj.lora_B.weight": torch.randn(HIDDEN, RANK),
            },
            {**CONFIG, "target_modules": ["q_proj", "k_proj", "v_proj"]},
            r"k_proj\.lora_A.*no 2-D layer.*unknown target module",
        ),
        (_tensors(v_proj__lora_B=None), CONFIG, r"v_proj\.lora_A.*no lora_B partner"),
        ({**_tensors(), "model.embed.weight": torch.randn(2, 2)}, CONFIG, "not a LoRA weight"),
        (
            _tensors(q_proj__lora_B=torch.full((HIDDEN, RANK), float("nan"))),
            CONFIG,
            r"q_proj\.lora_B.*NaN",
        ),
    ],
    ids=[
        "wrong-rank",
        "config-rank",
        "shape-in",
        "shape-out",
        "untargeted",
        "unknown-module",
        "unpaired",
        "not-lora",
        "nan",
    ],
)
def test_bad_adapters_are_refused_naming_the_tensor(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_adapter(resolve_adapter(tensors, config, _Base()))


def test_a_rank_over_the_servers_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="max_lora_rank 2"):
        check_adapter(resolve_adapter(_tensors(), CONFIG, _Base()), max_rank=2)


def test_a_good_adapter_is_written_as_a_peft_directory(tmp_path: Any) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file

    adapter = resolve_adapter(_tensors(), CONFIG, _Base())
    check_adapter(adapter)
    target = tmp_path / "policy" / "v1"
    written = write_adapter(target, adapter)
    assert written > adapter.nbytes
    loaded = load_file(target / "adapter_model.safetensors")
    assert set(loaded) == set(adapter.tensors)
    assert '"peft_type": "LORA"' in (target / "adapter_config.json").read_text()
    assert [p.name for p in tmp_path.joinpath("policy").iterdir()] == ["v1"]  # no staging


@pytest.mark.asyncio
async def test_bad_adapters_and_remote_servers_touch_no_server() -> None:
    async with FakeVLLMServer() as fake:
        async with az.Fleet([fake.url]) as fleet, az.AsyncWeightPublisher(fleet) as publisher:
            bad = _tensors(q_proj__lora_A=torch.randn(8, HIDDEN))
            with pytest.raises(ValueError, match=r"q_proj\.lora_A"):
                await publisher.publish_lora("p", bad, version="v1", config=CONFIG, base=_Base())
            with pytest.raises(ValueError, match="version"):
                await publisher.publish_lora("p", _tensors(), version="", config=CONFIG)
            with pytest.raises(ValueError, match="adapter name"):
                await publisher.publish_lora("a@b", _tensors(), version="v", config=CONFIG)
        assert not fake.requests_to("/v1/load_lora_adapter")
    async with az.Fleet(["http://gpu-node-7.invalid:8000"]) as fleet:
        publisher = az.AsyncWeightPublisher(fleet)
        with pytest.raises(ValueError, match="shared_dir"):
            await publisher.publish_lora("p", _tensors(), version="v1", config=CONFIG)
        await publisher.aclose()


def test_routing_takes_the_newest_version_within_the_bound() -> None:
    ledger = Ledger()
    a, b, c = (ledger.join(url) for url in ("http://a", "http://b", "http://c"))
    for version in ("v1", "v2", "v3"):
        ledger.adapter_published("p", version)
    ledger.adapter_loaded(a.url, "p", "v3")
    ledger.adapter_loaded(a.url, "p", "v2")
    ledger.adapter_loaded(b.url, "p", "v2")
    ledger.adapter_loaded(c.url, "p", "v1")
    assert ledger.adapter_held(a.url, "p") == "v3"
    assert skipped(ledger, "p", [a, b, c], max_staleness=0) == {
        b.url: "stale_adapter",
        c.url: "stale_adapter",
    }
    assert skipped(ledger, "p", [a, b, c], max_staleness=1) == {c.url: "stale_adapter"}
    assert skipped(ledger, "q", [a], max_staleness=None) == {a.url: "no_adapter"}
    ledger.adapter_loaded(a.url, "p", "v4")  # loaded by a round that did not commit: not routed
    assert ledger.adapter_held(a.url, "p") == "v3"
    ledger.adapter_forgotten(a.url)
    assert ledger.adapter_held(a.url, "p") is None
    assert served_name("p", "v3") == "p@v3"


def test_uses_in_flight_are_counted() -> None:
    ledger = Ledger()
    ledger.adapter_use_began("http://a", "p", "v1")
    ledger.adapter_use_began("http://a", "p", "v1")
    ledger.adapter_use_ended("http://a", "p", "v1")
    assert ledger.adapter_in_use("p", "v1")
    ledger.adapter_use_ended("http://a", "p", "v1")
    assert not ledger.adapter_in_use("p", "v1")


def test_one_models_plan_projected_at_each_call_site() -> None:
    """``GET /v1/models`` is planned once; a projection is the same request (route,
    retries, deadline, expected shape) whose answer is the part a caller needs, and the
    route's parser still refuses a malformed answer first."""
    plan = plan_models()
    names = plan.project(lambda entries: [m.id for m in entries])
    length = plan.project(context_length)
    for projected in (names, length):
        for field in dataclasses.fields(Call):
            if field.name != "parse":
                assert getattr(projected, field.name) == getattr(plan, field.name)
    answer = {"data": [{"id": "m", "max_model_len": 256}, {"id": "p@v1"}]}
    assert plan.parse(answer) == [ModelEntry("m", 256), ModelEntry("p@v1", None)]
    assert names.parse(answer) == ["m", "p@v1"]
    assert length.parse(answer) == 256
    assert length.parse({"data": [{"id": "m"}]}) is None
    for projected in (plan, names, length):
        with pytest.raises(Malformed):
            projected.parse({"data": [{"name": "m"}]})


def test_lora_route_parsers() -> None:
    limits = _parse_limits(
        {
            "vllm_config": {"lora_config": {"max_lora_rank": 8, "max_loras": 2}},
            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
        }
    )
    assert (limits.enabled, limits.max_lora_rank, limits.runtime_updates) == (True, 8, True)
    assert not _parse_limits({"vllm_config": {"lora_config": None}}).enabled


@pytest.mark.asyncio
async def test_generate_with_an_adapter_no_server_holds_waits_then_names_why() -> None:
    async with FakeVLLMServer() as fake, az.Fleet([fake.url]) as fleet:
        with pytest.raises(az.GenerationError, match="no_adapter"):
            await fleet.generate([1, 2], max_tokens=2, lora="p", admission_timeout=0.2)
        assert fleet.routing_reasons(lora="p") == {fake.url: "no_adapter"}
        assert fleet.routing_reasons() == {fake.url: None}  # the base model serves
        for version in ("v1", "v2"):
            fleet.ledger.adapter_published("p", version)
        fleet.ledger.adapter_loaded(fake.url, "p", "v1")
        fleet.max_staleness = 0
        assert fleet.routing_reasons(lora="p") == {fake.url: "stale_adapter"}
        fleet.max_staleness = 1
        assert fleet.routing_reasons(lora="p") == {fake.url: None}
        fleet.mark_dirty([fake.url])
        assert fleet.routing_reasons(lora="p") == {fake.url: "dirty"}
        with pytest.raises(ValueError, match="lora must be"):
            await fleet.generate([1, 2], lora="")
