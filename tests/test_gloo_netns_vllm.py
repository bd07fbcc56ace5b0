"""``backend="gloo"`` across two network stacks: the server runs in a network namespace of
its own, joined to the trainer's by a veth pair that this test creates (on this machine
only) and removes afterwards. Nothing but the veth link connects them, so the rendezvous
and the broadcast cross a real network boundary, with the defaults
(``master_address=None``: the address that routes to the server; ``master_port=None``).
Skipped with the reason where the machine does not allow namespaces (needs root and
``ip``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from anyio.from_thread import start_blocking_portal

import asyncsync as az
from asyncsync.testing import LocalVLLMServer, check_greedy
from asyncsync.testing._server import NamespacedServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7, 300, 5]
TRAINER_IP, SERVER_IP = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    """A network namespace with the server's end of a veth pair (``SERVER_IP``); the
    trainer's end (``TRAINER_IP``) stays in this namespace. Removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = uuid.uuid4().hex[:6]
    ns, host_end, ns_end = f"asx-{tag}", f"asxh{tag}", f"asxn{tag}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"this machine does not allow network namespaces: {made.stderr.strip()}")
    try:
        steps = [
            ("link", "add", host_end, "type", "veth", "peer", "name", ns_end),
            ("link", "set", ns_end, "netns", ns),
            ("addr", "add", f"{TRAINER_IP}/24", "dev", host_end),
            ("link", "set", host_end, "up"),
            ("netns", "exec", ns, "ip", "addr", "add", f"{SERVER_IP}/24", "dev", ns_end),
            ("netns", "exec", ns, "ip", "link", "set", ns_end, "up"),
            ("netns", "exec", ns, "ip", "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ({' '.join(step)}): {done.stderr}")
        yield ns
    finally:
        _ip("link", "del", host_end)
        _ip("netns", "del", ns)


@pytest.fixture(scope="module")
def remote_server(namespace: str, tiny_model_dir: Path) -> Iterator[LocalVLLMServer]:
    server = NamespacedServer(
        namespace,
        tiny_model_dir,
        backend="gloo",
        tokenizer=False,
        host=SERVER_IP,
        port=free_port(),  # any port: the namespace is empty
        cpu_cores="0",
        startup_timeout=float(os.environ.get("ASYNCSYNC_TEST_STARTUP_TIMEOUT", "600")),
    )
    with start_blocking_portal() as portal:
        portal.call(server.astart)
        try:
            yield server
        finally:
            portal.call(server.astop)


async def test_a_publish_crosses_network_namespaces_exactly(
    remote_server: LocalVLLMServer, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    async with (
        az.Fleet([remote_server.url]) as fleet,
        az.AsyncWeightPublisher(
            fleet, backend=az.backends.Gloo(buffer_bytes=256 * 1024)
        ) as publisher,
    ):
        report = await publisher.publish(model, version="across")
        assert report.chunks > 1
        # The defaults picked the trainer's end of the veth pair, not loopback.
        assert publisher._backend.link.group is not None  # type: ignore[attr-defined]
        assert publisher._backend.link.group.host == TRAINER_IP  # type: ignore[attr-defined]
        completion = await fleet.client(remote_server.url).generate(
            PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True
        )
    check_greedy(model, PROMPT, completion.token_ids, max_new_tokens=8)
