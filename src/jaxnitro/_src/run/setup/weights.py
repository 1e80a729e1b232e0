"""Setup of `Nitro(exp, checkpoint=...)`: which checkpoint a path names and loading its
weights (raw or EMA) into a fresh run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jaxnitro._src.checkpoint.record import _read_meta as checkpoint_meta
from jaxnitro._src.checkpoint.store import TopKCheckpointer
from jaxnitro._src.core.errors import CheckpointError
from jaxnitro._src.run.setup.population import on_targets
from jaxnitro._src.run.setup.restore import check_members, load_trees
from jaxnitro._src.run.spec import RunSpec
from jaxnitro._src.steps import ema as ema_mod
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    from jaxnitro._src.checkpoint.orbax_io import Bar


def weights_path(path: Path) -> Path:
    """`checkpoint=`: a checkpoint directory, or a run (or checkpoints) directory, whose best
    checkpoint (by its checkpointer's metric; else the newest) is used."""
    if not path.exists():
        raise CheckpointError(
            f"checkpoint={str(path)!r} does not exist; pass a checkpoint directory or a run "
            f"directory (its best checkpoint), e.g. checkpoint='runs/MyExp'."
        )
    if (path / "meta.json").is_file() or not path.is_dir():
        return path  # a checkpoint; anything else is reported by the load
    from jaxnitro._src.observe.runs import checkpoint_metric

    ck_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    run_dir = ck_dir.parent if ck_dir != path else path
    metric, mode = checkpoint_metric(run_dir, None)
    ck = TopKCheckpointer(metric=metric, mode=mode, dir=ck_dir)
    ck.bind(run_dir, writer=False)
    found = ck.best() or ck.latest()
    if found is None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no meta.json), nor a directory holding "
            f"checkpoints; pass a path returned by TopKCheckpointer.save(), latest() or best(), "
            f"or a run directory."
        )
    return found


def loaded_weights(path: Path, weights: str | None) -> str:
    """Which weights `checkpoint=path, weights=weights` loads: "raw" or "ema" (None: those
    its validation used)."""
    meta = checkpoint_meta(path)
    if weights is None and "ema" in meta["trees"]:
        return str(meta["meta"].get("weights", "raw"))
    return weights or "raw"


def load_weights(
    spec: RunSpec, ts: TrainState, path: Path, weights: str | None = None, bar: Bar | None = None
) -> TrainState:
    """`checkpoint=path`: the weights (params and model state) only; a fresh optimizer.
    `weights="ema"` loads the checkpoint's weight average (None: the weights its validation
    used, `loaded_weights`); an averaging run starts its own average from what was loaded."""
    check_members(spec, path, resume=False)
    meta = checkpoint_meta(path)
    has_ema = "ema" in meta["trees"]
    weights = loaded_weights(path, weights)
    if weights == "ema" and not has_ema:
        raise CheckpointError(
            f"weights='ema', but checkpoint {path} holds no weight average (its run trained "
            f"without ema=); pass weights='raw' (or leave it out), or a checkpoint of a run "
            f"with Nitro(ema=0.999)."
        )
    trees, _ = load_trees(ts, path, full=False, ema=weights == "ema", bar=bar)
    ts = ts.replace(
        params=on_targets(trees["params"], ts.params),
        state=on_targets(trees["model_state"], ts.state),
    )
    if weights == "ema":
        avg = {"params": trees["ema"]["params"], **({"state": trees["ema"]["state"]}
               if "state" in trees["ema"] else {})}  # fmt: skip
        params, state = ema_mod.as_model(avg, ts.params, ts.state)
        ts = ts.replace(params=on_targets(params, ts.params), state=on_targets(state, ts.state))
    if spec.ema is not None:
        ts = ts.replace(ema=ema_mod.init(spec.ema, ts.params, ts.state, ts.step))
    return ts
