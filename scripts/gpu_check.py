"""What a machine with one NVIDIA GPU and torch can verify of the ``ipc``/``nccl`` paths,
without vLLM (docs/transports/ipc.md, "On a GPU machine")::

    python scripts/gpu_check.py                 # a short table; exit 0 when all passed
    python scripts/gpu_check.py --json out.json --model-mb 1024
    python scripts/gpu_check.py --e2e --json e2e.json   # whole rounds (scripts/gpu_e2e.py)

``--e2e`` runs `scripts/gpu_e2e.py` instead (its options follow): whole ``ipc`` rounds
through ``AsyncWeightPublisher`` beside vLLM's own client, into receivers that load the
way vLLM's worker does; it needs vLLM's weight-transfer engines importable.

Checks (well under 5 minutes on one GPU; the CPU-side ones run anywhere):

1. ``ipc handles``: tensors of several dtypes (views with storage offsets included) are
   packed into a device buffer at the planned offsets; the buffer's handle (packed) and
   one handle per tensor (unpacked) come from torch's ``reduce_tensor``, as vLLM's
   engine makes them, and travel as asyncsync's encoder writes them for HTTP
   (``encode_ipc_update``: pickled, base64, inside JSON). A second, spawned process
   decodes them, opens them with ``rebuild_cuda_tensor`` on its own device index (as
   vLLM's worker does) and returns a digest of every tensor's bytes: they must equal
   the trainer's.
2. ``chunk boundaries``: the chunk plan (``plan_chunks``) over a model holding a tensor
   exactly as large as the buffer: every chunk within the buffer, every tensor in one
   chunk, in order, at aligned, non-overlapping offsets; a larger tensor is refused.
3. ``bridge per chunk``: a worker thread calling the thread-to-loop bridge
   (``RoundClient.update_weights``) against a loop whose fan-out does nothing.
4. ``pack GB/s``: copying a model's tensors into a device buffer at the planned offsets.

Only torch and the standard library are needed: asyncsync's modules are loaded from this
checkout without its package ``__init__`` (which needs aiohttp). Without a CUDA device the
CPU-side checks run, a message says why the others did not, and the exit status is 0
(2 with ``--require-cuda``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import pickle
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
#: The IPC check's packed buffer: small enough that a chunk holds many tensors.
IPC_BUFFER = 4 * MIB


def _load_asyncsync() -> None:
    """Make ``asyncsync.*`` importable from this checkout without running
    ``asyncsync/__init__.py`` (its facades import aiohttp); the modules used here need
    only the standard library and torch."""
    if "asyncsync" in sys.modules:
        return
    package = types.ModuleType("asyncsync")
    package.__path__ = [str(ROOT / "asyncsync")]
    sys.modules["asyncsync"] = package


@dataclass
class Row:
    check: str
    ok: bool | None  # None: not run here
    result: str
    seconds: float

    def line(self) -> str:
        status = {True: "ok", False: "FAILED", None: "skipped"}[self.ok]
        return f"{self.check:<20} {status:<8} {self.seconds:7.2f} s  {self.result}"


def timed(check: str, fn: Callable[[], tuple[bool, str]]) -> Row:
    began = time.perf_counter()
    try:
        ok, result = fn()
    except Exception as exc:  # a check that raises failed; the others still run
        ok, result = False, f"{type(exc).__name__}: {exc}"
    return Row(check, ok, result, time.perf_counter() - began)


# --------------------------------------------------------------------------- the model
def model_spec(total_mb: int, buffer_bytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of a decoder-like model of about ``total_mb`` MiB whose
    first layer holds one tensor exactly ``buffer_bytes`` large."""
    spec: list[tuple[str, str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", "bfloat16", (4096, 256)),
        ("model.layers.0.big.weight", "uint8", (buffer_bytes,)),
    ]
    per_layer = [
        ("self_attn.qkv_proj.weight", "bfloat16", (768, 256)),
        ("self_attn.o_proj.weight", "float32", (256, 256)),
        ("mlp.down_proj.weight", "float16", (256, 1024)),
        ("input_layernorm.weight", "float32", (256,)),
        ("mlp.router.bias", "int64", (7,)),
    ]
    layer_bytes = 768 * 256 * 2 + 256 * 256 * 4 + 256 * 1024 * 2 + 256 * 4 + 7 * 8
    layers = max(2, (total_mb * MIB - buffer_bytes) // layer_bytes)
    for i in range(1, layers + 1):
        spec += [(f"model.layers.{i}.{n}", d, s) for n, d, s in per_layer]
    spec += [("model.norm.weight", "float32", (256,)), ("lm_head.weight", "bfloat16", (4096, 256))]
    return spec


def make_tensors(spec: Sequence[tuple[str, str, tuple[int, ...]]], device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, dtype_name, shape in spec:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(
                dtype
            )
        else:
            out[name] = torch.randint(0, 100, shape, generator=g, device=device, dtype=dtype)
    return out


def digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes, as laid out contiguously (without numpy, which a
    torch install may lack: two position-weighted sums of the bytes, on the device)."""
    import torch

    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    try:
        raw = flat.cpu().numpy().tobytes()
    except (RuntimeError, TypeError, ImportError):
        values = flat.to(torch.int64)
        weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 65521
        plain, weighted = int(values.sum()), int(((weights + 1) * values).sum())
        return f"sums:{values.numel()}:{plain}:{weighted}"
    return hashlib.sha256(raw).hexdigest()


# --------------------------------------------------------------------------- 2. the plan
def check_plan(buffer_bytes: int, spec: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bool, str]:
    from asyncsync._transport.wire import ALIGNMENT, Manifest, nbytes
    from asyncsync.backends._shm_pack import plan_chunks

    manifest = Manifest.from_entries([(n, d, list(s)) for n, d, s in spec])
    chunks = plan_chunks(manifest, buffer_bytes)
    names = [n for c in chunks for n in c.names]
    problems = []
    if names != list(manifest.names):
        problems.append("tensors missing, repeated or out of order")
    sizes = {n: nbytes(d, s) for n, d, s in spec}
    for index, chunk in enumerate(chunks):
        if chunk.nbytes > buffer_bytes:
            problems.append(f"chunk {index} holds {chunk.nbytes} > {buffer_bytes} bytes")
        end = 0
        for name, offset in zip(chunk.names, chunk.offsets, strict=True):
            if offset % ALIGNMENT or offset < end:
                problems.append(f"{name} at {offset} (misaligned or overlapping)")
            end = offset + sizes[name]
        if end != chunk.nbytes:
            problems.append(f"chunk {index} ends at {end}, says {chunk.nbytes}")
    try:
        plan_chunks(Manifest.from_entries([("too.big", "uint8", [buffer_bytes + 1])]), buffer_bytes)
        problems.append("a tensor larger than the buffer was accepted")
    except ValueError:
        pass
    if problems:
        return False, "; ".join(problems[:3])
    return (
        True,
        f"{len(chunks)} chunks <= {buffer_bytes / MIB:.0f} MiB, {len(names)} tensors in order",
    )


# --------------------------------------------------------------------------- 3. the bridge
class _NoopCalls:
    """A fleet whose fan-outs do nothing: what is left is the bridge's own cost."""

    async def init(self, init_info: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def update(self, update_info: Any) -> None:
        pass

    async def finish(self, weight_version: str | None) -> None:
        pass

    async def world_sizes(self) -> dict[str, int]:
        return {}


def check_bridge(calls: int) -> tuple[bool, str]:
    from asyncsync._publish.bridge import RoundClient

    async def measure() -> list[float]:
        client = RoundClient.on_running_loop(_NoopCalls(), cancel=threading.Event())

        def worker() -> list[float]:
            runs = []
            for _ in range(3):
                began = time.perf_counter()
                for _ in range(calls):
                    client.update_weights({"names": []})
                runs.append((time.perf_counter() - began) / calls)
            return runs

        return await asyncio.get_running_loop().run_in_executor(None, worker)

    runs = asyncio.run(measure())
    best = min(runs) * 1e6
    median = sorted(runs)[1] * 1e6
    return True, f"{best:.1f} us per chunk (best of 3 x {calls} calls; median {median:.1f} us)"


# --------------------------------------------------------------------------- 1. IPC
def _open_in_child(conn: Any) -> None:
    """The second process: decode what HTTP would carry, open the handles on this
    process's device, digest every tensor (the way vLLM's worker opens them)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        device = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        results = {}
        for mode, body in json.loads(conn.recv()).items():
            handles = pickle.loads(base64.b64decode(body["ipc_handles_pickled"]))
            digests = {}
            if mode == "packed":
                args = list(handles[uuid])
                args[6] = device
                buffer = rebuild_cuda_tensor(*args)
                for name, dtype_name, shape, offset, size in zip(
                    body["names"], body["dtype_names"], body["shapes"], body["offsets"],
                    body["tensor_sizes"], strict=True,
                ):  # fmt: skip
                    view = buffer[offset : offset + size].view(getattr(torch, dtype_name))
                    digests[name] = digest(view.view(shape))
            else:
                for name, handle in zip(body["names"], handles, strict=True):
                    args = list(handle[uuid])
                    args[6] = device
                    digests[name] = digest(rebuild_cuda_tensor(*args))
            torch.cuda.synchronize()
            results[mode] = digests
        conn.send({"ok": True, "results": results})
    except Exception as exc:
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def ipc_wire(
    tensors: dict[str, Any],
    spec: list[tuple[str, str, tuple[int, ...]]],
    buffer_bytes: int,
    *,
    uuid: str,
    device: str,
    reduce: Callable[[Any], tuple[Any, tuple[Any, ...]]],
) -> tuple[str, int]:
    """What HTTP would carry for both modes (JSON text) and how many tensors it names:
    the plan's fullest chunk packed in one ``device`` buffer (one handle), and the first
    tensors plus the views with one handle each (vLLM's unpacked mode)."""
    import torch

    from asyncsync._transport.wire import Manifest
    from asyncsync.backends._ipc_handles import encode_ipc_update
    from asyncsync.backends._shm_pack import plan_chunks

    manifest = Manifest.from_entries([(n, d, list(s)) for n, d, s in spec])
    chunk = max(plan_chunks(manifest, buffer_bytes), key=lambda c: len(c.names))
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8, device=device)
    sizes = []
    for name, offset in zip(chunk.names, chunk.offsets, strict=True):
        flat = tensors[name].contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
        sizes.append(flat.numel())
    dtypes = {n: d for n, d, _ in spec}
    shapes = {n: list(s) for n, _, s in spec}
    packed = {
        "names": list(chunk.names),
        "dtype_names": [dtypes[n] for n in chunk.names],
        "shapes": [shapes[n] for n in chunk.names],
        "offsets": list(chunk.offsets),
        "tensor_sizes": sizes,
        "ipc_handles": {uuid: reduce(buffer)[1]},
    }
    some = [*[n for n, _, _ in spec][:8], "lm_head.weight.rows", "lm_head.weight.t"]
    unpacked = {"names": some, "ipc_handles": [{uuid: reduce(tensors[n])[1]} for n in some]}
    # The buffer must outlive the second process's use of it: keep it on the tensors.
    tensors["__buffer__"] = buffer
    wire = {"packed": encode_ipc_update(packed), "unpacked": encode_ipc_update(unpacked)}
    return json.dumps(wire), len(chunk.names) + len(some)


def with_views(
    tensors: dict[str, Any], spec: list[tuple[str, str, tuple[int, ...]]]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """Adds a view with a storage offset and a transposed copy of ``lm_head.weight``."""
    base = tensors["lm_head.weight"]
    tensors["lm_head.weight.rows"] = base[100:200]
    tensors["lm_head.weight.t"] = base.t().contiguous()
    rows, cols = base.shape
    return [
        *spec,
        ("lm_head.weight.rows", "bfloat16", (100, cols)),
        ("lm_head.weight.t", "bfloat16", (cols, rows)),
    ]


def compare(answer: dict[str, Any], expected: dict[str, str], count: int) -> tuple[bool, str]:
    """The second process's digests against the trainer's."""
    if not answer["ok"]:
        return False, f"second process: {answer['error']}"
    wrong = [
        f"{mode}:{name}"
        for mode, digests in answer["results"].items()
        for name, got in digests.items()
        if got != expected[name]
    ]
    opened = sum(len(d) for d in answer["results"].values())
    if wrong or opened != count:
        return False, f"{len(wrong)} of {opened} tensors differ: {', '.join(wrong[:4])}"
    return True, f"{opened} tensors identical in a second process"


def check_ipc(model_mb: int, buffer_bytes: int) -> tuple[bool, str]:
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    buffer_bytes = min(buffer_bytes, IPC_BUFFER)  # several tensors per packed chunk
    tensors = make_tensors(model_spec(model_mb, buffer_bytes), "cuda")
    spec = with_views(tensors, model_spec(model_mb, buffer_bytes))
    expected = {n: digest(tensors[n]) for n, _, _ in spec}
    wire, count = ipc_wire(
        tensors, spec, buffer_bytes, uuid=uuid, device="cuda", reduce=reduce_tensor
    )
    torch.cuda.synchronize()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_open_in_child, args=(child,), daemon=True)
    process.start()
    try:
        parent.send(wire)
        if not parent.poll(180):
            return False, "the second process did not answer within 180 s"
        answer = parent.recv()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    ok, result = compare(answer, expected, count)
    if ok:
        kib = len(wire) / 1024
        result += f" (one packed handle, one per tensor incl. views; {kib:.0f} KiB on the wire)"
    return ok, result


# --------------------------------------------------------------------------- 4. packing
def check_pack_rate(model_mb: int, buffer_bytes: int) -> tuple[bool, str]:
    import torch

    from asyncsync._transport.wire import Manifest
    from asyncsync.backends._shm_pack import plan_chunks

    spec = model_spec(model_mb, buffer_bytes)
    tensors = make_tensors(spec, "cuda")
    chunks = plan_chunks(Manifest.from_entries([(n, d, list(s)) for n, d, s in spec]), buffer_bytes)
    buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    flats = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in tensors.items()}
    total = sum(f.numel() for f in flats.values())

    def pack_all() -> None:
        for index, chunk in enumerate(chunks):
            buffer = buffers[index % 2]
            for name, offset in zip(chunk.names, chunk.offsets, strict=True):
                flat = flats[name]
                buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
        torch.cuda.synchronize()

    pack_all()  # warm-up
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        pack_all()
        runs.append(time.perf_counter() - began)
    best = min(runs)
    # Every byte landed where the plan says (the last chunk, checked against its source).
    last = chunks[-1]
    buffer = buffers[(len(chunks) - 1) % 2]
    for name, offset in zip(last.names, last.offsets, strict=True):
        flat = flats[name]
        if not torch.equal(buffer[offset : offset + flat.numel()], flat):
            return False, f"{name} was not packed at offset {offset}"
    return True, (
        f"{total / best / 1e9:.1f} GB/s ({total / MIB:.0f} MiB in {len(chunks)} chunks, "
        f"{len(flats)} tensors, best of 5: {best * 1e3:.1f} ms)"
    )


# --------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--e2e" in args_list:  # the whole-round check, with its own options
        args_list.remove("--e2e")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_e2e

        return int(gpu_e2e.main(args_list))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mb", type=int, default=512, help="model size for packing")
    parser.add_argument("--ipc-model-mb", type=int, default=64, help="model size for IPC")
    parser.add_argument("--buffer-mb", type=int, default=64, help="chunk buffer size")
    parser.add_argument("--bridge-calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--require-cuda", action="store_true", help="exit 2 when there is no CUDA device"
    )
    parser.add_argument(
        "--e2e", action="store_true", help="whole rounds instead (scripts/gpu_e2e.py --help)"
    )
    args = parser.parse_args(args_list)
    buffer_bytes = args.buffer_mb * MIB

    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; install torch (with CUDA) first")
        return 2
    _load_asyncsync()

    rows = [
        timed(
            "chunk boundaries",
            lambda: check_plan(buffer_bytes, model_spec(args.model_mb, buffer_bytes)),
        ),
        timed("bridge per chunk", lambda: check_bridge(args.bridge_calls)),
    ]
    cuda = torch.cuda.is_available()
    if cuda:
        rows.append(timed("ipc handles", lambda: check_ipc(args.ipc_model_mb, buffer_bytes)))
        rows.append(
            timed("pack GB/s (device)", lambda: check_pack_rate(args.model_mb, buffer_bytes))
        )
        where = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    else:
        why = (
            "no CUDA device visible to torch"
            if torch.version.cuda
            else (f"torch {torch.__version__} is built without CUDA")
        )
        rows += [Row(check, None, why, 0.0) for check in ("ipc handles", "pack GB/s (device)")]
        where = f"CPU only (torch {torch.__version__})"

    print(f"asyncsync gpu_check on {where}, pid {os.getpid()}")
    print(f"{'check':<20} {'status':<8} {'time':>9}  result")
    for row in rows:
        print(row.line())
    if args.json is not None:
        args.json.write_text(
            json.dumps({"where": where, "rows": [asdict(r) for r in rows]}, indent=2)
        )
    if any(row.ok is False for row in rows):
        return 1
    if not cuda:
        print(
            "gpu_check: no CUDA here, so the IPC and device checks did not run; run this "
            "on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
        return 2 if args.require_cuda else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
