"""What code in user text uses of asyncsync, resolved statically (tests/test_docs.py).

`UserCode` walks a block's statements in order and follows the objects asyncsync hands
out: modules and names imported from asyncsync, instances made by calling its classes
(``az.Fleet(...)``, ``async with ... as fleet``, ``x = await stack.enter_async_context
(...)``, ``except az.PublishError as err``), and what methods and properties return, read
from their annotations (``report = await publisher.publish(...)`` is a `PublishReport`).
Where it knows the object, it checks each attribute used and each keyword argument
passed against the real object, with ``inspect``; where it does not (a function's
parameter, a loop variable, anything not from asyncsync) it checks nothing, so a miss
is a real mistake, never a guess.

An attribute exists when the class has it, annotates it (dataclass fields) or one of its
methods assigns ``self.<name>``. A keyword is accepted by a named parameter, by the keys
of an ``**options: Unpack[SomeTypedDict]``, or by an untyped ``**kwargs`` unless that is
named ``deprecated...`` (user text shows no deprecated spelling).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["UserCode"]


@dataclass(frozen=True)
class Instance:
    """An object of ``cls`` (asyncsync's or not: only asyncsync's are checked)."""

    cls: type


@dataclass(frozen=True)
class Method:
    """A function reached through a class or an instance (``owner``: its ``Self``)."""

    owner: type | None
    fn: Callable[..., Any]


def ours(obj: object) -> bool:
    """Whether ``obj`` (a module, class or function) is asyncsync's."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return isinstance(name, str) and name.split(".")[0] == "asyncsync"


@cache
def _assigned_by_methods(cls: type) -> frozenset[str]:
    """Every ``self.<name> = ...`` in the methods of ``cls`` and its asyncsync bases (read
    per function: a class whose ``__module__`` says ``asyncsync`` lives elsewhere)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not ours(klass):
            continue
        for member in vars(klass).values():
            fn = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            if not inspect.isfunction(fn):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                continue
            names.update(
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            )
    return frozenset(names)


def has_attribute(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    if any("__getattr__" in vars(klass) for klass in cls.__mro__ if klass is not object):
        return True
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}) or name in (
            vars(klass).get("__slots__") or ()
        ):
            return True
    return name in _assigned_by_methods(cls)


def _hints(obj: object) -> dict[str, Any]:
    """``obj``'s evaluated annotations (empty where they cannot be evaluated)."""
    try:
        return typing.get_type_hints(inspect.unwrap(obj), include_extras=True)  # type: ignore[arg-type]
    except Exception:  # a name imported only for type checking, a forward reference
        return {}


def _value_of(hint: Any, owner: type | None) -> Instance | None:
    """The object an annotation promises, where it is one class."""
    if hint is typing.Self:
        return Instance(owner) if owner is not None else None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None: an X where there is one
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value_of(rest[0], owner) if len(rest) == 1 else None
    if origin is typing.Annotated:
        return _value_of(typing.get_args(hint)[0], owner)
    if isinstance(origin, type):  # FleetResult[int], list[Completion]
        return Instance(origin)
    if isinstance(hint, type) and hint is not type(None):
        return Instance(hint)
    return None


def _protocol_value(value: Any, method: str) -> Any:
    """What ``await value`` (``method="__await__"``) or ``with value as x`` gives, for an
    instance of one of asyncsync's classes that annotates that method with another
    class (``Launch.__aenter__ -> ServerGroup``, ``__await__ -> Generator[..., ServerGroup]``);
    else ``value`` itself (an async method's result, or ``__aenter__`` returning self)."""
    if not isinstance(value, Instance) or not ours(value.cls):
        return value
    fn = vars(value.cls).get(method)
    hint = _hints(fn).get("return") if fn is not None else None
    if method == "__await__" and typing.get_origin(hint) is not None:
        args = typing.get_args(hint)  # Generator[yield, send, result]
        hint = args[-1] if len(args) == 3 else None
    found = _value_of(hint, value.cls) if hint is not None else None
    return found if found is not None else value


class UserCode:
    """Resolve one text's code blocks, in order (names carry over from block to block,
    as a reader carries them), collecting what does not exist in `problems`.

    Args:
        names: what every block may use unimported (``{"az": asyncsync}``).
    """

    def __init__(self, names: dict[str, Any]) -> None:
        self.env: dict[str, Any] = dict(names)
        #: What does not exist, by where it is used: ``(where, line, what)``.
        self.problems: dict[tuple[str, int, str], None] = {}  # ordered, without repeats
        #: Where the code being run comes from (the caller sets it per block).
        self.where = ""

    def _problem(self, node: ast.AST, text: str) -> None:
        self.problems[(self.where, getattr(node, "lineno", 0), text)] = None

    # ------------------------------------------------------------------ expressions
    def value(self, node: ast.AST) -> Any:
        """What ``node`` evaluates to, as far as known (None: unknown)."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Await):  # an async method's annotation is the result's,
            return _protocol_value(self.value(node.value), "__await__")  # or __await__'s
        if isinstance(node, ast.Attribute):
            return self._attribute(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def check(self, node: ast.AST) -> None:
        """Resolve every attribute and call inside ``node``."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call | ast.Attribute):
                self.value(sub)

    def _attribute(self, node: ast.Attribute) -> Any:
        base, name = self.value(node.value), node.attr
        if isinstance(base, types.ModuleType):
            if hasattr(base, name):
                return getattr(base, name)
            try:
                return importlib.import_module(f"{base.__name__}.{name}")
            except ImportError:  # not a submodule, or one whose extra is not installed
                if ours(base) and importlib.util.find_spec(f"{base.__name__}.{name}") is None:
                    self._problem(node, f"{base.__name__}.{name} does not exist")
                return None
        if isinstance(base, type | Instance):
            cls = base if isinstance(base, type) else base.cls
            if not has_attribute(cls, name):
                if ours(cls):
                    if isinstance(base, type):
                        self._problem(node, f"{cls.__qualname__} has no attribute {name!r}")
                    else:
                        self._problem(node, f"{cls.__name__} objects have no attribute {name!r}")
                return None
            return self._member(cls, name, on_class=isinstance(base, type))
        return None

    def _member(self, cls: type, name: str, *, on_class: bool) -> Any:
        try:
            raw = inspect.getattr_static(cls, name)
        except AttributeError:  # an instance attribute: its annotation, where it has one
            return None if on_class else _value_of(_hints(cls).get(name), cls)
        if isinstance(raw, classmethod | staticmethod):
            return Method(cls, getattr(cls, name))
        if isinstance(raw, property):
            if on_class or raw.fget is None:
                return None
            return _value_of(_hints(raw.fget).get("return"), cls)
        if isinstance(raw, type):
            return raw
        if callable(raw):
            return Method(None if on_class else cls, getattr(cls, name))
        return None if on_class else _value_of(_hints(cls).get(name), cls)

    def _call(self, node: ast.Call) -> Any:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in {"enter_context", "enter_async_context"}
            and node.args
        ):
            self.value(func.value)
            return self.value(node.args[0])  # contextlib's stacks hand back what they enter
        target = self.value(func)
        if isinstance(target, type):
            if ours(target):
                self._keywords(node, target, target.__init__)
            return Instance(target)
        if isinstance(target, Method):
            if ours(target.fn):
                self._keywords(node, target.fn, target.fn)
            return _value_of(_hints(target.fn).get("return"), target.owner)
        if callable(target) and not isinstance(target, Instance):
            if ours(target):
                self._keywords(node, target, target)
            return _value_of(_hints(target).get("return"), None)
        return None

    def _keywords(self, node: ast.Call, callee: Any, annotated: Any) -> None:
        try:
            params = inspect.signature(callee).parameters
        except (TypeError, ValueError):
            return
        spread = next((p for p in params.values() if p.kind is p.VAR_KEYWORD), None)
        options: set[str] | None = None
        if spread is not None:
            args = typing.get_args(_hints(annotated).get(spread.name))
            if args and typing.is_typeddict(args[0]):
                options = set(typing.get_type_hints(args[0]))
        name = getattr(callee, "__qualname__", repr(callee))
        named = {
            p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        for kw in node.keywords:
            if kw.arg is None or kw.arg in named:  # **spread, or a parameter
                continue
            if spread is None:
                self._problem(node, f"{name}() takes no keyword {kw.arg!r}")
            elif options is not None and kw.arg not in options:
                self._problem(node, f"{name}() takes no option {kw.arg!r}")
            elif options is None and spread.name.startswith("deprecated"):
                self._problem(node, f"{name}({kw.arg}=...) is a deprecated spelling")

    # ------------------------------------------------------------------ statements
    def run(self, statements: Iterable[ast.stmt]) -> None:
        for statement in statements:
            self._statement(statement)

    def _bind(self, target: ast.AST, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
            for element in ast.walk(target):
                if isinstance(element, ast.Name):
                    self.env[element.id] = None

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            if isinstance(node, ast.Import):
                bound = alias.asname or alias.name.split(".")[0]
                module_name = alias.name if alias.asname else bound
                member = None
            else:
                bound, module_name, member = alias.asname or alias.name, node.module, alias.name
            self.env[bound] = None
            if not module_name or module_name.split(".")[0] != "asyncsync":
                continue
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an extra that is not installed (asyncsync.ray)
                continue
            if member is None:
                self.env[bound] = module
            elif hasattr(module, member):
                self.env[bound] = getattr(module, member)
            elif importlib.util.find_spec(f"{module_name}.{member}") is None:
                self._problem(node, f"{module_name} has no {member}")

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            self._import(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            if node.value is not None:
                self.check(node.value)
            value = None
            if node.value is not None and not isinstance(node, ast.AugAssign):
                value = self.value(node.value)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self._bind(target, value)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                self.check(item.context_expr)
                if item.optional_vars is not None:  # what __aenter__ / __enter__ returns
                    enter = "__aenter__" if isinstance(node, ast.AsyncWith) else "__enter__"
                    value = self.value(item.context_expr)
                    self._bind(item.optional_vars, _protocol_value(value, enter))
            self.run(node.body)
        elif isinstance(node, ast.For | ast.AsyncFor):
            self.check(node.iter)
            self._bind(node.target, None)
            self.run(node.body)
            self.run(node.orelse)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for decorator in node.decorator_list:
                self.check(decorator)
            outer = dict(self.env)
            if not isinstance(node, ast.ClassDef):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                            args.kwarg]:  # fmt: skip
                    if arg is not None:
                        self.env[arg.arg] = None
            self.run(node.body)
            self.env = outer
            self.env[node.name] = None
        elif isinstance(node, ast.If | ast.While):
            self.check(node.test)
            self.run(node.body)
            self.run(node.orelse)
        elif isinstance(node, ast.Try | ast.TryStar):
            self.run(node.body)
            for handler in node.handlers:
                caught = self.value(handler.type) if handler.type is not None else None
                if handler.name:  # except*: an ExceptionGroup of them
                    star = isinstance(node, ast.TryStar)
                    bound = Instance(caught) if isinstance(caught, type) and not star else None
                    self.env[handler.name] = bound
                self.run(handler.body)
            self.run(node.orelse)
            self.run(node.finalbody)
        else:
            self.check(node)
