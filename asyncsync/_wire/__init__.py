"""Wire knowledge: vLLM's routes as planned calls, generation request bodies and
parsers (no I/O), and what the installed vLLM can do (caps.py: it probes vLLM, in a
subprocess, and caches the answer on disk)."""
