"""The process-wide program cache shared by every `Nitro` and by `jn.train_step`.

A key holds everything that changes the compiled graph (experiment class, GraphConst values,
model and optimizer structure, input avals and shardings, hook fingerprints, options) and
nothing that does not. Programs are compiled ahead of time (`lower(...).compile()`), so a
miss is exactly one XLA compile and `misses == entries` after the first step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import re
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax

from jaxnitro._src.compile import backend_options, explain, report
from jaxnitro._src.compile.fingerprint import fingerprint, fingerprint_value

if TYPE_CHECKING:
    import optax

    from jaxnitro._src.core.types import PyTree


@dataclasses.dataclass
class Program:
    """One compiled program, what it cost, and why it was compiled."""

    kind: str
    key: Hashable
    compiled: Any  # jax.stages.Compiled
    lower_seconds: float
    compile_seconds: float
    label: str = ""
    parts: Any = None  # explain.ProgramKey: the key itself, when it is one
    record: Any = None  # report.CompileRecord
    reasons: tuple[str, ...] = ()  # why this was a miss, against the closest earlier program
    deps: tuple = ()  # (function name, fingerprint) of the user code traced into it
    text_key: str = ""  # digest of its StableHLO text, devices and pytree signature
    text_digest: str = ""  # the same digest for a program with host callbacks too

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)


def direct_call(compiled: Any) -> Any:
    """What to call for `compiled` (a `jax.stages.Compiled`) on a hot path: the C++ call its
    `__call__` forwards to once it has made it (at its first call), a Python frame less per
    dispatch; `compiled` itself before that, or on a JAX without it."""
    return getattr(compiled, "_call", None) or compiled


_lock = threading.RLock()
_entries: dict[Hashable, Program] = {}
_by_text: dict[str, Program] = {}
_callback_programs = itertools.count()  # text keys of programs never shared by text
_stats = {"hits": 0, "misses": 0, "persistent_hits": 0, "verified": 0, "unseen": 0}
# The keys programs were asked for, newest last, kept after their programs are dropped (a
# stale program) or when they were served by a twin's text (a copied experiment): a later
# miss is explained against them. Bounded: old keys only explain old programs.
_seen: collections.OrderedDict[explain.ProgramKey, None] = collections.OrderedDict()
_SEEN_MAX = 512
# JAX reports a load from its persistent cache as a monitoring event in the compiling thread.
_loads = threading.local()


def _on_jax_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _loads.count = getattr(_loads, "count", 0) + 1


jax.monitoring.register_event_listener(_on_jax_event)


def cache_stats() -> dict[str, int]:
    """{hits, misses, entries, persistent_hits} of the process-wide program cache.

    A miss is a program this process had not built; `persistent_hits` counts the misses
    JAX loaded from its persistent compilation cache instead of compiling (a warm start).

    Returns:
        A dict of counts: ``hits``, ``misses``, ``entries`` (programs held now) and
        ``persistent_hits``.

    Example:
        >>> jn.cache_stats()
        {'hits': 3, 'misses': 2, 'entries': 2, 'persistent_hits': 0}
    """
    with _lock:
        return {
            "hits": _stats["hits"],
            "misses": _stats["misses"],
            "entries": len(_by_text),
            "persistent_hits": _stats["persistent_hits"],
        }


def cache_reset() -> None:
    """Drop every cached program (the escape hatch when a key cannot see a change).

    Returns:
        None; the next call of each program compiles it again (or loads it from JAX's
        persistent compilation cache).

    Example:
        >>> jn.cache_reset()
        >>> jn.cache_stats()
        {'hits': 0, 'misses': 0, 'entries': 0}
    """
    with _lock:
        _entries.clear()
        _by_text.clear()
        _proven.clear()
        _seen.clear()
        for name in _stats:
            _stats[name] = 0
        for hook in _reset_hooks:
            hook()


_reset_hooks: list[Callable[[], Any]] = []


def on_reset(hook: Callable[[], Any]) -> None:
    """Call `hook()` on `cache_reset` (a layer with its own lookup table in front of this one)."""
    _reset_hooks.append(hook)


def avals(tree: PyTree) -> tuple:
    """Hashable (treedef, per-leaf shape/dtype/weak_type/sharding) of program arguments."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(_aval(x) for x in leaves))


def _aval(x: Any) -> tuple[Any, ...]:
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), x.sharding)
    if isinstance(x, jax.Array):
        t = jax.typeof(x) if hasattr(jax, "typeof") else x.aval
        if not x.committed and not t.weak_type and x.is_fully_addressable:
            # Placed by the program as a numpy array is (it lowers to the same text): the
            # same key, so one program serves either (a constant kept on the device, a
            # scheduled value sent per call).
            return ("ndarray", x.shape, str(x.dtype))
        return (x.shape, str(x.dtype), bool(t.weak_type), x.sharding)
    # Python scalars and numpy values are weakly typed / host: their type is part of the key.
    return (type(x).__name__, getattr(x, "shape", ()), str(getattr(x, "dtype", "")))


def input_spec(x: Any) -> tuple[tuple, str, bool]:
    """(shape, dtype as the program sees it, weak_type) of one program input, for explaining
    a miss: numpy float64 reads as float32 (x64 off), a Python scalar as weakly typed."""
    import jax.numpy as jnp
    import numpy as np

    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        weak = bool(
            getattr(
                jax.typeof(x) if isinstance(x, jax.Array) and hasattr(jax, "typeof") else x,
                "weak_type",
                False,
            )
        )
        return tuple(x.shape), str(x.dtype), weak
    if isinstance(x, (bool, int, float, complex)):
        return (), str(jnp.asarray(x).dtype), True
    dtype = np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)
    return tuple(np.shape(x)), str(jax.dtypes.canonicalize_dtype(dtype)), False


def freeze(obj: Any) -> Hashable:
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


def _is_function_like(obj: Any) -> bool:
    import functools
    import types

    return isinstance(obj, (types.FunctionType, types.MethodType, functools.partial))


_optimizer_keys: collections.OrderedDict = collections.OrderedDict()


def optimizer_key(tx: optax.GradientTransformation) -> Hashable:
    """Structure of an optax transformation: its init/update functions and their closures.

    Fingerprinting optax's nested closures costs ~0.3 ms, more than a small train step, and
    `jn.train_step` needs the key on every call; an optax transformation does not change after
    it is built, so the key is kept per object (the entry holds `tx`, so its id stays unique).
    """
    with _lock:
        hit = _optimizer_keys.get(id(tx))
        if hit is not None and hit[0] is tx:
            _optimizer_keys.move_to_end(id(tx))
            return hit[1]
    key = ("optax", fingerprint(tx.init, depth=3), fingerprint(tx.update, depth=3))
    with _lock:
        _optimizer_keys[id(tx)] = (tx, key)
        if len(_optimizer_keys) > 64:
            _optimizer_keys.popitem(last=False)
    return key


def get_or_compile(
    key: Hashable,
    lower: Callable[[], Any],
    *,
    kind: str,
    label: str = "",
    devices: tuple = (),
    hooks: tuple[str, ...] = (),
    compile_options: dict | None = None,
    on_compile: Callable[[str, str], Any] | None = None,
    verify: bool = False,
    closed: bool = False,
) -> Program:
    """Return the cached program for `key`, compiling it (once per process) on a miss.

    `key`: an `explain.ProgramKey` (a miss says why) or any hashable (`jn.train_step`);
    `lower()` gives a `jax.stages.Traced` or `Lowered`; `on_compile(kind, label)` a context
    manager around a compile. Keys that lower to identical StableHLO (same `devices`) share
    one executable: the text is the identity (a program calling back into Python excepted).

    With `verify`, a key hit is not trusted: the current code is traced and lowered, and the
    cached executable runs only if its text is the same (else the new text is compiled, or
    found under another key). A `closed` key covers by content all the trace reads (no gaps
    in its fingerprints): once a trace gave its program, `proven(key)` says so, and the
    caller may skip the check for an equal closed key.
    """
    with _lock:
        prog = _safe_get(key)
        if prog is not None and not verify:
            return _hit(key)
    lowered, trace_seconds, lower_seconds = _lower(lower)
    text_key, text_digest = _text_key(lowered, devices, compile_options)
    with _lock:
        # (a program that calls back into Python is shared by no other key, but its own key
        # with the same text is its own program: the key names the Python function)
        if prog is not None and prog.text_digest == text_digest:
            _stats["verified"] += 1
            return _hit(key, closed=closed)
        twin = _by_text.get(text_key)
        if twin is not None:
            _entries[key] = twin
            return _hit(key, closed=closed)
    compiled, seconds, loaded, rec = _compile(
        lowered, kind, label, compile_options, on_compile, hooks, (trace_seconds, lower_seconds)
    )
    parts = key if isinstance(key, explain.ProgramKey) else None
    stale = prog is not None  # the key's program traced to another text: the key missed it
    with _lock:
        why = (UNSEEN_CHANGE,) if stale else _why(parts)
        deps = parts.deps if parts is not None else ()
        prog = Program(kind, key, compiled, lower_seconds, seconds, label, parts, rec, why, deps)
        prog.text_key, prog.text_digest = text_key, text_digest
        _stats["misses"] += 1
        _stats["persistent_hits"] += int(loaded)
        _stats["unseen"] += int(stale)
        _entries[key] = prog
        _by_text[text_key] = prog
        _prove(key, closed)
        _remember(key)
    return prog


def _hit(key: Hashable, *, closed: bool | None = None) -> Program:
    """Count a hit on `key` (under the lock); after a trace (`closed` given), note whether
    it proved the key's program."""
    _stats["hits"] += 1
    if closed is not None:
        _prove(key, closed)
    _remember(key)
    return _entries[key]


def _compile(
    lowered: Any,
    kind: str,
    label: str,
    compile_options: dict | None,
    on_compile: Callable[[str, str], Any] | None,
    hooks: tuple[str, ...],
    staged: tuple[float | None, float],
) -> tuple[Any, float, bool, Any]:
    """(executable, compile seconds, loaded from the persistent cache, report record)."""
    t0 = time.perf_counter()
    ctx = on_compile(kind, label) if on_compile is not None else contextlib.nullcontext()
    loads = getattr(_loads, "count", 0)
    with ctx as note:
        # (jaxnitro's own options made XLA's for this program: `backend_options.resolve`)
        options = backend_options.resolve(compile_options or {}, lowered)
        compiled = lowered.compile(compiler_options=options or None)
        loaded = getattr(_loads, "count", 0) > loads  # from the persistent cache, not compiled
        if note is not None and hasattr(note, "loaded"):  # the display says "loaded ..."
            note.loaded = loaded
    seconds = time.perf_counter() - t0
    rec = report.record(
        kind,
        label,
        lowered,
        compiled,
        lower_seconds=staged[1],
        compile_seconds=seconds,
        trace_seconds=staged[0],
        hooks=hooks or ("forward", "loss"),
        loaded=loaded,
    )
    return compiled, seconds, loaded, rec


# Closed keys whose program a trace of the same content gave (see `get_or_compile`): each is
# in `_entries` with that program (a drop or a reset takes it out of both).
_proven: set[Hashable] = set()


def _prove(key: Hashable, closed: bool) -> None:
    try:
        if closed:
            _proven.add(key)
        else:
            _proven.discard(key)
    except Exception:  # a key that cannot be hashed is never proven
        pass


def proven(key: Hashable) -> bool:
    """Whether a trace already gave `key`'s cached program from the content `key` covers: for
    a closed key (no gaps), an equal key proves the program unchanged without a trace."""
    with _lock:
        try:
            return key in _proven and key in _entries
        except Exception:
            return False


#: Why a program recompiled though its key was a hit: the trace of the current code differs.
UNSEEN_CHANGE = (
    "the traced program changed though nothing in its key did: code or a value the "
    "fingerprints do not follow changed (an object mutated in place, a value read through "
    "getattr, globals() or a module imported inside a function); the current code was compiled"
)


def _safe_get(key: Hashable) -> Program | None:
    """`_entries.get(key)`; a key that cannot be hashed or compared is a miss, never an error."""
    try:
        return _entries.get(key)
    except Exception:
        return None


def _remember(key: Hashable) -> None:
    """Note a key asked for (under the lock), for explaining later misses. A key whose hash
    changed after it was stored (a mutable object inside it) is dropped from the table, never
    raised: one experiment's bad key must not break the other programs of the process."""
    if not isinstance(key, explain.ProgramKey):
        return
    try:
        _seen[key] = None
        _seen.move_to_end(key)
    except Exception:
        kept = []
        for k in list(_seen):
            try:
                kept.append((hash(k), k))
            except Exception:
                continue
        _seen.clear()
        _seen.update((k, None) for _, k in kept)
        return
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)


def _lower(lower: Callable[[], Any]) -> tuple[Any, float | None, float]:
    """(Lowered, trace seconds or None, lower seconds) from a Traced or Lowered factory."""
    t0 = time.perf_counter()
    staged = lower()
    t1 = time.perf_counter()
    if hasattr(staged, "lower") and not hasattr(staged, "compile"):  # Traced -> Lowered
        lowered = staged.lower()
        return lowered, t1 - t0, time.perf_counter() - t1
    return staged, None, t1 - t0


_CALLBACK_TARGET = re.compile(r"custom_call @\w*python\w*callback")


def _host_callbacks(lowered: jax.stages.Lowered, text: str) -> bool:
    """Whether the program calls back into Python (`jax.pure_callback`, `jax.debug.print`,
    `io_callback`). The text names such a callback by an index into the lowering's own list of
    Python functions, so two programs with the same text may call different functions. The
    lowering's list says so; where a JAX version lacks it, the callback's target in the text."""
    found = getattr(getattr(lowered, "_lowering", None), "compile_args", {}).get("host_callbacks")
    if found is not None:
        return bool(found)
    return bool(_CALLBACK_TARGET.search(text))


def _text_key(
    lowered: jax.stages.Lowered, devices: tuple, compile_options: dict | None
) -> tuple[str, str]:
    """(sharing key, digest). Same text, devices and pytree signature => the same executable
    is correct to share, unless it calls back into Python: then it is shared by its own key
    only (the sharing key is unique; the digest is the text's)."""
    text = lowered.as_text()
    ident = (
        text,
        repr(devices),
        repr(lowered.in_tree),
        repr(lowered.out_tree),
        repr(sorted((compile_options or {}).items())),
    )
    digest = hashlib.sha256("\x00".join(ident).encode()).hexdigest()
    if _host_callbacks(lowered, text):
        return f"callbacks:{next(_callback_programs)}", digest
    return digest, digest


def _why(parts: Any) -> tuple[str, ...]:
    """Reasons this program differs from the closest one already compiled (same kind first)."""
    if parts is None:
        return ()
    # Every key asked for before, also those whose program was dropped as stale or served by
    # a twin compiled for another experiment, so an edit is explained against what this
    # experiment itself ran; the key itself (asked again after a drop) explains nothing.
    known = [
        k for k in _seen if k != parts and k.kind == parts.kind and k.experiment == parts.experiment
    ]
    old = explain.closest(parts, known)
    return tuple(explain.reasons(old, parts)) if old is not None else ()


def drop(predicate: Callable[[Program], bool], *, by_text: bool = True) -> int:
    """Drop every cached program for which `predicate(program)` holds; returns how many.

    With `by_text=False` only their keys go: an executable stays findable by its program
    text (an edit that traces to the same text, a docstring, reuses it)."""
    with _lock:
        doomed = [k for k, p in _entries.items() if predicate(p)]
        programs = {id(_entries.pop(k)) for k in doomed}
        _proven.difference_update(doomed)
        if not by_text:
            return len(programs)
        texts = [t for t, p in _by_text.items() if predicate(p)]
        for t in texts:
            _by_text.pop(t)
        return len(texts)
