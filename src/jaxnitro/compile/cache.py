"""The process-wide program cache shared by every `Nitro` and by `jn.train_step`.

A key holds everything that changes the compiled graph (experiment class, GraphConst values,
model and optimizer structure, input avals and shardings, hook fingerprints, options) and
nothing that does not. Programs are compiled ahead of time (`lower(...).compile()`), so a
miss is exactly one XLA compile and `misses == entries` after the first step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from .fingerprint import fingerprint, fingerprint_value


@dataclasses.dataclass
class Program:
    """One compiled program and what it cost."""

    kind: str
    key: Hashable
    compiled: Any  # jax.stages.Compiled
    lower_seconds: float
    compile_seconds: float
    label: str = ""

    def __call__(self, *args):
        return self.compiled(*args)


_lock = threading.RLock()
_entries: dict[Hashable, Program] = {}
_by_text: dict[str, Program] = {}
_stats = {"hits": 0, "misses": 0}


def cache_stats() -> dict[str, int]:
    """{hits, misses, entries} of the process-wide program cache.

    Example:
        >>> jn.cache_stats()
        {'hits': 3, 'misses': 2, 'entries': 2}
    """
    with _lock:
        return {"hits": _stats["hits"], "misses": _stats["misses"], "entries": len(_by_text)}


def cache_reset() -> None:
    """Drop every cached program (the escape hatch when a key cannot see a change)."""
    with _lock:
        _entries.clear()
        _by_text.clear()
        _stats["hits"] = _stats["misses"] = 0


def avals(tree) -> tuple:
    """Hashable (treedef, per-leaf shape/dtype/weak_type/sharding) of program arguments."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(_aval(x) for x in leaves))


def _aval(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), x.sharding)
    if isinstance(x, jax.Array):
        t = jax.typeof(x) if hasattr(jax, "typeof") else x.aval
        return (x.shape, str(x.dtype), bool(t.weak_type), x.sharding)
    # Python scalars and numpy values are weakly typed / host: their type is part of the key.
    return (type(x).__name__, getattr(x, "shape", ()), str(getattr(x, "dtype", "")))


def freeze(obj) -> Hashable:
    """A hashable content key: callables by fingerprint, containers recursively."""
    if callable(obj) and not isinstance(obj, type) and _is_function_like(obj):
        return ("fn", fingerprint(obj))
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(freeze(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((str(k), freeze(v)) for k, v in obj.items())))
    try:
        hash(obj)
        return obj
    except TypeError:
        fp = fingerprint_value(obj)
        return ("value", fp if fp is not None else (type(obj).__qualname__, id(obj)))


def _is_function_like(obj) -> bool:
    import functools
    import types

    return isinstance(obj, (types.FunctionType, types.MethodType, functools.partial))


def optimizer_key(tx) -> Hashable:
    """Structure of an optax transformation: its init/update functions and their closures."""
    return ("optax", fingerprint(tx.init, depth=3), fingerprint(tx.update, depth=3))


def get_or_compile(key: Hashable, lower: Callable[[], Any], *, kind: str, label: str = "",
                   devices: tuple = (),
                   on_compile: Callable[[str, str], Any] | None = None) -> Program:
    """Return the cached program for `key`, compiling it (once per process) on a miss.

    `lower()` returns a `jax.stages.Lowered`. Two keys that lower to identical StableHLO (and
    the same `devices`) share one executable: the program text is the authoritative identity.
    `on_compile(kind, label)` is a context-manager factory the caller uses to show progress.
    """
    with _lock:
        prog = _entries.get(key)
        if prog is not None:
            _stats["hits"] += 1
            return prog
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    # Same text, devices and pytree signature => the same executable is correct to share.
    ident = (lowered.as_text(), repr(devices), repr(lowered.in_tree), repr(lowered.out_tree))
    text_key = hashlib.sha256("\x00".join(ident).encode()).hexdigest()
    with _lock:
        twin = _by_text.get(text_key)
        if twin is not None:
            _entries[key] = twin
            _stats["hits"] += 1
            return twin
    ctx = on_compile(kind, label) if on_compile is not None else None
    if ctx is not None:
        with ctx:
            compiled = lowered.compile()
    else:
        compiled = lowered.compile()
    t2 = time.perf_counter()
    prog = Program(kind, key, compiled, t1 - t0, t2 - t1, label)
    with _lock:
        _stats["misses"] += 1
        _entries[key] = prog
        _by_text[text_key] = prog
    return prog
