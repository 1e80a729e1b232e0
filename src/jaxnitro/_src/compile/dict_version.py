"""Whether a dict changed since it was last looked at, in one read: CPython's dict version.

CPython 3.11 to 3.13 keep in every dict a 64-bit version (PEP 509's `ma_version_tag`) that
each insertion, deletion, clear or change of a value moves to a number no dict had before.
A guard that runs on every call of a hot path (`remembered`'s code checks, `context`'s
environment check) reads it instead of repeating its lookups: one load, however many keys
it looked up. Equal versions prove the dict unchanged; a moved version proves nothing (the
dict may have been set and set back): the caller then makes its lookups, and remembers the
new version where they hold. TorchDynamo's guards use the same field for the same purpose.

The field is read through `ctypes` at its offset. `tag` gives a reader only where a check at
first use shows that this interpreter keeps the field there and moves it as described;
elsewhere (another Python, a free-threaded build, a version without the field) it gives None
and callers compare the contents, as they would without it.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import sysconfig
import types
from typing import Any

__all__ = ["tag", "underlying"]

# PyDictObject: ob_refcnt, ob_type, ma_used (Py_ssize_t), ma_version_tag (uint64), ...
_USED, _VERSION = 16, 24
_works: list[bool] = []  # the self-test's answer, once


def tag(mapping: Any) -> ctypes.c_uint64 | None:
    """A reader of `mapping`'s version (`.value`, an int), or None where it has none that can
    be read here. `mapping` is a dict or a class namespace's `mappingproxy` (its dict is
    read); the caller keeps `mapping` alive while it reads the tag.

    Example:
        >>> d = {"a": 1}
        >>> t = tag(d)
        >>> before = t.value if t is not None else None
        >>> d["a"] = 2
        >>> t is None or t.value != before
        True
    """
    target = underlying(mapping)
    if target is None or not _supported():
        return None
    return ctypes.c_uint64.from_address(id(target) + _VERSION)


def underlying(mapping: Any) -> dict | None:
    """The dict itself of a dict (not a subclass: it may override what changes it) or of a
    `mappingproxy` over one (a class's `__dict__`); None for anything else."""
    if type(mapping) is dict:
        return mapping
    if type(mapping) is types.MappingProxyType:
        inner = gc.get_referents(mapping)
        if len(inner) == 1 and type(inner[0]) is dict:
            return inner[0]
    return None


def _supported() -> bool:
    if not _works:
        _works.append(_self_test())
    return _works[0]


def _self_test() -> bool:
    """This interpreter keeps a dict's size and version where `_USED` and `_VERSION` say,
    and every kind of change moves the version (while reading it alone does not)."""
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return False
    if sysconfig.get_config_var("Py_GIL_DISABLED"):  # another object header
        return False
    d: dict = {}
    used = ctypes.c_ssize_t.from_address(id(d) + _USED)
    version = ctypes.c_uint64.from_address(id(d) + _VERSION)
    seen = [version.value]

    def moved() -> bool:
        now = version.value
        fresh = now not in seen
        seen.append(now)
        return fresh and version.value == now  # (a second read leaves it)

    changes = (
        lambda: d.__setitem__("a", object()),  # insert
        lambda: d.__setitem__("a", object()),  # another value
        lambda: d.update(b=1),
        lambda: d.setdefault("c", 2),
        lambda: d.pop("c"),
        lambda: d.__delitem__("b"),
        lambda: d.popitem(),
        lambda: d.update(x=1, y=2),
        lambda: d.clear(),
    )
    for change in changes:
        change()
        if used.value != len(d) or not moved():
            return False

    class Probe:
        pass

    namespace = underlying(Probe.__dict__)
    if namespace is None:
        return False
    version = ctypes.c_uint64.from_address(id(namespace) + _VERSION)
    seen = [version.value]
    Probe.attr = 1  # type: ignore[attr-defined]
    return moved()
