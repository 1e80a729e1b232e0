"""Names for the values jaxnitro passes along, as users' type checkers see them.

A user's pytree, model or data source can be anything the user wrote; jaxnitro reads it
through its hooks and never depends on its class. These names say so where a signature takes
one, instead of a bare `Any`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeAlias, TypeVar

from jaxtyping import PyTree as PyTree

# `PyTree` (jaxtyping's): a user's pytree (parameters, model state, optimizer state, a batch's
# arrays). Checkers read it as `Any`, and `PyTree[jax.Array]` says what the leaves are: a
# static type cannot follow the node classes a user registers (NNX states, Equinox modules).


class Experiment(Protocol):
    """An instance of an `@jn.experiment` class: a frozen keyword-only dataclass.

    Checkers see the decorated class as a dataclass (`dataclass_transform`), so passing the
    class itself, or any object that is not an experiment, to `jn.Nitro` is a type error.
    """

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


#: The experiment type a generic handle carries: `jn.Nitro(MyExp())` is a `Nitro[MyExp]`, so
#: `n.experiment.width` is typed.
ExperimentT = TypeVar("ExperimentT", bound=Experiment)
#: An experiment as jaxnitro's internals read it: hooks looked up by name, each optional and
#: checked at setup (`experiment/hooks.py`), which no protocol can list.
Hooked: TypeAlias = Any
#: The model of `jn.split_model`: an NNX, Linen or Equinox description, or a plain apply
#: function (see `experiment/models.py`). No protocol covers all four: `Any` to checkers.
Model: TypeAlias = Any
#: One batch, field name -> array (numpy on the host, jax on the device).
Batch: TypeAlias = Mapping[str, Any]
#: A split's data: a `jn.DataLoader`, a grain source, a Hugging Face dataset, or any
#: re-iterable of dict batches.
Source: TypeAlias = Any

__all__ = ["Batch", "Experiment", "ExperimentT", "Hooked", "Model", "PyTree", "Source"]
