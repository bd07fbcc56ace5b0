"""Wire knowledge, no I/O: what a vLLM server can do (probed), its control routes as
planned calls, generation request bodies and parsers."""
