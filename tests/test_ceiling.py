"""Each transport's ceiling (what `PublishReport.efficiency` divides by) and the ipc
backend's packing rule, without a server or vLLM."""

from __future__ import annotations

import pytest
import torch

import asyncsync as az
from asyncsync._publish.report import PublishReport
from asyncsync.backends import Ceiling, create_backend, options_for
from asyncsync.backends._ceiling import interface_of, link_ceiling, memcpy_rate
from asyncsync.backends.contract import WeightSource
from asyncsync.backends.ipc import (
    PACK_MEAN_BYTES,
    PACK_MIN_TENSORS,
    IpcBackend,
    packed_by_default,
)


def _backend(options: az.backends.BackendOptions) -> az.backends.TrainerBackend:
    name, opts = options_for(options)
    return create_backend(name, opts, rank=0, world_size=1, api="engine")


def test_a_ceiling_is_a_positive_rate() -> None:
    with pytest.raises(ValueError, match="> 0 GB/s"):
        Ceiling(0.0, "nothing")
    for bad in (0, -1.0, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="link_gb_per_s must be GB/s > 0"):
            az.backends.Gloo(link_gb_per_s=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="link_gb_per_s must be GB/s > 0"):
            az.backends.NCCL(link_gb_per_s=bad)  # type: ignore[arg-type]


def test_shm_and_ipc_without_cuda_measure_this_hosts_memcpy() -> None:
    assert memcpy_rate(4 * 1024 * 1024, repeats=2) > 0
    shm = _backend(az.backends.Shm()).ceiling(["http://127.0.0.1:1"])
    assert shm is not None
    assert shm.gb_per_s > 0
    assert shm.basis == "this host's memcpy, 1 thread"
    if not torch.cuda.is_available():  # the ipc backend's device copy, on CPU stand-ins
        ipc = _backend(az.backends.IPC(allow_insecure_serialization=True)).ceiling([])
        assert ipc is not None
        assert ipc.basis == shm.basis


def test_a_given_link_rate_is_the_ceiling() -> None:
    gloo = _backend(az.backends.Gloo(link_gb_per_s=12.5)).ceiling(["http://10.1.2.3:8000"])
    assert gloo == Ceiling(12.5, "link, as given (Gloo(link_gb_per_s=...))")
    nccl = _backend(az.backends.NCCL(link_gb_per_s=450.0)).ceiling(["http://10.1.2.3:8000"])
    assert nccl == Ceiling(450.0, "link, as given (NCCL(link_gb_per_s=...))")
    # NVLink or a network between GPUs cannot be measured from one side: no ceiling.
    assert _backend(az.backends.NCCL()).ceiling(["http://10.1.2.3:8000"]) is None


def test_gloo_on_loopback_measures_a_tcp_connection() -> None:
    found = _backend(az.backends.Gloo()).ceiling(["http://127.0.0.1:8000"])
    assert found is not None
    assert found.basis == "loopback TCP, measured"
    assert found.gb_per_s > 0


def test_a_link_without_a_known_rate_has_no_ceiling() -> None:
    # 192.0.2.0/24 is documentation space: no interface of this host holds .99
    assert interface_of("192.0.2.99") is None
    assert link_ceiling("192.0.2.99") is None


def test_auto_is_bounded_by_its_slower_transport() -> None:
    auto = _backend(az.backends.Auto())
    assert isinstance(auto, az.backends.TrainerBackend)
    auto.transports = {"http://a:1": "shm", "http://b:1": "gloo"}  # type: ignore[attr-defined]
    auto.gloo.link_gb_per_s = 0.001  # type: ignore[attr-defined]
    found = auto.ceiling(["http://a:1", "http://b:1"])
    assert found == Ceiling(0.001, "link, as given (Gloo(link_gb_per_s=...))")
    shm_only = auto.ceiling(["http://a:1"])
    assert shm_only is not None
    assert shm_only.basis == "this host's memcpy, 1 thread"


def test_efficiency_is_the_rate_over_the_ceiling() -> None:
    report = PublishReport(
        version="v1", servers=["s"], bytes=2_000_000_000, chunks=1, params=1,
        seconds={"total": 1.0},
    )  # fmt: skip
    assert report.efficiency is None
    assert "ceiling" not in str(report)
    report.ceiling_gb_per_s, report.ceiling_basis = 8.0, "this host's memcpy, 1 thread"
    assert report.efficiency == pytest.approx(0.25)
    assert "0.250 of the ceiling (8.00 GB/s: this host's memcpy, 1 thread)" in str(report)


# --------------------------------------------------------------------------- packing
def test_the_packing_rule_matches_the_documented_one() -> None:
    """docs/transports/ipc.md: packed when there are at least 64 tensors whose mean
    size is under 32 MiB; explicit packed= wins; a stream goes packed."""
    assert (PACK_MIN_TENSORS, PACK_MEAN_BYTES) == (64, 32 * 1024 * 1024)
    cases = [
        (51, 4_010_000_000, False),  # a dense 4 GB model: 78 MB a tensor
        (339, 15_230_000_000, False),  # a dense 7B model in bf16: 45 MB a tensor
        (9_339, 5_100_000_000, True),  # MoE-like: 0.55 MB a tensor
        (1_250, 1_000_000_000, True),
        (63, 63, False),  # too few to pay for a copy
        (64, 64 * PACK_MEAN_BYTES - 1, True),
        (64, 64 * PACK_MEAN_BYTES, False),
        (None, None, True),
    ]
    for tensors, nbytes, packed in cases:
        assert packed_by_default(tensors, nbytes) is packed, (tensors, nbytes)


def _ipc(packed: bool | None = None, buffer: int = 1 << 30) -> IpcBackend:
    options = az.backends.IPC(
        allow_insecure_serialization=True, packed=packed, packed_buffer_size_bytes=buffer
    )
    backend = _backend(options)
    assert isinstance(backend, IpcBackend)
    return backend


def test_each_round_chooses_from_its_model_unless_packed_is_given() -> None:
    small = WeightSource({f"experts.{i}.w": torch.zeros(256) for i in range(100)})
    large = WeightSource({f"layers.{i}.w": torch.zeros(5_000_000) for i in range(2)})
    stream = WeightSource(iter([("w", torch.zeros(4))]))
    assert az.backends.IPC(allow_insecure_serialization=True).packed is None
    auto = _ipc()
    # many small tensors: packed, the staging buffer at most the model's size
    assert auto.round_mode(small) == (True, 100 * 256 * 4)
    assert auto.round_mode(large) == (False, 1 << 30)
    assert auto.round_mode(stream) == (True, 1 << 30)
    assert _ipc(buffer=4096).round_mode(small) == (True, 4096)
    # an explicit choice always wins, with its own buffer size
    assert _ipc(packed=False).round_mode(small) == (False, 1 << 30)
    assert _ipc(packed=True, buffer=8192).round_mode(large) == (True, 8192)
    with pytest.raises(TypeError, match="packed must be True, False or None"):
        az.backends.IPC(allow_insecure_serialization=True, packed="yes")  # type: ignore[arg-type]
