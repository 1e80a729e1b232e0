"""Setup, [9]: a resume restores the trees, the `Progress` and the data position from the
checkpoint, after checking that it was written by the same configuration."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.checkpoint.record import _read_meta as checkpoint_meta
from jaxnitro._src.checkpoint.store import load_checkpoint, validate_int
from jaxnitro._src.core.errors import CheckpointError, warn_user
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.dist import sharding as sharding_mod
from jaxnitro._src.experiment.markers import graph_key
from jaxnitro._src.run.early_stop import StopState
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.run.setup.population import on_targets
from jaxnitro._src.run.setup.rundir import read_meta
from jaxnitro._src.run.spec import RunSpec
from jaxnitro._src.steps import ema as ema_mod
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    from jaxnitro._src.checkpoint.orbax_io import Bar

_TREES = {
    "params": "the model structure (layers, widths, parameter names)",
    "model_state": "the model state (batch statistics, RNG streams)",
    "opt_state": "the optimizer state layout (param groups, optimizer rules, clipping or "
    "scheduled hyperparameters)",
    "ema": "the weight average (ema_state=True also averages the model state)",
}


def check_config(spec: RunSpec, path: Path) -> None:
    """A resume needs the same GraphConst config: report changed fields, not array shapes."""
    have = read_meta(path).get("config")
    want = jsonable(dict(graph_key(spec.experiment)))
    if have is not None and have != want:
        diff = {
            k: (have.get(k), want.get(k))
            for k in set(have) | set(want)
            if have.get(k) != want.get(k)
        }
        raise CheckpointError(
            f"cannot resume from {path}: its GraphConst config differs from this run's "
            f"(field: checkpoint → now): {diff}. Resume with the same config, or start a new "
            f"run_dir."
        )


def check_members(spec: RunSpec, path: Path, *, resume: bool) -> None:
    """A checkpoint of a population holds every member: its member count must be the run's."""
    have = read_meta(path).get("population")
    want = spec.population.size if spec.population is not None else None
    if have == want or not isinstance(have, (int, type(None))):
        return
    what = "resume from" if resume else "load the weights of"
    held = f"a population of {have} members" if have else "one model"
    runs = f"a population of {want}" if want else "one model"
    if have and resume:
        fix = f"Resume with population={have}."
    elif have:
        fix = (
            f"Load it into a population of {have}, or resume that population and take one "
            f"member with jn.member(n, i)."
        )
    else:
        fix = "Start the population in a new run_dir (its members start from their seeds)."
    raise CheckpointError(
        f"cannot {what} {path}: it holds {held}, and this run trains {runs}. {fix}"
    )


def load_trees(
    ts: TrainState, path: Path, *, full: bool, ema: bool = False, bar: Bar | None = None
) -> tuple[dict, dict]:
    """(trees, meta) of a checkpoint, restored onto this run's templates (with `ema`, the
    weight average too, when the checkpoint holds one), under the display's `bar`."""
    templates = {"params": ts.params, "model_state": ts.state}
    if full:
        templates["opt_state"] = ts.opt_state
    if ema and "ema" in checkpoint_meta(path)["trees"]:
        templates["ema"] = _ema_template(ts, path)
    try:
        return load_checkpoint(path, templates, bar=bar)
    except CheckpointError as e:
        tree = next((t for t in _TREES if f"tree '{t}' does not match" in str(e)), None)
        if tree is None:
            raise
        fix = {
            "opt_state": "Resume with the same settings, or pass checkpoint=path to load the "
            "weights only.",
            "ema": "Resume with the same ema_state, or pass checkpoint=path to load the "
            "weights only.",
        }.get(tree, "Resume with the same model.")
        raise CheckpointError(
            f"cannot {'resume' if full else 'load weights'} from {path}: {_TREES[tree]} "
            f"differs from this run's. {fix}\n{e}"
        ) from e
    except Exception as e:  # noqa: BLE001 - add which checkpoint and why
        raise CheckpointError(
            f"cannot load checkpoint {path}: {e}. Pass another checkpoint (or resume=False)."
        ) from e


def restore(
    spec: RunSpec, ts: TrainState, path: Path, bar: Bar | None = None
) -> tuple[TrainState, Progress, Any]:
    """Resume: the state, the progress and the schedules' horizon saved in the checkpoint
    (its arrays read under the display's `bar`)."""
    check_config(spec, path)
    check_members(spec, path, resume=True)
    trees, meta = load_trees(ts, path, full=True, ema=spec.ema is not None, bar=bar)
    step = validate_int(meta, "step", path)
    ts = ts.replace(
        params=on_targets(trees["params"], ts.params),
        state=on_targets(trees["model_state"], ts.state),
        opt_state=on_targets(trees["opt_state"], ts.opt_state),
        # (a population keeps one step counter per member)
        step=sharding_mod.to_sharding(np.full(ts.step.shape, step, np.int32), spec.replicated),
    )
    if spec.ema is not None:  # the saved average continues; a run without one starts it here
        ts = ts.replace(ema=_restored_ema(spec, ts, trees.get("ema")))
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise CheckpointError(
            f"checkpoint {path}: meta field 'history' must be a list of rows, got "
            f"{type(history).__name__}. Resume from another checkpoint."
        )
    spe = spec.steps_per_epoch
    progress = Progress(
        step=step,
        # Every epoch takes at least one step: a larger epoch is a damaged or edited meta.
        epoch=validate_int(meta, "epoch", path, maximum=step),
        batch_in_epoch=validate_int(
            meta, "batch_in_epoch", path, default=0, maximum=spe and spe * spec.accum
        ),
        skipped_steps=validate_int(meta, "skipped_steps", path, default=0),
        history=tuple(history),
        early_stop=early_stop_start(spec, meta.get("early_stop")),
        data_state=_data_state(meta, path),
        epoch_loss=_epoch_loss(meta, path),
    )
    return ts, progress, meta.get("total_steps")


def _epoch_loss(meta: Mapping, path: Path) -> tuple[float, int]:
    """The saved epoch's losses so far, [sum, count] (absent in older checkpoints: (0, 0),
    so such a resume's epoch mean covers the steps after it only)."""
    value = meta.get("epoch_loss", [0.0, 0])
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], (int, float))
        and type(value[1]) is int
        and value[1] >= 0
    )
    if not ok:
        raise CheckpointError(
            f"checkpoint {path}: meta field 'epoch_loss' must be [sum, count] of the epoch's "
            f"train losses so far, got {value!r}. Resume from another checkpoint."
        )
    return float(value[0]), int(value[1])


def _data_state(meta: Mapping, path: Path) -> Mapping | None:
    state = meta.get("data_state")
    if state is not None and not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {path}: meta field 'data_state' (the data iterator's state) must be "
            f"a JSON object, got {type(state).__name__}. Resume from another checkpoint."
        )
    return state


def resume_position(path: Path | None) -> tuple[int, int, Mapping | None]:
    """(epoch, batch in epoch, iterator state) a resume continues from; (0, 0, None) fresh.
    Read before the data is checked, so the first batch looked at is the one training reads
    first (a resumed stream never reads what precedes its position)."""
    if path is None:
        return 0, 0, None
    meta = read_meta(path)
    try:
        epoch = validate_int(meta, "epoch", path)
        batch = validate_int(meta, "batch_in_epoch", path, default=0)
    except CheckpointError:
        return 0, 0, None  # restore() reports the damage with its context
    return epoch, batch, _data_state(meta, path)


def warn_replay(splits: Mapping, position: tuple[int, int, Any]) -> None:
    """A resume mid-epoch from a train source that cannot seek: say what happens, and what
    to use instead, rather than replaying silently."""
    epoch, batch, _ = position
    src = splits.get("train")
    if batch and src is not None and data_mod.replays(src):
        warn_user(
            f"resuming mid-epoch (epoch {epoch + 1}, batch {batch}) from a 'train' split of "
            f"type {type(src).__name__}, which cannot report or seek to a position: the "
            f"resume replays its first {batch} batches of the epoch (reading them again) and "
            f"trusts that every pass yields the same batches in the same order. Use "
            f"jn.DataLoader (arrays, memory maps, datasets.Dataset), a grain dataset or "
            f"grain.DataLoader, or a list of batches, which resume at the position directly.",
        )


def _ema_template(ts: TrainState, path: Path) -> dict:
    """The saved average's layout: this run's when it averages, else f32 params (and model
    state, which a checkpoint of an ema_state=True run holds too)."""
    if ts.ema is not None:
        return {k: v for k, v in ts.ema.items() if k != "decay"}
    leaves = checkpoint_meta(path)["trees"]["ema"]["leaves"]
    averaged = {"params": ts.params}
    if any(leaf["path"].startswith("['state']") for leaf in leaves):
        averaged["state"] = ts.state
    return jax.eval_shape(lambda t: jax.tree.map(ema_mod.f32, t), averaged)


def _restored_ema(spec: RunSpec, ts: TrainState, saved: Mapping[str, Any] | None) -> dict:
    assert spec.ema is not None  # (called for a run with an average only)
    fresh = ema_mod.init(spec.ema, ts.params, ts.state, ts.step)
    if saved is None:
        return fresh
    return {"decay": fresh["decay"], **{k: on_targets(saved[k], fresh[k]) for k in saved}}


def warn_horizon(spec: RunSpec, progress: Progress, horizon: Any) -> None:
    if spec.schedules.fns and isinstance(horizon, int) and horizon != spec.total_steps:
        warn_user(
            f"resuming a run whose schedules spanned {horizon} steps into one of "
            f"{spec.total_steps} (max_epochs={spec.max_epochs}): the schedules are stretched "
            f"to the new length, so from step {progress.step} on the scheduled values differ "
            f"from the original run's.",
        )


def early_stop_start(spec: RunSpec, saved: Any = None) -> StopState | None:
    """Early stopping's counters at the start: those a checkpoint `saved`, else fresh (one per
    member of a population); None without early stopping."""
    if spec.early_stop is None:
        return None
    members = spec.population.size if spec.population is not None else None
    return spec.early_stop.start(saved, members=members)
