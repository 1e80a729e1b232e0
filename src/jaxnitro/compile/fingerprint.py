"""Content fingerprints of user hooks, so a cached XLA program is never silently stale.

The program cache is process-wide and its keys include `fingerprint(hook)` for every hook
traced into a program. The fingerprint covers what the traced behaviour depends on: the
bytecode and constants, defaults, closure cells, the module-level values the code reads, and
(to `depth` levels) the user helpers it calls. It leaves out file names and line numbers, so
an identical re-definition (a notebook cell re-run) hits the cache and any edit misses it.

Library code (jax, numpy, optax, flax, equinox, the standard library, anything installed in
site-packages) cannot change within a process, so it is hashed by name. A library *closure*
is still hashed by content: its cells are where per-instance values live (the learning rate
of `optax.adam(1e-3)` sits in a closure cell of its update function).

Objects that cannot be hashed by content are hashed by identity, through a token that is
never reused by a later object (unlike `id()`), so a new object always means a new key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import itertools
import os
import sysconfig
import types
import weakref

import jax
import numpy as np

__all__ = ["MAX_ARRAY_BYTES", "describe_reach", "fingerprint", "fingerprint_value"]

#: Arrays up to this many bytes are hashed by content; bigger ones by dtype, shape and identity.
MAX_ARRAY_BYTES = 16 * 2**20

# Top-level packages whose functions are hashed by module + qualname only.
_LIBRARY_ROOTS = frozenset(
    {"jax", "jaxlib", "numpy", "optax", "flax", "equinox", "builtins", "functools", "typing",
     "math"}
)
# Installed and standard-library code, recognised by where its file lives. Code exec'd from a
# string or a notebook cell lives in none of these, so it is always user code.
_LIBRARY_DIRS = tuple(
    sorted({os.path.join(p, "") for k, p in sysconfig.get_paths().items()
            if k in ("purelib", "platlib", "stdlib", "platstdlib")})
) + ("<frozen ",)

_TRACER = getattr(jax.core, "Tracer", ())
_SCALARS = (type(None), bool, int, float, complex, str, bytes, types.EllipsisType)
_FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                   functools.partial, classmethod, staticmethod, np.ufunc)


def fingerprint(obj, *, depth: int = 2) -> str:
    """Hex digest (sha256) of what a callable's behaviour depends on.

    `depth` is how many levels of helpers below `obj` have their code hashed: `obj`'s own
    code always is, helpers it reaches are hashed with `depth - 1`, and below zero a helper
    counts by module + qualname only. The instance behind a bound method is not hashed
    (the caller keys `self` itself).
    """
    if not (callable(obj) or isinstance(obj, classmethod)):  # classmethod objects aren't callable
        raise TypeError(f"fingerprint() takes a callable, got {type(obj).__qualname__}; "
                        f"use fingerprint_value() for plain values")
    return _Hasher().callable_(obj, depth)


def describe_reach(obj, *, depth: int = 2) -> dict[str, str]:
    """name -> per-item digest of everything `fingerprint(obj, depth=depth)` covered.

    Functions appear under their qualname with a digest of their *own* code, defaults and
    name (not of what they reach), module-level values as ``global:<name>`` and closure
    cells as ``closure:<name>``; a name that two different owners would share is qualified
    with the module or function. Diffing two results names exactly what changed.
    """
    hasher = _Hasher()
    hasher.callable_(obj, depth)
    return dict(hasher.reach)


def fingerprint_value(value) -> str | None:
    """Digest of a plain value, or None when it cannot be fingerprinted by content.

    Covers scalars, str/bytes, tuples/lists/dicts/sets (recursively), numpy and jax arrays
    (dtype, shape and bytes; above `MAX_ARRAY_BYTES` dtype, shape and identity), numpy
    dtypes, enums, dataclass instances (type and fields), modules and classes (by name) and
    functions (as `fingerprint`). Arbitrary objects give None.
    """
    return _Hasher().value(value, 2, strict=True)


def _h(*parts: str | bytes) -> str:
    """sha256 of length-prefixed parts, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        b = part if isinstance(part, bytes) else part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


class _Hasher:
    """One traversal. The memo, cycle guard and reach table live for a single call only,
    since globals and closure cells may change between calls."""

    def __init__(self) -> None:
        self.reach: dict[str, str] = {}
        self._owners: dict[str, object] = {}
        self._memo: dict[tuple[int, int], tuple[object, str]] = {}
        self._codes: dict[int, tuple[types.CodeType, str, frozenset[str]]] = {}
        self._active: set[int] = set()

    # -- callables ------------------------------------------------------------------------

    def callable_(self, obj, depth: int) -> str:
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

    def _unwrap(self, obj, depth: int) -> str:
        if isinstance(obj, functools.partial):
            args = self.value((obj.args, obj.keywords), depth - 1, strict=False)
            self._record(args, obj, f"partial:{_names(obj.func)[1]}")
            return _h("partial", self.callable_(obj.func, depth), args)
        if isinstance(obj, (types.MethodType, classmethod, staticmethod)):
            return self.callable_(obj.__func__, depth)
        if (inner := _wrapped(obj)) is not None:
            # Follow the decorator to the user's function, but keep the wrapper too: a user
            # decorator that scales the loss is as much a part of it as the body is.
            outer = (self._function(obj, depth) if isinstance(obj, types.FunctionType)
                     else _h("object", _type_name(obj)))
            return _h("wrapped", outer, self.callable_(inner, depth))
        if isinstance(obj, types.FunctionType):
            return self._function(obj, depth)
        call = getattr(type(obj), "__call__", None)  # noqa: B004 (we want the function itself)
        if not isinstance(obj, type) and (isinstance(call, types.FunctionType)
                                          or _wrapped(call) is not None):
            return _h("object", _type_name(obj), self.callable_(call, depth))
        return self._by_name(obj)  # builtins, C-extension callables, classes

    def _function(self, fn: types.FunctionType, depth: int) -> str:
        module, qualname = _names(fn)
        if depth < 0:
            return self._by_name(fn)
        if _is_library(fn):
            code, names = "library", frozenset()
        else:
            code, names = self._code(fn.__code__)
        own = _h("function", module, qualname, code,
                 self.value(fn.__defaults__, depth - 1, strict=False),
                 self.value(fn.__kwdefaults__, depth - 1, strict=False))
        self._record(own, fn, qualname, f"{module}.{qualname}")
        parts = [own]
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not assigned yet (its name is bound after the def)
                parts += [name, "empty cell"]
                continue
            parts += [name, self._binding(contents, depth - 1, fn, f"closure:{name}",
                                          f"closure:{qualname}.{name}")]
        globals_ = fn.__globals__
        for name in sorted(names):  # sorted: set order changes with the string hash seed
            # Names not found are attribute names, builtins, or not defined yet; the code
            # digest already covers them, and defining one later changes this digest.
            if name in globals_:
                parts += [name, self._binding(globals_[name], depth - 1, globals_,
                                              f"global:{name}", f"global:{module}.{name}")]
        return _h(*parts)

    def _code(self, code: types.CodeType) -> tuple[str, frozenset[str]]:
        """Digest of a code object, and every name it or code nested in it looks up."""
        if (hit := self._codes.get(id(code))) is not None:
            return hit[1], hit[2]
        names = set(code.co_names)
        consts = []
        for const in code.co_consts:  # lambdas, comprehensions and inner defs live here
            if isinstance(const, types.CodeType):
                digest, inner = self._code(const)
                names |= inner
            else:
                digest = self.value(const, -1, strict=False)
            consts.append(digest)
        # No co_filename, co_firstlineno or line table: moving code must not change it.
        digest = _h(
            "code", code.co_qualname, code.co_code, code.co_exceptiontable,
            repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                  code.co_flags)),
            "\0".join(code.co_names), "\0".join(code.co_varnames),
            "\0".join(code.co_freevars), "\0".join(code.co_cellvars), *consts,
        )
        self._codes[id(code)] = (code, digest, frozenset(names))
        return digest, frozenset(names)

    def _binding(self, value, depth: int, owner, *keys: str) -> str:
        """Digest of a global or closure value; functions are recorded under their own names."""
        if _is_function_like(value):
            return self.callable_(value, depth)
        digest = self.value(value, depth, strict=False)
        self._record(digest, owner, *keys)
        return digest

    def _by_name(self, obj) -> str:
        module, qualname = _names(obj)
        digest = _h("name", module, qualname)
        self._record(digest, obj, qualname, f"{module}.{qualname}", weak=True)
        return digest

    def _record(self, digest: str, owner, *keys: str, weak: bool = False) -> None:
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

    def value(self, v, depth: int, *, strict: bool) -> str | None:
        """Digest of a value. Functions inside are hashed at `depth`. What cannot be hashed
        by content gives None when `strict`, else an identity digest (a new object, a new key)."""
        t = type(v)
        if t in _SCALARS:
            return _h(t.__name__, v if t is bytes else repr(v))
        if isinstance(v, enum.Enum):
            digest = _h("enum", _qualified(t), v.name)
        elif isinstance(v, (np.ndarray, np.generic, jax.Array)):
            digest = _array_digest(v)
        elif isinstance(v, np.dtype):
            digest = _h("dtype", v.str, v.name)
        elif isinstance(v, types.ModuleType):
            digest = _h("module", v.__name__)  # attribute reads are names in the code digest
        elif isinstance(v, type):
            digest = _h("class", _qualified(v))
        elif _is_function_like(v):
            return self.callable_(v, depth)
        elif isinstance(v, slice):
            digest = self._items(v, (v.start, v.stop, v.step), depth, strict)
        elif isinstance(v, (tuple, list, dict, set, frozenset)) or (
                dataclasses.is_dataclass(v) and not isinstance(v, type)):
            digest = self._items(v, None, depth, strict)
        else:
            digest = None
        if digest is None and not strict:
            digest = _h("identity", _identity(v))
        return digest

    def _items(self, v, items, depth: int, strict: bool) -> str | None:
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
                    parts.append(self.value(getattr(v, field.name), depth, strict=strict)
                                 if hasattr(v, field.name) else "unset")
        finally:
            self._active.discard(id(v))
        if None in parts:
            return None
        return _h("items", _type_name(v), *parts)


# -- identity, arrays and names ----------------------------------------------------------

_identities: dict[int, tuple[weakref.ref, str]] = {}
_array_digests: dict[str, str] = {}  # identity token -> content digest of an immutable jax array
_tokens = itertools.count()


def _identity(obj) -> str:
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


def _array_digest(a) -> str | None:
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
        digest = _h("array", *head, hashlib.sha256(host.reshape(-1).view(np.uint8)).digest())
    except Exception:  # deleted/donated, not fully addressable, extended dtypes (PRNG keys)
        return None
    if token is not None and _identities.get(id(a), (None, ""))[1] == token:
        _array_digests[token] = digest  # only while _forget will drop it when `a` dies
    return digest


def _wrapped(obj):
    """The callable a decorator wrapped (functools.wraps, jax.jit, custom_jvp), or None.

    Only the instance dict is read: `getattr` on an object with a permissive `__getattr__`
    (a mock, a proxy) would hand back an endless chain of new wrappers.
    """
    try:
        inner = vars(obj).get("__wrapped__")
    except TypeError:  # no __dict__
        return None
    return inner if callable(inner) and inner is not obj else None


def _is_function_like(v) -> bool:
    """Hashed through `callable_` when met as a value; other callables count as objects."""
    return not isinstance(v, type) and (isinstance(v, _FUNCTION_TYPES) or (
        callable(v) and _wrapped(v) is not None))


def _is_library(fn: types.FunctionType) -> bool:
    module = fn.__module__
    if module and module.partition(".")[0] in _LIBRARY_ROOTS:
        return True
    return fn.__code__.co_filename.startswith(_LIBRARY_DIRS)


def _names(obj) -> tuple[str, str]:
    """(module, qualname), falling back on the type for objects without their own."""
    module = getattr(obj, "__module__", None) or ""
    qualname = (getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
                or type(obj).__qualname__)
    return str(module), str(qualname)


def _qualified(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _type_name(obj) -> str:
    return _qualified(type(obj))
