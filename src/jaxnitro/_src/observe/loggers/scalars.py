"""What the scalar backends share: which values are scalars, the tag names, and importing the
optional library a logger needs (a `ConfigError` naming the extra when it is missing)."""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np

from jaxnitro._src.core.errors import ConfigError


def scalar(value: Any) -> float | None:
    """`value` as a finite float, or None for what a scalar sink skips: None, NaN, ±inf,
    strings, arrays with more than one element (a confusion matrix), anything else.

    Example:
        >>> scalar(0.5), scalar(np.float32(2)), scalar(float("nan")), scalar(np.eye(2))
        (0.5, 2.0, None, None)
    """
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        out = float(value)
    elif getattr(value, "shape", None) == () and getattr(value, "dtype", None) is not None:
        if np.dtype(value.dtype).kind not in "biuf":
            return None
        out = float(np.asarray(value))  # a 0-d numpy or jax array
    else:
        return None
    return out if math.isfinite(out) else None


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite scalar values of a `log_metrics` call (the `split` label left out)."""
    out = {}
    for key, value in metrics.items():
        if key == "split":
            continue
        v = scalar(value)
        if v is not None:
            out[str(key)] = v
    return out


def section(context: str, metrics: dict[str, Any]) -> str:
    """The tag prefix of a `log_metrics` call: its context (`train`, `validate`, `data`), or
    `evaluate/<split>` for a `jn.evaluate` line of a split other than 'val'.

    Example:
        >>> section("train", {"loss": 0.3}), section("validate", {"split": "test", "acc": 1.0})
        ('train', 'evaluate/test')
    """
    split = metrics.get("split")
    if isinstance(split, str) and split != "val":
        return f"evaluate/{split}"
    return context


def require(module: str, logger: str, extra: str) -> Any:
    """Import the optional library `module` that `jn.<logger>` needs, else a ConfigError that
    says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"jn.{logger} needs {module}: pip install 'jaxnitro[{extra}]' (importing it "
            f"failed: {e})."
        ) from e
