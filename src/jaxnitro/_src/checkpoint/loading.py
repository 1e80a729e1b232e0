"""Loading a checkpoint into the caller's templates (`load_checkpoint`) and verifying one end
to end without a template (`verify_checkpoint`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnitro._src.checkpoint.format import META
from jaxnitro._src.checkpoint.format import checksum as _checksum
from jaxnitro._src.checkpoint.leaves import _assemble, _check_template, _nest
from jaxnitro._src.checkpoint.messages import _short
from jaxnitro._src.checkpoint.orbax_io import _read_arrays
from jaxnitro._src.checkpoint.record import _read_meta
from jaxnitro._src.core.errors import (
    CheckpointError,
    did_you_mean,
)

if TYPE_CHECKING:
    from jaxnitro._src.checkpoint.orbax_io import Bar


def load_checkpoint(
    path: str | os.PathLike, templates: dict[str, Any] | None = None, *, bar: Bar | None = None
) -> tuple[dict[str, Any], dict]:
    """Load ``(trees, meta)`` from a checkpoint directory, verifying its checksums.

    Each tree named in ``templates`` comes back with the template's treedef; its leaves
    become jax arrays (on the template leaf's sharding, if any), while numpy and
    Python-scalar template leaves keep their kind. Trees without a template come back as
    nested dicts/lists of numpy arrays (PRNG keys as raw key data). Templates are compared
    with meta.json before any array is read, and arrays are read only in the shapes
    meta.json records, so a mismatched or crafted checkpoint fails fast.

    Args:
        path: the checkpoint directory (e.g. `ck.best()`, `ck.latest()`).
        templates: tree name -> a pytree of arrays or ``jax.ShapeDtypeStruct`` to restore
            into; None: every tree as numpy.
        bar: a progress bar factory such as a run's ``n.display.bar``; the arrays are then
            read in parts (about 64 MiB or more each) and the bar counts them.

    Returns:
        ``(trees, meta)``: tree name -> tree, and the user meta given to ``save`` plus
        "epoch", "step", "metrics" (user keys win).

    Raises:
        CheckpointError: the checkpoint is missing, corrupted (a checksum or leaf spec does
            not match), or has no tree a template names.

    Example:
        >>> trees, meta = jn.load_checkpoint(ck.best(), {"params": {"w": np.zeros(3)}})
        >>> trees["params"]["w"], meta["step"], meta["metrics"]
        (array([1., 1., 1.]), 100, {'acc': 0.91})
    """
    ckpt = Path(path).absolute()  # Orbax refuses relative paths; a relative one is fine here
    info = _read_meta(ckpt)
    templates = templates or {}
    _check_templates(ckpt, info, templates)
    try:
        arrays = _read_arrays(ckpt, info, bar)
    except (KeyError, TypeError, ValueError) as exc:  # e.g. an unknown dtype or PRNG impl
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (bad leaf spec in {META}: {_short(exc)}); use "
            "another checkpoint"
        ) from exc
    trees = {
        name: _rebuild_tree(ckpt, name, spec, arrays, templates.get(name, _NO_TEMPLATE))
        for name, spec in info["trees"].items()
    }
    return trees, {
        "epoch": info["epoch"],
        "step": info["step"],
        "metrics": info["metrics"],
        **info["meta"],
    }


_NO_TEMPLATE = object()  # (None is a valid pytree template: the empty tree)


def _check_templates(ckpt: Path, info: dict, templates: dict[str, Any]) -> None:
    """Every template names a stored tree and matches its leaf specs (no array read yet)."""
    unknown = sorted(set(templates) - set(info["trees"]))
    if unknown:
        raise CheckpointError(
            f"checkpoint {ckpt} has no tree(s) {unknown}; it holds "
            f"{sorted(info['trees'])}; pass templates for those only."
            + did_you_mean(unknown[0], info["trees"])
        )
    for name, template in templates.items():
        _check_template(ckpt, name, template, info["trees"][name]["leaves"])


def _rebuild_tree(ckpt: Path, name: str, spec: dict, arrays: dict, template: Any) -> Any:
    """One stored tree, checksum-verified, in the template's structure (or as nested dicts)."""
    leaves = spec["leaves"]
    stored = arrays.get(f"t{spec['index']}", {})
    values = [np.asarray(stored[f"l{j}"]) for j in range(len(leaves))]
    if spec.get("sharded"):  # written by several processes: checksums per shard
        from jaxnitro._src.checkpoint import shards as checkpoint_shards

        checkpoint_shards.verify(ckpt, name, spec, values)
    elif _checksum([leaf["path"] for leaf in leaves], values) != spec["sha256"]:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (checksum mismatch in tree {name!r}); use "
            "another checkpoint"
        )
    pairs = list(zip(leaves, values, strict=True))
    if template is not _NO_TEMPLATE:
        return _assemble(template, {leaf["path"]: (v, leaf) for leaf, v in pairs})
    return _nest([(leaf["keys"], v) for leaf, v in pairs])


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint end to end without a template; return its meta or raise CheckpointError.

    Reads and validates ``meta.json``, restores every array (in the recorded shapes only) and
    compares each tree's sha256 with the one recorded at save time, so a truncated, edited or
    half-deleted checkpoint is caught.

    Example:
        >>> jn.checkpoint.verify_checkpoint(ck.latest())["step"]
        100
    """
    try:
        _, meta = load_checkpoint(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the checkpoint is unusable
        raise CheckpointError(
            f"checkpoint {path} is corrupted ({type(exc).__name__}: {_short(exc)}); use "
            "another checkpoint"
        ) from exc
    return meta
