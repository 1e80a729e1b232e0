"""Content fingerprints of user hooks, so a cached XLA program is never silently stale.

The program cache is process-wide and its keys include `fingerprint(hook)` for every hook
traced into a program. The fingerprint covers what the traced behaviour depends on: the
bytecode and constants, defaults, closure cells, the module-level values the code loads as
globals, the attributes it reads from user modules (`losses.penalty`, `cfg.SCALE`,
`pkg.sub.fn`), the user classes it uses (by their methods and class-level values), and (to
`depth` levels) the user helpers it calls. It leaves out file names and line numbers, so an
identical re-definition (a notebook cell re-run) hits the cache and any edit misses it.

Only names the bytecode loads as globals (LOAD_GLOBAL, and LOAD_NAME in class bodies) are
looked up in the module: an attribute read such as `self.tol` never depends on a module-level
`tol`. A global (or closure cell) holding a user module is followed through the attribute
reads that come right after it, so editing `losses.py` and reloading it is seen; what is read
there counts like a global of the reader (a function one level down, a value by content).

A user class the code loads and uses as such (instantiates, passes on) is hashed by content:
the functions in its own namespace (`vars(cls)`) one level down, its class-level values, its
user bases. A class the code only reads attributes from (`Cfg.SCALE`, a parent hook
`Base.loss(self, x)`, `super().loss(x)`) contributes those attributes alone, so an edit
elsewhere in that class does not recompile. An object of a user class hashed by identity
carries its class's digest, so a method patched onto the class is seen.

Library code (jax, numpy, optax, flax, equinox, jaxnitro itself, the standard library,
anything installed in site-packages) cannot change within a process, so it is hashed by name.
A library *closure* is still hashed by content: its cells are where per-instance values live
(the learning rate of `optax.adam(1e-3)` sits in a closure cell of its update function).

Objects that cannot be hashed by content are hashed by identity, through a token that is
never reused by a later object (unlike `id()`), so a new object always means a new key.
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import enum
import functools
import hashlib
import itertools
import os
import sys
import sysconfig
import types
import typing
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigArgumentError

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = [
    "MAX_ARRAY_BYTES",
    "describe_reach",
    "fingerprint",
    "fingerprint_value",
    "is_library_class",
    "is_user_function",
]

#: Arrays up to this many bytes are hashed by content; bigger ones by dtype, shape and identity.
MAX_ARRAY_BYTES = 16 * 2**20

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

_TRACER = getattr(jax.core, "Tracer", ())
_SCALARS = (type(None), bool, int, float, complex, str, bytes, types.EllipsisType)
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

# Opcodes that read a module-level name (LOAD_NAME: class bodies and module code), read a
# closure cell, and read an attribute of what is on top of the stack.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_DEREF_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_MAX_CHAIN = 4  # `a.b.c.d.e`: attributes followed after the global


class _Plain:
    """An empty class: its namespace holds only what every class statement adds."""


# Class-namespace entries that are bookkeeping of the class machinery, not behaviour: the
# generated methods they describe (a dataclass __init__, __eq__) are hashed themselves. An
# empty class's own entries (the instance-namespace and weakref descriptors, ...) are among
# them.
_CLASS_SKIP = frozenset(vars(_Plain)) | frozenset(
    {
        "__weakref__",
        "__module__",
        "__qualname__",
        "__doc__",
        "__annotations__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__orig_bases__",
        "__parameters__",
        "_abc_impl",
        "__firstlineno__",
        "__static_attributes__",
    }
)


# What `functools.update_wrapper` copies onto a wrapper, and the wrapped callable itself
# (hashed on its own): naming, not behaviour.
_WRAPPER_SKIP = frozenset(functools.WRAPPER_ASSIGNMENTS) | {"__wrapped__", "__dict__"}


def fingerprint(obj: Any, *, depth: int = 2) -> str:
    """Hex digest (sha256) of what a callable's behaviour depends on.

    `depth` is how many levels of helpers below `obj` have their code hashed: `obj`'s own
    code always is, helpers it reaches are hashed with `depth - 1`, and below zero a helper
    counts by module + qualname only. The instance behind a bound method is not hashed
    (the caller keys `self` itself).

    Example:
        >>> def loss(x):
        ...     return (x**2).sum()
        >>> fingerprint(loss) == fingerprint(loss), len(fingerprint(loss))
        (True, 64)
    """
    if not (callable(obj) or isinstance(obj, (classmethod, functools.partialmethod))):
        # (classmethod and partialmethod objects are not callable themselves)
        raise ConfigArgumentError(
            f"fingerprint() takes a callable, got {type(obj).__qualname__}; "
            f"use fingerprint_value() for plain values"
        )
    return _Hasher().callable_(obj, depth)


def describe_reach(obj: Any, *, depth: int = 2) -> dict[str, str]:
    """name -> per-item digest of everything `fingerprint(obj, depth=depth)` covered.

    Functions appear under their qualname with a digest of their *own* code, defaults and
    name (not of what they reach), user classes under their qualname (name, bases and
    attribute names; their methods appear as functions), module-level values as
    ``global:<name>``, attributes read from a user module as ``global:<module>.<name>``,
    class-level values as ``global:<Class>.<name>`` and closure cells as
    ``closure:<name>``; a name that two different owners would share is qualified with the
    module or function. Diffing two results names exactly what changed.

    Example:
        >>> SCALE = 1.0
        >>> def loss(x):
        ...     return (x**2).sum() * SCALE
        >>> before = describe_reach(loss)
        >>> SCALE = 2.0
        >>> sorted(k for k, v in describe_reach(loss).items() if before.get(k) != v)
        ['global:SCALE']
    """
    hasher = _Hasher()
    hasher.callable_(obj, depth)
    return dict(hasher.reach)


@typing.overload
def fingerprint_value(value: Any, *, strict: typing.Literal[True] = ...) -> str | None: ...
@typing.overload
def fingerprint_value(value: Any, *, strict: typing.Literal[False]) -> str: ...


def fingerprint_value(value: Any, *, strict: bool = True) -> str | None:
    """Digest of a plain value, or None when it cannot be fingerprinted by content.

    Covers scalars, str/bytes, tuples/lists/dicts/sets (recursively), numpy and jax arrays
    (dtype, shape and bytes; above `MAX_ARRAY_BYTES` dtype, shape and identity), numpy
    dtypes, enums, dataclass instances (type and fields), modules (by name), classes (user
    classes by content, library classes by name) and functions (as `fingerprint`).
    Arbitrary objects give None, or with `strict=False` a digest of their identity (a new
    object, a new digest).

    Example:
        >>> fingerprint_value((1, "a")) == fingerprint_value((1, "a"))
        True
        >>> fingerprint_value(object()) is None
        True
    """
    return _Hasher().value(value, 2, strict=strict)


def _h(*parts: str | bytes) -> str:
    """sha256 of the parts, so ("ab", "c") and ("a", "bc") differ: the repr of a tuple of
    str and bytes quotes each one, so it reads back as exactly these parts (and costs one
    C call, not a Python loop: this runs a few hundred times per fingerprint)."""
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()


class _Hasher:
    """One traversal. The memo, cycle guard and reach table live for a single call only,
    since globals and closure cells may change between calls."""

    def __init__(self) -> None:
        self.reach: dict[str, str] = {}
        self._owners: dict[str, object] = {}
        self._memo: dict[tuple[int, int], tuple[object, str]] = {}
        self._containers: dict[tuple[int, int, bool], tuple[object, str | None]] = {}
        self._active: set[Hashable] = set()

    # -- callables ------------------------------------------------------------------------

    def callable_(self, obj: Any, depth: int) -> str:
        """Digest of a callable of any kind: unwrap it, then hash the function underneath."""
        key = (id(obj), depth)
        if (hit := self._memo.get(key)) is not None:
            return hit[1]
        if id(obj) in self._active:  # recursion (f -> f, f -> g -> f): name it, don't descend
            return _h("cycle", *_names(obj))
        self._active.add(id(obj))
        try:
            digest = self._unwrap(obj, depth)
        finally:
            self._active.discard(id(obj))
        self._memo[key] = (obj, digest)  # holding obj keeps its id from being reused mid-call
        return digest

    def _unwrap(self, obj: Any, depth: int) -> str:
        if isinstance(obj, (functools.partial, functools.partialmethod)):
            args = self.value((obj.args, obj.keywords), depth - 1, strict=False)
            self._record(args, obj, f"partial:{_names(obj.func)[1]}")
            return _h("partial", self.callable_(obj.func, depth), args)
        if isinstance(obj, (types.MethodType, classmethod, staticmethod)):
            return self.callable_(obj.__func__, depth)
        if (inner := _wrapped(obj)) is not None:
            # Follow the decorator to the user's function, but keep the wrapper too: a user
            # decorator that scales the loss is as much a part of it as the body is.
            outer = (
                self._function(obj, depth)
                if isinstance(obj, types.FunctionType)
                else self._wrapper(obj, depth)
            )
            return _h("wrapped", outer, self.callable_(inner, depth))
        if isinstance(obj, types.FunctionType):
            return self._function(obj, depth)
        call = getattr(type(obj), "__call__", None)  # noqa: B004 (we want the function itself)
        if not isinstance(obj, type) and (
            isinstance(call, types.FunctionType) or _wrapped(call) is not None
        ):
            # __call__ at full depth, and the rest of a user class (the methods it calls
            # through `self`) one level down.
            return _h(
                "object",
                _type_name(obj),
                self.callable_(call, depth),
                self.class_(type(obj), depth),
            )
        if isinstance(obj, type) and not is_library_class(obj):
            return self.class_(obj, depth + 1)  # a class as the hook: its methods at `depth`
        return self._by_name(obj)  # builtins, C-extension callables, library classes

    def _wrapper(self, obj: Any, depth: int) -> str:
        """Digest of a wrapper object (not a function) around a callable: what it holds and
        what it calls, besides the callable it wraps.

        A user wrapper class (a decorator written as a class, `functools.update_wrapper`) is
        hashed by its `__call__`, its class and every attribute of the instance (a decorator's
        parameter lives there). A library wrapper (`jax.custom_jvp`, `jax.custom_vjp`,
        `jax.jit`) by its type, the callables it holds (the rules `jvp`, `fwd`, `bwd`) and its
        plain settings (`nondiff_argnums`); its other machinery is rebuilt per object, so it
        is left out to let an identical re-definition match.
        """
        t = type(obj)
        parts = [_type_name(obj)]
        library = is_library_class(t)
        if not library:
            call = getattr(t, "__call__", None)  # noqa: B004 (the function itself)
            if call is not None:
                parts.append(self.callable_(call, depth))
            parts.append(self.class_(t, depth))
        for name, v in sorted(vars(obj).items()):
            if name in _WRAPPER_SKIP:
                continue
            if _is_function_like(v):
                parts += [name, self.callable_(v, depth)]
            elif not library:
                parts += [name, self.value(v, depth - 1, strict=False)]
            elif (plain := self.value(v, -1, strict=True)) is not None and not name.startswith("_"):
                parts += [name, plain]
        digest = _h("wrapper", *parts)
        self._record(digest, obj, f"wrapper:{_names(obj)[1]}")
        return digest

    def _function(self, fn: types.FunctionType, depth: int) -> str:
        module, qualname = _names(fn)
        if depth < 0:
            return self._by_name(fn)
        if _is_library(fn):
            code = "library"
            names: frozenset[str] = frozenset()
            bare: frozenset[tuple] = frozenset()
            paths: frozenset[tuple] = frozenset()
        else:
            code, names, bare, paths = _code_info(fn.__code__)
        own = _h(
            "function",
            module,
            qualname,
            code,
            self.value(fn.__defaults__, depth - 1, strict=False),
            self.value(fn.__kwdefaults__, depth - 1, strict=False),
        )
        self._record(own, fn, qualname, f"{module}.{qualname}")
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
        return _h(
            own,
            *self._cell_parts(fn, cells, bare, depth),
            *self._global_parts(fn, names, bare, depth),
            *self._path_parts(fn, cells, paths, depth),
        )

    def _cell_parts(self, fn: types.FunctionType, cells: dict, bare: Any, depth: int) -> list[str]:
        """Name and digest of each closure cell `fn` reads."""
        qualname = _names(fn)[1]
        parts = []
        for name, cell in cells.items():
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not assigned yet (its name is bound after the def)
                parts += [name, "empty cell"]
                continue
            keys = (f"closure:{name}", f"closure:{qualname}.{name}")
            parts += [name, self._read(contents, ("deref", name) in bare, depth, fn, *keys)]
        return parts

    def _global_parts(self, fn: types.FunctionType, names: Any, bare: Any, depth: int) -> list[str]:
        """Name and digest of each module-level name `fn` loads as a global."""
        module = _names(fn)[0]
        globals_ = fn.__globals__
        parts = []
        for name in sorted(names):  # sorted: set order changes with the string hash seed
            # Names not found are builtins or not defined yet; the code digest covers the
            # name, and defining it later changes this digest.
            if name in globals_:
                keys = (f"global:{name}", f"global:{module}.{name}")
                value = globals_[name]
                parts += [name, self._read(value, ("global", name) in bare, depth, globals_, *keys)]
        return parts

    def _path_parts(
        self,
        fn: types.FunctionType,
        cells: dict,
        paths: frozenset[tuple[str, str, tuple[str, ...]]],
        depth: int,
    ) -> list[str]:
        """Digests of the attribute paths `fn` reads: `mod.attr`, `Cls.attr`, `super().attr`."""
        globals_ = fn.__globals__
        parts = []
        for kind, root, attrs in sorted(paths):
            if kind == "global":
                if root not in globals_:
                    continue
                base = globals_[root]
            else:
                try:
                    base = cells[root].cell_contents
                except (KeyError, ValueError):  # a cell of an inner function, or still empty
                    continue
            if kind == "super":  # zero-argument super(): the class after `__class__`
                if isinstance(base, type) and not is_library_class(base):
                    parts += self._class_lookup(base, attrs[0], depth, skip_first=True)
            elif isinstance(base, (types.ModuleType, type)):
                parts += self._attributes(base, attrs, depth)
        return parts

    def _read(self, value: Any, bare: bool, depth: int, owner: Any, *keys: str) -> str:
        """Digest of a global or closure value a function at `depth` reads."""
        if not bare and isinstance(value, type) and not is_library_class(value):
            # Only read as `Cls.attr` (or through `super()`): those attributes are hashed as
            # paths, not the whole class (a parent hook `Base.loss(self, ...)` needs
            # Base.loss, not Base.build_data).
            digest = _h("class", _qualified(value))
            self._record(digest, owner, *keys, weak=True)
            return digest
        return self._binding(value, depth - 1, owner, *keys)

    def _attributes(self, obj: Any, attrs: tuple[str, ...], depth: int) -> list[str]:
        """Digests of `obj.a`, `obj.a.b`, ... while the object read from is a user module,
        and of `Cls.a` for a user class (found along its MRO).

        An attribute read this way counts like a global of the reading function (`depth`
        is the reader's): a function is hashed at `depth - 1`, a value is recorded as
        ``global:<module>.<name>`` (``global:<Class>.<name>``). Library modules and classes
        stay by name, and so do their attributes.
        """
        out = []
        for attr in attrs:
            if isinstance(obj, types.ModuleType):
                if _is_library_module(obj):
                    break
                ns = vars(obj)  # not getattr: a module-level __getattr__ may import or compute
                path = f"{obj.__name__}.{attr}"
                if attr not in ns:  # not defined (yet): defining it later changes the digest
                    out += [path, "missing"]
                    break
                obj = ns[attr]
                # The module's dict is the owner, as for the globals of its own functions, so
                # a value read both as `mod.X` and as `X` inside `mod` shares one reach entry.
                out += [path, self._binding(obj, depth - 1, ns, f"global:{path}")]
            elif isinstance(obj, type) and not is_library_class(obj):
                out += self._class_lookup(obj, attr, depth)
                break  # what follows reads from a value, not from a module or class
            else:
                break
        return out

    def _class_lookup(
        self, cls: type, attr: str, depth: int, *, skip_first: bool = False
    ) -> list[str]:
        """`cls.attr` as found along the MRO (after `cls` itself for `super()`), for a
        reader at `depth`: user-class attributes by content, library ones by name.

        For `super()` the MRO is that of `cls`; an instance of a subclass mixing in more
        bases may resolve the name elsewhere (cooperative multiple inheritance).
        """
        path = f"{'super:' if skip_first else ''}{_qualified(cls)}.{attr}"
        mro = cls.__mro__[1:] if skip_first else cls.__mro__
        owner = next((k for k in mro if attr in vars(k)), None)
        if owner is None:  # from the metaclass (`__name__`), or not defined (yet)
            return [path, "missing"]
        if is_library_class(owner):
            return [path, _h("name", _qualified(owner), attr)]
        return [path, self._class_attribute(owner, attr, vars(owner)[attr], depth)]

    def _binding(self, value: Any, depth: int, owner: Any, *keys: str) -> str:
        """Digest of a global or closure value; functions and user classes are recorded
        under their own names."""
        if _is_function_like(value):
            return self.callable_(value, depth)
        if isinstance(value, type) and depth >= 0 and not is_library_class(value):
            return self.class_(value, depth)
        digest = self.value(value, depth, strict=False)
        self._record(digest, owner, *keys)
        return digest

    # -- classes --------------------------------------------------------------------------

    def class_(self, cls: type, depth: int) -> str:
        """Digest of a user class by content: its bases (user ones by content, library ones
        by name), metaclass (by name), and every entry of its own namespace (`vars`): functions,
        static/class methods and property accessors hashed at `depth - 1`, plain values by
        content. Library classes, and any class below depth 0, count by name."""
        if depth < 0 or is_library_class(cls):
            return _h("class", _qualified(cls))
        key = (id(cls), depth)
        if (hit := self._memo.get(key)) is not None:
            return hit[1]
        # A guard of its own: the class may be the callable being hashed (`callable_` marks
        # its id active first), which is no cycle.
        guard = ("class", id(cls))
        if guard in self._active:  # a method that names its own class, a class attribute
            return _h("cycle", "class", _qualified(cls))
        self._active.add(guard)
        try:
            module, qualname = _names(cls)
            bases = [self.class_(base, depth) for base in cls.__bases__]
            namespace = vars(cls)
            attrs = sorted(name for name in namespace if name not in _CLASS_SKIP)
            parts = []
            for name in attrs:
                parts += [name, self._class_attribute(cls, name, namespace[name], depth)]
            own = _h(
                "class",
                module,
                qualname,
                _qualified(type(cls)),
                *(_qualified(b) for b in cls.__bases__),
                "\0".join(attrs),
            )
            self._record(own, cls, qualname, f"{module}.{qualname}")
            digest = _h("class", own, *bases, *parts)
        finally:
            self._active.discard(guard)
        self._memo[key] = (cls, digest)
        return digest

    def _class_attribute(self, cls: type, name: str, attr: str, depth: int) -> str:
        if isinstance(attr, property):
            return _h(
                "property",
                *(
                    self.callable_(f, depth - 1) if f is not None else "-"
                    for f in (attr.fget, attr.fset, attr.fdel)
                ),
            )
        if isinstance(attr, functools.cached_property):
            return _h("cached_property", self.callable_(attr.func, depth - 1))
        if _is_function_like(attr):
            method = self.callable_(attr, depth - 1)
            qualname = _names(cls)[1]
            if _names(attr)[1] != f"{qualname}.{name}":
                # a function put on the class from elsewhere (`Net.__call__ = call`): also
                # recorded under the name the class gives it, which is how it is called
                self._record(method, cls, f"method:{qualname}.{name}")
            return method
        if isinstance(attr, type):
            return self.class_(attr, depth - 1)  # a nested class
        if isinstance(attr, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            return _h("slot", name)  # __slots__ entries: new objects per class, same meaning
        digest = self.value(attr, depth - 1, strict=True)
        if digest is None:
            if not isinstance(attr, (tuple, list, dict, set, frozenset)) and is_library_class(
                type(attr)
            ):
                # Machinery a library puts on its classes (flax's descriptors and internal
                # state): new objects per class definition, hashed by type so an identical
                # re-definition still matches.
                digest = _h("object", _type_name(attr))
            else:
                digest = self.value(attr, depth - 1, strict=False)
        if not (name.startswith("__") and name.endswith("__")):
            module, qualname = _names(cls)
            self._record(
                digest, cls, f"global:{qualname}.{name}", f"global:{module}.{qualname}.{name}"
            )
        return digest

    def _by_name(self, obj: Any) -> str:
        module, qualname = _names(obj)
        digest = _h("name", module, qualname)
        self._record(digest, obj, qualname, f"{module}.{qualname}", weak=True)
        return digest

    def _record(self, digest: str, owner: Any, *keys: str, weak: bool = False) -> None:
        """Enter `digest` in the reach table under the first of `keys` no other owner holds.

        A weak entry (a name-only digest) never replaces one already there, so a helper
        reached both deeply and by name shows its content digest.
        """
        numbered = (f"{keys[-1]}#{i}" for i in itertools.count(2))
        for key in itertools.chain(keys, numbered):
            if self._owners.setdefault(key, owner) is owner:
                break
        if not (weak and key in self.reach):
            self.reach[key] = digest

    # -- values ---------------------------------------------------------------------------

    @typing.overload
    def value(self, v: Any, depth: int, *, strict: typing.Literal[False]) -> str: ...
    @typing.overload
    def value(self, v: Any, depth: int, *, strict: bool) -> str | None: ...

    def value(self, v: Any, depth: int, *, strict: bool) -> str | None:
        """Digest of a value. Functions inside are hashed at `depth`. What cannot be hashed
        by content gives None when `strict`, else an identity digest (a new object, a new key)."""
        digest: str | None
        t = type(v)
        if t in _SCALARS:
            return _scalar_digest(t, v)
        if isinstance(v, enum.Enum):
            # the value too: code may read `.value`, and a re-defined enum may change it
            digest = _h("enum", _qualified(t), v.name, self.value(v._value_, -1, strict=False))
        elif isinstance(v, (np.ndarray, np.generic, jax.Array)):
            digest = _array_digest(v)
        elif isinstance(v, np.dtype):
            digest = _h("dtype", v.str, v.name)
        elif isinstance(v, types.ModuleType):
            digest = _h("module", v.__name__)  # what code reads from it is hashed as paths
        elif isinstance(v, type):
            return self.class_(v, depth)  # user classes by content, library ones by name
        elif _is_function_like(v):
            return self.callable_(v, depth)
        elif isinstance(v, slice):
            digest = self._items(v, (v.start, v.stop, v.step), depth, strict)
        elif isinstance(v, (tuple, list, dict, set, frozenset)) or (
            dataclasses.is_dataclass(v) and not isinstance(v, type)
        ):
            digest = self._items(v, None, depth, strict)
            if (
                digest is not None
                and depth >= 0
                and t not in (tuple, list, dict, set, frozenset)
                and not is_library_class(t)
            ):
                # a user dataclass or NamedTuple: its methods are part of what it does
                digest = _h("items", digest, self.class_(t, depth))
        else:
            digest = None
        if digest is None and not strict:
            digest = _h("identity", _identity(v))
            if depth >= 0 and not is_library_class(t):
                # An object of a user class: a method patched on its class changes what
                # the same object does.
                digest = _h("identity", digest, self.class_(t, depth))
        return digest

    def _items(self, v: Any, items: Any, depth: int, strict: bool) -> str | None:
        key = (id(v), depth, strict)
        if (hit := self._containers.get(key)) is not None:
            return hit[1]  # one container met twice (a class's field table and a closure)
        if id(v) in self._active:  # a container that contains itself
            return None if strict else _h("cycle", _type_name(v))
        self._active.add(id(v))
        try:
            if items is not None:
                parts = [self.value(x, depth, strict=strict) for x in items]
            elif isinstance(v, dict):  # insertion order kept: code iterating over it sees it
                parts = [self.value(x, depth, strict=strict) for kv in v.items() for x in kv]
            elif isinstance(v, (set, frozenset)):
                parts = [self.value(x, depth, strict=strict) for x in v]
                if None not in parts:
                    parts.sort()  # iteration order of a set is arbitrary
            elif isinstance(v, (tuple, list)):
                parts = [self.value(x, depth, strict=strict) for x in v]
            else:  # dataclass instance
                parts = []
                for field in dataclasses.fields(v):
                    parts.append(_h("field", field.name))
                    parts.append(
                        self.value(getattr(v, field.name), depth, strict=strict)
                        if hasattr(v, field.name)
                        else "unset"
                    )
        finally:
            self._active.discard(id(v))
        digest = (
            None if None in parts else _h("items", _type_name(v), *typing.cast(list[str], parts))
        )
        self._containers[key] = (v, digest)  # holding v keeps its id from being reused
        return digest


# -- identity, arrays and names ----------------------------------------------------------

_codes: dict[int, tuple[weakref.ref, str, frozenset[str], frozenset[tuple], frozenset[tuple]]] = {}
_identities: dict[int, tuple[weakref.ref, str]] = {}
_array_digests: dict[str, str] = {}  # identity token -> content digest of an immutable jax array
_tokens = itertools.count()


def _identity(obj: Any) -> str:
    """A token for this very object. Unlike id(), a later object never gets the same one."""
    key = id(obj)
    entry = _identities.get(key)
    if entry is not None and entry[0]() is obj:
        return entry[1]
    token = f"{_type_name(obj)}#{next(_tokens)}"
    try:
        ref = weakref.ref(obj, functools.partial(_forget, key))
    except TypeError:
        # Not weak-referenceable, so we cannot see it die; id() is the best there is.
        return f"{_type_name(obj)}@{key}"
    _identities[key] = (ref, token)
    return token


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _identities.get(key)
    if entry is not None and entry[0] is ref:
        del _identities[key]
        _array_digests.pop(entry[1], None)


def _array_digest(a: Any) -> str | None:
    """dtype + shape + bytes; dtype + shape + identity above MAX_ARRAY_BYTES."""
    if isinstance(a, _TRACER):
        return None  # abstract inside a trace: there are no bytes to hash
    token = None
    if isinstance(a, jax.Array):  # immutable, and reading it back costs a device transfer
        token = _identity(a)
        if (hit := _array_digests.get(token)) is not None:
            return hit
    try:
        head = (str(a.dtype), a.dtype.str, repr(tuple(a.shape)))
        if a.dtype.hasobject:
            return None  # the bytes are pointers
        if a.size * a.dtype.itemsize > MAX_ARRAY_BYTES:
            return _h("array by identity", *head, _identity(a))
        host = np.ascontiguousarray(a)  # device -> host for a jax array
        digest = _h("array", *head, hashlib.sha256(host.reshape(-1).view(np.uint8).data).digest())
    except Exception:  # deleted/donated, not fully addressable, extended dtypes (PRNG keys)
        return None
    if token is not None and _identities.get(id(a), (None, ""))[1] == token:
        _array_digests[token] = digest  # only while _forget will drop it when `a` dies
    return digest


_scalars: dict[tuple, str] = {}


def _scalar_digest(t: type, v: Any) -> str:
    # Floats by repr in the key: 0.0 == -0.0, and nan != nan, yet each traces differently.
    key = (t, v) if t is not float and t is not complex else (t, repr(v))
    try:
        return _scalars[key]
    except KeyError:
        pass
    except TypeError:  # not hashable (cannot happen for these types; be safe)
        return _h(t.__name__, v if t is bytes else repr(v))
    digest = _h(t.__name__, v if t is bytes else repr(v))
    if len(_scalars) > 4096:
        _scalars.clear()
    _scalars[key] = digest
    return digest


def _code_info(
    code: types.CodeType,
) -> tuple[str, frozenset[str], frozenset[tuple], frozenset[tuple]]:
    """(digest, global names, bare loads, attribute paths) of a code object and the code
    nested in it.

    A code object is immutable, so this is computed once per object for the whole process.
    Global names are those the bytecode loads as globals; attribute names (`self.tol`) are
    not among them, though the digest covers them. A bare load, ``("global", name)`` or
    ``("deref", name)``, is a load not followed by an attribute read (a call, an argument, a
    store). A path is ``(kind, root, attrs)``: a global (``"global"``) or closure cell
    (``"deref"``) `root` followed right away by attribute reads `attrs` (``losses.penalty``,
    ``pkg.sub.fn``), or ``("super", "__class__", (name,))`` for ``super().name``.
    """
    entry = _codes.get(id(code))
    if entry is not None and entry[0]() is code:
        return entry[1:]
    names, bare, paths = _scan_loads(code)
    consts = []
    doc = _docstring_slot(code)
    for i, const in enumerate(code.co_consts):  # lambdas, comprehensions and inner defs here
        if i == 0 and doc:
            digest = "docstring"  # never loaded by the code: editing it changes nothing
        elif isinstance(const, types.CodeType):
            digest, inner_names, inner_bare, inner_paths = _code_info(const)
            names |= inner_names
            bare |= inner_bare
            paths |= inner_paths
        else:  # code constants are immutable, so this digest holds as long as the code
            digest = _Hasher().value(const, -1, strict=False)
        consts.append(digest)
    # No co_filename, co_firstlineno or line table: moving code must not change it.
    digest = _h(
        "code",
        code.co_qualname,
        code.co_code,
        code.co_exceptiontable,
        repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)),
        "\0".join(code.co_names),
        "\0".join(code.co_varnames),
        "\0".join(code.co_freevars),
        "\0".join(code.co_cellvars),
        *consts,
    )
    result = (digest, frozenset(names), frozenset(bare), frozenset(paths))
    try:
        ref = weakref.ref(code, functools.partial(_forget_code, id(code)))
    except TypeError:
        return result
    _codes[id(code)] = (ref, *result)
    return result


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def _docstring_slot(code: types.CodeType) -> bool:
    """Whether `co_consts[0]` is the function's docstring slot. A function's first constant
    is its docstring, or None without one (before Python 3.14, which keeps it out of
    `co_consts` unless used); comprehensions and class bodies have no such slot. (A None there
    that the code also loads is seen in the bytecode, which then differs.)"""
    return (
        bool(code.co_consts)
        and (code.co_consts[0] is None or isinstance(code.co_consts[0], str))
        and bool(code.co_flags & 0x1)  # CO_OPTIMIZED: a function, not module or class code
        and code.co_name not in _COMPREHENSIONS
        and sys.version_info < (3, 14)
    )


def _scan_loads(code: types.CodeType) -> tuple[set[str], set[tuple], set[tuple]]:
    """(global names, bare loads, attribute paths) of one code object's own bytecode (see
    `_code_info`; nested code objects are scanned by their own call)."""
    names: set[str] = set()
    bare: collections.Counter = collections.Counter()
    paths: set[tuple] = set()
    root: tuple[str, str] | None = None
    attrs: list[str] = []
    zero_arg_super = False

    def close() -> None:
        if attrs and root is not None:  # (attrs only ever follow a root)
            paths.add((*root, tuple(attrs)))
        elif root is not None:
            bare[root] += 1

    for ins in dis.get_instructions(code):
        op = ins.opname
        if op == "EXTENDED_ARG":
            continue
        if root is not None and op in _ATTR_LOADS and len(attrs) < _MAX_CHAIN:
            attrs.append(ins.argval)
            continue
        if zero_arg_super:  # `super()` (3.11: PRECALL 0, CALL 0), then `.name` or not
            if op in ("PRECALL", "CALL") and ins.arg == 0:
                continue
            zero_arg_super = False
            if op in _ATTR_LOADS:
                paths.add(("super", "__class__", (ins.argval,)))
                continue
            bare["deref", "__class__"] += 1  # `s = super()`: any attribute of the class
        close()
        root, attrs = None, []
        if op in _GLOBAL_LOADS:
            names.add(ins.argval)
            if ins.argval == "super" and "__class__" in code.co_freevars:
                zero_arg_super = True  # two-argument super() loads its class explicitly
            else:
                root = ("global", ins.argval)
        elif op in _DEREF_LOADS:
            root = ("deref", ins.argval)
        elif op == "LOAD_SUPER_ATTR":  # 3.12: super, __class__ and self loaded, then this
            paths.add(("super", "__class__", (ins.argval,)))
            bare["deref", "__class__"] -= 1
    if zero_arg_super:
        bare["deref", "__class__"] += 1
    close()
    return names, {load for load, n in bare.items() if n > 0}, paths


def _forget_code(key: int, ref: weakref.ref) -> None:
    entry = _codes.get(key)
    if entry is not None and entry[0] is ref:
        del _codes[key]


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
