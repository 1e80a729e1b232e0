"""What a batch is, checked: a dict of batch-first arrays, one batch size, the same fields and
per-sample shapes in every batch of a split (one compiled program); padding a short batch to
the program's size, and the sharding that splits the batch axis over the `data` mesh axis
(so multi-device runs change nothing else)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxnitro._src.core.errors import DataError, warn_user


def as_array(name: str, value) -> np.ndarray:
    if isinstance(value, jax.Array):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        # Numbers (numpy scalars included) become 0-d arrays, which the callers refuse as
        # scalars ("batch dimension first"), not as "not an array".
        if isinstance(value, (list, tuple, np.generic, int, float, complex)):
            value = np.asarray(value)
        else:
            raise DataError(
                f"batch field {name!r} is a {type(value).__name__}, not an array. Batch fields "
                f"are numpy/jax arrays; convert it with np.asarray, or drop it from the batch."
            )
    if value.dtype == object or value.dtype.kind in "OUSV":
        raise DataError(
            f"batch field {name!r} has dtype {value.dtype}, which cannot go to a device. Encode "
            f"it as numbers (e.g. token ids or class indices) before batching."
        )
    return value


def check_batch(batch, split: str, *, expect_fields: frozenset | None = None) -> int:
    """Validate one host batch; return its batch size (the shared leading dimension).

    Example:
        >>> check_batch({"img": np.zeros((8, 784)), "label": np.zeros(8)}, "train")
        8
    """
    if not isinstance(batch, Mapping):
        raise DataError(
            f"the {split!r} split yielded a {type(batch).__name__}; batches are dicts of arrays "
            f"such as {{'img': x, 'label': y}}. Wrap your arrays in jn.DataLoader."
        )
    if expect_fields is not None and frozenset(batch) != expect_fields:
        raise DataError(
            f"the {split!r} batch fields changed mid-run: expected {sorted(expect_fields)}, got "
            f"{sorted(batch)}. Every batch of a split must carry the same fields."
        )
    sizes = {}
    for k, v in batch.items():
        v = as_array(k, v)
        if v.ndim == 0:
            raise DataError(
                f"batch field {k!r} of split {split!r} is a scalar; batch dimension "
                f"first: give it one row per sample (e.g. np.full(batch_size, value)), "
                f"or make it an experiment field (jn.Device for a traced value)."
            )
        sizes[k] = v.shape[0]
    if len(set(sizes.values())) > 1:
        raise DataError(
            f"the {split!r} batch fields disagree on the batch size (leading dimension): {sizes}. "
            f"Every field of a batch needs one row per sample (batch dimension first): slice "
            f"all fields with the same indices, or use jn.DataLoader, which does."
        )
    if not sizes:
        raise DataError(
            f"the {split!r} split yielded an empty batch (a dict with no fields). "
            f"Yield dicts of arrays such as {{'img': x, 'label': y}}."
        )
    return next(iter(sizes.values()))


def batch_specs(batch: Mapping[str, Any], split: str) -> dict[str, tuple[tuple, np.dtype]]:
    """{field: (per-sample shape, dtype as the device sees it)} of a split's first batch.

    With x64 off (JAX's default) float64 and int64 arrays run as float32 and int32; a float64
    field says so once, since it doubles every transfer and hides a precision choice.
    """
    specs = {}
    for k, v in batch.items():
        dtype = np.dtype(getattr(v, "dtype", None) or np.asarray(v).dtype)
        canonical = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
        if dtype == np.float64 and canonical != dtype:
            warn_user(
                f"split {split!r}: field {k!r} is float64; JAX computes in float32 (x64 is "
                f"off), so every batch is cast. Convert it once (x.astype(np.float32)) to "
                f"silence this and halve the transfer.",
            )
        specs[k] = (tuple(np.shape(v)[1:]), canonical)
    return specs


def check_specs(batch: Mapping[str, Any], split: str, index: int, specs: Mapping) -> None:
    """A later batch must match the first one's per-sample shapes and dtypes (one program)."""
    for k, (shape, dtype) in specs.items():
        v = batch[k]
        got_shape = tuple(np.shape(v)[1:])
        raw = np.dtype(getattr(v, "dtype", None) or np.asarray(v).dtype)
        got = np.dtype(jax.dtypes.canonicalize_dtype(raw))
        if got_shape != shape or got != dtype:
            raise DataError(
                f"batch {index} of split {split!r}: field {k!r} has per-sample shape "
                f"{got_shape} and dtype {raw}, but the split's first batch had {shape} and "
                f"{dtype}. Every batch of a split shares one program: make the field the same "
                f"shape and dtype in every batch (pad or crop features, cast with .astype)."
            )


def check_same_specs(
    specs: Mapping, reference: Mapping, split: str, against: str = "train"
) -> None:
    """Fields a split shares with the `against` split must match its per-sample shape and
    dtype (the model is the same): said at setup, before JAX fails inside `forward`."""
    for k in sorted(specs.keys() & reference.keys()):
        (shape, dtype), (ref_shape, ref_dtype) = specs[k], reference[k]
        if shape != ref_shape or dtype != ref_dtype:
            raise DataError(
                f"split {split!r}: field {k!r} has per-sample shape {shape} and dtype {dtype}, "
                f"but the {against!r} split has {ref_shape} and {ref_dtype}. The same model "
                f"reads both: build the splits with the same features (same preprocessing)."
            )


def pad_batch(batch: Mapping[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """Pad to `size` rows by repeating the last row (real values: no NaN from zeros).

    Example:
        >>> pad_batch({"x": np.arange(3)}, 5)["x"]
        array([0, 1, 2, 2, 2])
    """
    out = {}
    for k, v in batch.items():
        n = v.shape[0]
        if n == size:
            out[k] = v
        else:
            fill = np.repeat(v[-1:], size - n, axis=0)
            out[k] = np.concatenate([np.asarray(v), fill], axis=0)
    return out


def batch_sharding(mesh, *, axis: int = 0) -> NamedSharding:
    """The batch axis (leading, or after `axis` stacking axes) split over the `data` mesh axis."""
    return NamedSharding(mesh, PartitionSpec(*([None] * axis), "data"))
