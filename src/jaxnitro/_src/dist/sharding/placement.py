"""Putting a run's arrays on its mesh: parameters by their specs, optimizer state after its
parameter, and what that costs each device."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxnitro._src.core.errors import ConfigError, warn_user
from jaxnitro._src.core.units import format_bytes
from jaxnitro._src.dist.sharding.rules import Sharding, param_specs


def make_mesh(sharding: Sharding, n_devices: int | None) -> Mesh:
    """The run's mesh: one `data` axis over `n_devices`, or the axes of `Sharding(mesh=...)`."""
    from jaxnitro._src.dist.devices import make_mesh as data_mesh

    if sharding.mesh is None:
        return data_mesh(n_devices)
    sizes = dict(sharding.mesh)
    total = int(np.prod(list(sizes.values())))
    if n_devices is not None and n_devices != total:
        raise ConfigError(
            f"n_devices={n_devices} but Sharding(mesh={sizes}) spans {total} devices; drop "
            f"n_devices or make the axis sizes multiply to it."
        )
    flat = data_mesh(total)  # checks that enough devices are visible
    devices = np.asarray(flat.devices).reshape(tuple(sizes.values()))
    return Mesh(devices, tuple(sizes))


def flax_specs(params) -> Any:
    """Flax partitioning metadata (`nnx.with_partitioning`, `nn.with_partitioning`) as a tree
    of specs, or None when the model has none."""
    try:
        from flax import nnx

        if isinstance(params, nnx.State):
            specs = nnx.get_partition_spec(params)
            leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
            return specs if any(isinstance(x, PartitionSpec) and len(x) for x in leaves) else None
    except Exception:  # noqa: BLE001 - no annotations to honour
        return None
    return None


def param_shardings(params, sharding: Sharding, mesh: Mesh):
    """A tree of `NamedSharding`s for `params` on `mesh`."""
    axes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    specs = param_specs(params, sharding, axes, flax_specs(params))
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def place(tree, shardings):
    """`tree` on the devices, each leaf with its sharding (a fresh copy, never an alias)."""
    return jax.tree.map(
        lambda x, s: to_sharding(x, s) if isinstance(x, (jax.Array, np.ndarray)) else x,
        tree,
        shardings,
    )


def to_sharding(x, sharding):
    """One array (host or device) placed with `sharding`, a fresh copy.

    With several processes a sharding spans devices this process cannot address, and
    `jax.device_put` refuses a device array for it: each process then places its own part of
    its copy of `x` (the same on every process: built from the same seed and data), without
    any cross-process transfer. Typed PRNG keys travel as their key data.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding, may_alias=False)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = np.asarray(jax.random.key_data(x))
        spec = tuple(sharding.spec) + (None,) * (data.ndim - len(tuple(sharding.spec)))
        wide = NamedSharding(sharding.mesh, PartitionSpec(*spec))
        placed = jax.make_array_from_callback(data.shape, wide, lambda index: data[index])
        return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=sharding)(
            placed
        )
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def opt_state_shardings(tx, params, shardings, replicated):
    """The optimizer state's shardings: each copy of a parameter inside it (moments, decay
    anchors) follows that parameter, found by path and shape; counters, hyperparameters and
    masked-out entries are replicated."""
    from jaxnitro._src.optim.groups import path_str

    by_path = {
        path_str(path): (tuple(np.shape(x)), sh)
        for (path, x), sh in zip(
            jax.tree_util.tree_flatten_with_path(params)[0],
            jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)),
            strict=True,
        )
    }
    names = sorted(by_path, key=len, reverse=True)  # the longest (most specific) match first

    def follow(path, leaf):
        where = path_str(path)
        for name in names:
            shape, sh = by_path[name]
            if (where == name or where.endswith("/" + name)) and tuple(leaf.shape) == shape:
                return sh
        return replicated

    abstract = jax.eval_shape(tx.init, params)
    return jax.tree_util.tree_map_with_path(follow, abstract)


def device_bytes(x) -> int:
    """Bytes of one array on one device (its shard), or of a host array."""
    shape = x.sharding.shard_shape(x.shape) if isinstance(x, jax.Array) else np.shape(x)
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


def describe(params) -> list[tuple[str, tuple, str, int, int]]:
    """(path, shape, spec, bytes, bytes per device) of every parameter."""
    from jaxnitro._src.optim.groups import path_str

    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        spec = x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else ""
        total = int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        rows.append((path_str(path), tuple(np.shape(x)), str(spec), total, device_bytes(x)))
    return rows


def check_fsdp(params, sharding: Sharding, n_devices: int, *, threshold: float = 0.05) -> None:
    """Under FSDP, say which arrays stay whole when they hold more than `threshold` of the
    parameter bytes (a dimension the axis does not divide, or a rule that replicates)."""
    if not sharding.fsdp or n_devices <= 1:
        return
    rows = describe(params)
    total = sum(r[3] for r in rows) or 1
    whole = [r for r in rows if r[3] == r[4] and r[3] > sharding.min_shard_bytes]
    share = sum(r[3] for r in whole) / total
    if share > threshold:
        names = ", ".join(f"{r[0]} {r[1]}" for r in whole[:5])
        warn_user(
            f"sharding='fsdp' leaves {share:.0%} of the parameter bytes "
            f"({format_bytes(sum(r[3] for r in whole))}) replicated on every device: {names}. "
            f"No dimension of these divides by the {n_devices} devices; pad the dimension or "
            f"add a Sharding rule for them.",
        )
