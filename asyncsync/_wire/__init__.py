"""Wire knowledge: vLLM's routes as planned calls, generation request bodies and
parsers, as pure functions and records (no I/O). What the installed vLLM can do is
probed in `asyncsync._vllm`."""
