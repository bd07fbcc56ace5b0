"""The package's public surface and its import-time promises."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import asyncsync
import asyncsync.testing


def test_public_namespace_is_explicit() -> None:
    """``__all__`` is the namespace: each entry once and there, none private, and nothing
    else public in it but the package's own modules (a helper that ``__init__`` imports
    without an underscore would be importable as ``asyncsync.<helper>``)."""
    exported = asyncsync.__all__
    assert len(exported) == len(set(exported))
    assert [n for n in exported if not hasattr(asyncsync, n)] == []
    assert [n for n in exported if n.startswith("_") and n != "__version__"] == []
    leaked = [
        name
        for name, value in vars(asyncsync).items()
        if not name.startswith("_")
        and name not in exported
        and not (inspect.ismodule(value) and value.__name__ == f"asyncsync.{name}")
    ]
    assert leaked == []


def test_every_export_says_what_it_is() -> None:
    """Each exported class, function and module has a docstring of its own (the API
    reference is built from them; tests/test_docs.py checks each has its entry there),
    and exceptions and warnings carry the public module's name in tracebacks."""
    undocumented = []
    for name in asyncsync.__all__:
        obj = getattr(asyncsync, name)
        if isinstance(obj, str):  # __version__
            continue
        doc = vars(obj).get("__doc__") if isinstance(obj, type) else obj.__doc__
        if not (doc or "").strip():
            undocumented.append(name)
        if isinstance(obj, type) and issubclass(obj, BaseException | Warning):
            assert obj.__module__ == "asyncsync", name
    assert undocumented == []


def test_testing_namespace_exports() -> None:
    for name in asyncsync.testing.__all__:
        assert hasattr(asyncsync.testing, name), name
    assert {"make_tiny_model", "LocalVLLMServer"} <= set(asyncsync.testing.__all__)


def test_version_has_one_source() -> None:
    """pyproject.toml's version is dynamic: hatchling reads asyncsync/__init__.py's
    ``__version__`` when it builds, so the installed distribution's metadata says the
    same. (An editable install made before a version change keeps the old metadata
    until it is reinstalled: this test then says so.)"""
    root = Path(__file__).resolve().parent.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second, static version"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["hatch"]["version"]["path"] == "asyncsync/__init__.py"
    assert importlib.metadata.version("asyncsync") == asyncsync.__version__


def test_py_typed_marker_shipped() -> None:
    assert (Path(asyncsync.__file__).parent / "py.typed").is_file()


def test_import_without_vllm_or_torch() -> None:
    """`import asyncsync` (and asyncsync.testing) must not need vLLM or torch."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'vllm', 'torch', 'transformers'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        "import asyncsync, asyncsync.testing\n"
        "assert not any(m.split('.')[0] in {'vllm', 'torch'} for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_errors_carry_context_and_pickle() -> None:
    import pickle

    err = asyncsync.ServerError(
        "boom", server="http://h:1", route="/update_weights", status=500, body="x" * 2000
    )
    assert "http://h:1" in str(err)
    assert "/update_weights" in str(err)
    assert "HTTP 500" in str(err)
    assert err.body is not None
    assert len(err.body) < 600
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is asyncsync.ServerError
    assert (clone.server, clone.route, clone.status) == ("http://h:1", "/update_weights", 500)
    assert isinstance(asyncsync.ServerTimeout("t"), TimeoutError)
    perr = asyncsync.PublishError("round failed", version="v2", needs_resync=["http://a"])
    assert "needs resync: http://a" in str(perr)
    perr2 = pickle.loads(pickle.dumps(perr))
    assert perr2.version == "v2"
    assert perr2.needs_resync == ("http://a",)


def test_every_benchmark_runs_in_the_bench_session() -> None:
    """``nox -s bench`` runs every ``benchmarks/bench_*.py`` (its BENCHMARKS table, read
    from noxfile.py without importing nox), and every ``nox -s bench -- NAME`` the docs
    tell a reader to type names one of them."""
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "noxfile.py").read_text())
    table = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "BENCHMARKS" for t in node.targets)
    )
    benchmarks = ast.literal_eval(table)
    scripts = {p.relative_to(root).as_posix() for p in (root / "benchmarks").glob("bench_*.py")}
    assert set(benchmarks.values()) == scripts
    named = {
        name
        for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        for name in re.findall(r"nox -s bench -- ([a-z_]+)", page.read_text())
    }
    assert named, "the docs name no benchmark (the pattern above is stale)"
    assert named <= set(benchmarks), sorted(named - set(benchmarks))


def test_fast_uses_uvloop_only_through_asyncsync_run() -> None:
    """The ``fast`` extra's uvloop is used where the entry point asks for it
    (`asyncsync.run`), never because asyncsync was imported (README, quickstart,
    pyproject): the loop policy and ``asyncio.run``'s loop stay the standard ones."""
    pytest.importorskip("uvloop")
    code = (
        "import asyncio\n"
        "policy = type(asyncio.get_event_loop_policy())\n"
        "import asyncsync, asyncsync.blocking, asyncsync.testing\n"
        "assert type(asyncio.get_event_loop_policy()) is policy, 'the policy changed'\n"
        "async def loop_type():\n"
        "    return type(asyncio.get_running_loop()).__module__\n"
        "print(asyncio.run(loop_type()), asyncsync.run(loop_type()))\n"
    )
    env = {**os.environ, "ASYNCSYNC_NO_UVLOOP": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    plain, run = out.stdout.split()
    assert plain.startswith("asyncio"), plain
    assert run.startswith("uvloop"), run
