"""Where a bundle came from: versions, the experiment, its checkpoint, the code's commit
(read without running git's configured programs: see `gitstate`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro.core.jsonable import jsonable
from jaxnitro.core.version import __version__
from jaxnitro.experiment.markers import GRAPH, field_values
from jaxnitro.export import compat
from jaxnitro.export.gitstate import git_state

if TYPE_CHECKING:
    from jaxnitro.run.nitro import Nitro


def provenance(n: Nitro, exported) -> dict:
    """The manifest's ``provenance``: what made the bundle, enough to rebuild or audit it."""
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
        "checkpoint": source_checkpoint(n),
        "git": git_state(Path(spec.run_dir)),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def source_checkpoint(n: Nitro) -> dict | None:
    """The run's checkpoint holding exactly these weights (its step is the handle's), or None."""
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
        "metrics": jsonable(row.get("metrics", {})),
    }
