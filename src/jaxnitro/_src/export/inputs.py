"""A bundle's inputs on the way in: exact dtypes (float64 is never cast down), per-example
shapes, one batch size, and the power-of-two bucket a batch is padded to."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxnitro._src.core.errors import BundleInputError
from jaxnitro._src.export.format import TensorSpec


def as_input(name: str, value: Any, spec: TensorSpec) -> np.ndarray:
    """``value`` as a host array of the spec's dtype and shape, or an error naming both."""
    if type(value) is np.ndarray and value.dtype == spec.dtype and value.shape[1:] == spec.shape:
        if value.ndim == 1 + len(spec.shape) and value.shape[0] >= 1:  # the common case, fast
            return value
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        arr = np.asarray(value)
        if arr.dtype != spec.dtype:
            raise BundleInputError(
                f"input {name!r}: expected dtype {spec.dtype}, got {arr.dtype}; the bundle does "
                f"not cast silently. Convert it: {name}.astype({_dtype_code(spec.dtype)})."
            )
    else:  # a list or a Python number carries no precision of its own
        arr = np.asarray(value)
        if arr.dtype.kind not in _KINDS.get(spec.dtype.kind, spec.dtype.kind):
            raise BundleInputError(
                f"input {name!r}: expected {signature(spec)}, got {arr.dtype} values; pass "
                f"np.asarray(..., dtype={_dtype_code(spec.dtype)})."
            )
        arr = arr.astype(spec.dtype)
    if arr.ndim != 1 + len(spec.shape) or arr.shape[1:] != spec.shape:
        hint = " Add the batch dimension: x[None]." if arr.shape == spec.shape else ""
        raise BundleInputError(
            f"input {name!r}: expected shape {signature(spec)} (any batch >= 1), got "
            f"{list(arr.shape)}.{hint}"
        )
    if arr.shape[0] < 1:
        raise BundleInputError(f"input {name!r}: the batch is empty; pass at least one row.")
    return arr


def signature(spec: TensorSpec) -> str:
    """'float32[batch, 8]'."""
    return f"{spec.dtype}[{', '.join(['batch', *map(str, spec.shape)])}]"


#: Which kinds of list values convert to a dtype kind without losing meaning.
_KINDS = {"f": "biuf", "V": "biuf", "c": "biufc", "i": "biu", "u": "bu", "b": "b"}


def _dtype_code(dtype: np.dtype) -> str:
    return "ml_dtypes.bfloat16" if dtype.name == "bfloat16" else f"np.{dtype.name}"


def batch_size(inputs: dict[str, np.ndarray]) -> int:
    sizes = {k: v.shape[0] for k, v in inputs.items()}
    if len(set(sizes.values())) > 1:
        raise BundleInputError(
            f"inputs have different batch sizes {sizes}; every input needs one row per example."
        )
    return next(iter(sizes.values()))


def bucket(size: int, cap: int) -> int:
    """The next power of two (at most ``cap``): log2(cap) + 2 programs for every size."""
    b = 1
    while b < size:
        b *= 2
    return min(b, cap)
