"""The installed vLLM, probed: what it can do, read from vLLM itself (caps.py). Unlike
`asyncsync._wire` this does I/O: it imports vLLM, runs a subprocess and caches the answer
on disk. Imports only `asyncsync._core`; this file imports nothing."""
