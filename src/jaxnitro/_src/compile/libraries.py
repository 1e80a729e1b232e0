"""Which code is the user's and which a library's, and how objects are named in digests.

Library code (jax, numpy, optax, flax, equinox, jaxnitro itself, the standard library, anything
installed in site-packages) cannot change within a process, so fingerprints hash it by name;
user code (a script, a notebook cell, a file of the project) by content.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["is_library_class", "is_user_function"]

# Top-level packages whose functions, classes and modules are hashed by name only.
_LIBRARY_ROOTS = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "optax",
        "flax",
        "equinox",
        "builtins",
        "functools",
        "typing",
        "math",
        "jaxnitro",
    }
)
# Installed and standard-library code, recognised by where its file lives. Code exec'd from a
# string or a notebook cell lives in none of these, so it is always user code.
_LIBRARY_DIRS = tuple(
    sorted(
        {
            os.path.join(p, "")
            for k, p in sysconfig.get_paths().items()
            if k in ("purelib", "platlib", "stdlib", "platstdlib")
        }
    )
) + ("<frozen ",)

_FUNCTION_TYPES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    functools.partialmethod,
    classmethod,
    staticmethod,
    np.ufunc,
)


def _wrapped(obj: Any) -> Callable[..., Any] | None:
    """The callable a decorator wrapped (functools.wraps, jax.jit, custom_jvp), or None.

    Only the instance dict is read: `getattr` on an object with a permissive `__getattr__`
    (a mock, a proxy) would hand back an endless chain of new wrappers.
    """
    try:
        inner = vars(obj).get("__wrapped__")
    except TypeError:  # no instance namespace: vars() has nothing to read
        return None
    return inner if callable(inner) and inner is not obj else None


def _is_function_like(v: Any) -> bool:
    """Hashed through `callable_` when met as a value; other callables count as objects."""
    return not isinstance(v, type) and (
        isinstance(v, _FUNCTION_TYPES) or (callable(v) and _wrapped(v) is not None)
    )


def is_user_function(obj: Any) -> bool:
    """Whether `obj` is a function (or a partial of one) of user code, not of a library."""
    while isinstance(obj, (functools.partial, functools.partialmethod)):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)
    return isinstance(obj, types.FunctionType) and not _is_library(obj)


def _is_library(fn: types.FunctionType) -> bool:
    module = fn.__module__
    if module and module.partition(".")[0] in _LIBRARY_ROOTS:
        return True
    return fn.__code__.co_filename.startswith(_LIBRARY_DIRS)


def _is_library_module(mod: types.ModuleType) -> bool:
    name = getattr(mod, "__name__", None) or ""
    if not isinstance(name, str):
        return False
    if name.partition(".")[0] in _LIBRARY_ROOTS or name in sys.builtin_module_names:
        return True
    file = getattr(mod, "__file__", None)
    if not isinstance(file, str):  # built-in, frozen, or made at run time (types.ModuleType)
        return getattr(getattr(mod, "__spec__", None), "origin", None) in ("built-in", "frozen")
    return file.startswith(_LIBRARY_DIRS)


_library_classes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: set for classes made by a class statement


def is_library_class(cls: type) -> bool:
    """By its package, else by the module it names: a class of a module in site-packages or
    the standard library is library code; one of "__main__" (a script or notebook, even where
    "__main__" names a launcher inside site-packages), of a user file, or of source exec'd
    into a namespace no module holds, is user code. Types written in C are library code."""
    try:
        return _library_classes[cls]
    except (KeyError, TypeError):
        pass
    module = getattr(cls, "__module__", None)
    module = module if isinstance(module, str) else ""
    mod = sys.modules.get(module)
    result = (
        module.partition(".")[0] in _LIBRARY_ROOTS
        or not cls.__flags__ & _HEAPTYPE
        or (module != "__main__" and isinstance(mod, types.ModuleType) and _is_library_module(mod))
    )
    try:
        _library_classes[cls] = result
    except TypeError:
        pass
    return result


def _names(obj: Any) -> tuple[str, str]:
    """(module, qualname), falling back on the type for objects without their own."""
    module = getattr(obj, "__module__", None) or ""
    qualname = (
        getattr(obj, "__qualname__", None)
        or getattr(obj, "__name__", None)
        or type(obj).__qualname__
    )
    return str(module), str(qualname)


def _qualified(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _type_name(obj: Any) -> str:
    return _qualified(type(obj))
