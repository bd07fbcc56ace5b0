"""Griffe extensions for the API reference (loaded by ``mkdocs.yml``'s mkdocstrings
options): `RouteDocstrings`, `BlockingFacades`, `CommentDocstrings` and `LiteralBlocks`.

**RouteDocstrings.** The control route methods of `AsyncVLLMClient` and `Fleet` take
their docstring from the routes' table at import time::

    @routes.PAUSE.describes
    async def pause(self, mode: PauseMode | None = None, ...) -> None: ...

Static analysis sees a method without a docstring. This extension reads the ``doc=``
string of the table entry the decorator names (``PAUSE = Route(..., doc="...")`` in
`asyncsync._wire.routes`) and gives it to the method, as ``describes`` does at runtime;
it runs before `BlockingFacades`, which copies it on to the blocking facades.

**BlockingFacades.** `asyncsync.blocking` builds most facade methods at import time from
the async classes::

    generate = blocking_method(az.Fleet.generate)
    stream = wrapping_method(az.Fleet.stream, CompletionStream._adopt)

Static analysis (griffe, which mkdocstrings uses) sees class attributes whose value is a
call, not methods, so the API reference would leave them out. This extension replaces
each such attribute with a copy of the async method's griffe model, which is what the
helpers do at runtime (``functools.update_wrapper``): same parameters, overloads and
docstring, without the ``async`` label; a ``wrapping_method`` returns the facade class
its ``wrap`` argument belongs to (``CompletionStream._adopt`` -> ``CompletionStream``).

Nothing is imported and nothing is copied by hand: a method added to the async class
and to the facade with one of the helpers appears in the reference with the async
method's docstring. ``tests/test_docs.py`` compares the rendered page with the runtime
classes (every public method, every parameter), so the two cannot drift apart.

**CommentDocstrings.** A module constant documented the Sphinx way, by ``#:`` comment
lines right above it (``asyncsync.testing.FLOAT32_TOLERANCE``), gets those lines as its
docstring; griffe reads only string literals below an assignment.

**LiteralBlocks.** The package's docstrings show code the reST way (a paragraph ending in
``::``, then an indented block), which ``help()`` and IDEs read well; the site renders
Markdown, where that is a stray ``::`` and an indented paragraph. Each such block becomes
a fenced code block (Python when it parses as Python) on the site only.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

import griffe

#: The package, its facade module and the helpers in `asyncsync._core.portal` that
#: generate the facade's methods.
PACKAGE = "asyncsync"
FACADES = "blocking"
HELPERS = {
    f"asyncsync._core.portal.{name}"
    for name in ("blocking_method", "loop_method", "wrapping_method")
}
WRAPPING = "asyncsync._core.portal.wrapping_method"


ROUTES_MODULE = "asyncsync._wire.routes"
DESCRIBES = "describes"


class RouteDocstrings(griffe.Extension):
    """``@routes.X.describes`` methods get the ``doc`` of table entry ``X``."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **_: Any) -> None:
        if pkg.path != PACKAGE:
            return
        for module in _modules(pkg):
            for cls in module.classes.values():
                for member in cls.members.values():
                    if not member.is_alias and member.is_function:
                        self._describe(member, loader)

    def _describe(self, method: griffe.Function, loader: griffe.GriffeLoader) -> None:
        for decorator in method.decorators:
            path = getattr(decorator.value, "canonical_path", "")
            entry, _, last = path.rpartition(".")
            if last != DESCRIBES or not entry.startswith(ROUTES_MODULE + "."):
                continue
            doc = _route_doc(entry, loader)
            if doc is None:
                raise griffe.GriffeError(f"{method.path}: no doc= string in route {entry}")
            method.docstring = griffe.Docstring(
                inspect.cleandoc(doc),
                lineno=method.lineno,
                endlineno=method.lineno,
                parent=method,
            )


def _modules(module: griffe.Module) -> list[griffe.Module]:
    """``module`` and its submodules, all levels down."""
    found = [module]
    for sub in module.modules.values():
        if not sub.is_alias:
            found += _modules(sub)
    return found


def _route_doc(entry: str, loader: griffe.GriffeLoader) -> str | None:
    """The ``doc=`` string literal of the table entry at path ``entry``."""
    parts = entry.split(".")
    try:
        obj: Any = loader.modules_collection[parts[0]]
        for part in parts[1:]:
            obj = obj.members[part]
    except KeyError:
        return None
    call = getattr(obj, "value", None)
    if not isinstance(call, griffe.ExprCall):
        return None
    for argument in call.arguments:
        if isinstance(argument, griffe.ExprKeyword) and argument.name == "doc":
            value = ast.literal_eval(str(argument.value))
            return value if isinstance(value, str) else None
    return None


class BlockingFacades(griffe.Extension):
    """Turns ``name = <helper>(az.X.name, ...)`` class attributes of `asyncsync.blocking`
    into documented methods."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **_: Any) -> None:
        if pkg.path != PACKAGE or FACADES not in pkg.members:
            return
        module = pkg[FACADES]
        for cls in module.classes.values():
            for name, member in list(cls.members.items()):
                if member.is_alias or not member.is_attribute:
                    continue
                method = self._generated(member, loader)
                if method is not None:
                    cls.set_member(name, method)

    def _generated(self, attr: griffe.Attribute, loader: griffe.GriffeLoader) -> Any:
        call = attr.value
        if not isinstance(call, griffe.ExprCall) or not call.arguments:
            return None
        helper = call.function
        if not isinstance(helper, griffe.ExprName | griffe.ExprAttribute):
            return None
        if helper.canonical_path not in HELPERS:
            return None
        source = _resolve(call.arguments[0], loader)
        if source is None or not source.is_function:
            raise griffe.GriffeError(
                f"{attr.path}: cannot find the async method {call.arguments[0]} it wraps"
            )
        returns = None
        if helper.canonical_path == WRAPPING and len(call.arguments) > 1:
            returns = _facade_of(call.arguments[1], attr)
        method = _copy(source, attr, returns)
        if source.overloads:
            method.overloads = [_copy(o, attr, returns) for o in source.overloads]
        return method


def _resolve(expr: Any, loader: griffe.GriffeLoader) -> Any:
    """The griffe object an expression such as ``az.Fleet.generate`` names (aliases
    followed; a class's inherited members included: `Fleet` gets its control methods
    from a base class)."""
    path = getattr(expr, "canonical_path", None)
    if not path:
        return None
    parts = path.split(".")
    try:
        obj: Any = loader.modules_collection[parts[0]]
        for part in parts[1:]:
            obj = obj.final_target if obj.is_alias else obj
            obj = (obj.all_members if obj.is_class else obj.members)[part]
        return obj.final_target if obj.is_alias else obj
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _facade_of(wrap: Any, attr: griffe.Attribute) -> griffe.Expr | str | None:
    """``CompletionStream._adopt`` -> the name ``CompletionStream`` in the facade module."""
    if isinstance(wrap, griffe.ExprAttribute) and wrap.last.name == "_adopt":
        owner = wrap.values[-2]
        if isinstance(owner, griffe.ExprName):
            return griffe.ExprName(owner.name, parent=attr.module)
    return None


def _copy(
    source: griffe.Function,
    attr: griffe.Attribute,
    returns: griffe.Expr | str | None,
) -> griffe.Function:
    """The async ``source`` as a plain method named like ``attr``, placed where it is."""
    parameters = griffe.Parameters(
        *(
            griffe.Parameter(
                p.name, annotation=p.annotation, kind=p.kind, default=p.default,
                docstring=p.docstring,
            )
            for p in source.parameters
        )
    )  # fmt: skip
    method = griffe.Function(
        attr.name,
        lineno=attr.lineno,
        endlineno=attr.endlineno,
        parameters=parameters,
        returns=returns if returns is not None else source.returns,
        parent=attr.parent,
        analysis="static",
    )
    method.labels = set(source.labels) - {"async"}
    if source.docstring is not None:
        method.docstring = griffe.Docstring(
            source.docstring.value,
            lineno=source.docstring.lineno,
            endlineno=source.docstring.endlineno,
            parent=method,
            parser=source.docstring.parser,
            parser_options=source.docstring.parser_options,
        )
    return method


class CommentDocstrings(griffe.Extension):
    """``#:`` comments above a module-level assignment become its docstring."""

    def on_attribute(self, *, attr: griffe.Attribute, **_: Any) -> None:
        if attr.docstring is not None or not attr.parent or not attr.parent.is_module:
            return
        if attr.lineno is None or not attr.path.startswith(PACKAGE + "."):
            return
        lines = attr.parent.lines  # the module's source lines
        start = attr.lineno - 1
        while start > 0 and lines[start - 1].lstrip().startswith("#:"):
            start -= 1
        comment = [
            line.strip().removeprefix("#:").strip() for line in lines[start : attr.lineno - 1]
        ]
        if comment:
            attr.docstring = griffe.Docstring(
                "\n".join(comment), lineno=start + 1, endlineno=attr.lineno - 1, parent=attr
            )


class LiteralBlocks(griffe.Extension):
    """reST literal blocks (``text::`` + an indented block) become fenced code blocks."""

    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None and "::" in obj.docstring.value:
            obj.docstring.value = fence_literal_blocks(obj.docstring.value)


_LITERAL_INTRO = re.compile(r"^(?P<indent>\s*)(?P<text>.*?)(?P<sep>\s?)::\s*$")


def fence_literal_blocks(text: str) -> str:
    """reST literal blocks in ``text`` as Markdown fences: ``Run it::`` -> ``Run it:``,
    a line ``::`` alone disappears, and the indented block after it is fenced."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        intro = _LITERAL_INTRO.match(lines[i])
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        base = len(intro["indent"]) if intro else 0
        if intro is None or j == len(lines) or _indent(lines[j]) <= base:
            out.append(lines[i])
            i += 1
            continue
        body_end = j
        while body_end < len(lines) and (
            not lines[body_end].strip() or _indent(lines[body_end]) > base
        ):
            body_end += 1
        while not lines[body_end - 1].strip():
            body_end -= 1
        if intro["text"]:
            colon = ":" if intro["sep"] == "" else ""
            out += [intro["indent"] + intro["text"] + colon, ""]
        code = textwrap.dedent("\n".join(lines[j:body_end]))
        out += [
            intro["indent"] + line if line else line
            for line in [f"```{_language(code)}", *code.splitlines(), "```"]
        ]
        i = body_end
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(code: str) -> str:
    """``python`` for code that parses (top-level ``await`` and ``async with`` do: the
    parser leaves those checks to the compiler), else ``text``."""
    try:
        ast.parse(code)
    except SyntaxError:
        return "text"
    return "python"
