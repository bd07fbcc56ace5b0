"""Import rules between the publish round and the transports, read from the source.

The transport contract lives in one public module, `asyncsync.backends.contract`. The
backends implement it and never import the round (``asyncsync._publish``); the round
reaches the backends only through the contract or the public ``asyncsync.backends``
package. Every import counts: module level, function level and ``TYPE_CHECKING`` alike.

The wire layer (``asyncsync/_wire``) is pure: it imports only ``_core`` and itself, and no
module that does I/O. The installed-vLLM probe, which does (a subprocess, a disk cache),
is ``asyncsync/_vllm``, a layer above ``_core`` alone (docs/development.md's layout).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncsync.backends
from asyncsync.backends import contract

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncsync"
CONTRACT = "asyncsync.backends.contract"
#: What ``asyncsync/_publish`` may import of the backends.
PUBLIC_BACKENDS = {"asyncsync.backends", CONTRACT}
#: Imports of ``asyncsync/_publish`` that still reach a private backends module, and why.
#: An entry here is a known debt; a new one is a failing test. Empty: what both sides of
#: a transport share lives in ``asyncsync/_transport`` (issue 32's module moves).
PUBLISH_EXCEPTIONS: dict[tuple[str, str], str] = {}
#: What a third-party backend imports of asyncsync (tests/test_third_party_backend.py).
THIRD_PARTY_ALLOWED = {"asyncsync", "asyncsync.backends", CONTRACT, "asyncsync.testing"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, wherever it sits; ``from m import
    n`` yields ``m.n`` when that names a submodule (``from asyncsync.backends import
    contract``), else ``m``. Relative imports are resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    ROOT / Path(*sub.split(".")) / "__init__.py"
                ).exists()
                yield node.lineno, sub if is_module else module


def runtime_imports(path: Path) -> Iterator[tuple[int, str]]:
    """The imports a module runs when it is imported (outside ``TYPE_CHECKING`` and
    outside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, ("." * node.level) + (node.module or "")


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def files(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("path", files("backends"), ids=lambda p: p.name)
def test_the_backends_never_import_the_publish_round(path: Path) -> None:
    bad = [f"line {n}: {m}" for n, m in imports(path) if within(m, "asyncsync._publish")]
    assert bad == [], f"{path.relative_to(ROOT)} imports the publish round: {bad}"


@pytest.mark.parametrize("path", files("_publish"), ids=lambda p: p.name)
def test_the_publish_round_reaches_the_backends_only_through_the_contract(path: Path) -> None:
    name = module_name(path)
    bad = [
        f"line {n}: {m}"
        for n, m in imports(path)
        if within(m, "asyncsync.backends")
        and m not in PUBLIC_BACKENDS
        and (name, m) not in PUBLISH_EXCEPTIONS
    ]
    assert bad == [], (
        f"{path.relative_to(ROOT)} reaches into private backends modules: {bad}; import "
        f"what a backend implements or is handed from {CONTRACT}"
    )


def test_the_known_exceptions_are_still_needed() -> None:
    """An exception that no longer happens is removed from the list, so the list stays
    the true debt."""
    found = {
        (module_name(path), m)
        for path in files("_publish")
        for _, m in imports(path)
        if within(m, "asyncsync.backends")
    }
    stale = set(PUBLISH_EXCEPTIONS) - found
    assert stale == set(), f"remove from PUBLISH_EXCEPTIONS: {stale}"
    # An empty list checks nothing above; the walk itself must still see the round's
    # imports of the backends (the contract at least), or it has gone blind.
    assert any(m == CONTRACT for _, m in found), "the walk found no import of the contract"


def test_the_contract_imports_nothing_of_asyncsync_or_torch_when_imported() -> None:
    """The contract is the bottom of the transports: importing it (the vLLM plugin
    imports the backends package in every vLLM process) loads no other asyncsync module,
    no torch and no vLLM; the fleet it names is a type-only import."""
    path = PACKAGE / "backends" / "contract.py"
    loaded = [m for _, m in runtime_imports(path)]
    bad = [
        m for m in loaded if m.startswith(".") or m.split(".")[0] in {"asyncsync", "torch", "vllm"}
    ]
    assert bad == [], f"contract.py imports {bad} at import time"


def test_the_contract_defines_every_name_it_exports() -> None:
    """Defined in contract.py, not re-exported from elsewhere: the contract is one module
    a reader can read whole."""
    tree = ast.parse((PACKAGE / "backends" / "contract.py").read_text())
    defined: set[str] = set()
    objects: set[str] = set()  # classes and functions (the rest are type aliases)
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            defined.add(node.name)
            objects.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    exported = set(contract.__all__)
    assert exported - defined == set(), f"re-exported, not defined: {exported - defined}"
    for name in exported & objects:
        value = getattr(contract, name)
        assert value.__module__ == CONTRACT, (name, value.__module__)
        assert value.__doc__, f"{name} has no docstring"


def test_the_backends_package_exports_the_contract_s_own_objects() -> None:
    for name in asyncsync.backends.__all__:
        if name in contract.__all__:
            assert getattr(asyncsync.backends, name) is getattr(contract, name), name


def test_the_third_party_backend_uses_public_modules_only() -> None:
    path = ROOT / "tests" / "test_third_party_backend.py"
    used = {m for _, m in imports(path) if within(m, "asyncsync")}
    assert used - THIRD_PARTY_ALLOWED == set(), f"private imports: {used - THIRD_PARTY_ALLOWED}"
    assert CONTRACT in used
    text = path.read_text()
    assert "._" not in text.replace("self._", "").replace("__", ""), (
        "the third-party backend's test reaches a private attribute"
    )


#: Modules whose import says a module does I/O (processes, files, threads, the network)
#: or loads vLLM or torch: none of them is imported by the pure wire layer.
IO_MODULES = {
    "aiohttp", "asyncio", "importlib", "io", "os", "pathlib", "shutil", "socket",
    "subprocess", "sys", "tempfile", "threading", "torch", "vllm",
}  # fmt: skip
#: What each layer below the facades may import of asyncsync (its own package included).
LAYERS = {
    "asyncsync._wire": ("asyncsync._core", "asyncsync._wire"),
    "asyncsync._vllm": ("asyncsync._core", "asyncsync._vllm"),
    "asyncsync._transport": ("asyncsync._core", "asyncsync._transport"),
}


@pytest.mark.parametrize(
    "path", files("_wire") + files("_vllm") + files("_transport"), ids=lambda p: p.name
)
def test_the_lower_layers_import_only_the_layers_below(path: Path) -> None:
    name = module_name(path)
    layer = next(layer for layer in LAYERS if within(name, layer))
    allowed = LAYERS[layer]
    bad = [
        f"line {n}: {m}"
        for n, m in imports(path)
        if within(m, "asyncsync") and not any(within(m, a) for a in allowed)
    ]
    assert bad == [], f"{path.relative_to(ROOT)} (layer {layer}) imports above it: {bad}"


@pytest.mark.parametrize("path", files("_wire"), ids=lambda p: p.name)
def test_the_wire_layer_does_no_io(path: Path) -> None:
    bad = [f"line {n}: {m}" for n, m in imports(path) if m.split(".")[0] in IO_MODULES]
    assert bad == [], (
        f"{path.relative_to(ROOT)} imports {bad}: _wire is pure; I/O about vLLM goes in "
        "asyncsync/_vllm, HTTP in asyncsync/_http"
    )


#: The public packages of asyncsync: a folder whose name has no leading underscore. Their
#: underscore modules are theirs alone.
PUBLIC_PACKAGES = sorted(
    f"asyncsync.{p.parent.name}"
    for p in PACKAGE.glob("*/__init__.py")
    if not p.parent.name.startswith("_")
)
#: Imports of a public package's underscore module from outside that package, and why.
#: An entry here is a known debt; a new one is a failing test. None are left.
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def private_module_of(module: str) -> str | None:
    """The public package ``module`` is an underscore module of (``asyncsync.backends``
    for ``asyncsync.backends._shm_pack`` or ``asyncsync.testing._fake._lm``), else None."""
    for package in PUBLIC_PACKAGES:
        if within(module, package) and module != package:
            rest = module[len(package) + 1 :].split(".")
            if any(part.startswith("_") for part in rest):
                return package
    return None


def foreign_private_imports(root: Path) -> set[tuple[str, str]]:
    """``(importer, imported)`` for every module under ``root`` that imports a public
    package's underscore module from outside that package."""
    found: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        name = module_name(path)
        for _, m in imports(path):
            owner = private_module_of(m)
            if owner is not None and not within(name, owner):
                found.add((name, m))
    return found


def test_the_public_packages_are_found() -> None:
    assert {"asyncsync.backends", "asyncsync.vllm_plugin", "asyncsync.testing"} <= set(
        PUBLIC_PACKAGES
    ), PUBLIC_PACKAGES


def test_no_module_reaches_into_another_public_package_s_private_modules() -> None:
    """``asyncsync.backends._*`` is backends' own, ``asyncsync.vllm_plugin._*`` the
    plugin's, and so on for every public package: what two packages share goes in a
    private package of its own (``asyncsync/_transport``), not in one of them."""
    bad = foreign_private_imports(PACKAGE) - set(PRIVATE_EXCEPTIONS)
    assert bad == set(), f"imports of another package's private modules: {sorted(bad)}"


def test_the_private_exceptions_are_still_needed() -> None:
    stale = set(PRIVATE_EXCEPTIONS) - foreign_private_imports(PACKAGE)
    assert stale == set(), f"remove from PRIVATE_EXCEPTIONS: {stale}"


def test_the_rule_names_the_owner_of_a_private_module() -> None:
    """The old layout's imports are caught (the plugin importing ``backends._wire``), a
    public module or a private package is not."""
    assert private_module_of("asyncsync.backends._wire") == "asyncsync.backends"
    assert private_module_of("asyncsync.vllm_plugin._mirror") == "asyncsync.vllm_plugin"
    assert private_module_of("asyncsync.testing._fake._lm") == "asyncsync.testing"
    assert private_module_of("asyncsync.backends.shm") is None
    assert private_module_of("asyncsync.backends") is None
    assert private_module_of("asyncsync._transport.wire") is None
