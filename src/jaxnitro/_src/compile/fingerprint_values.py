"""The value and class half of a fingerprint traversal (`fingerprint._Hasher` adds callables).

Values by content (scalars, containers, arrays, dataclasses, enums), user classes by their
namespace, and the reach table that names what a fingerprint covered.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import types
import typing
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from jaxnitro._src.compile.digests import (
    MAX_ARRAY_BYTES,
    _array_digest,
    _h,
    _identity,
    _scalar_digest,
)
from jaxnitro._src.compile.libraries import (
    _is_function_like,
    _names,
    _qualified,
    _type_name,
    is_library_class,
)

_SCALARS = (type(None), bool, int, float, complex, str, bytes, types.EllipsisType)


_MISSING = object()  # (what a lookup that found nothing read)


def _frozen(v: Any) -> bool:
    """Whether `v`'s digest cannot change while `v` is the same object: a scalar, a dtype,
    a module (by name), a function or class (whose own reads are logged), or a tuple or
    frozenset of such."""
    t = type(v)
    if t in _SCALARS or t is np.dtype or isinstance(v, (types.ModuleType, types.FunctionType)):
        return True
    if isinstance(v, type):
        return True
    if t is tuple or t is frozenset:
        return all(map(_frozen, v))
    return False


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


class _Values:
    """One traversal's state and its value and class hashing. The memo, cycle guard and reach
    table live for a single call only, since globals and closure cells may change between
    calls."""

    def __init__(self) -> None:
        self.reach: dict[str, str] = {}
        self._owners: dict[str, object] = {}
        self._memo: dict[tuple[int, int], tuple[object, str]] = {}
        self._containers: dict[tuple[int, int, bool], tuple[object, str | None]] = {}
        self._active: set[Hashable] = set()
        # What this traversal could not hash by content (an object by identity, a helper
        # below the depth by name, code that reads through getattr or imports): where any is
        # found, the digest cannot prove that a program traced from the code is unchanged.
        self.gaps: list[str] = []
        # What the traversal read, for `remembered.remembered`: (mapping, key, value) and
        # (object, attribute, value) it looked up, and values hashed by content that may
        # change in place (re-hashed to check). `unsure`: it read something not logged.
        self.seen_items: list[tuple[Any, str, Any]] = []
        self.seen_attrs: list[tuple[Any, str, Any]] = []
        self.seen_sizes: list[tuple[Any, int]] = []
        self.rehash: list[tuple[Any, int, bool, str | None]] = []
        self.unsure = False

    def saw_item(self, mapping: Any, key: str) -> None:
        self.seen_items.append((mapping, key, mapping.get(key, _MISSING)))

    def saw_attrs(self, obj: Any, *names: str) -> None:
        for name in names:
            try:
                found = getattr(obj, name, _MISSING)
            except ValueError:  # an empty closure cell
                found = _MISSING
            self.seen_attrs.append((obj, name, found))

    def saw_value(self, v: Any, depth: int, strict: bool, digest: str | None) -> None:
        """A value hashed by content: re-hashed on a check unless it cannot change in place
        (its own reads logged when it is a function or class)."""
        if not _frozen(v):
            self.rehash.append((v, depth, strict, digest))

    def gap(self, why: str) -> None:
        if why not in self.gaps:
            self.gaps.append(why)

    def callable_(self, obj: Any, depth: int) -> str:  # the callables half (`_Hasher`)
        raise NotImplementedError

    def class_(self, cls: type, depth: int) -> str:
        """Digest of a user class by content: its bases (user ones by content, library ones
        by name), metaclass (by name), and every entry of its own namespace (`vars`): functions,
        static/class methods and property accessors hashed at `depth - 1`, plain values by
        content. Library classes, and any class below depth 0, count by name."""
        if depth < 0 or is_library_class(cls):
            if depth < 0 and not is_library_class(cls):
                self.gap(f"class `{_qualified(cls)}` below the depth, by name")
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
            self.saw_attrs(cls, "__bases__", "__qualname__", "__class__")
            bases = [self.class_(base, depth) for base in cls.__bases__]
            namespace = vars(cls)
            self.seen_sizes.append((namespace, len(namespace)))
            for name in namespace:
                self.saw_item(namespace, name)
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
        if digest is not None:
            self.saw_value(attr, depth - 1, True, digest)
        elif not isinstance(attr, (tuple, list, dict, set, frozenset)) and is_library_class(
            type(attr)
        ):
            # Machinery a library puts on its classes (flax's descriptors and internal
            # state): new objects per class definition, hashed by type so an identical
            # re-definition still matches. That digest reads the type alone, so a remembered
            # traversal re-hashes nothing of it (the namespace entry is checked by identity),
            # unless it is a dataclass, whose fields may come to hash by content.
            digest = _h("object", _type_name(attr))
            if dataclasses.is_dataclass(attr):
                self.saw_value(attr, depth - 1, True, None)
        else:
            # (an edit that makes it hash by content changes this digest too: one re-hash)
            digest = self.value(attr, depth - 1, strict=False)
            self.saw_value(attr, depth - 1, False, digest)
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
        if isinstance(v, np.ndarray) and v.nbytes > MAX_ARRAY_BYTES:
            self.gap(f"a {v.nbytes:,}-byte numpy array, by identity")  # (mutable in place)
        if digest is None and not strict:
            self.gap(f"a `{_type_name(v)}` object, by identity")
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
