"""A whole ``ipc`` round on one GPU, asyncsync beside vLLM's own client
(docs/transports/ipc.md, "On a GPU machine")::

    python scripts/gpu_check.py --e2e --json e2e.json --markdown e2e.md   # one GPU
    python scripts/gpu_e2e.py --standins --size small                     # CPU (CI)

What one run does, on one GPU with torch and vLLM's weight-transfer engines importable:

1. Starts two receiving processes. Each is asyncsync's `FakeVLLMServer` speaking vLLM's
   protocol, whose update hook is vLLM's own IPC worker engine
   (``IPCWeightTransferEngine.update_weights``) on the same GPU, loading into CUDA
   tensors allocated when the process started, as a model load would (`Preallocated`).
   Its ``/weight_checker`` answers a digest of every tensor as loaded.
2. For two models (`dense_spec`: bf16, fp32 norms, about 4 GB in 51 tensors;
   `moe_spec`: 9,339 tensors, about 5 GB), unpacked and packed, publishes through
   ``AsyncWeightPublisher(fleet, backend=IPC(...))`` into the first receiver and through
   vLLM's own ``IPCTrainerWeightTransferEngine`` with ``HTTPVLLMWeightSyncClient`` into the
   second, one round of each in turn (the order alternating), the weights negated before
   every pair (exact in every dtype: a stale tensor shows).
3. Reports per model and mode: each path's median round, GB/s, asyncsync's time over
   vLLM's (the median of the per-pair ratios and their range), the event loop's lag
   during asyncsync's rounds (p99, max), the device's copy rate for the same bytes
   (`copy_rate`, the ceiling, timed in the same run), the efficiency asyncsync's
   `PublishReport` states, and whether the digests of every tensor on both receivers
   equal the trainer's. Exit status 1 when a digest differs or a round failed; the
   issue's targets are reported as met or not, never hidden in the exit status.

``--standins`` runs the same code on CPU with the CUDA stand-ins of
``tests/cuda_standins.py`` (handles across processes through shared memory): what CI
runs (``tests/test_gpu_check.py``), with ``--size small``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Spec = list[tuple[str, str, tuple[int, ...]]]
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
#: How long a receiving process may take to start (imports, CUDA context, allocation).
RECEIVER_START_S = 300.0

#: The models per ``--size``: the dense model's (hidden, layers, vocab) and the MoE-like
#: one's (hidden, layers, experts, expert intermediate size, vocab).
SIZES: dict[str, dict[str, tuple[int, ...]]] = {
    "full": {"dense": (4096, 8, 32000), "moe": (1024, 24, 128, 256, 32000)},
    "small": {"dense": (128, 2, 512), "moe": (32, 3, 16, 16, 512)},
    # the full MoE-like model's 9,339 tensors, each a few KB: the per-tensor costs alone
    "many": {"dense": (128, 2, 512), "moe": (64, 24, 128, 16, 512)},
}


# --------------------------------------------------------------------------- the plan
def dense_spec(hidden: int = 4096, layers: int = 8, vocab: int = 32000) -> Spec:
    """A dense decoder in bf16 with fp32 norms: hidden 4096 and 8 layers give 51
    tensors, 4.0 GB (fused qkv and gate-up projections, as vLLM's checkpoints of
    Llama-like models carry them after loading)."""
    inter, kv = hidden * 7 // 2, hidden // 4
    spec: Spec = [("model.embed_tokens.weight", "bfloat16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", "float32", (hidden,)),
            (p + "self_attn.qkv_proj.weight", "bfloat16", (hidden + 2 * kv, hidden)),
            (p + "self_attn.o_proj.weight", "bfloat16", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", "float32", (hidden,)),
            (p + "mlp.gate_up_proj.weight", "bfloat16", (2 * inter, hidden)),
            (p + "mlp.down_proj.weight", "bfloat16", (hidden, inter)),
        ]
    spec += [
        ("model.norm.weight", "float32", (hidden,)),
        ("lm_head.weight", "bfloat16", (vocab, hidden)),
    ]
    return spec


def moe_spec(
    hidden: int = 1024, layers: int = 24, experts: int = 128, expert_inter: int = 256,
    vocab: int = 32000,
) -> Spec:  # fmt: skip
    """An MoE-like decoder whose experts are separate tensors, as a trainer holds them:
    24 layers of 128 experts give 9,339 tensors, 5.1 GB in bf16 (fp32 norms)."""
    kv = hidden // 4
    spec: Spec = [("model.embed_tokens.weight", "bfloat16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", "float32", (hidden,)),
            (p + "self_attn.qkv_proj.weight", "bfloat16", (hidden + 2 * kv, hidden)),
            (p + "self_attn.o_proj.weight", "bfloat16", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", "float32", (hidden,)),
            (p + "mlp.gate.weight", "bfloat16", (experts, hidden)),
        ]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            spec += [
                (q + "gate_proj.weight", "bfloat16", (expert_inter, hidden)),
                (q + "up_proj.weight", "bfloat16", (expert_inter, hidden)),
                (q + "down_proj.weight", "bfloat16", (hidden, expert_inter)),
            ]
    spec += [
        ("model.norm.weight", "float32", (hidden,)),
        ("lm_head.weight", "bfloat16", (vocab, hidden)),
    ]
    return spec


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _name, dtype, shape in spec:
        count = 1
        for dim in shape:
            count *= dim
        total += count * ITEMSIZE[dtype]
    return total


def models(size: str) -> dict[str, Spec]:
    """The run's models, their names prefixed with the model's key: one receiver holds
    both (each tensor allocated once, at start)."""
    dims = SIZES[size]
    plain = {"dense": dense_spec(*dims["dense"]), "moe": moe_spec(*dims["moe"])}
    return {key: [(f"{key}.{n}", d, s) for n, d, s in spec] for key, spec in plain.items()}


# --------------------------------------------------------------------------- digests
def digests(tensors: Mapping[str, Any], chunk: int = 1 << 24) -> dict[str, str]:
    """A digest of each tensor's bytes, computed on its device: dtype, shape, the sum of
    its bytes and their sum weighted by position (mod 65521, plus 1), in int64 (wrapping
    alike on every device). Any changed byte changes it; one transfer to the host for
    all tensors."""
    import torch

    sums = []
    index: Any = None
    for tensor in tensors.values():
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk].to(torch.int64)
            if index is None or index.device != flat.device or index.numel() < part.numel():
                index = torch.arange(max(chunk, part.numel()), device=flat.device)
            weights = (index[: part.numel()] + start).remainder_(65521).add_(1)
            total[0] += part.sum()
            total[1] += (part * weights).sum()
        sums.append(total)
    values = torch.stack(sums).tolist() if sums else []
    return {
        name: f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:{a}:{b}"
        for (name, t), (a, b) in zip(tensors.items(), values, strict=True)
    }


# --------------------------------------------------------------------------- the device
def install_standins() -> Any:
    """CPU with the CUDA stand-ins (tests/cuda_standins.py): vLLM's engines allocate
    their "device" buffers in shared memory and exchange handles that another process
    maps."""
    import pytest
    import torch.multiprocessing

    sys.path.insert(0, str(ROOT))
    from tests.cuda_standins import install_cuda_on_cpu, install_shared_ipc_handles

    torch.multiprocessing.set_sharing_strategy("file_system")
    patch = pytest.MonkeyPatch()
    install_cuda_on_cpu(patch, shared=True)
    return install_shared_ipc_handles(patch)


@dataclass
class Device:
    """Where the tensors live: the GPU, or CPU memory standing in for it."""

    standins: bool

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device("cpu") if self.standins else torch.device("cuda", 0)

    def sync(self) -> None:
        import torch

        if not self.standins:
            torch.cuda.synchronize()

    def describe(self) -> str:
        import torch

        if self.standins:
            return f"CPU with CUDA stand-ins (torch {torch.__version__})"
        cuda = torch.version.cuda
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {cuda})"

    def allocate(self, spec: Spec, *, shared: bool = False) -> dict[str, Any]:
        """The tensors of ``spec``, uninitialized. ``shared`` (stand-ins): views of one
        storage in shared memory, so that a handle to any of them opens in a receiver."""
        import torch

        if self.standins and shared:
            sizes = [spec_bytes([entry]) for entry in spec]
            offsets, total = [], 0
            for size in sizes:
                offsets.append(total)
                total += -(-size // 64) * 64
            arena = torch.empty(max(total, 1), dtype=torch.uint8)
            arena.untyped_storage()._share_filename_cpu_()
            return {
                name: arena[offset : offset + size].view(getattr(torch, dtype)).view(shape)
                for (name, dtype, shape), offset, size in zip(spec, offsets, sizes, strict=True)
            }
        device = self.torch_device
        return {n: torch.empty(s, dtype=getattr(torch, d), device=device) for n, d, s in spec}

    def fill(self, tensors: Mapping[str, Any], seed: int) -> None:
        import torch

        g = torch.Generator(device=self.torch_device).manual_seed(seed)
        for tensor in tensors.values():
            values = torch.randn(tensor.shape, generator=g, device=self.torch_device)
            tensor.copy_(values.to(tensor.dtype))
        self.sync()

    def copy_rate(self, nbytes: int, repeats: int = 5) -> float:
        """GB/s of a device-to-device copy of ``nbytes`` (payload bytes; the best of
        ``repeats`` after a warm-up): the ceiling a round of that many bytes is held to."""
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            self.sync()
            began = time.perf_counter()
            dst.copy_(src)
            self.sync()
            best = min(best, time.perf_counter() - began)
        return nbytes / best / 1e9


# --------------------------------------------------------------------------- the receiver
class Preallocated:
    """What a receiver loads into: the model's tensors, allocated when it started, each
    received weight copied into its tensor (vLLM's default weight loader)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.loaded = 0

    def load_weights(self, weights: Any) -> set[str]:
        names = set()
        for name, weight in weights:
            target = self.params.get(name)
            if target is None:
                raise KeyError(f"{name!r} is not a parameter of the served model")
            if target.shape != weight.shape or target.dtype != weight.dtype:
                raise ValueError(
                    f"{name}: received {weight.dtype} {tuple(weight.shape)}, the model holds "
                    f"{target.dtype} {tuple(target.shape)}"
                )
            target.copy_(weight)
            names.add(name)
        self.loaded += len(names)
        return names


def _stub_mtp_validation() -> None:
    """vLLM's worker engine imports one context manager from its model loader (it turns
    off a check of speculative-decoding layers this receiver has none of), which drags
    in vLLM's whole loader (xgrammar, fastapi, ...): a no-op one stands in, on every
    machine alike."""
    name = "vllm.model_executor.model_loader.mtp_validation"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.disable_mtp_completeness_check = contextlib.nullcontext  # type: ignore[attr-defined]
        sys.modules[name] = module


class ReceiverEngine:
    """The fake server's update hook: vLLM's IPC worker engine, initialized from the
    server's latest ``/init_weight_transfer_engine`` (again when a new one arrives)."""

    def __init__(self, fake: Any, model: Preallocated, device: Device) -> None:
        self.fake = fake
        self.model = model
        self.device = device
        self.engine: Any = None
        self.inits = 0

    def __call__(self, update_info: Any) -> None:
        from types import SimpleNamespace

        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        if self.engine is None or len(self.fake.init_infos) != self.inits:
            parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
            config = SimpleNamespace(parallel_config=parallel, model_config=None)
            self.engine = IPCWeightTransferEngine(
                WeightTransferConfig(backend="ipc"), config, self.device.torch_device, self.model
            )
            self.inits = len(self.fake.init_infos)
            init = self.fake.init_infos[-1] if self.fake.init_infos else {}
            self.engine.init_transfer_engine(self.engine.parse_init_info(init))
        self.engine.update_weights(update_info)
        self.device.sync()


async def _serve(spec_path: Path, device: Device) -> None:
    import signal

    import vllm

    from asyncsync.testing import FakeVLLMServer

    spec = [(n, d, tuple(s)) for n, d, s in json.loads(spec_path.read_text())]  # noqa: ASYNC240
    model = Preallocated(device.allocate(spec))
    device.fill(model.params, seed=12345)  # not the trainer's: a missed tensor shows
    fake = FakeVLLMServer(
        version=str(vllm.__version__),
        backend="ipc",
        checksum_hook=lambda: digests(model.params),
        max_recorded=16,
    )
    fake.update_hook = ReceiverEngine(fake, model, device)
    await fake.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"url": fake.url, "pid": os.getpid()}), flush=True)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def receive(spec_path: Path, standins: bool) -> None:
    if standins:
        install_standins()
    _stub_mtp_validation()
    asyncio.run(_serve(spec_path, Device(standins)))


class ReceiverProcess:
    """A receiving process, started with the spec of every model it holds."""

    def __init__(self, spec_path: Path, standins: bool, log: Path) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "receive", str(spec_path)]
        if standins:
            cmd.append("--standins")
        env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONUNBUFFERED="1")
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.url = ""

    def wait_ready(self, deadline: float) -> str:
        assert self.process.stdout is not None
        result: dict[str, Any] = {}

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith("{"):
                    result.update(json.loads(line))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        if "url" not in result:
            self.stop()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"the receiver did not start (exit {self.process.poll()}):\n{tail}")
        self.url = str(result["url"])
        return self.url

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log_file.close()


# --------------------------------------------------------------------------- vLLM's path
class PairsSource:
    """The trainer's tensors as vLLM's ``WeightSource`` (metadata and iteration)."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.tensors.items())


def vllm_engine(url: str, tensors: Mapping[str, Any], packed: bool, buffer_bytes: int) -> Any:
    """vLLM's own trainer engine and HTTP client, as vLLM's docs set them up."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerInitInfo,
        IPCTrainerWeightTransferEngine,
    )

    info = IPCTrainerInitInfo(packed=packed, packed_buffer_size_bytes=buffer_bytes, rank=0)
    return IPCTrainerWeightTransferEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=PairsSource(tensors)
    )


# --------------------------------------------------------------------------- a run
@dataclass
class Row:
    """One model and mode: both paths' rounds and what they show."""

    model: str
    mode: str
    tensors: int
    bytes: int
    asyncsync_s: list[float] = field(default_factory=list)
    vllm_s: list[float] = field(default_factory=list)
    lag_p99_ms: float = 0.0
    lag_max_ms: float = 0.0
    #: garbage collections during asyncsync's rounds: how many, the longest (ms); a
    #: collection holds the GIL, so the loop waits it out whichever thread ran it
    gc_collections: int = 0
    gc_longest_ms: float = 0.0
    ceiling_gb_per_s: float = 0.0
    report_ceiling_gb_per_s: float | None = None
    report_efficiency: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    default_packed: bool | None = None
    exact_asyncsync: bool = False
    exact_vllm: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [a / v for a, v in zip(self.asyncsync_s, self.vllm_s, strict=True) if v > 0]

    def summary(self) -> dict[str, Any]:
        a = statistics.median(self.asyncsync_s) if self.asyncsync_s else 0.0
        v = statistics.median(self.vllm_s) if self.vllm_s else 0.0
        ratios = self.ratios
        return {
            **asdict(self),
            "asyncsync_median_s": a,
            "vllm_median_s": v,
            "asyncsync_gb_per_s": self.bytes / a / 1e9 if a else 0.0,
            "vllm_gb_per_s": self.bytes / v / 1e9 if v else 0.0,
            "ratio_median": statistics.median(ratios) if ratios else 0.0,
            "ratio_min": min(ratios, default=0.0),
            "ratio_max": max(ratios, default=0.0),
            "efficiency": (self.bytes / a / 1e9) / self.ceiling_gb_per_s
            if a and self.ceiling_gb_per_s
            else 0.0,
        }


def negate(tensors: Mapping[str, Any], device: Device) -> None:
    """New weights for the next pair of rounds, exact in every dtype."""
    import torch

    with torch.no_grad():
        for tensor in tensors.values():
            tensor.neg_()
    device.sync()


async def _digests_of(session: Any, url: str) -> dict[str, str]:
    async with session.post(f"{url}/weight_checker", json={"action": "checksum"}) as resp:
        body = await resp.json()
    return {k.removeprefix("dp0:pp0:pcp0:tp0:"): v for k, v in body["checksums"].items()}


class Paths:
    """One model and mode: asyncsync's publisher and vLLM's own engine, each into its
    receiver, timed round by round."""

    def __init__(
        self, row: Row, tensors: Mapping[str, Any], device: Device, *, lag: bool = True,
        stalls: Any = None, stall_s: float = 0.015,
    ) -> None:  # fmt: skip
        self.row = row
        #: where `--stall-dump` writes every thread's stack when the loop has not run for
        #: ``stall_s`` during asyncsync's rounds (faulthandler's watchdog, which needs no GIL)
        self.stalls = stalls
        self.stall_s = stall_s
        #: a 1 ms timer on the loop during asyncsync's rounds (its lag); it wakes the
        #: loop a thousand times a second, each time taking the GIL from the send
        self.with_lag = lag
        self.tensors = tensors
        self.device = device
        self.publisher: Any = None
        self.engine: Any = None
        self.lag: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.collections: list[float] = []
        self._gc_began = 0.0
        self._counting = False

    def _on_gc(self, phase: str, info: Mapping[str, Any]) -> None:
        if not self._counting:
            return
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.collections.append(time.perf_counter() - self._gc_began)

    async def ours(self, version: str) -> float:
        import gc

        from asyncsync.testing import LoopLagMonitor

        self.device.sync()
        gc.callbacks.append(self._on_gc)
        watchdog: asyncio.Task[None] | None = None
        try:
            async with LoopLagMonitor(interval=0.001 if self.with_lag else 3600) as lag:
                if self.stalls is not None:
                    watchdog = self._watch(version)
                self._counting = True
                began = time.perf_counter()
                report = await self.publisher.publish(self.tensors, version=version)
                seconds = time.perf_counter() - began
                self._counting = False
        finally:
            self._counting = False
            gc.callbacks.remove(self._on_gc)
            if watchdog is not None:
                watchdog.cancel()
                faulthandler.cancel_dump_traceback_later()
        self.lag.extend(lag.samples)
        self.row.report_ceiling_gb_per_s = report.ceiling_gb_per_s
        self.row.report_efficiency = report.efficiency
        for phase, value in report.seconds.items():
            self.phases.setdefault(phase, []).append(value)
        return seconds

    def _watch(self, version: str) -> asyncio.Task[None]:
        """Re-arms faulthandler's watchdog every millisecond from the loop: when the loop
        stalls for ``stall_s``, every thread's stack is written at that moment."""
        self.stalls.write(f"--- round {version}\n")
        self.stalls.flush()

        async def rearm() -> None:
            while True:
                faulthandler.dump_traceback_later(self.stall_s, file=self.stalls)
                await asyncio.sleep(0.001)

        return asyncio.get_running_loop().create_task(rearm())

    async def theirs(self) -> float:
        self.device.sync()
        began = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.send_weights)
        return time.perf_counter() - began

    async def measure(self, rounds: int) -> None:
        """A warm-up round of each (the engines' init, the first handles), then
        ``rounds`` pairs, the order alternating, the weights negated before each."""
        row = self.row
        await self.ours(f"{row.model}-{row.mode}-warmup")
        await self.theirs()
        self.lag.clear()
        self.phases.clear()
        self.collections.clear()
        for i in range(rounds):
            negate(self.tensors, self.device)
            version = f"{row.model}-{row.mode}-{i}"
            if i % 2 == 0:
                row.asyncsync_s.append(await self.ours(version))
                row.vllm_s.append(await self.theirs())
            else:
                row.vllm_s.append(await self.theirs())
                row.asyncsync_s.append(await self.ours(version))
        ordered = sorted(self.lag)
        if ordered:
            row.lag_p99_ms = 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            row.lag_max_ms = 1000 * ordered[-1]
        row.phases_ms = {k: 1000 * statistics.median(v) for k, v in self.phases.items()}
        row.gc_collections = len(self.collections)
        row.gc_longest_ms = 1000 * max(self.collections, default=0.0)


async def run_model(
    key: str, spec: Spec, args: argparse.Namespace, device: Device, urls: tuple[str, str],
    session: Any,
) -> list[Row]:  # fmt: skip
    import gc

    import asyncsync as az
    from asyncsync.backends.ipc import packed_by_default

    tensors = device.allocate(spec, shared=True)
    device.fill(tensors, seed=1)
    nbytes = spec_bytes(spec)
    runs = [(packed, args.freeze_gc) for packed in args.modes]
    if args.unfrozen and args.freeze_gc:  # the same unpacked rounds, the GC not frozen
        runs.append((False, False))
    ceiling = device.copy_rate(nbytes)
    expected_default = packed_by_default(len(spec), nbytes)
    print(
        f"{key}: {len(spec):,} tensors, {nbytes / 1e9:.2f} GB; device copy {ceiling:.0f} GB/s; "
        f"asyncsync's default: {'packed' if expected_default else 'unpacked'}",
        flush=True,
    )
    rows = []
    loop = asyncio.get_running_loop()
    for packed, freeze in runs:
        mode = "packed" if packed else "unpacked"
        row = Row(
            key, mode if freeze == args.freeze_gc else f"{mode}, GC not frozen", len(spec), nbytes
        )
        if freeze:  # as a trainer would once its model is loaded (docs/publishing.md)
            gc.collect()
            gc.freeze()
        row.ceiling_gb_per_s = ceiling
        row.default_packed = expected_default
        paths = Paths(
            row, tensors, device, lag=not args.no_lag, stalls=args.stalls,
            stall_s=args.stall_ms / 1000,
        )  # fmt: skip
        options = az.backends.IPC(
            allow_insecure_serialization=True,
            packed=packed,
            packed_buffer_size_bytes=args.buffer_bytes,
        )
        paths.engine = await loop.run_in_executor(
            None, vllm_engine, urls[1], tensors, packed, args.buffer_bytes
        )
        async with (
            az.Fleet([urls[0]]) as fleet,
            az.AsyncWeightPublisher(fleet, backend=options) as paths.publisher,
        ):
            await paths.measure(args.rounds)
        await loop.run_in_executor(None, paths.engine.shutdown)
        expected = await loop.run_in_executor(None, digests, tensors)
        for url, path in zip(urls, ("asyncsync", "vllm"), strict=True):
            found = await _digests_of(session, url)
            wrong = [n for n in expected if found.get(n) != expected[n]]
            setattr(row, f"exact_{path}", not wrong)
            if wrong:
                row.problems.append(f"{path}: {len(wrong)} tensors differ, e.g. {wrong[:3]}")
        print(json.dumps(row.summary(), default=str), flush=True)
        rows.append(row)
        gc.unfreeze()
    return rows


async def trainer(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import torch
    import vllm

    device = Device(args.standins)
    specs = models(args.size)
    work = Path(tempfile.mkdtemp(prefix="asyncsync-e2e-"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps([e for spec in specs.values() for e in spec]))
    receivers = [
        ReceiverProcess(spec_path, args.standins, work / f"receiver{i}.log") for i in range(2)
    ]
    began = time.perf_counter()
    result: dict[str, Any] = {
        "device": device.describe(),
        "torch": torch.__version__,
        "vllm": str(vllm.__version__),
        "python": sys.version.split()[0],
        "rounds": args.rounds,
        "buffer_bytes": args.buffer_bytes,
        "rows": [],
    }
    try:
        deadline = time.monotonic() + RECEIVER_START_S
        urls = (receivers[0].wait_ready(deadline), receivers[1].wait_ready(deadline))
        result["receivers_ready_s"] = time.perf_counter() - began
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for key in args.models:
                try:
                    rows = await run_model(key, specs[key], args, device, urls, session)
                except Exception as exc:  # the other model still runs and reports
                    result.setdefault("errors", []).append(f"{key}: {type(exc).__name__}: {exc}")
                    print(f"FAILED {key}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                result["rows"] += [row.summary() for row in rows]
                if not args.standins:
                    torch.cuda.empty_cache()
                if args.json is not None:  # what is done so far, should the run be cut
                    args.json.write_text(json.dumps(result, indent=2, default=str))
    finally:
        for receiver in receivers:
            receiver.stop()
    result["seconds"] = time.perf_counter() - began
    result["targets"] = targets(result["rows"])
    return result


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each met or not, with the numbers it was judged on."""
    out = []
    for row in rows:
        name = f"{row['model']} {row['mode']}"
        out.append(
            {
                "target": f"{name}: asyncsync's round <= 1.0x vLLM's own client's",
                "value": round(row["ratio_median"], 3),
                "met": row["ratio_median"] <= 1.0,
            }
        )
        out.append(
            {
                "target": f"{name}: loop lag p99 <= 5 ms and max <= 20 ms",
                "value": [round(row["lag_p99_ms"], 2), round(row["lag_max_ms"], 2)],
                "met": row["lag_p99_ms"] <= 5.0 and row["lag_max_ms"] <= 20.0,
            }
        )
        if row["model"] == "dense" and row["mode"] == "packed":
            out.append(
                {
                    "target": "dense packed: >= 0.5x the device's copy rate",
                    "value": round(row["efficiency"], 3),
                    "met": row["efficiency"] >= 0.5,
                }
            )
    return out


def markdown(result: Mapping[str, Any]) -> str:
    """The run as docs/performance.md's table."""
    lines = [
        "| model | mode | asyncsync | vLLM's own client | ratio (range) | loop lag p99 / max "
        "| ceiling | efficiency |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        (
            f"| {r['model']} {r['bytes'] / 1e9:.1f} GB, {r['tensors']:,} tensors | {r['mode']} "
            f"| {r['asyncsync_median_s'] * 1e3:,.1f} ms ({r['asyncsync_gb_per_s']:.1f} GB/s) "
            f"| {r['vllm_median_s'] * 1e3:,.1f} ms ({r['vllm_gb_per_s']:.1f} GB/s) "
            f"| {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {r['lag_p99_ms']:.1f} / {r['lag_max_ms']:.1f} ms "
            f"| {r['ceiling_gb_per_s']:,.0f} GB/s | {r['efficiency']:.3f} |"
        )
        for r in result["rows"]
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    recv = sub.add_parser("receive", help="serve one receiver (internal)")
    recv.add_argument("spec", type=Path)
    recv.add_argument("--standins", action="store_true")
    parser.add_argument("--standins", action="store_true", help="CPU with the CUDA stand-ins")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--models", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--rounds", type=int, default=5, help="measured pairs per model and mode")
    parser.add_argument(
        "--modes", nargs="+", choices=["unpacked", "packed"], default=["unpacked", "packed"]
    )
    parser.add_argument(
        "--buffer-mb", type=float, default=1024, help="packed buffer (vLLM's default: 1 GiB)"
    )
    parser.add_argument(
        "--no-freeze-gc",
        dest="freeze_gc",
        action="store_false",
        help="leave the garbage collector as it is (default: gc.freeze() once the model is "
        "loaded, as docs/publishing.md advises a trainer)",
    )
    parser.add_argument(
        "--unfrozen",
        action="store_true",
        help="also the unpacked rounds with the garbage collector not frozen",
    )
    parser.add_argument(
        "--no-lag", action="store_true", help="time asyncsync's rounds without the 1 ms timer"
    )
    parser.add_argument(
        "--stall-dump",
        type=Path,
        help="a diagnostic: write every thread's stack here whenever the loop stalls for "
        "--stall-ms during asyncsync's rounds (faulthandler's watchdog thread, which needs "
        "no GIL and so sees a C call that holds it; it reads the other threads' frames "
        "unlocked and can crash the run, as it did once on an H100 after four dumps: use "
        "it to find a stall, not for the table)",
    )
    parser.add_argument("--stall-ms", type=float, default=15.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # this checkout's asyncsync, when it is not installed
    if args.command == "receive":
        receive(args.spec, args.standins)
        return 0
    args.buffer_bytes = int(args.buffer_mb * (1 << 20))
    args.stalls = args.stall_dump.open("w") if args.stall_dump is not None else None
    args.modes = [mode == "packed" for mode in args.modes]
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.standins:
        install_standins()
    elif not _cuda():
        print("gpu_e2e: no CUDA device; run with --standins for the CPU version")
        return 2
    result = asyncio.run(trainer(args))
    table = markdown(result)
    print(f"\n{result['device']}, vLLM {result['vllm']}, {result['seconds']:.0f} s\n{table}")
    for target in result["targets"]:
        print(f"{'met    ' if target['met'] else 'NOT MET'} {target['target']}: {target['value']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    failed = [p for r in result["rows"] for p in r["problems"]] + result.get("errors", [])
    for problem in failed:
        print(f"FAILED {problem}")
    return 1 if failed else 0


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
