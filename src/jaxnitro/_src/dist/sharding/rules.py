"""Which `PartitionSpec` each parameter gets: user rules, Flax annotations, then FSDP.

The FSDP rule is the robust one: an array of at most `min_shard_bytes` (4 MiB) is replicated
(splitting it saves little and costs a gather); a larger one is split along its largest
dimension that the `data` axis divides; one that no axis divides is replicated (and reported).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxnitro._src.core.errors import ConfigError

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a run splits its arrays over the devices.

    Attributes:
        mesh: axis name -> size, e.g. {"data": 4, "model": 2} (None: one `data` axis over
            the run's devices). The product is the number of devices used; `data` is required
            (batches are split over it).
        rules: (regex on the parameter path, PartitionSpec), e.g.
            ``[(r"mlp/.*kernel", P(None, "model"))]``; a path that two rules match is an error.
        fsdp: split every parameter over `data` by the FSDP rule (after rules and annotations).
        min_shard_bytes: arrays up to this size stay replicated under FSDP.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> s = jn.Sharding(mesh={"data": 4, "model": 2}, rules=[(r"out/kernel", P(None, "model"))])
        >>> n = jn.Nitro(MyGPT(), sharding=s)
    """

    mesh: Mapping[str, int] | None = None
    rules: Sequence[tuple[str, Any]] = ()
    fsdp: bool = False
    min_shard_bytes: int = 4 * _MIB

    def __post_init__(self):
        if self.mesh is not None:
            if not isinstance(self.mesh, Mapping) or "data" not in self.mesh:
                raise ConfigError(
                    f"Sharding(mesh={self.mesh!r}): give axis sizes as a dict with a 'data' "
                    f"axis, e.g. mesh={{'data': 4, 'model': 2}}."
                )
            for axis, size in self.mesh.items():
                if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                    raise ConfigError(
                        f"Sharding mesh axis {axis!r} has size {size!r}; sizes are positive "
                        f"ints, e.g. mesh={{'data': 4, 'model': 2}}."
                    )
        for rule in self.rules:
            if not (
                isinstance(rule, tuple)
                and len(rule) == 2
                and isinstance(rule[0], str)
                and isinstance(rule[1], PartitionSpec)
            ):
                raise ConfigError(
                    f"Sharding rule {rule!r} must be (regex on the parameter path, "
                    f"PartitionSpec), e.g. (r'mlp/.*kernel', P(None, 'model'))."
                )
            try:
                re.compile(rule[0])
            except re.error as e:
                raise ConfigError(
                    f"Sharding rule {rule[0]!r} is not a valid regex ({e}); fix the pattern."
                ) from e

    def describe(self) -> str:
        kind = "fsdp" if self.fsdp else "dp"
        return (
            kind
            + (f", mesh {dict(self.mesh)}" if self.mesh else "")
            + (f", {len(self.rules)} rule(s)" if self.rules else "")
        )


def resolve(value) -> Sharding:
    """`"dp"`, `"fsdp"` or a `jn.Sharding` as a `Sharding`."""
    if isinstance(value, Sharding):
        return value
    if value in (None, "dp"):
        return Sharding()
    if value == "fsdp":
        return Sharding(fsdp=True)
    raise ConfigError(
        f"sharding={value!r}; use 'dp' (replicated parameters, the default), 'fsdp' "
        f"(parameters and optimizer state split over the devices) or jn.Sharding(...)."
    )


def spec_for(shape: tuple, nbytes: int, axis_size: int, min_bytes: int) -> PartitionSpec:
    """The FSDP spec of one array: its largest dimension the `data` axis divides."""
    if axis_size <= 1 or nbytes <= min_bytes:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[dim] % axis_size == 0:
            return PartitionSpec(*([None] * dim), "data")
    return PartitionSpec()


def param_specs(params, sharding: Sharding, axes: Mapping[str, int], annotated=None) -> Any:
    """A tree of `PartitionSpec`s matching `params`: the first of a user rule, a Flax
    partitioning annotation (`annotated`, a tree of specs or None), the FSDP rule, replicated."""
    from jaxnitro._src.optim.groups import path_str

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    notes = _annotations(annotated, len(flat))
    specs = []
    for (path, leaf), note in zip(flat, notes, strict=True):
        name = path_str(path)
        shape = tuple(np.shape(leaf))
        hits = [(pat, spec) for pat, spec in sharding.rules if re.search(pat, name)]
        if len(hits) > 1:
            raise ConfigError(
                f"parameter {name!r} matches two sharding rules, {hits[0][0]!r} and "
                f"{hits[1][0]!r}; make the patterns exclusive (anchor them, e.g. '^mlp/')."
            )
        if hits:
            spec = hits[0][1]
        elif note is not None:
            spec = note
        elif sharding.fsdp:
            nbytes = int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
            spec = spec_for(shape, nbytes, axes.get("data", 1), sharding.min_shard_bytes)
        else:
            spec = PartitionSpec()
        specs.append(_checked(name, shape, spec, axes))
    return jax.tree.unflatten(treedef, specs)


def _annotations(annotated, count: int) -> list:
    if annotated is None:
        return [None] * count
    leaves = jax.tree.leaves(annotated, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)
    if len(leaves) != count:
        return [None] * count
    return [x if isinstance(x, PartitionSpec) and len(x) else None for x in leaves]


def _checked(name: str, shape: tuple, spec: PartitionSpec, axes: Mapping[str, int]):
    if len(spec) > len(shape):
        raise ConfigError(
            f"parameter {name!r} of shape {shape} got the spec {spec}, which names more "
            f"dimensions than it has; give one entry per dimension (None to keep it whole)."
        )
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        size = 1
        for axis in names:
            if axis is None:
                continue
            if axis not in axes:
                raise ConfigError(
                    f"parameter {name!r}: its spec {spec} names mesh axis {axis!r}, but the "
                    f"mesh has {sorted(axes)}; add the axis to Sharding(mesh=...) or fix the rule."
                )
            size *= axes[axis]
        if shape[dim] % size:
            raise ConfigError(
                f"parameter {name!r}: dimension {dim} of shape {shape} ({shape[dim]}) does not "
                f"divide by the {size} devices of {entry!r} in its spec {spec}; change the rule "
                f"or the mesh."
            )
    return spec
