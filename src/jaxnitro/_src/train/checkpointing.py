"""The driver's checkpoint: what a checkpoint of the run holds, written at an epoch's end or
inside one (`val_every` / `checkpoint_every`), in the background while training goes on."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import jax

from jaxnitro._src.checkpoint.store import TopKCheckpointer
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.experiment.markers import DEVICE, field_values, graph_key
from jaxnitro._src.observe.loggers.base import flush_logger
from jaxnitro._src.run.rates import saved_rates

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro


def save_checkpoint(
    n: Nitro,
    row: dict,
    *,
    stop_reason: str | None = None,
    validated: bool = True,
    requested: bool = False,
) -> float:
    """Checkpoint the run at its current step; returns the seconds training stalled for it.
    `requested`: the user asked for it (`handle.checkpoint()`): retention keeps it."""
    spec, ts = n.spec, n.train_state
    metrics = {k: v for k, v in row.items() if isinstance(v, float)}
    meta = _meta(n, stop_reason=stop_reason, validated=validated)
    if requested:
        meta["requested"] = True
    trees = {"params": ts.params, "model_state": ts.state, "opt_state": ts.opt_state}
    if ts.ema is not None and spec.ema is not None:  # the average (not its decay: a setting)
        trees["ema"] = {k: v for k, v in ts.ema.items() if k != "decay"}
        meta["weights"] = spec.ema.validates  # what `checkpoint=` loads by default
    ck = n.checkpointer
    t0 = time.perf_counter()
    # A resume from this checkpoint replays only the steps after it: what a logger still holds
    # (MLflow's batch, TensorBoard's file buffer) is written or sent first, or a kill after
    # the checkpoint would lose it for good.
    flush_logger(n.logger)
    if not isinstance(ck, TopKCheckpointer) or stop_reason is not None or jax.process_count() > 1:
        ck.save(epoch=row["epoch"], step=n.step, metrics=metrics, trees=trees, meta=meta)
        return time.perf_counter() - t0
    # A checkpoint during training is written in the background: training waits only for the
    # copy to host memory (the stall, logged per checkpoint) and for the previous write.
    path = ck.save(
        epoch=row["epoch"], step=n.step, metrics=metrics, trees=trees, meta=meta, background=True
    )
    stall = time.perf_counter() - t0
    n.logger.log_other({"checkpoint": path.name, "checkpoint_stall_s": stall})
    return stall


def _meta(n: Nitro, *, stop_reason: str | None, validated: bool) -> dict[str, Any]:
    """The checkpoint's record of the run: where it is, what it trained with, its history."""
    spec, progress = n.spec, n.progress
    return {
        "run_id": spec.run_id,
        "validated": validated,
        "total_steps": spec.total_steps,
        "epoch": progress.epoch,
        "batch_in_epoch": progress.batch_in_epoch,
        "epoch_loss": list(progress.epoch_loss),  # the epoch's losses so far: [sum, count]
        "data_state": jsonable(progress.data_state),
        "step": progress.step,
        "seed": spec.seed,
        "population": spec.population.size if spec.population is not None else None,
        "config": jsonable(dict(graph_key(n.experiment))),
        # the Device values trained with (their base values, for a scheduled one): what the
        # shell's validate/test/predict use unless given (the loss may read them)
        "device": jsonable(field_values(n.experiment, DEVICE)),
        "experiment": spec.cls.__qualname__,
        "history": jsonable([dict(r) for r in progress.history]),
        "skipped_steps": progress.skipped_steps,
        "stop_reason": stop_reason,
        "early_stop": (
            spec.early_stop.to_json(progress.early_stop)
            if spec.early_stop is not None and progress.early_stop is not None
            else None
        ),
        "loggers": logger_state(n),
        # the rates set mid-run (jn.set_lr, the plateau rule) and the rule's counters: a
        # resume continues with them (run/rates.py)
        **saved_rates(n.device, progress),
    }


def logger_state(n: Nitro) -> Any:
    """What the loggers need to reattach to their runs on a resume (see jn.Logger)."""
    state = getattr(n.logger, "state_dict", None)
    return jsonable(state()) if callable(state) else None
