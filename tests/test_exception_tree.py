"""Every error asyncsync raises is an `AsyncSyncError` (docs/errors.md), apart from
Python's own exceptions for a mistake in use, each kind named below with why.

Two walks over the package. Every exception class asyncsync defines (or exports) is an
`AsyncSyncError`, unless it is a warning or a signal that never leaves asyncsync
(listed, with where it is caught). Every ``raise`` of a class by name in asyncsync's
source raises one of those classes or one of the listed built-in kinds. The worker side
(``asyncsync/vllm_plugin``) runs inside vLLM: what it raises reaches a caller as the
server's answer (a `ServerError`), and it defines no exception class.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pickle
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import asyncsync
from asyncsync import AsyncSyncError

PACKAGE = Path(asyncsync.__file__).resolve().parent
#: Runs inside vLLM's worker processes; a caller sees what it raises as a server's answer.
WORKER_SIDE = PACKAGE / "vllm_plugin"
#: Optional dependencies a module may need (a module that needs a missing one is skipped:
#: the ``tests`` session has them all).
OPTIONAL = {"vllm", "ray", "peft", "transformers", "torch", "zstandard", "openai", "agents"}

#: Exception classes of asyncsync that are no AsyncSyncError, and why none reaches a
#: caller.
SIGNALS = {
    "asyncsync._http.h1._BadAnswer": "the lean HTTP pool's parse failure; the pool maps it",
    "asyncsync._wire.control.Malformed": "a parser's; the transport maps it (ProtocolError)",
    "asyncsync._wire.generation.stream.StreamFailed": "a stream's error event; GenerationError",
    "asyncsync._publish.round._Regroup": "the round sends again, or fails (PublishError)",
    "asyncsync.backends.contract.RoundCancelled": (
        "a backend's stop at a chunk boundary; the caller gets its CancelledError"
    ),
    "asyncsync._transport.gloo_group.GlooAborted": "inside a gloo send; PublishError's cause",
    "asyncsync._transport.gloo_group.GlooTimeout": "inside a gloo send; PublishError's cause",
}

#: Python's own exceptions asyncsync raises, each for a mistake in use (docs/errors.md).
BUILTIN_KINDS = {
    ValueError: "an argument's value",
    TypeError: "an argument's type",
    RuntimeError: (
        "a call in the wrong state or place: an object not started or already started, a "
        "second publish with if_busy='raise', a blocking call from the loop's own thread, "
        "a backend without the device it needs, the demo's run"
    ),
    KeyError: "a server that is not in the fleet",
    ImportError: "an extra that is not installed",
    AttributeError: "a name a module does not have (deprecated names' __getattr__)",
    NotImplementedError: "a per-server init info asked for as one",
    FileNotFoundError: "asyncsync.testing: no model at the path, vllm-router not installed",
    TimeoutError: "asyncsync.testing: the test router did not come up",
    AssertionError: "asyncsync.testing: check_greedy's verdict, a fake's unreachable branch",
    StopIteration: "the iterator protocol",
    StopAsyncIteration: "the async iterator protocol",
    SystemExit: "a script's exit (the option probe, the watchdog)",
}
#: Third-party exceptions raised by name: the lean HTTP pool raises aiohttp's, which the
#: transport maps at its one boundary like aiohttp's own; cancellation is re-raised.
FOREIGN = {"aiohttp": PACKAGE / "_http", "asyncio": PACKAGE}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if WORKER_SIDE not in p.parents)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in OPTIONAL or name.startswith("asyncsync.ray"):
            pytest.skip(f"{name} needs {missing or 'an extra'}, not installed here")
        raise


def _exception_classes() -> Iterator[type[BaseException]]:
    """Every exception class defined in asyncsync's modules (worker side excluded)."""
    seen: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(asyncsync.__path__, "asyncsync."):
        if info.name.startswith("asyncsync.vllm_plugin"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] in OPTIONAL or info.name.startswith("asyncsync.ray"):
                continue
            raise
        for _, value in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(value, BaseException)
                and value.__module__.startswith("asyncsync")
                and value not in seen
            ):
                seen.add(value)
                yield value


def _qualified(cls: type) -> str:
    return f"{inspect.getmodule(cls).__name__}.{cls.__qualname__}"  # type: ignore[union-attr]


def test_every_exception_class_of_asyncsync_is_an_asyncsync_error() -> None:
    found = list(_exception_classes())
    assert len(found) > 20, "the walk found too few classes: is it still walking?"
    outside = [
        _qualified(cls)
        for cls in found
        if not issubclass(cls, AsyncSyncError | Warning) and _qualified(cls) not in SIGNALS
    ]
    assert not outside, f"exception classes outside AsyncSyncError: {outside}"
    names = {_qualified(cls) for cls in found}
    assert set(SIGNALS) <= names, f"listed, but gone: {set(SIGNALS) - names}"


def test_every_exported_exception_is_an_asyncsync_error() -> None:
    modules = [asyncsync, asyncsync.backends, asyncsync.metrics, asyncsync.blocking]
    modules += [asyncsync.testing]
    try:
        import asyncsync.ray as ray_api
    except ImportError:
        pass
    else:
        modules.append(ray_api)
    exported = {
        f"{module.__name__}.{name}": value
        for module in modules
        for name in module.__all__
        if inspect.isclass(value := getattr(module, name)) and issubclass(value, BaseException)
    }
    outside = [
        name
        for name, cls in exported.items()
        if not issubclass(cls, AsyncSyncError | Warning) and _qualified(cls) not in SIGNALS
    ]
    assert not outside, f"exported exceptions outside AsyncSyncError: {outside}"


def _raised_names(path: Path) -> Iterator[tuple[int, str]]:
    """``raise Name(...)``, ``raise Name``, ``raise pkg.Name(...)``: (line, dotted name)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        parts: list[str] = []
        while isinstance(target, ast.Attribute):
            parts.insert(0, target.attr)
            target = target.value
        if isinstance(target, ast.Name):
            yield node.lineno, ".".join([target.id, *parts])


def _resolve(module: ModuleType, dotted: str) -> object:
    head, *rest = dotted.split(".")
    value = getattr(module, head, getattr(builtins, head, None))
    for part in rest:
        value = getattr(value, part, None)
    return value


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_what_each_module_raises_is_an_asyncsync_error_or_a_mistake_in_use(path: Path) -> None:
    raised = list(_raised_names(path))
    if not raised:
        return
    module = _import(_module_name(path))
    problems = []
    for line, dotted in raised:
        cls = _resolve(module, dotted)
        if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
            continue  # a variable holding an error, or a function that builds one
        if issubclass(cls, AsyncSyncError) or _qualified(cls) in SIGNALS:
            continue
        if cls in BUILTIN_KINDS:
            continue
        root = cls.__module__.split(".")[0]
        if root in FOREIGN and FOREIGN[root] in (path, *path.parents):
            continue
        problems.append(f"line {line}: raise {dotted} ({cls.__module__}.{cls.__qualname__})")
    assert not problems, (
        f"{path.relative_to(PACKAGE)} raises what is neither an AsyncSyncError nor a "
        f"listed kind: {problems}"
    )


def test_the_worker_side_defines_no_exception_class() -> None:
    for path in sorted(WORKER_SIDE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b.endswith(("Error", "Exception")) for b in bases), (
                    f"{path.relative_to(PACKAGE)}: class {node.name}({', '.join(bases)})"
                )


def test_chat_request_error_is_both_an_asyncsync_error_and_a_value_error() -> None:
    """``except ValueError`` (a refused argument) and ``except AsyncSyncError`` both
    catch it; it keeps the field it names across pickling."""
    err = asyncsync.ChatRequestError("messages[2].role must be a string", "messages[2].role")
    assert isinstance(err, AsyncSyncError)
    assert isinstance(err, ValueError)
    assert str(err) == "messages[2].role must be a string"
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is asyncsync.ChatRequestError
    assert (clone.message, clone.param) == (err.message, err.param)
    with pytest.raises(ValueError, match="role"):
        raise err
