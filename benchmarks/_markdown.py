"""Shared by the benchmark scripts: replace one marked section of a markdown file."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, begin: str, end: str, block: str, heading: str = "") -> None:
    """Put ``block`` between the ``begin``/``end`` markers of ``path`` (markers included
    in ``block`` or not); append it under ``heading`` when the markers are absent."""
    if not block.startswith(begin):
        block = f"{begin}\n{block}\n{end}"
    text = path.read_text() if path.exists() else "# Performance\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        title = f"\n## {heading}\n" if heading else ""
        text = text.rstrip() + "\n" + title + "\n" + block + "\n"
    path.write_text(text)
