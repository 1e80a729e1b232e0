"""The bundle format: file names, versions, `TensorSpec` and the manifest's tensor entries.

A bundle is a directory of three files:

- ``manifest.json``: name, inputs and outputs (name, dtype, shape with ``"batch"`` first),
  platforms, provenance, and the sha256 of every other file;
- ``weights.safetensors``: one entry per parameter and model-state leaf, keyed by path
  (``params/hidden/kernel``, ``state/bn/mean``);
- ``model.jaxexport``: the serialized `jax.export` program
  ``(weights: dict[str, Array], inputs: dict[str, Array]) -> dict[str, Array]``.

This module is shared by the writer and the loader, and imports neither.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

FORMAT = "jaxnitro-bundle"
#: Bumped when a reader of an older version could misread a bundle of this one.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
PROGRAM = "model.jaxexport"
#: The symbolic leading dimension of every input and output.
BATCH = "batch"
#: A model name: it goes into URLs such as /v2/models/<name>.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
#: Platform names jax.export lowers for.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def dtype_name(dtype: Any) -> str:
    """The manifest's name of a dtype: numpy's name (``float32``, ``bfloat16``, ``uint8``).

    Example:
        >>> dtype_name(jnp.bfloat16)
        'bfloat16'
    """
    return np.dtype(dtype).name


def parse_dtype(name: str) -> np.dtype:
    """The dtype a manifest names (bfloat16 and the other ml_dtypes included)."""
    return np.dtype(jnp.dtype(name))


@dataclasses.dataclass(frozen=True, init=False)
class TensorSpec:
    """One input or output of an exported model, per example (the batch dimension is not
    part of ``shape``; every tensor has one, first, of any size >= 1).

    Args:
        dtype: a numpy or jax dtype, or its name (``"float32"``, ``"uint8"``, ``"bfloat16"``).
        shape: the per-example shape, e.g. ``(28, 28)``; ``()`` for one scalar per example.

    Example:
        >>> jn.TensorSpec("uint8", (28, 28))
        TensorSpec(dtype='uint8', shape=(28, 28))
    """

    dtype: np.dtype
    shape: tuple[int, ...]

    def __init__(self, dtype: Any, shape: Sequence[int] = ()) -> None:
        try:
            dt = np.dtype(jnp.dtype(dtype))
        except TypeError as e:
            raise TypeError(
                f"TensorSpec dtype {dtype!r} is not a dtype; pass e.g. np.float32 or 'uint8'."
            ) from e
        if isinstance(shape, int) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise TypeError(
                f"TensorSpec shape must be a tuple of ints >= 0 (per example, without the batch "
                f"dimension), got {shape!r}; e.g. TensorSpec('float32', (28, 28))."
            )
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    def __repr__(self) -> str:
        return f"TensorSpec(dtype={dtype_name(self.dtype)!r}, shape={self.shape})"

    def entry(self, name: str) -> dict:
        """The manifest entry: ``{"name", "dtype", "shape": ["batch", ...]}``."""
        return {"name": name, "dtype": dtype_name(self.dtype), "shape": [BATCH, *self.shape]}

    @classmethod
    def from_entry(cls, entry: Any, where: str) -> tuple[str, TensorSpec]:
        """(name, spec) of a manifest entry; ValueError naming ``where`` if malformed."""
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and entry["shape"][:1] == [BATCH]
        )
        if not ok:
            raise ValueError(
                f"{where} entry {entry!r} is not {{'name': str, 'dtype': str, 'shape': "
                f"['batch', ...]}}"
            )
        return entry["name"], cls(parse_dtype(entry["dtype"]), entry["shape"][1:])
