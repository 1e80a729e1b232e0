"""Leaves between device and disk: a leaf copied to host memory with its JSON spec (`stage`,
`_to_host`), and a tree rebuilt from stored arrays, with a template (`_check_template`,
`_assemble`) or without one (`_nest`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.checkpoint.format import is_prng_key as _is_prng_key
from jaxnitro._src.core.errors import CheckpointError


class _Staged:
    """A leaf already copied to the host (`stage`): its array to store and its JSON spec."""

    __slots__ = ("array", "spec")

    def __init__(self, array: np.ndarray, spec: dict) -> None:
        self.array, self.spec = array, spec


def stage(trees: dict[str, Any]) -> dict[str, Any]:
    """The trees with every leaf copied to host memory now (their device buffers may be
    donated to the next train step while a background write still runs)."""

    def copy(kp: Any, leaf: Any, name: Any) -> _Staged:
        arr, spec = _to_host(f"{name}{jax.tree_util.keystr(kp)}", leaf)
        return _Staged(np.array(arr, copy=True), spec)

    return {
        name: jax.tree_util.tree_map_with_path(lambda kp, x, n=name: copy(kp, x, n), tree)
        for name, tree in trees.items()
    }


def _to_host(where: str, leaf: Any) -> tuple[np.ndarray, dict]:
    """Leaf -> (numpy array to store, JSON spec). Typed PRNG keys are stored as key_data."""
    if isinstance(leaf, _Staged):
        return leaf.array, leaf.spec
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise CheckpointError(
            f"leaf {where} is an abstract ShapeDtypeStruct; save the real arrays (a "
            "ShapeDtypeStruct only describes one, e.g. as a load_checkpoint template)"
        )
    if _is_prng_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        spec = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "prng_impl": impl}
        return np.asarray(jax.random.key_data(leaf)), spec
    arr = np.asarray(leaf)  # Python scalars become 0-d arrays
    if arr.dtype.kind in "OUS":  # (bfloat16 reports kind "V", so list the bad kinds)
        raise CheckpointError(
            f"leaf {where} ({type(leaf).__name__}) is not a numeric array; keep strings and "
            "objects out of the saved trees (put plain values in meta=)"
        )
    return arr, {"shape": list(arr.shape), "dtype": str(arr.dtype), "prng_impl": None}


@functools.cache
def _key_data_layout(impl: str) -> tuple[tuple, str]:
    kd = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return tuple(kd.shape), str(kd.dtype)


def _stored_layout(leaf: dict) -> tuple[tuple, str]:
    """(shape, dtype) of the array Orbax holds for a meta.json leaf spec (keys as key data)."""
    if leaf["prng_impl"]:
        trailing, dtype = _key_data_layout(leaf["prng_impl"])
        return tuple(leaf["shape"]) + trailing, dtype
    return tuple(leaf["shape"]), str(jnp.dtype(leaf["dtype"]))


def _nest(entries: list[tuple[list, np.ndarray]]) -> Any:
    """Plain nested dicts/lists rebuilt from stored key paths (used when there is no template)."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]  # the whole tree was a single leaf
    root: dict = {}
    for keys, value in entries:
        node = root
        for kind, key in keys[:-1]:
            node = node.setdefault((kind, key), {})
        node[tuple(keys[-1])] = value

    def freeze(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(kind in ("i", "f") for kind, _ in node):
            return [freeze(node[k]) for k in sorted(node, key=lambda kk: kk[1])]
        return {key: freeze(v) for (_, key), v in node.items()}

    return freeze(root)


def _like(template_leaf: Any, arr: np.ndarray, spec: dict) -> Any:
    """Turn a restored array into the kind of value the template leaf is."""
    if isinstance(template_leaf, bool | int | float | complex):
        return type(template_leaf)(arr.item())
    if isinstance(template_leaf, np.ndarray | np.generic):
        return arr if isinstance(template_leaf, np.ndarray) else arr[()]
    value: Any = arr
    if spec["prng_impl"] and _is_prng_key(template_leaf):  # (wrap_key_data takes numpy too)
        value = jax.random.wrap_key_data(value, impl=spec["prng_impl"])
    sharding = getattr(template_leaf, "sharding", None)  # honour the caller's placement
    if sharding is None:
        return jnp.asarray(value)
    if not sharding.is_fully_addressable:  # several processes: each places its own part
        from jaxnitro._src.dist.sharding import to_sharding

        return to_sharding(value, sharding)
    return jax.device_put(value, sharding)


def _check_template(ckpt: Path, name: str, template: Any, leaves: list[dict]) -> None:
    """Compare a template with meta.json's leaf specs, before any array is read."""
    wanted = {
        jax.tree_util.keystr(p): leaf
        for p, leaf in jax.tree_util.tree_flatten_with_path(template)[0]
    }
    stored = {leaf["path"]: leaf for leaf in leaves}
    problems = [f"{p}: missing from checkpoint" for p in wanted if p not in stored]
    problems += [f"{p}: in checkpoint but not in template" for p in stored if p not in wanted]
    for p, leaf in wanted.items():
        if p in stored:
            spec = stored[p]
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            # Python-scalar template leaves are weakly typed: compare their shape only.
            if shape != tuple(spec["shape"]) or (dtype is not None and str(dtype) != spec["dtype"]):
                problems.append(
                    f"{p}: template {shape} {dtype}, "
                    f"checkpoint {tuple(spec['shape'])} {spec['dtype']}"
                )
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {ckpt}: tree {name!r} does not match its template:\n  "
            + "\n  ".join(problems[:5])
            + more
            + "\nBuild the template from the same model/optimizer configuration that was saved."
        )


def _assemble(template: Any, stored: dict[str, tuple]) -> Any:
    """Re-assemble `stored` ({keystr: (array, spec)}, already checked) with the template's
    treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = [_like(leaf, *stored[jax.tree_util.keystr(p)]) for p, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)
