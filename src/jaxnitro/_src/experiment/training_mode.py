"""The mode a model runs in: `mode(train=..., rng=...)` sets, for `apply` calls in this thread,
whether dropout is active and batch statistics update, and the key each call's dropout
draws from. The framework enters it while tracing a step; anywhere else a call is
deterministic inference."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import jax

from jaxnitro._src.core.errors import ConfigError


@dataclasses.dataclass
class _Mode:
    train: bool
    rng: jax.Array | None
    calls: int = 0  # apply() calls so far in this block; folded into each call's key


_local = threading.local()


def _current() -> _Mode | None:
    return getattr(_local, "mode", None)


@contextlib.contextmanager
def mode(*, train: bool, rng: jax.Array | None = None) -> Iterator[None]:
    """Set train/eval mode and the dropout key for `apply` calls in this thread.

    Blocks nest; leaving one restores the enclosing mode. The per-call key counter
    starts afresh on entry, so tracing the same step twice yields the same keys.

    Example:
        >>> with mode(train=True, rng=jax.random.key(0)):
        ...     outputs, state = jn.apply(model, params, state, x)  # dropout active
    """
    if not isinstance(train, bool):
        # A traced or array flag cannot choose a Python code path at trace time.
        raise ConfigError(
            f"mode(train=...) needs a Python bool, got {type(train).__name__}. "
            "Pass train=True or train=False."
        )
    previous = _current()
    _local.mode = _Mode(train, rng)
    try:
        yield
    finally:
        _local.mode = previous


def is_training() -> bool:
    """Return whether the current thread is inside `mode(train=True)`.

    Example:
        >>> with mode(train=True):
        ...     is_training()
        True
    """
    current = _current()
    return current is not None and current.train


def next_key() -> jax.Array | None:
    """Return a fresh key for one `apply` call, or None when the mode has no rng."""
    current = _current()
    if current is None or current.rng is None:
        return None
    # Two applications of one model in a step (e.g. two augmented views) must not
    # share a dropout mask, so every call gets its own key.
    key = jax.random.fold_in(current.rng, current.calls)
    current.calls += 1
    return key
