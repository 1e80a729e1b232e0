"""`jsonable`: the one sanitiser for what goes to JSON (logs, checkpoint meta, run records),
and `parse_json`, the one reader of JSON files jaxnitro did not necessarily write."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["jsonable", "parse_json"]


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


def parse_json(text: str | bytes, *, max_depth: int | None = None) -> Any:
    """``json.loads(text)``, where a document nested too deeply is a ``ValueError`` too.

    The json module raises ``RecursionError`` for deep nesting (``[[[[...``), which a caller
    catching ``ValueError`` for a damaged file misses. ``max_depth`` also refuses a document
    that parses but nests deeper than that (a later ``copy.deepcopy`` or walk of it would
    hit the recursion limit instead).

    Example:
        >>> parse_json('{"a": [1, 2]}')
        {'a': [1, 2]}
        >>> parse_json("[" * 100_000)
        Traceback (most recent call last):
        ValueError: the JSON is nested too deeply (more levels than Python's recursion limit)
    """
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(
            "the JSON is nested too deeply (more levels than Python's recursion limit)"
        ) from None
    if max_depth is not None:
        level = [doc]
        for _ in range(max_depth + 1):  # breadth first, no recursion
            level = [
                v
                for x in level
                if isinstance(x, dict | list)
                for v in (x.values() if isinstance(x, dict) else x)
            ]
            if not level:
                return doc
        raise ValueError(f"the JSON is nested more than {max_depth} levels deep")
    return doc
