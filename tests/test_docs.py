"""User-facing text stays true: code in README and docs/ parses, names the public API only,
and the docs site's sources hang together (mkdocs --strict checks links: ``nox -s docs``)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import asyncsync as az
from asyncsync import backends, blocking, metrics, testing

ROOT = Path(__file__).resolve().parent.parent
#: What a user reads; docs/development.md is the map for contributors (it names modules).
USER_TEXT = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")],
)
USER_TEXT = [p for p in USER_TEXT if p.name != "development.md"]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

PY_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
#: A private module used as code: imported, or reached as an attribute.
PRIVATE_USE = re.compile(r"(?:from|import)\s+asyncsync(?:\.\w+)*\._\w+|asyncsync\._\w+\.\w+")
AZ_NAME = re.compile(r"\baz\.([A-Za-z_]\w*)")
BLOCKING_NAME = re.compile(r"\bblocking\.([A-Za-z_]\w*)")


def _blocks(path: Path) -> list[str]:
    return PY_BLOCK.findall(path.read_text())


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", USER_TEXT, ids=_rel)
def test_python_blocks_parse(path: Path) -> None:
    for i, block in enumerate(_blocks(path)):
        if block.lstrip().startswith("--8<--"):  # an example file included by the site
            continue
        try:
            compile(block, f"{_rel(path)} block {i}", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as err:
            pytest.fail(f"{_rel(path)}: python block {i} does not parse: {err}\n{block}")


@pytest.mark.parametrize("path", USER_TEXT + EXAMPLES, ids=_rel)
def test_no_private_module_in_user_text(path: Path) -> None:
    found = PRIVATE_USE.findall(path.read_text())
    assert not found, f"{_rel(path)} sends users to private modules: {found}"


@pytest.mark.parametrize("path", USER_TEXT + EXAMPLES, ids=_rel)
def test_names_used_exist(path: Path) -> None:
    text = path.read_text()
    if path.suffix == ".md":
        text = "\n".join(_blocks(path)) + "\n" + "\n".join(re.findall(r"`([^`\n]+)`", text))
    missing = sorted({n for n in AZ_NAME.findall(text) if not hasattr(az, n)})
    missing += sorted({f"blocking.{n}" for n in BLOCKING_NAME.findall(text)
                       if not hasattr(blocking, n)})  # fmt: skip
    assert not missing, f"{_rel(path)} names what asyncsync does not export: {missing}"


def test_reference_pages_cover_the_public_api() -> None:
    reference = (ROOT / "docs" / "reference" / "asyncsync.md").read_text()
    documented = set(re.findall(r"^::: asyncsync\.(\w+)$", reference, re.M))
    public = {
        n for n in az.__all__ if not n.startswith("__") and not inspect.ismodule(getattr(az, n))
    }
    assert public - documented == set(), f"undocumented in the API reference: {public - documented}"
    assert documented - public == set(), f"documented but not exported: {documented - public}"
    for module in (backends, blocking, metrics, testing):
        page = ROOT / "docs" / "reference" / f"{module.__name__.split('.')[-1]}.md"
        assert f"::: {module.__name__}" in page.read_text(), page


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if p not in nav)
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
