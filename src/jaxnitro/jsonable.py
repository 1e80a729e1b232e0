"""`jsonable`: the one sanitiser for what goes to JSON (logs, checkpoint meta, run records)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """``value`` as plain data that ``json.dumps(..., allow_nan=False)`` accepts.

    numpy/jax scalars and 0-d arrays become Python numbers, other arrays nested lists,
    non-finite floats ``None`` (JSON has no NaN/inf), mapping keys strings, tuples lists;
    anything else (a set, an object, a PRNG key array) becomes its ``repr``.

    Example:
        >>> jsonable({"loss": np.float32(0.5), 1: (float("nan"), np.arange(2))})
        {'loss': 0.5, '1': [None, [0, 1]]}
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)  # np.str_ as a plain str
    if isinstance(value, int):
        return int(value)  # an IntEnum or other int subclass as the plain number
    if isinstance(value, float):  # np.float64 is a float subclass
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "__array__"):
        try:
            arr = np.asarray(value)
        except Exception:  # noqa: BLE001 - e.g. typed PRNG keys refuse conversion
            return repr(value)
        if arr.dtype.kind not in "biufcUSO":
            try:  # bfloat16 and other ml_dtypes report kind "V"
                arr = arr.astype(np.float64)
            except (TypeError, ValueError):
                return repr(value)
        plain = arr.item() if arr.ndim == 0 else arr.tolist()
        if hasattr(plain, "__array__"):  # .item() gave a numpy scalar back: no progress
            return repr(value)
        return jsonable(plain)
    return repr(value)
