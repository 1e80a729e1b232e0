"""Checkpoints of a multi-process run: every process writes its own shards.

The layout is the one of `checkpoint/store.py` (an Orbax store of flattened trees plus meta.json),
written by all processes together: each hands Orbax its global arrays and Orbax writes the
shards this process holds (one sub-database per process, merged when the save commits). The
checksums are per shard: each process hashes the shards it writes (one copy of each
replicated shard, `replica_id == 0`), process 0 collects them into meta.json, and a load (which
reads whole arrays) hashes the same slices again. Process 0 alone picks the name, writes
meta.json, renames the temporary directory and updates the manifest; every barrier and
exchange has a timeout (`jaxnitro._src.dist.distributed`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxnitro._src.checkpoint.format import (
    ARRAYS,
    META,
    Unverified,
    checksum,
    is_prng_key,
    key_entry,
    orbax_layout,
    record_hash,
    write_json,
)
from jaxnitro._src.core.errors import CheckpointError
from jaxnitro._src.dist import distributed


def _orbax_together() -> tuple[Any, Any, Any]:
    """Orbax for a save by every process, its barriers on the coordination service (with a
    timeout: listing the processes makes Orbax use it instead of an XLA all-gather)."""
    import orbax.checkpoint as ocp

    everyone = {
        "multiprocessing_options": ocp.options.MultiprocessingOptions(
            primary_host=0,
            active_processes=set(range(jax.process_count())),
            barrier_sync_key_prefix="jaxnitro",
        )
    }
    handler = ocp.StandardCheckpointHandler(**everyone)
    return ocp, handler, ocp.Checkpointer(handler, **everyone)


def _leaf(where: str, leaf: Any) -> tuple[Any, dict]:
    """A leaf as Orbax stores it (a global array, or a host array the same everywhere) and its
    meta.json spec; typed PRNG keys as their key data."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise CheckpointError(
            f"leaf {where} is an abstract ShapeDtypeStruct; save the real arrays (a "
            "ShapeDtypeStruct only describes one, e.g. as a load_checkpoint template)"
        )
    if is_prng_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        spec = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "prng_impl": impl}
        return jax.random.key_data(leaf), spec
    arr = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
    if np.dtype(arr.dtype).kind in "OUS":
        raise CheckpointError(
            f"leaf {where} ({type(leaf).__name__}) is not a numeric array; keep strings and "
            "objects out of the saved trees (put plain values in meta=)"
        )
    return arr, {"shape": list(arr.shape), "dtype": str(arr.dtype), "prng_impl": None}


def _index(slices: tuple, shape: tuple) -> list[list[int]]:
    return [
        [s.start or 0, dim if s.stop is None else s.stop]
        for s, dim in zip(slices, shape, strict=True)
    ]


def _shards(path: str, arr: Any) -> list[list]:
    """[(index, sha256)] of the shards of `arr` this process writes."""
    if not isinstance(arr, jax.Array):  # a host array: process 0 writes it whole
        if jax.process_index() != 0:
            return []
        return [[[[0, dim] for dim in arr.shape], checksum([path], [arr])]]
    return [
        [_index(s.index, arr.shape), checksum([path], [np.asarray(s.data)])]
        for s in arr.addressable_shards
        if s.replica_id == 0
    ]


def _tree_hash(leaves: list[dict]) -> str:
    text = json.dumps([leaf["shards"] for leaf in leaves], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def flatten(trees: dict[str, Any]) -> tuple[dict, dict]:
    """(the Orbax item, the tree specs of meta.json with every process's shard hashes)."""
    item: dict = {}
    specs: dict = {}
    for i, (tname, tree) in enumerate(trees.items()):
        leaves, arrays = [], {}
        for j, (kp, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            path = jax.tree_util.keystr(kp)
            arr, spec = _leaf(f"{tname}{path}", leaf)
            arrays[f"l{j}"] = arr
            leaves.append({"path": path, "keys": [key_entry(k) for k in kp], **spec})
            leaves[-1]["shards"] = _shards(path, arr)
        if arrays:
            item[f"t{i}"] = arrays
        specs[tname] = {"index": i, "sharded": True, "leaves": leaves}
    everyone = distributed.gather("checkpoint-shards", specs)
    for tname, spec in specs.items():
        for j, leaf in enumerate(spec["leaves"]):
            leaf["shards"] = sorted(
                (s for other in everyone for s in other[tname]["leaves"][j]["shards"]),
                key=lambda s: s[0],
            )
        spec["sha256"] = _tree_hash(spec["leaves"])
    return item, specs


def write(target: Path, trees: dict[str, Any], record: dict) -> None:
    """Every process: write the arrays into `target` (made by process 0); then process 0
    checks the store and writes meta.json. Raises on every process if any part failed."""
    item, specs = flatten(trees)
    failed: str | None = None
    if item:
        ocp, handler, ckptr = _orbax_together()
        try:
            with ckptr:
                ckptr.save(target / ARRAYS, args=ocp.args.StandardSave(item))
        except Exception as e:  # noqa: BLE001 - reported on every process below
            failed = f"{type(e).__name__}: {e}"
    failures = [f for f in distributed.gather("checkpoint-written", failed) if f]
    if failures:
        raise Unverified(f"a process could not write its shards ({failures[0][:300]})")

    def finish() -> None:
        if item:
            want = {
                t: {k: (tuple(a.shape), str(np.dtype(a.dtype))) for k, a in leaves.items()}
                for t, leaves in item.items()
            }
            if orbax_layout(handler, target / ARRAYS) != want:
                raise Unverified("the arrays did not read back as written")
        info = json.loads(json.dumps({**record, "trees": specs}))
        write_json(target / META, {**info, "record_sha256": record_hash(info)})

    distributed.decided_by_process_zero("checkpoint-meta", finish)


def verify(ckpt: Path, name: str, spec: dict, values: list[np.ndarray]) -> None:
    """The shards recorded for tree `name` hash as they did when written (whole arrays were
    read); they cover each array exactly once."""
    leaves = spec["leaves"]
    ok = isinstance(spec.get("sha256"), str) and spec["sha256"] == _tree_hash(leaves)
    for leaf, value in zip(leaves, values, strict=True):
        if not ok:
            break
        shards = leaf.get("shards")
        if not isinstance(shards, list):
            ok = False
            break
        covered = 0
        for index, sha in shards:
            part = value[tuple(slice(a, b) for a, b in index)]
            covered += part.size
            ok = ok and checksum([leaf["path"]], [part]) == sha
        ok = ok and covered == value.size  # every element once: no shard left out
    if not ok:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (checksum mismatch in tree {name!r}); use "
            "another checkpoint"
        )
