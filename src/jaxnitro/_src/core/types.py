"""Names for the values jaxnitro passes along without knowing their type.

A user's pytree, experiment, model or data source can be anything the user wrote; jaxnitro
reads it through its hooks and never depends on its class. These aliases say so where a
signature takes one, instead of a bare `Any`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

#: A user's pytree: parameters, model state, optimizer state, a batch's arrays.
PyTree: TypeAlias = Any
#: The user's experiment: an instance of any class with jaxnitro's hooks and fields.
Experiment: TypeAlias = Any
#: The model of `jn.split_model`: an NNX, Linen or Equinox description, or a plain apply
#: function (see `experiment/models.py`).
Model: TypeAlias = Any
#: One batch, field name -> array (numpy on the host, jax on the device).
Batch: TypeAlias = Mapping[str, Any]
#: A split's data: a `jn.DataLoader`, a grain source, a Hugging Face dataset, or any
#: re-iterable of dict batches.
Source: TypeAlias = Any

__all__ = ["Batch", "Experiment", "Model", "PyTree", "Source"]
