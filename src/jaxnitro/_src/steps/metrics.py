"""Exact metrics: each is (sum, count); totals are summed over all batches and divided once.

`count=None` means summed and never divided (e.g. a confusion matrix). Accumulation happens
inside the compiled eval step, so a whole split costs one read-back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.core.errors import MetricsError

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree


def _describe(value: Any) -> str:
    """'an array of shape (32,) (float32)' for arrays and tracers, else the type name."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"an array of shape {tuple(shape)} ({dtype})"
    return type(value).__name__


def _numeric(hook: str, name: str, part: str, value: Any) -> jax.Array:
    try:
        arr = jnp.asarray(value)
    except (TypeError, ValueError):
        arr = None
    if arr is None or not (jnp.issubdtype(arr.dtype, jnp.number) or arr.dtype == jnp.bool_):
        raise MetricsError(
            f"{hook}() returned a {part} for {name!r} that is not numeric ({value!r:.60}); the "
            f"sum and the count are numbers or arrays, e.g. (correct.sum(), label.shape[0])."
        )
    return arr


def normalize(out: Any, hook: str = "metrics") -> dict[str, tuple[Any, Any]]:
    """Check a metrics hook's result and return {name: (sum, count or None)} as arrays."""
    if not isinstance(out, Mapping):
        raise MetricsError(
            f"{hook}() must return a dict name -> (sum, count), got {_describe(out)}. "
            f"Example: return {{'acc': ((logits.argmax(-1) == label).sum(), label.shape[0])}}"
        )
    result = {}
    for name, value in out.items():
        if not isinstance(name, str):
            raise MetricsError(
                f"{hook}() returned a non-string metric name {name!r}; name "
                f"metrics with strings, e.g. {{'acc': (correct, count)}}."
            )
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            what = (
                f"a {len(value)}-element {type(value).__name__}"
                if isinstance(value, (tuple, list))
                else _describe(value)
            )
            raise MetricsError(
                f"{hook}() returned {name!r} as {what}; each metric is "
                f"(sum, count), e.g. {name!r}: (correct.sum(), label.shape[0]), or (total, None) "
                f"for a value that is summed and never divided."
            )
        total, count = value
        total = _numeric(hook, name, "sum", total)
        if count is not None:
            count = _numeric(hook, name, "count", count)
            if count.ndim != 0:
                raise MetricsError(
                    f"{hook}() returned a count of shape {count.shape} for {name!r}; a count "
                    f"is a scalar (the number of samples or tokens the sum covers), e.g. "
                    f"label.shape[0] or mask.sum()."
                )
        result[name] = (_widen(total), None if count is None else _widen(count))
    return result


def _widen(x: Any) -> jax.Array:
    # Sums over a whole split: integers in int32 stay exact; floats accumulate in float32.
    if jnp.issubdtype(x.dtype, jnp.bool_):
        return x.astype(jnp.int32)
    return x


def zeros_like_totals(shapes: Any) -> dict:
    """Zero totals with the structure of `normalize`'s output (from `jax.eval_shape`)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def add(totals: Any, batch: Batch) -> PyTree:
    """Add one batch's (sum, count) pairs into running totals, inside the compiled step."""
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), totals, batch)


def finalize(totals: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Divide counted metrics once; scalars become Python floats.

    Example:
        >>> finalize({"acc": (np.float32(45), np.int32(50)), "top": (np.float32(2.5), None)})
        {'acc': 0.9, 'top': 2.5}
    """
    values = {}
    for name, (total, count) in totals.items():
        total = np.asarray(total)
        if count is None:
            values[name] = _scalar(total)
        else:
            c = np.asarray(count)
            values[name] = _scalar(total / c) if c != 0 else float("nan")
    return values


def _scalar(x: Any) -> Any:
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else x
