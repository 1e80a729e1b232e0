"""A run's params and model state as one flat dict of host arrays keyed by path, and the
way back to the pytrees inside the exported program (which takes flat dicts: framework
objects such as an `nnx.State` or an Equinox module cannot be serialized)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.core.errors import ExportError
from jaxnitro._src.optim.groups import path_str


@dataclasses.dataclass(frozen=True)
class Weights:
    """The run's params and model state as one flat dict of host arrays, and the way back.

    Attributes:
        arrays: ``params/<path>`` and ``state/<path>`` -> host array (typed PRNG keys as
            their raw key data).
        keys: the dict's keys in the pytree's leaf order.
        treedef: the structure of ``{"params": params, "state": state}``.
        prng: key -> PRNG implementation, for leaves stored as key data.
    """

    arrays: dict[str, np.ndarray]
    keys: tuple[str, ...]
    treedef: Any
    prng: Mapping[str, Any]

    def rebuild(self, flat: Mapping[str, Any]) -> tuple[Any, Any]:
        """(params, model state) from a flat dict (inside the traced program)."""
        leaves = [
            jax.random.wrap_key_data(flat[k], impl=self.prng[k]) if k in self.prng else flat[k]
            for k in self.keys
        ]
        tree = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return tree["params"], tree["state"]

    def specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.arrays.items()}


def flatten_weights(params: Any, state: Any) -> Weights:
    """`Weights` of a TrainState's params and model state, keyed ``params/hidden/kernel``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path({"params": params, "state": state})
    arrays: dict[str, np.ndarray] = {}
    prng: dict[str, Any] = {}
    for path, leaf in flat:
        key = path_str(path)
        if key in arrays:
            raise ExportError(
                f"two weights share the path {key!r}; rename one of the model's attributes "
                f"so that every parameter has its own path."
            )
        if jnp.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            prng[key] = jax.random.key_impl(leaf)
            leaf = jax.random.key_data(leaf)
        arrays[key] = np.asarray(jax.device_get(leaf))
    return Weights(arrays, tuple(arrays), treedef, prng)
