"""Deprecated spellings kept for one release: each warns once per call site with a
`DeprecationWarning` naming its replacement (CHANGELOG.md lists them under Renamed and
Deprecated, and says when they go; `tests/test_deprecations.py` tests every one)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["module_getattr", "warn_deprecated"]

#: The release that removes every spelling deprecated in 0.2.0.
REMOVED_IN = "0.3.0"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in asyncsync {REMOVED_IN}; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def module_getattr(module: str, aliases: Mapping[str, tuple[str, Any]], name: str) -> Any:
    """A module ``__getattr__`` body: ``aliases`` maps an old name to (new name, object)."""
    if name in aliases:
        new, obj = aliases[name]
        warn_deprecated(f"{module}.{name}", f"{module}.{new}", stacklevel=4)
        return obj
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
