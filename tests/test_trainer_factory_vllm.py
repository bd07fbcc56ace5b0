"""vLLM's own trainer API (``WeightTransferTrainerFactory`` + ``HTTPVLLMWeightSyncClient``)
driving asyncsync's ``asyncsync_shm`` trainer engine against the session's real servers.
(The gloo engine's counterpart is in ``test_gloo_vllm.py``, against gloo servers.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import asyncsync as az
from asyncsync.testing import check_greedy
from tests.test_publish_vllm import _perturbed

pytestmark = pytest.mark.vllm

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
MAX_TOKENS = 8


def test_the_factory_knows_asyncsyncs_trainer_engines() -> None:
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    import asyncsync.vllm_plugin.trainer  # noqa: F401 - registers on import

    assert {"asyncsync_shm", "asyncsync_gloo"} <= set(WeightTransferTrainerFactory._registry)


@pytest.mark.asyncio
@pytest.mark.usefixtures("original_weights_restored")
async def test_vllms_trainer_api_drives_the_shm_engine(
    fleet: az.Fleet, tiny_model_dir: Path
) -> None:
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from asyncsync.vllm_plugin.trainer import ShmTrainerInitInfo

    url = fleet.urls[0]
    model = _perturbed(tiny_model_dir, seed=11)

    def vllm_style() -> None:
        engine = WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0, buffer_bytes=256 * 1024),
            client=HTTPVLLMWeightSyncClient(url, timeout=120),
            source=ModuleSource(model),
        )
        try:
            engine.send_weights()  # several chunks: the buffer is smaller than the model
            engine.send_weights()  # and a second round through the same engine
        finally:
            engine.shutdown()

    await asyncio.to_thread(vllm_style)
    async with az.AsyncVLLMClient(url) as client:
        completion = await client.generate(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
    check_greedy(model, PROMPT, completion.token_ids, max_new_tokens=MAX_TOKENS)
