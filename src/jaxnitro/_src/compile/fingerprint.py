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

import functools
import types
import typing
from typing import TYPE_CHECKING

from jaxnitro._src.compile.code_scan import _MAX_CHAIN, _code_info, dynamic_reads
from jaxnitro._src.compile.digests import (  # (the tables: tests watch them)
    MAX_ARRAY_BYTES,
    _array_digests,
    _h,
    _identities,
)
from jaxnitro._src.compile.fingerprint_values import _CLASS_SKIP, _Values
from jaxnitro._src.compile.libraries import (
    _is_function_like,
    _is_library,
    _is_library_module,
    _names,
    _qualified,
    _type_name,
    _wrapped,
    is_library_class,
    is_user_function,
)
from jaxnitro._src.core.errors import ConfigArgumentError

if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "MAX_ARRAY_BYTES",
    "describe_reach",
    "fingerprint",
    "fingerprint_reach",
    "fingerprint_value",
    "is_library_class",
    "is_user_function",
]

_ = (_CLASS_SKIP, _array_digests, _identities)  # re-exported for the tests that watch them

# What `functools.update_wrapper` copies onto a wrapper, and the wrapped callable itself
# (hashed on its own): naming, not behaviour.
_WRAPPER_SKIP = frozenset(functools.WRAPPER_ASSIGNMENTS) | {"__wrapped__", "__dict__"}


def fingerprint(obj: Any, *, depth: int = 2, gaps: list[str] | None = None) -> str:
    """Hex digest (sha256) of what a callable's behaviour depends on.

    `depth` is how many levels of helpers below `obj` have their code hashed: `obj`'s own
    code always is, helpers it reaches are hashed with `depth - 1`, and below zero a helper
    counts by module + qualname only. The instance behind a bound method is not hashed
    (the caller keys `self` itself).

    `gaps`, when given, receives what the digest could not cover by content (an object
    hashed by identity, a helper below `depth` by name, code reading through `getattr` or
    importing inside a function): with none, equal digests mean the code and everything it
    reads are unchanged; with any, they do not prove it.

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
    hasher = _Hasher()
    digest = hasher.callable_(obj, depth)
    if gaps is not None:
        gaps.extend(hasher.gaps)
    return digest


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


def fingerprint_reach(
    obj: Any, *, depth: int = 2, gaps: list[str] | None = None
) -> tuple[str, dict[str, str]]:
    """`fingerprint` and `describe_reach` of `obj` in one traversal (a program key needs both)."""
    hasher = _Hasher()
    digest = hasher.callable_(obj, depth)
    if gaps is not None:
        gaps.extend(hasher.gaps)
    return digest, dict(hasher.reach)


@typing.overload
def fingerprint_value(
    value: Any, *, strict: typing.Literal[True] = ..., gaps: list[str] | None = ...
) -> str | None: ...
@typing.overload
def fingerprint_value(
    value: Any, *, strict: typing.Literal[False], gaps: list[str] | None = ...
) -> str: ...


def fingerprint_value(
    value: Any, *, strict: bool = True, gaps: list[str] | None = None
) -> str | None:
    """Digest of a plain value, or None when it cannot be fingerprinted by content.

    Covers scalars, str/bytes, tuples/lists/dicts/sets (recursively), numpy and jax arrays
    (dtype, shape and bytes; above `MAX_ARRAY_BYTES` dtype, shape and identity), numpy
    dtypes, enums, dataclass instances (type and fields), modules (by name), classes (user
    classes by content, library classes by name) and functions (as `fingerprint`).
    Arbitrary objects give None, or with `strict=False` a digest of their identity (a new
    object, a new digest). `gaps` as for `fingerprint`.

    Example:
        >>> fingerprint_value((1, "a")) == fingerprint_value((1, "a"))
        True
        >>> fingerprint_value(object()) is None
        True
    """
    hasher = _Hasher()
    digest = hasher.value(value, 2, strict=strict)
    if gaps is not None:
        gaps.extend(hasher.gaps)
    return digest


class _Hasher(_Values):
    """One traversal: values and classes (`_Values`), and callables of every kind."""

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
        if isinstance(obj, types.FunctionType):
            self.saw_item(vars(obj), "__wrapped__")
        plain = (types.FunctionType, type, staticmethod, classmethod)  # (their parts are fixed)
        if not isinstance(obj, plain) or _wrapped(obj) is not None:
            self.unsure = True  # (only plain functions and classes log what they read)
        if isinstance(obj, (functools.partial, functools.partialmethod)):
            args = self.value((obj.args, obj.keywords), depth - 1, strict=False)
            self._record(args, obj, f"partial:{_names(obj.func)[1]}")
            return _h("partial", self.callable_(obj.func, depth), args)
        if isinstance(obj, (types.MethodType, classmethod, staticmethod)):
            owner = getattr(obj, "__self__", None)
            if owner is not None and not isinstance(owner, type):
                self.value(owner, depth - 1, strict=False)  # (a gap where by identity)
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
            # through `self`) one level down; what the instance holds is not hashed.
            if getattr(obj, "__dict__", None) or getattr(type(obj), "__slots__", None):
                self.gap(f"the attributes of a `{_type_name(obj)}` object")
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
        self.saw_attrs(
            fn, "__module__", "__qualname__", "__code__", "__defaults__", "__kwdefaults__"
        )
        if depth < 0:
            if not _is_library(fn):
                self.gap(f"function `{qualname}` below the depth, by name")
            return self._by_name(fn)
        if _is_library(fn):
            code = "library"
            names: frozenset[str] = frozenset()
            bare: frozenset[tuple] = frozenset()
            paths: frozenset[tuple] = frozenset()
        else:
            code, names, bare, paths = _code_info(fn.__code__)
            if (why := dynamic_reads(fn.__code__)) is not None:
                self.gap(f"`{qualname}` reads through `{why}`")
        defaults = self.value(fn.__defaults__, depth - 1, strict=False)
        kwdefaults = self.value(fn.__kwdefaults__, depth - 1, strict=False)
        self.saw_value(fn.__defaults__, depth - 1, False, defaults)
        self.saw_value(fn.__kwdefaults__, depth - 1, False, kwdefaults)
        own = _h("function", module, qualname, code, defaults, kwdefaults)
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
            self.saw_attrs(cell, "cell_contents")
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
            self.saw_item(globals_, name)
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
                self.saw_item(globals_, root)
                if root not in globals_:
                    continue
                base = globals_[root]
            else:
                try:
                    self.saw_attrs(cells[root], "cell_contents")
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
        if bare and isinstance(value, types.ModuleType) and not _is_library_module(value):
            self.gap(f"module `{value.__name__}` passed on as a value")  # (read elsewhere)
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
                self.saw_item(ns, attr)
                if attr not in ns:  # not defined (yet): defining it later changes the digest
                    out += [path, "missing"]
                    if "__getattr__" in ns:
                        self.gap(f"`{path}` from the module's `__getattr__`")
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
        else:
            if len(attrs) == _MAX_CHAIN and isinstance(obj, (types.ModuleType, type)):
                self.gap(f"attributes past `{'.'.join(attrs)}`")  # (past the chain followed)
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
        self.saw_attrs(cls, "__mro__")
        for k in mro:  # each class looked in, up to the one that has it
            self.saw_item(vars(k), attr)
            if attr in vars(k):
                break
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
        self.saw_value(value, depth, False, digest)
        self._record(digest, owner, *keys)
        return digest

    # -- classes --------------------------------------------------------------------------
