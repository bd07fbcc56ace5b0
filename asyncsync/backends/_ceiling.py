"""The rate the hardware allows a transport: what `PublishReport.efficiency` is the
achieved GB/s over.

Each backend says what bounds it (`TrainerBackend.ceiling`): ``shm`` this host's memcpy,
``ipc`` a device-to-device copy on the trainer's GPU, ``gloo`` and ``nccl`` the link (the
rate the user gives, else, for gloo, measured or read). The publisher asks once, in its
worker thread, before its first round: a measurement takes tens of milliseconds and
never runs on the event loop. Rates are payload bytes per second (a copy of N bytes
moves N bytes, not 2N), in GB/s (1e9 bytes).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import threading
import time
from pathlib import Path

from asyncsync.backends.contract import Ceiling

__all__ = [
    "device_copy_ceiling",
    "interface_of",
    "link_ceiling",
    "loopback_tcp_rate",
    "memcpy_ceiling",
    "memcpy_rate",
]

#: What a memcpy measurement copies: beyond the caches of today's CPUs (src + dst).
MEMCPY_BYTES = 64 * 1024 * 1024
#: What a device copy measurement copies (twice that is allocated for a moment).
DEVICE_COPY_BYTES = 256 * 1024 * 1024
#: What the loopback TCP measurement sends.
TCP_BYTES = 64 * 1024 * 1024


def memcpy_rate(nbytes: int = MEMCPY_BYTES, repeats: int = 5) -> float:
    """GB/s of one thread copying ``nbytes`` into memory already touched (the best of
    ``repeats``): how fast this host moves bytes from one place to another."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch every page
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(dst, src)  # one thread, the GIL released
        best = min(best, time.perf_counter() - began)
    return nbytes / best / 1e9


def memcpy_ceiling() -> Ceiling:
    return Ceiling(memcpy_rate(), "this host's memcpy, 1 thread")


def device_copy_ceiling(nbytes: int = DEVICE_COPY_BYTES, repeats: int = 10) -> Ceiling | None:
    """A device-to-device copy on the current CUDA device (timed with CUDA events, the
    best of ``repeats``); this host's memcpy where torch sees no CUDA device (the CPU
    stand-ins of the tests); None when the copy's memory cannot be had."""
    import torch

    if not torch.cuda.is_available():
        return memcpy_ceiling()
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
    except (RuntimeError, MemoryError):  # a full GPU: no ceiling rather than a failure
        return None
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del src, dst
    name = torch.cuda.get_device_name()
    return Ceiling(nbytes / best / 1e9, f"device copy on {name}")


def loopback_tcp_rate(nbytes: int = TCP_BYTES) -> float:
    """GB/s of one TCP connection on loopback (what gloo's TCP transport uses between
    processes of one host)."""
    server = socket.create_server(("127.0.0.1", 0))
    received = threading.Event()
    block = 1024 * 1024

    def drain(conn: socket.socket) -> None:
        left = nbytes
        with conn:
            while left > 0:
                data = conn.recv(min(block, left))
                if not data:
                    break
                left -= len(data)
        received.set()

    with server, socket.create_connection(server.getsockname()) as client:
        conn, _ = server.accept()
        reader = threading.Thread(target=drain, args=(conn,), daemon=True)
        reader.start()
        payload = memoryview(bytes(block))
        began = time.perf_counter()
        for _ in range(nbytes // block):
            client.sendall(payload)
        received.wait(60)
        seconds = time.perf_counter() - began
        reader.join(1)
    return nbytes / seconds / 1e9


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 ``address`` (Linux), or None."""
    import fcntl

    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def link_ceiling(address: str) -> Ceiling | None:
    """The link a trainer's collective uses from local ``address``: loopback TCP,
    measured; else the interface's own rate (``/sys/class/net/<name>/speed``, Mbit/s);
    None when neither is known."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(address).is_loopback:
            return Ceiling(loopback_tcp_rate(), "loopback TCP, measured")
    name = interface_of(address)
    if name is None:
        return None
    try:
        mbit = int(Path(f"/sys/class/net/{name}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    if mbit <= 0:
        return None
    return Ceiling(mbit / 8000, f"link {name} ({mbit} Mbit/s, as the interface reports it)")
