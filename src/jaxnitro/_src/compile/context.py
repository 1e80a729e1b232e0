"""What a trace reads besides the code and its inputs: JAX's configuration and the environment.

`jax.config.update("jax_enable_x64", True)` or `jax_default_matmul_precision="highest"`
changes what the same code lowers to, and so may a value read from `os.environ` while
tracing. Both go into a program's key (JAX's own jit cache keys on its trace-time flags
too), each cheap enough to read at every entry-point call: the flags are read from JAX's
trace context, and the environment is compared with its last snapshot (a digest is computed
only when it changed).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from jaxnitro._src.compile import dict_version

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["environment", "environment_changes", "jax_flags", "unchanged"]

_last_flags: list[Any] = [None, ()]
_trace_context: list[Any] = [None]  # JAX's `trace_context`, once found


def jax_flags() -> tuple[tuple[str, str], ...]:
    """(flag, repr of its value) of every JAX flag that changes tracing or lowering.

    Example:
        >>> dict(jax_flags())["jax_enable_x64"]
        'False'
    """
    read = _trace_context[0]
    if read is not None:  # (an entry point calls this at every call: no import statement)
        values = read()
        if values == _last_flags[0]:
            return _last_flags[1]
    try:
        from jax._src import config as jax_config

        values = jax_config.trace_context()
        _trace_context[0] = jax_config.trace_context
        if values == _last_flags[0]:
            return _last_flags[1]
        names = jax_config.trace_context_names()
        flags = tuple(
            (name, repr(value))
            for name, value in zip(names, values, strict=False)
            if name.startswith("jax_")
        )
    except (ImportError, AttributeError):  # another JAX: the flags the docs name
        import jax

        values = None
        flags = tuple((name, repr(getattr(jax.config, name, None))) for name in _KNOWN_FLAGS)
    _last_flags[:] = [values, flags]
    return flags


_KNOWN_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_softmax_custom_jvp",
    "jax_disable_jit",
)

# digest -> the environment it was computed from (for naming a changed variable)
_snapshots: OrderedDict[str, dict[str, str]] = OrderedDict()
_last_env: list[Any] = [None, ""]


def environment() -> str:
    """A digest of `os.environ` (a value read from it while tracing may change the program).

    Example:
        >>> environment() == environment()
        True
    """
    # (inline: an entry point calls this at every call) os.environ's own dict, else a copy
    raw = getattr(os.environ, "_data", None)
    if type(raw) is not dict:
        raw = dict(os.environ)
    if raw == _last_env[0]:
        return _last_env[1]
    snap = dict(os.environ)
    digest = hashlib.sha256(repr(sorted(snap.items())).encode()).hexdigest()[:32]
    _last_env[:] = [dict(raw), digest]
    _snapshots[digest] = snap
    _snapshots.move_to_end(digest)
    while len(_snapshots) > 64:
        _snapshots.popitem(last=False)
    return digest


def unchanged(flags: tuple, env: str) -> Callable[[], bool]:
    """A check that `jax_flags()` still gives `flags` and `environment()` still `env`: the
    raw values compared (JAX's trace context, `os.environ`'s own dict), no call of either;
    the environment's dict is compared only when its version moved (`dict_version`).
    Where the current values are not those, or cannot be read raw, it calls both.

    A check that compares raw values has `.common`: `(read, values, version, seen)`, for a
    caller on a hot path to inline the common case (`read() == values` and `version.value
    == seen[0]`), calling the check itself only where the version moved.

    Example:
        >>> same = unchanged(jax_flags(), environment())
        >>> same()
        True
    """
    current = (jax_flags(), environment())  # (the first call finds JAX's trace context)
    read, raw = _trace_context[0], getattr(os.environ, "_data", None)
    if read is None or type(raw) is not dict or current != (flags, env):
        return lambda: jax_flags() == flags and environment() == env
    values, snapshot = read(), dict(raw)
    version = dict_version.tag(raw)
    if version is None:
        return lambda: read() == values and raw == snapshot
    seen = [version.value]  # a version of `raw` known to equal `snapshot`

    def same() -> bool:
        if read() != values:
            return False
        now = version.value  # (read before comparing: a change after it moves it again)
        if now != seen[0]:  # changed, maybe set and set back: compare the contents
            if raw != snapshot:
                return False
            seen[0] = now
        return True

    same.common = (read, values, version, seen)  # type: ignore[attr-defined]
    return same


def environment_changes(old: str, new: str) -> list[str]:
    """The variables that differ between two `environment()` digests (empty: not known)."""
    a, b = _snapshots.get(old), _snapshots.get(new)
    if a is None or b is None:
        return []
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def environment_value(digest: str, name: str) -> str | None:
    """The value `name` had in the environment of `digest` (None: unset or not known)."""
    return _snapshots.get(digest, {}).get(name)
