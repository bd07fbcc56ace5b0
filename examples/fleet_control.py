"""Drive a fleet of vLLM servers through a weight-sync control round, with a failure.

Runs anywhere in a second: three FakeVLLMServers stand in for vLLM (one of them speaks
the vLLM 0.23 protocol; one fails an update, is marked dirty and is resynced). The same
code drives real servers started with ``VLLM_SERVER_DEV_MODE=1``: pass their URLs.

    python examples/fleet_control.py
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import asyncsync as az
from asyncsync.testing import FakeVLLMServer, Fault

UPDATE_INFO = {
    "names": ["model.embed_tokens.weight", "lm_head.weight"],
    "dtype_names": ["bfloat16", "bfloat16"],
    "shapes": [[512, 128], [512, 128]],
}


async def main() -> None:
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(FakeVLLMServer()),
            await stack.enter_async_context(FakeVLLMServer(version="0.23.0")),
            await stack.enter_async_context(FakeVLLMServer()),
        ]
        urls = [s.url for s in servers]
        # Per-phase deadlines: a server that stops answering fails its call at them.
        timeouts = az.Timeouts(control=10.0, update=60.0)

        async with az.Fleet(urls, timeouts=timeouts) as fleet:
            # A clean round on every server.
            await fleet.pause("keep")
            await fleet.start_weight_update()
            await fleet.update_weights(UPDATE_INFO)
            await fleet.finish_weight_update("step-1")
            await fleet.resume()
            for state in fleet.servers:
                print(f"{state.url}  vLLM {state.vllm_version}  weights {state.weight_version}")

            # A worker of the third server fails while loading the next update.
            servers[2].inject("/update_weights", Fault.error(500, "CPU out of memory"))
            await fleet.start_weight_update()
            try:
                await fleet.update_weights(UPDATE_INFO)
            except* az.ServerError as group:
                for err in group.exceptions:
                    print(f"failed: {err}")
            print("dirty:", fleet.where(lambda s: s.dirty))
            # Finish where the update went in; the failed server has no update to finish.
            done = await fleet.finish_weight_update("step-2", require="any")
            print(f"finished step-2 on {len(done.succeeded)} of {len(done)} servers")
            for url in done.failed:
                print(f"  {url}: {done[url].error}")

            # Resync the dirty server alone.
            dirty = fleet.where(lambda s: s.dirty)
            await fleet.start_weight_update(targets=dirty)
            await fleet.update_weights(UPDATE_INFO, targets=dirty)
            await fleet.finish_weight_update("step-2", targets=dirty)
            print("after resync:", {s.url: s.weight_version for s in fleet.servers})


if __name__ == "__main__":
    az.run(main())
