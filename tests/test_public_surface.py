"""The public surface, written out as text and compared with tests/public_surface.txt.

Each public module's ``__all__`` and, for every public name, what it is: a function's
signature, a class's constructor signature, bases and public members (methods with
their signatures, properties marked, fields with their annotations, enum members,
TypedDict keys). A change to the surface, intended or not, fails this test with a
unified diff; when the change is meant, rewrite the file and commit it with the change::

    ASYNCSYNC_UPDATE_SURFACE=1 python3 -m nox -R -s unit -- tests/test_public_surface.py

The text is the same on every machine: names sorted, annotations as written in the
source, no memory addresses, sets printed sorted. A module that needs an optional
dependency (``asyncsync.ray`` needs Ray) is checked where that dependency is installed
(the ``tests`` session) and skipped, saying so, where it is not; rewriting the file
without it keeps that module's section as it was.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ForwardRef, get_origin, is_typeddict

import pytest

SNAPSHOT = Path(__file__).with_name("public_surface.txt")
UPDATE_ENV = "ASYNCSYNC_UPDATE_SURFACE"

#: The public modules (docs/reference/), each with the optional dependency it needs.
MODULES: dict[str, str | None] = {
    "asyncsync": None,
    "asyncsync.backends": None,
    "asyncsync.backends.contract": None,
    "asyncsync.blocking": None,
    "asyncsync.metrics": None,
    "asyncsync.testing": None,
    "asyncsync.ray": "ray",
}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_HEADER = re.compile(r"^## (\S+)$")
#: A set literal with no nesting, as a repr prints it: ``frozenset({1, 2})``, ``{'a'}``.
_SET = re.compile(r"(frozenset\(|(?<![\w)\]]))\{([^{}()\[\]:]+)\}")


class _Text:
    """An annotation or default shown as given: ``inspect`` prints its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(annotation: Any) -> str:
    """As written in the source (modules use ``from __future__ import annotations``), or
    the evaluated annotation as ``inspect`` names it."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, ForwardRef):  # a TypedDict's key, written as text
        return annotation.__forward_arg__
    return _ADDRESS.sub("", inspect.formatannotation(annotation))


def _value(value: Any) -> str:
    """A default or constant's repr with no address and sets in sorted order."""
    if isinstance(value, frozenset | set):
        items = ", ".join(sorted(_value(v) for v in value))
        return f"{type(value).__name__}({{{items}}})" if value else f"{type(value).__name__}()"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | type):
        return f"{value.__module__}.{value.__qualname__}"
    return _SET.sub(_sorted_set, _ADDRESS.sub("", repr(value)))


def _sorted_set(match: re.Match[str]) -> str:
    """A flat set literal inside a repr (a dataclass's field), its items sorted."""
    items = sorted(match.group(2).split(", "))
    return f"{match.group(1)}{{{', '.join(items)}}}"


def _signature(obj: Callable[..., Any]) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(<no signature>)"
    params = [
        p.replace(
            annotation=(
                p.annotation if p.annotation is p.empty else _Text(_annotation(p.annotation))
            ),
            default=p.default if p.default is p.empty else _Text(_value(p.default)),
        )
        for p in signature.parameters.values()
    ]
    returns = signature.return_annotation
    if returns is not signature.empty:
        returns = _Text(_annotation(returns))
    return str(signature.replace(parameters=params, return_annotation=returns))


def _def(obj: Callable[..., Any]) -> str:
    if inspect.isasyncgenfunction(obj):
        return "async def*"
    if inspect.iscoroutinefunction(obj):
        return "async def"
    return "def"


def _own(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "asyncsync"


def _class_name(cls: type) -> str:
    """A class by its public name where it has one (``asyncsync.Trajectory``), by its
    name alone when it is private to asyncsync (a module may move), else in full."""
    if not _own(cls):
        return f"{cls.__module__}.{cls.__qualname__}"
    for module_name in MODULES:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, cls.__name__, None) is cls:
            return f"{module_name}.{cls.__name__}"
    return cls.__qualname__


def _kinds(cls: type) -> list[str]:
    kinds = []
    if dataclasses.is_dataclass(cls):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        kinds.append("frozen dataclass" if params.frozen else "dataclass")
    if is_typeddict(cls):
        kinds.append("TypedDict")
    if getattr(cls, "_is_protocol", False):
        kinds.append("Protocol")
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kinds.append("NamedTuple")
    return kinds


def _member(name: str, raw: Any) -> str:
    """One line for a class attribute found in a class's own ``__dict__``."""
    if isinstance(raw, property):
        returns = inspect.signature(raw.fget).return_annotation if raw.fget else None
        shown = "" if returns in (None, inspect.Signature.empty) else f": {_annotation(returns)}"
        settable = " (settable)" if raw.fset is not None else ""
        return f"property {name}{shown}{settable}"
    if isinstance(raw, functools.cached_property):
        returns = inspect.signature(raw.func).return_annotation
        shown = "" if returns is inspect.Signature.empty else f": {_annotation(returns)}"
        return f"cached property {name}{shown}"
    if isinstance(raw, staticmethod):
        return f"static {_def(raw.__func__)} {name}{_signature(raw.__func__)}"
    if isinstance(raw, classmethod):
        return f"classmethod {_def(raw.__func__)} {name}{_signature(raw.__func__)}"
    if inspect.isfunction(raw):
        return f"{_def(raw)} {name}{_signature(raw)}"
    if isinstance(raw, type):
        return f"class {name}" if raw.__name__ == name else f"{name} = {_class_name(raw)}"
    if isinstance(raw, types.MemberDescriptorType | types.GetSetDescriptorType):
        return f"slot {name}"  # a slotted dataclass's field: its annotation says the rest
    if callable(raw):  # a callable descriptor object (e.g. functools.partialmethod)
        return f"{type(raw).__name__} {name}{_signature(raw)}"
    if isinstance(raw, str | int | float | bool | bytes | type(None) | frozenset | tuple):
        return f"{name} = {_value(raw)}"
    return f"{name}: {type(raw).__name__}"


def _class_lines(cls: type) -> Iterator[str]:
    bases = ", ".join(_class_name(b) for b in cls.__bases__ if b is not object)
    kinds = " ".join(f"[{k}]" for k in _kinds(cls))
    head = f"class {cls.__name__}" + (f"({bases})" if bases else "")
    yield f"{head}{' ' + kinds if kinds else ''}"
    if is_typeddict(cls):
        required = cls.__required_keys__  # type: ignore[attr-defined]
        for key, annotation in sorted(cls.__annotations__.items()):
            mark = "required" if key in required else "optional"
            yield f"    {key}: {_annotation(annotation)} ({mark})"
        return
    if issubclass(cls, enum.Enum):
        for member in cls:
            yield f"    {member.name} = {_value(member.value)}"
    elif not issubclass(cls, BaseException) or any(
        _own(k) and "__init__" in vars(k) for k in cls.__mro__
    ):
        yield f"    {cls.__name__}{_signature(cls)}"
    seen: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # the most derived definition wins
        if not _own(klass):
            continue
        fields = {
            name: _annotation(annotation)
            for name, annotation in vars(klass).get("__annotations__", {}).items()
            if not name.startswith("_")
        }
        for name, annotation in fields.items():
            seen[name] = f"field {name}: {annotation}"
        for name, raw in vars(klass).items():
            if name.startswith("_") or (issubclass(cls, enum.Enum) and name in cls.__members__):
                continue
            line = _member(name, raw)
            if name in fields and line.startswith("slot "):
                continue  # the field line already says it
            if name in fields and not line.startswith(("property", "cached", "static", "class")):
                line = f"field {name}: {fields[name]} = {_value(raw)}"
            seen[name] = line
    for name in sorted(seen):
        yield f"    {seen[name]}"


def _name_lines(module: types.ModuleType, name: str) -> Iterator[str]:
    obj = getattr(module, name)
    if inspect.ismodule(obj):
        yield f"module {name} = {obj.__name__}"
    elif isinstance(obj, type):
        if obj.__name__ != name:
            yield f"{name} = {_class_name(obj)}"
        else:
            yield from _class_lines(obj)
    elif callable(obj) and not get_origin(obj):  # a function, or one wrapped (lru_cache)
        yield f"{_def(inspect.unwrap(obj))} {name}{_signature(obj)}"
    elif get_origin(obj) is not None or isinstance(obj, types.UnionType):
        yield f"alias {name} = {_annotation(obj)}"
    else:
        yield f"{name}: {type(obj).__name__}"


def module_surface(module_name: str) -> str:
    """One module's section: its ``__all__``, then each name's lines, sorted by name."""
    module = importlib.import_module(module_name)
    exported: list[str] = list(module.__all__)
    lines = [f"## {module_name}", "", "__all__ = ["]
    lines += [f"    {name!r}," for name in sorted(exported)]
    lines.append("]")
    deprecated = getattr(module, "_DEPRECATED", {})
    for old in sorted(deprecated):
        lines.append(f"deprecated {old} -> {deprecated[old][0]}")
    for name in sorted(exported):
        lines.append("")
        lines += _name_lines(module, name)
    return "\n".join(lines) + "\n"


def read_sections(text: str) -> dict[str, str]:
    """The snapshot file's sections by module name (each from its ``## `` line)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        match = _HEADER.match(line.rstrip("\n"))
        if match:
            current = sections.setdefault(match.group(1), [])
        if current is not None:
            current.append(line)
    return {name: "".join(lines).rstrip("\n") + "\n" for name, lines in sections.items()}


def write_sections(sections: dict[str, str]) -> str:
    intro = (
        "# asyncsync's public surface, written by tests/test_public_surface.py: do not\n"
        f"# edit by hand; {UPDATE_ENV}=1 rewrites it (docs/development.md).\n"
    )
    return intro + "".join("\n" + sections[name] for name in MODULES if name in sections)


def _missing(module_name: str) -> str | None:
    """The optional dependency ``module_name`` needs that is not installed, if any."""
    dependency = MODULES[module_name]
    if dependency is None:
        return None
    try:
        importlib.import_module(dependency)
    except ImportError:
        return dependency
    return None


def test_public_surface_matches_the_snapshot() -> None:
    stored = read_sections(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    current = dict(stored)
    skipped = []
    for module_name in MODULES:
        missing = _missing(module_name)
        if missing is None:
            current[module_name] = module_surface(module_name)
        else:
            skipped.append(f"{module_name} (needs {missing}, not installed)")
    current = {name: current[name] for name in MODULES if name in current}
    if os.environ.get(UPDATE_ENV) == "1":
        SNAPSHOT.write_text(write_sections(current))
        stored = current
    diff = "".join(
        difflib.unified_diff(
            write_sections(stored).splitlines(keepends=True),
            write_sections(current).splitlines(keepends=True),
            fromfile=str(SNAPSHOT.name),
            tofile="the package now",
        )
    )
    if diff:
        pytest.fail(
            "the public surface changed; if that is meant, rewrite the snapshot with\n"
            f"  {UPDATE_ENV}=1 python3 -m nox -R -s unit -- tests/test_public_surface.py\n"
            "and commit tests/public_surface.txt with the change (docs/development.md)\n\n" + diff,
            pytrace=False,
        )
    if skipped:
        pytest.skip("surface not checked for " + ", ".join(skipped))


def test_missing_module_sections_are_kept_and_reported() -> None:
    """Rewriting the file where an optional module cannot be imported keeps its stored
    section: the sections round-trip through the file's text unchanged."""
    text = SNAPSHOT.read_text()
    sections = read_sections(text)
    assert write_sections(sections) == text
    assert set(sections) <= set(MODULES)
    assert {"asyncsync", "asyncsync.backends", "asyncsync.blocking"} <= set(sections)


def test_surface_text_is_free_of_addresses_and_unordered_sets() -> None:
    """What the text prints for values an address or a hash seed would change."""
    sentinel = object()

    def f(a: int, b: Any = sentinel, c: frozenset[str] = frozenset({"b", "a", "c"})) -> None:
        return

    text = _signature(f)
    assert " at 0x" not in text
    assert "frozenset({'a', 'b', 'c'})" in text
    for module_name in MODULES:
        if _missing(module_name) is None:
            assert " at 0x" not in module_surface(module_name)
