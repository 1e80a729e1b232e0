"""The driver: `train`, `validate`, `evaluate`, `predict`, and live Device values.

`train` runs, in this order, for each epoch: train steps (prefetched; losses read back a few
steps behind so dispatch never waits), validation, a history row, the log line, the
checkpoint, the stop check. It ends with a `finish` log line and a short summary.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import data as data_mod
from . import events, feed, introspect, programs
from . import metrics as metrics_mod
from .compile import cache, report
from .errors import ConfigError, DataError, NonFiniteLossError, closest, did_you_mean
from .experiment import DEVICE, GRAPH, fields, graph_key, replace
from .history import History
from .nitro import Nitro, _jsonable
from .phases import set_phase
from .signals import Preempted, graceful_stop

# Losses are read back in chunks, a chunk behind the newest step, so dispatch never waits on
# the device and one transfer serves many steps.
_READBACK_CHUNK = 16


@dataclasses.dataclass
class TrainResult:
    """What `jn.train` returns."""

    history: History
    best_checkpoint: Path | None
    stop_reason: str
    best_metric: float | None
    steps_per_second: float
    programs_compiled: int
    wall_seconds: float


def train(n: Nitro) -> TrainResult:
    """Train to `max_epochs` (or a stop); validate, log and checkpoint after each epoch.

    The order is fixed: check for stale programs; compile every planned program and check the
    memory plan (before step 1); then per epoch: train steps, validation, history row, log,
    checkpoint, early-stopping check, stop check. Ctrl-C stops after the current step (twice
    aborts); SIGTERM checkpoints the current step and exits with status 143.

    Example:
        >>> result = jn.train(jn.Nitro(MnistMLP()))
        >>> result.history.best["acc"]
    """
    if "train" not in n.splits:
        raise DataError(f"jn.train needs a 'train' split; the data has {sorted(n.splits)}.")
    if n.epoch >= n.max_epochs:
        warnings.warn(
            f"{n.cls.__name__} has already trained to max_epochs={n.max_epochs} (epoch "
            f"{n.epoch}, step {n.step}): nothing to train. To train further, continue from its "
            f"checkpoint in a new handle with a larger max_epochs: jn.Nitro(exp, "
            f"run_dir='{n.run_dir}', resume='auto', max_epochs={n.max_epochs + 1}) (schedules "
            f"then span the new length).",
            stacklevel=2,
        )
        return TrainResult(
            history=history(n),
            best_checkpoint=_best_checkpoint(n),
            stop_reason="completed",
            best_metric=_best_metric(n),
            steps_per_second=0.0,
            programs_compiled=0,
            wall_seconds=0.0,
        )
    _check_horizon(n)
    with writing(n, "train"):
        return _train(n)


def _train(n: Nitro) -> TrainResult:
    t_start = time.perf_counter()
    misses0 = cache.cache_stats()["misses"]
    stop_reason = "completed"
    steps_run, seconds_run = 0, 0.0
    n.program_set.reset_train()  # re-keyed at each entry point: never served stale
    n.preempted = False
    set_phase(n, "Starting", force=True)
    programs.check_stale(n)
    try:
        with graceful_stop(n):
            # Every program this run uses compiles now and must fit: OOM before step 1.
            notes = programs.plan_notes(n)
            if any("avoids it" in note for note in notes):  # say why before compiling them
                n.display.line("programs this run compiles:\n  " + "\n  ".join(notes))
            plan = introspect.check_memory(n)
            while n.epoch < n.max_epochs:
                epoch = n.epoch  # 0-based; logs and history say epoch + 1
                losses, seconds = _train_epoch(n, epoch)
                steps_run, seconds_run = steps_run + len(losses), seconds_run + seconds
                stop_reason = _end_epoch(n, epoch, losses, seconds)
                if stop_reason != "completed":
                    break
        set_phase(n, "Done")
    except BaseException as e:
        set_phase(n, "Failed", info={"error": repr(e)})
        n.logger.finish("error", error=repr(e), step=n.step, epoch=n.epoch)
        n.display.close()
        raise
    n.stop_requested = False
    compiled = cache.cache_stats()["misses"] - misses0
    result = TrainResult(
        history=history(n),
        best_checkpoint=_best_checkpoint(n),
        stop_reason=stop_reason,
        best_metric=_best_metric(n),
        steps_per_second=steps_run / seconds_run if seconds_run else 0.0,
        programs_compiled=compiled,
        wall_seconds=time.perf_counter() - t_start,
    )
    n.logger.finish(
        stop_reason,
        stop_reason=stop_reason,
        step=n.step,
        epoch=n.epoch,
        programs_compiled=compiled,
        steps_per_s=result.steps_per_second,
        skipped_steps=n.skipped_steps,
    )
    records = [p.record for p in n.program_set.compiled[-compiled:] if compiled]
    if records:
        n.display.line(report.format_table(records))
    if compiled > len(plan.programs):
        n.display.line(
            f"this run compiled {compiled} programs; its plan expected "
            f"{len(plan.programs)}. jn.explain(n) says why."
        )
    _summary(n, result)
    if stop_reason == "preempted":
        raise Preempted(n.step, n.checkpointer.latest())  # exit status 143, catchable
    return result


def _best_checkpoint(n: Nitro) -> Path | None:
    """This run's best checkpoint (or its newest): never one of another run in the dir."""
    return n.checkpointer.best() or n.checkpointer.latest()


def _best_metric(n: Nitro):
    best_row = history(n).best
    return None if best_row is None else best_row.get(n.checkpointer.metric)


def _check_horizon(n: Nitro) -> None:
    """Schedules were resolved for the steps known at setup; say so when that changed."""
    spe = n.steps_per_epoch or 0
    if not n.schedules.fns or not spe or spe * n.max_epochs == n.total_steps:
        return
    warnings.warn(
        f"max_epochs is now {n.max_epochs}, but this handle's schedules were resolved at setup "
        f"for {n.total_steps} steps ({n.total_steps // spe} epochs): past step "
        f"{n.total_steps} they hold their last value. To extend a scheduled run, continue in "
        f"a new handle, which spans the schedules over the new length: jn.Nitro(exp, "
        f"run_dir='{n.run_dir}', resume='auto', max_epochs={n.max_epochs}).",
        stacklevel=3,
    )


def writing(n: Nitro, purpose: str, *, required: bool = True):
    """The run's writing session (`Services.writing`): lock, logger open, first lines."""
    return n.services.writing(purpose, step=n.step, required=required)


def _train_epoch(n: Nitro, epoch: int) -> tuple[list[float], float]:
    """Run the train steps of one epoch (from the saved position); returns (losses, seconds)."""
    set_phase(n, "Training")
    loader = n.splits["train"]
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    total = len(loader) if hasattr(loader, "__len__") else None
    n.display.start_epoch(epoch, n.max_epochs, total, n.batch_in_epoch)
    feed_cls = data_mod.InlineFeed if n.direct_feed else data_mod.Prefetcher
    stream = feed_cls(
        feed.train_units(n, loader, n.batch_in_epoch, epoch), feed.train_prepare(n, epoch)
    )
    pending: collections.deque = collections.deque()
    losses: list[float] = []
    t0 = time.perf_counter()
    compile_s = 0.0
    extras = n.extras()
    lr_of, clock = _lr_reader(n), [t0]
    cadence = _Cadence(n)
    try:
        for payloads, _, _ in stream:
            for dev_batch, hyper, steps in payloads:
                prog = n.program_set.train.get(("train", steps))
                if prog is None:
                    c0 = time.perf_counter()
                    prog = n.program_set.train[("train", steps)] = programs.train_program(
                        n, dev_batch, hyper, steps
                    )
                    compile_s += time.perf_counter() - c0
                n._leaves, out = prog(n._leaves, dev_batch, extras, hyper)
                n.batch_in_epoch += steps * n.accum
                n.host_step += steps
                pending.append((n.host_step, n.batch_in_epoch, steps, out))
                validate, save = cadence.due(n.host_step - steps, n.host_step)
                if (validate or save) and n.batch_in_epoch != total:  # the epoch end does both
                    _drain(n, pending, len(pending), epoch, losses, lr_of, clock)
                    _mid_epoch(n, epoch, validate=validate, save=save)
                    cadence.saved(save)
            if len(pending) >= 2 * _READBACK_CHUNK:
                _drain(n, pending, _READBACK_CHUNK, epoch, losses, lr_of, clock)
                elapsed = time.perf_counter() - t0 - compile_s
                n.display.update(
                    n.batch_in_epoch, losses[-1], len(losses) / elapsed if elapsed > 0 else None
                )
            if n.stop_requested:
                break
        _drain(n, pending, len(pending), epoch, losses, lr_of, clock)
    finally:
        stream.close()
    jax.block_until_ready(n._leaves)
    seconds = time.perf_counter() - t0 - compile_s
    wait_frac = min(1.0, stream.wait_seconds / seconds) if seconds > 0 else 0.0
    n.logger.log_metrics(
        {
            "data_wait_frac": wait_frac,
            "steps_per_s": len(losses) / seconds if seconds else None,
            "peak_bytes_in_use": introspect.peak_memory(n),
            "skipped_steps": n.skipped_steps,
        },
        context="data",
        epoch=epoch + 1,
        step=n.step,
    )
    _check_epoch_length(n, epoch, total)
    if total is None or n.batch_in_epoch >= total or not n.stop_requested:
        n.epoch += 1
        n.batch_in_epoch = 0
    return losses, seconds


class _Cadence:
    """When step-based validation and checkpoints are due (`val_every`, `checkpoint_every`,
    `checkpoint_every_minutes`), counted in optimizer steps across epochs."""

    def __init__(self, n: Nitro):
        self.val, self.ckpt = n.val_every, n.checkpoint_every
        self.seconds = (
            None if n.checkpoint_every_minutes is None else n.checkpoint_every_minutes * 60
        )
        self.last = time.monotonic()

    def due(self, before: int, after: int) -> tuple[bool, bool]:
        validate = self.val is not None and after // self.val > before // self.val
        save = self.ckpt is not None and after // self.ckpt > before // self.ckpt
        if self.seconds is not None and time.monotonic() - self.last >= self.seconds:
            save = True
        return validate, save

    def saved(self, save: bool) -> None:
        if save:
            self.last = time.monotonic()


def _mid_epoch(n: Nitro, epoch: int, *, validate: bool, save: bool) -> None:
    """Validation and/or a checkpoint inside an epoch: the checkpoint holds the batch
    position, so a resume from it continues mid-epoch exactly."""
    row: dict[str, Any] = {"epoch": epoch + 1, "step": n.step}
    if validate and "val" in n.splits:
        row.update(_evaluate(n, "val"))
        n.logger.log_metrics(
            {k: v for k, v in row.items() if k not in ("epoch", "step") and _is_scalar(v)},
            context="validate",
            epoch=epoch + 1,
            step=n.step,
        )
    if save:
        set_phase(n, "Checkpointing")
        _checkpoint(n, row)
    set_phase(n, "Training")


def _check_epoch_length(n: Nitro, epoch: int, total: int | None) -> None:
    """An epoch that ends early (a source that is partly one-shot, or shrinks) says so."""
    if n.stop_requested:
        return
    seen = n.batch_in_epoch
    lengths = n.epoch_lengths
    expected = total if total is not None else lengths.get("first")
    if total is None and "first" not in lengths:
        lengths["first"] = seen
    if expected is not None and seen < expected:
        warnings.warn(
            f"epoch {epoch + 1} yielded {seen} train batches, but "
            + (
                f"the split's len() is {expected}"
                if total is not None
                else f"the first epoch had {expected}"
            )
            + ". A source whose iterator is shared between passes runs dry; make __iter__ "
            "start a new pass (or use jn.DataLoader).",
            stacklevel=3,
        )


def _end_epoch(n: Nitro, epoch: int, losses: list[float], seconds: float) -> str:
    """Validate, record, log, checkpoint, and decide whether to stop; returns the stop reason."""
    row = {
        "epoch": epoch + 1,
        "step": n.step,
        "train_loss": float(np.mean(losses)) if losses else None,
    }
    if "val" in n.splits and not n.preempted:  # preemption leaves no time to validate
        n.display.phase("validating")
        try:
            row.update(_evaluate(n, "val"))
        except BaseException:
            # A failing val loader or a second Ctrl-C must not cost the epoch's training:
            # checkpoint the trained state, marked unvalidated, then let the error through.
            _record_row(n, row)
            with contextlib.suppress(Exception):
                _checkpoint(n, row, stop_reason="error", validated=False)
            raise
        n.logger.log_metrics(
            {k: v for k, v in row.items() if k not in ("epoch", "step") and _is_scalar(v)},
            context="validate",
            epoch=epoch + 1,
            step=n.step,
        )
    _record_row(n, row)
    reason = "completed"
    finished = n.batch_in_epoch == 0  # the epoch ran to its end
    if n.early_stop is not None and finished and not n.stop_requested:
        if n.early_stop.update(epoch + 1, row):
            reason = "early_stop"
    if n.stop_requested:
        reason = "preempted" if n.preempted else "requested"
    set_phase(n, "Checkpointing")
    _checkpoint(n, row, stop_reason=None if reason == "completed" else reason)
    n.display.end_epoch(_epoch_summary(row, len(losses) / seconds if seconds else 0))
    return reason


def _record_row(n: Nitro, row: dict) -> None:
    if n.history_rows and n.history_rows[-1]["epoch"] == row["epoch"]:
        n.history_rows[-1] = row  # the epoch a stop cut short, now finished
    else:
        n.history_rows.append(row)


def _lr_reader(n: Nitro):
    """step (0-based) -> {"lr": rate} (one group) or {"lr/<group>": rate}, as fed to the step."""
    keys = [
        (i, k)
        for i, (kind, k) in enumerate(n.hyper_keys)
        if kind == "opt" and k.endswith(".learning_rate")
    ]
    groups = [k.split(".")[1] for _, k in keys]
    names = ["lr"] if len(groups) == 1 else [f"lr/{g}" for g in groups]
    if not n.schedules.fns:
        vec = n.hyper_values(0)
        fixed = {name: float(vec[i]) for name, (i, _) in zip(names, keys, strict=True)}
        return lambda t: fixed

    def at(t: int) -> dict[str, float]:
        vec = n.hyper_values(t)
        return {name: float(vec[i]) for name, (i, _) in zip(names, keys, strict=True)}

    return at


def _drain(
    n: Nitro,
    pending: collections.deque,
    count: int,
    epoch: int,
    losses: list[float],
    lr_of=None,
    clock: list | None = None,
) -> None:
    """Read back and log the oldest `count` dispatches' outputs in one transfer; then the
    step callbacks (`jn.every`) of the steps read."""
    items = [pending.popleft() for _ in range(count)]
    if not items:
        return
    now = time.perf_counter()
    steps_read = sum(item[2] for item in items)
    step_s = (now - clock[0]) / steps_read if clock and steps_read else None
    if clock:
        clock[0] = now
    callbacks = n.services.step_callbacks
    fire = events.has_callbacks(callbacks)
    # One device-side stack and one transfer per run of equal shapes (a fused call and the
    # single steps of an epoch's tail differ), instead of a read per scalar.
    hosts: list = []
    for _, run in itertools.groupby(items, key=lambda item: item[2]):
        outs = [o for *_, o in run]
        keys = list(outs[0])  # every output of one program has the same keys and shapes
        flat = jnp.stack([o[k] for o in outs for k in keys])  # one device op, one transfer
        host = np.asarray(jax.device_get(flat))
        host = host.reshape((len(outs), len(keys)) + host.shape[1:])
        hosts += [{k: host[i, j] for j, k in enumerate(keys)} for i in range(len(outs))]
    for (last_step, last_batch, steps, _), host in zip(items, hosts, strict=True):
        for j in range(steps):  # a fused call returns one row per optimizer step
            row = {
                k: float(np.asarray(v).reshape(-1)[j] if steps > 1 else v) for k, v in host.items()
            }
            step = last_step - steps + 1 + j
            if row.get("skipped"):
                n.skipped_steps += 1
            elif not math.isfinite(row["loss"]):
                batch = last_batch - (steps - j) * n.accum
                raise NonFiniteLossError(
                    f"the training loss is {row['loss']} at step {step} (epoch {epoch + 1}, "
                    f"batch {batch}). Lower the learning rate, check the data for NaN/inf, or "
                    f"add gradient clipping (or pass on_nonfinite='skip' to skip such steps). "
                    + _last_good(n)
                )
            if not row.get("skipped"):
                losses.append(row["loss"])
            rates = lr_of(step - 1) if lr_of is not None else {}
            row.update(rates)
            n.logger.log_metrics(row, context="train", epoch=epoch + 1, step=step)
            if fire:
                events.fire(
                    callbacks,
                    events.StepRecord(
                        step=step,
                        epoch=epoch + 1,
                        loss=row["loss"],
                        grad_norm=row.get("grad_norm"),
                        learning_rates={
                            k.removeprefix("lr/")
                            if k != "lr"
                            else next(iter(n.optimizer.groups)): v
                            for k, v in rates.items()
                        },
                        step_seconds=step_s,
                        metrics=dict(row),
                    ),
                )


def _last_good(n: Nitro) -> str:
    latest = n.checkpointer.latest()
    return (
        f"The last good checkpoint is {latest}."
        if latest is not None
        else "There is no checkpoint yet (the first is written at the end of epoch 1)."
    )


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float)) or v is None


def _epoch_summary(row: dict, rate: float) -> str:
    parts = [f"train_loss {row['train_loss']:.4f}" if row.get("train_loss") is not None else ""]
    parts += [
        f"{k} {v:.4f}"
        for k, v in row.items()
        if k not in ("epoch", "step", "train_loss") and isinstance(v, float)
    ]
    parts.append(f"{rate:,.0f} steps/s")
    return " · ".join(p for p in parts if p)


def _checkpoint(
    n: Nitro, row: dict, *, stop_reason: str | None = None, validated: bool = True
) -> None:
    metrics = {k: v for k, v in row.items() if isinstance(v, float)}
    meta = {
        "run_id": n.run_id,
        "validated": validated,
        "total_steps": n.total_steps,
        "epoch": n.epoch,
        "batch_in_epoch": n.batch_in_epoch,
        "step": n.step,
        "seed": n.seed,
        "config": _jsonable(dict(graph_key(n.experiment))),
        "experiment": n.cls.__qualname__,
        "history": _jsonable(n.history_rows),
        "skipped_steps": n.skipped_steps,
        "stop_reason": stop_reason,
        "early_stop": n.early_stop.state_dict() if n.early_stop is not None else None,
    }
    trees = {
        "params": n.carry.params,
        "model_state": n.carry.model_state,
        "opt_state": n.carry.opt_state,
    }
    n.checkpointer.save(epoch=row["epoch"], step=n.step, metrics=metrics, trees=trees, meta=meta)


def _summary(n: Nitro, r: TrainResult) -> None:
    metric = n.checkpointer.metric
    best = (
        f"best {metric} {r.best_metric:.4f}"
        if isinstance(r.best_metric, float)
        else "no validation"
    )
    n.display.line(
        f"done ({r.stop_reason}) · {best} · checkpoint {r.best_checkpoint} · "
        f"{r.programs_compiled} program(s) compiled · {r.steps_per_second:,.0f} steps/s · "
        f"{r.wall_seconds:.1f}s"
    )


# -- evaluation ------------------------------------------------------------------------
def _check_split(n: Nitro, split: str) -> None:
    if split not in n.splits:
        raise DataError(
            f"no split {split!r}; the data has {sorted(n.splits)}." + did_you_mean(split, n.splits)
        )


def _evaluate(n: Nitro, split: str) -> dict[str, Any]:
    _check_split(n, split)
    programs.check_stale(n)
    set_phase(n, "Evaluating", info={"split": split})
    bs = n.batch_info[split]["batch_size"]
    src = n.splits[split]
    stream = data_mod.Prefetcher(iter(src), feed.eval_prepare(n, split, bs))
    totals, extras = None, n.extras()
    progs: dict = {}
    try:
        for dev_batch, size, _ in stream:
            if size > bs:
                raise DataError(
                    f"a {split!r} batch has {size} rows, more than the first "
                    f"batch's {bs}; batches of a split share one size (the last may "
                    f"be shorter)."
                )
            n_valid = None if size == bs else size
            if totals is None:
                shapes = programs.eval_metric_shapes(n, split)
                totals = jax.device_put(metrics_mod.zeros_like_totals(shapes), n._rep)
            prog = progs.get(n_valid)
            if prog is None:
                prog = progs[n_valid] = programs.eval_program(n, split, dev_batch, totals, n_valid)
            totals = prog(n.carry.params, n.carry.model_state, dev_batch, extras, totals)
    finally:
        stream.close()
    values, raw = metrics_mod.finalize(jax.device_get(totals))
    if split != "val" and "val_loss" in values:  # the loss is named after its split
        values[f"{split}_loss"] = values.pop("val_loss")
        raw[f"{split}_loss"] = raw.pop("val_loss")
    fin = getattr(n.cls, "finalize_metrics", None)
    if fin is not None:
        out = fin(n.experiment, values, split)
        if not isinstance(out, Mapping):
            raise ConfigError(f"finalize_metrics must return a dict, got {type(out).__name__}.")
        values = {k: _host_value(v) for k, v in out.items()}
    return values


def _host_value(v):
    """0-d numpy/jax values become Python floats (logged, compared, JSON-safe)."""
    if hasattr(v, "shape") and getattr(v, "shape", None) == ():
        return float(np.asarray(v))
    return v


def validate(n: Nitro) -> dict[str, Any]:
    """Evaluate the 'val' split; returns {metric: value} (exact: totals divided once)."""
    return evaluate(n, split="val")


def evaluate(n: Nitro, split: str = "test") -> dict[str, Any]:
    """Evaluate any split with the eval program; returns {metric: value}."""
    _check_split(n, split)
    phase = n.phase
    values = _evaluate(n, split)
    with writing(n, "evaluate", required=False) as may_write:
        if may_write:
            n.logger.log_metrics(
                {"split": split, **{k: v for k, v in values.items() if _is_scalar(v)}},
                context="validate",
                epoch=n.epoch,
                step=n.step,
            )
    set_phase(n, phase if phase not in ("Starting", "Evaluating") else "Done")
    return values


# -- prediction ------------------------------------------------------------------------
def predict(n: Nitro, batch_or_loader):
    """Run `forward` in inference mode; host outputs with any padding sliced away.

    A dict batch returns the outputs for it; a loader (any re-iterable of dict batches)
    returns a lazy iterator of per-batch outputs.
    """
    programs.check_stale(n)
    if isinstance(batch_or_loader, Mapping):
        return _predict_batch(n, batch_or_loader, pad_to=None)
    if isinstance(batch_or_loader, (np.ndarray, jax.Array)) or not hasattr(
        batch_or_loader, "__iter__"
    ):
        fields = n.routes["forward"].required
        raise DataError(
            f"predict takes a dict batch (or a loader of them), got a bare "
            f"{type(batch_or_loader).__name__}. forward() expects the field(s) {list(fields)}: "
            f"pass e.g. jn.predict(n, {{{fields[0]!r}: x}})."
            if fields
            else f"predict takes a dict batch, got {type(batch_or_loader).__name__}."
        )
    return _predict_lazy(n, batch_or_loader)


def _predict_lazy(n: Nitro, loader) -> Iterator:
    pad_to = getattr(loader, "batch_size", None)
    for batch in loader:
        yield _predict_batch(n, batch, pad_to=pad_to)


def _predict_batch(n: Nitro, batch, *, pad_to: int | None):
    route = n.routes["forward"]
    missing = [f for f in route.required if f not in batch]
    if missing:
        hints = [(m, closest(m, batch, cutoff=0.5)) for m in missing]
        renames = [f"rename {got!r} to {m!r}" for m, got in hints if got]
        raise DataError(
            f"predict: forward() needs field(s) {missing}; the batch has {sorted(batch)}. "
            + ("; ".join(renames).capitalize() + "." if renames else f"Pass a dict with {missing}.")
        )
    fields = [f for f in batch if route.takes_all or f in route.required or f in route.optional]
    size = data_mod.check_batch({f: batch[f] for f in fields}, "predict")
    if "train" in n.batch_info:
        data_mod.check_same_specs(
            data_mod.batch_specs({f: batch[f] for f in fields}, "predict"),
            n.batch_info["train"]["specs"],
            "predict",
        )
    if pad_to is None:  # a dict batch of any size: a bounded set of programs
        cap = _predict_cap(n)
        if size > cap:  # in pieces of the largest bucket, outputs joined (batch first)
            pieces = [
                _predict_batch(n, {f: batch[f][i : i + cap] for f in fields}, pad_to=None)
                for i in range(0, size, cap)
            ]
            return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *pieces)
        pad_to = _bucket(size, cap)
    target = pad_to if pad_to and size < pad_to else size
    rem = target % n.n_devices
    if rem:
        target += n.n_devices - rem
    host = data_mod.pad_batch({f: np.asarray(batch[f]) for f in fields}, target)
    dev = {f: feed._put(n, host[f], n.batch_sharding) for f in fields}
    # One program per padded size: the padding rows are sliced away on the host, so the
    # number of real rows is not part of the program.
    prog = programs.predict_program(n, dev, None)
    out = jax.device_get(prog(n.carry.params, n.carry.model_state, dev, n.extras()))
    if target == size:
        return out
    return jax.tree.map(
        lambda a: a[:size] if getattr(a, "ndim", 0) and a.shape[0] == target else a, out
    )


def _predict_cap(n: Nitro) -> int:
    """The largest predict bucket: the train batch size (else the largest batch seen)."""
    sizes = [info["batch_size"] for info in n.batch_info.values()]
    train = n.batch_info.get("train", {}).get("batch_size")
    return max(train or max(sizes, default=1), 1)


def _bucket(size: int, cap: int) -> int:
    """Powers of two up to `cap` (and `cap` itself): predict over arbitrary batch sizes
    compiles at most log2(cap) + 2 programs instead of one per size."""
    b = 1
    while b < size:
        b *= 2
    return min(b, cap)


# -- live Device values ----------------------------------------------------------------
def set_device(n: Nitro, **values) -> None:
    """Change Device fields of a live handle; no recompile.

    Example:
        >>> jn.set_device(n, smoothing=0.1)
    """
    known = {f.name: f for f in fields(n.experiment)}
    for name, value in values.items():
        info = known.get(name)
        if info is None:
            raise ConfigError(
                f"{n.cls.__name__} has no field {name!r}." + did_you_mean(name, known)
            )
        if info.marker != DEVICE:
            why = (
                "it is baked into the compiled program; build a new Nitro (one recompile)"
                if info.marker == GRAPH
                else "it is driver-only; use dataclasses.replace on the experiment"
            )
            raise ConfigError(
                f"set_device cannot change {info.marker} field {name!r}: {why}. "
                f"Only jn.Device fields are live inputs."
            )
        new = n._device_value(name, value)
        old = n.device_values[name]
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ConfigError(
                f"set_device({name}=...) would change its shape/dtype from {old.shape}/"
                f"{old.dtype} to {new.shape}/{new.dtype}, which needs a new program. Pass a "
                f"value of the same shape and dtype."
            )
        if f"device.{name}" in n.schedules.fns:
            raise ConfigError(
                f"set_device cannot change {name!r}: a schedule drives it "
                f"(schedule key 'device.{name}'). Change the schedule instead."
            )
        n.device_values[name] = new
    n.invalidate_hyper()
    n.experiment = replace(n.experiment, **values)


def device_value(n: Nitro, name: str):
    """The current host value of a Device field."""
    if name not in n.device_values:
        raise ConfigError(
            f"{name!r} is not a Device field; Device fields: "
            f"{sorted(n.device_values)}." + did_you_mean(name, n.device_values)
        )
    arr = np.asarray(jax.device_get(n.device_values[name]))
    return arr.item() if arr.ndim == 0 else arr


def request_stop(n: Nitro) -> None:
    """Ask a running `train` to stop after the current step (validates and checkpoints)."""
    n.stop_requested = True


def history(n: Nitro) -> History:
    """Rows (epoch, step, train_loss, val metrics), best row by the checkpointer's metric."""
    return History(list(n.history_rows), metric=n.checkpointer.metric, mode=n.checkpointer.mode)
