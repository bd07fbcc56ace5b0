"""``scripts/gpu_check.py`` on a machine without CUDA: it runs what the CPU can run, says
why the rest did not, and exits cleanly; its IPC decoding is exercised with the
stand-in handles (the real ones need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tests.cuda_standins import STANDIN_GPU_UUID, IpcHandles

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"

#: Everything the script imports besides torch is blocked: it must not need them.
_BLOCKED = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("aiohttp", "anyio", "yarl", "vllm", "orjson"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED, str(SCRIPT), "--model-mb", "16", "--buffer-mb", "4",
         "--bridge-calls", "200", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_the_cpu_checks_run_and_it_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = run_script("--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "no CUDA here, so the IPC and device checks did not run" in done.stdout
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["chunk boundaries"]["ok"] is True
    assert rows["bridge per chunk"]["ok"] is True
    assert "us per chunk" in rows["bridge per chunk"]["result"]
    assert rows["ipc handles"]["ok"] is None
    assert "without CUDA" in rows["ipc handles"]["result"]
    assert run_script("--require-cuda").returncode == 2


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_plan_check_finds_every_tensor_in_bounds(gpu_check: ModuleType) -> None:
    buffer = 4 * 1024 * 1024
    ok, result = gpu_check.check_plan(buffer, gpu_check.model_spec(16, buffer))
    assert ok, result
    assert "tensors in order" in result


def test_second_process_decoding_matches_the_trainers_tensors(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wire both modes produce (asyncsync's encoder), decoded, opened and digested
    by the script's second-process code; here in-process with stand-in handles."""
    from torch.multiprocessing import reductions

    handles = IpcHandles()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", handles.rebuild_cuda_tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d=None: SimpleNamespace(uuid=STANDIN_GPU_UUID)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda _d=None: None)
    buffer = gpu_check.IPC_BUFFER
    tensors = gpu_check.make_tensors(gpu_check.model_spec(16, buffer), "cpu")
    spec = gpu_check.with_views(tensors, gpu_check.model_spec(16, buffer))
    expected = {n: gpu_check.digest(tensors[n]) for n, _, _ in spec}
    wire, count = gpu_check.ipc_wire(
        tensors, spec, buffer, uuid=STANDIN_GPU_UUID, device="cpu", reduce=handles.reduce_tensor
    )
    body = json.loads(wire)
    assert "ipc_handles" not in body["packed"]  # pickled for HTTP
    assert len(body["packed"]["names"]) > 3  # the packed chunk holds several tensors

    parent, child = multiprocessing.Pipe()
    parent.send(wire)
    gpu_check._open_in_child(child)
    answer = parent.recv()
    assert gpu_check.compare(answer, expected, count) == (
        True,
        f"{count} tensors identical in a second process",
    )
    assert handles.opened == count - len(body["packed"]["names"]) + 1

    tampered = dict(expected, **{"lm_head.weight.rows": "0" * 64})
    ok, result = gpu_check.compare(answer, tampered, count)
    assert not ok
    assert "unpacked:lm_head.weight.rows" in result
