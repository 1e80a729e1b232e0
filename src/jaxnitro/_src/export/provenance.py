"""Where a bundle came from: versions, the experiment, its checkpoint, the code's commit
(read without running git's configured programs: see `gitstate`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.core.version import __version__
from jaxnitro._src.experiment.markers import GRAPH, field_values
from jaxnitro._src.export import compat
from jaxnitro._src.export.gitstate import git_state

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro


def provenance(n: Nitro, exported, weights: str = "raw") -> dict:
    """The manifest's ``provenance``: what made the bundle, enough to rebuild or audit it.
    `weights` ("raw" or "ema") is which weights the bundle holds; the checkpoint's scores
    are those of these weights."""
    spec = n.spec
    versions = compat.versions()
    return {
        "jaxnitro": __version__,
        "jax": versions["jax"],
        "jaxlib": versions["jaxlib"],
        "serialization_version": versions["serialization_version"],
        "calling_convention_version": exported.calling_convention_version,
        "experiment": f"{spec.cls.__module__}.{spec.cls.__qualname__}",
        "graph_consts": jsonable(field_values(spec.experiment, GRAPH)),
        "device_values": {
            k: jsonable(np.asarray(jax.device_get(v))) for k, v in n.device.values.items()
        },
        "seed": spec.seed,
        "step": n.step,
        "epoch": n.epoch,
        "run_dir": str(spec.run_dir),
        "weights": weights,
        "checkpoint": source_checkpoint(n, weights),
        "git": git_state(Path(spec.run_dir)),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def source_checkpoint(n: Nitro, weights: str = "raw") -> dict | None:
    """The run's checkpoint holding exactly these weights (its step is the handle's), or None;
    its `metrics` are the scores of `weights` (`scores_of`)."""
    try:
        rows = n.checkpointer.records()
    except (AttributeError, NotImplementedError):  # checkpointer=False
        return None
    run_id = getattr(n.checkpointer, "run_id", None)
    mine = [
        r
        for r in rows
        if r.get("step") == n.step and (run_id is None or r.get("run_id") in (None, run_id))
    ]
    if not mine:
        return None
    row, where = mine[-1], n.checkpointer.dir
    assert where is not None  # the rows were read from it
    return {
        "path": str(where / row["path"]),
        "step": row["step"],
        "epoch": row.get("epoch"),
        "metrics": jsonable(scores_of(row.get("metrics", {}), weights, validated(n))),
    }


def validated(n: Nitro) -> str:
    """Which weights the run's validation scored: its `val_*` metrics ("ema" or "raw")."""
    return n.spec.ema.validates if n.spec.ema is not None else "raw"


def scores_of(metrics: dict, weights: str, scored: str) -> dict:
    """The checkpoint's metrics that score `weights`, where validation scored `scored`:
    `val_*` as they are when they match, else the `val_raw_*` of `ema_eval="both"` renamed
    to `val_*` (raw weights), else none; metrics of training (`train_loss`) are kept.

    Example:
        >>> scores_of({"val_loss": 1.0, "val_raw_loss": 2.0, "train_loss": 3.0}, "raw", "ema")
        {'train_loss': 3.0, 'val_loss': 2.0}
    """
    out = {k: v for k, v in metrics.items() if not k.startswith("val_")}
    if weights == scored:
        out.update({k: v for k, v in metrics.items() if k.startswith("val_")
                    and not k.startswith("val_raw_")})  # fmt: skip
    elif weights == "raw":
        out.update({f"val_{k[8:]}": v for k, v in metrics.items() if k.startswith("val_raw_")})
    return out
