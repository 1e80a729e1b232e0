"""Digests of values that need no traversal: parts, scalars, arrays, and object identity."""

from __future__ import annotations

import functools
import hashlib
import itertools
import weakref
from typing import Any

import jax
import numpy as np

from jaxnitro._src.compile.libraries import _type_name

__all__ = ["MAX_ARRAY_BYTES"]

#: Arrays up to this many bytes are hashed by content; bigger ones by dtype, shape and identity.
MAX_ARRAY_BYTES = 16 * 2**20

_TRACER = getattr(jax.core, "Tracer", ())


def _h(*parts: str | bytes) -> str:
    """sha256 of the parts, so ("ab", "c") and ("a", "bc") differ: the repr of a tuple of
    str and bytes quotes each one, so it reads back as exactly these parts (and costs one
    C call, not a Python loop: this runs a few hundred times per fingerprint)."""
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()


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
