"""Registrations of callbacks (`jn.every`, `jn.on_phase`): each returns a remover, and a
process-wide one replaces an earlier one of the same definition (a notebook cell run again)
instead of stacking on it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def _site(fn: Callable) -> tuple | None:
    """Where `fn` was defined (file, line, name), or None (a builtin, a callable object)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_filename, code.co_firstlineno, getattr(fn, "__qualname__", "")


def add(entries: list, entry: Any, fn: Callable, *, replace_same_site: bool) -> Callable[[], None]:
    """Append `entry` (which holds `fn`) to `entries`; returns `remove()`, which takes it out
    again (once; a second call does nothing). With `replace_same_site`, an earlier entry whose
    function was defined at the same place as `fn` is taken out first."""
    site = _site(fn) if replace_same_site else None
    if site is not None:
        entries[:] = [e for e in entries if _site(_fn_of(e)) != site]
    entries.append(entry)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            entries.remove(entry)

    return remove


def _fn_of(entry: Any) -> Callable:
    return entry[-1] if isinstance(entry, tuple) else entry
