"""``python -m asyncsync.testing._fake_cli``: serve FakeVLLMServers in this process.

A separate entry module, so that running it does not re-execute a module the
``asyncsync.testing`` package has already imported.
"""

from asyncsync.testing._fake._cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
