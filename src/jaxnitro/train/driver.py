"""The driver: `jn.train`.

For each epoch, in this order: train steps (prefetched; losses read back a few steps behind
so dispatch never waits), validation, a history row, the log line, the checkpoint, the stop
check. It ends with a `finish` log line and a short summary. The loop works on the handle's
parts: it reads the `RunSpec`, runs the programs on the train state's leaves, and hands the
new leaves and a new `Progress` back to the handle (`_commit`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro.checkpoint.store import TopKCheckpointer
from jaxnitro.compile import autotune, cache, plan, report
from jaxnitro.compile.programs import check_stale, train_program
from jaxnitro.core.errors import DataError, NonFiniteLossError, warn_user
from jaxnitro.core.jsonable import jsonable
from jaxnitro.data import feed
from jaxnitro.data import loader as data_mod
from jaxnitro.experiment.markers import DEVICE, field_values, fields, graph_key
from jaxnitro.observe import render
from jaxnitro.observe.display import show_image
from jaxnitro.observe.events import steps as step_events
from jaxnitro.observe.events.phases import set_phase
from jaxnitro.observe.events.signals import Preempted, PreemptionSync, graceful_stop
from jaxnitro.observe.introspect import peak_memory
from jaxnitro.observe.loggers.base import flush_logger
from jaxnitro.observe.plot import write_curves
from jaxnitro.run import config
from jaxnitro.run.live import history
from jaxnitro.steps import population
from jaxnitro.train.evaluation import is_scalar, validation
from jaxnitro.train.history import History

# Losses are read back in chunks, a chunk behind the newest step, so dispatch never waits on
# the device and one transfer serves many steps.
_READBACK_CHUNK = 16


@dataclasses.dataclass
class TrainResult:
    """What `jn.train` returns.

    Example:
        >>> result = jn.train(n)
        >>> result.stop_reason, result.best_checkpoint, result.programs_compiled
        ('completed', PosixPath('runs/MnistMLP/checkpoints/epoch-0003-...'), 2)
    """

    history: History  # a row per validation (mid-epoch ones too), with its step
    best_checkpoint: Path | None
    stop_reason: str
    best_metric: float | None  # best_checkpoint's score (else the history's best)
    steps_per_second: float
    programs_compiled: int
    wall_seconds: float
    members: list[dict] | None = None  # a population's members, best first (last validation)
    programs_loaded: int = 0  # from JAX's persistent compilation cache (a warm start)


def train(n) -> TrainResult:
    """Train to `max_epochs` (or a stop); validate, log and checkpoint after each epoch.

    The order is fixed: check for stale programs; compile every planned program and check the
    memory plan (before step 1); then per epoch: train steps, validation, history row, log,
    checkpoint, early-stopping check, stop check. Ctrl-C stops after the current step (twice
    aborts); SIGTERM checkpoints the current step and raises `jn.Preempted` (exit status 143).

    Example:
        >>> result = jn.train(jn.Nitro(MnistMLP()))
        >>> result.history.best["acc"]
    """
    spec = n.spec
    if "train" not in spec.splits:
        raise DataError(
            f"jn.train needs a 'train' split; the data has {sorted(spec.splits)}. Return one "
            f"from build_data (or use jn.evaluate for a model that is not trained)."
        )
    if n.epoch >= n.max_epochs:
        warn_user(
            f"{spec.cls.__name__} has already trained to max_epochs={n.max_epochs} (epoch "
            f"{n.epoch}, step {n.step}): nothing to train. To train further, continue from its "
            f"checkpoint in a new handle with a larger max_epochs: jn.Nitro(exp, "
            f"run_dir='{n.run_dir}', resume='auto', max_epochs={n.max_epochs + 1}) (schedules "
            f"then span the new length).",
        )
        return _result(n, "completed", 0.0, 0, 0.0)
    _check_horizon(n)
    with n.services.writing("train", step=n.step):
        if jax.process_index() == 0:  # what repeats this run: jaxnitro train --config
            config.write(n.run_dir, n.config)
        return _train(n)


def _result(
    n, reason: str, rate: float, compiled: int, wall: float, loaded: int = 0
) -> TrainResult:
    hist = history(n)
    best = n.checkpointer.best()
    return TrainResult(
        history=hist,
        # this run's best checkpoint (or its newest): never one of another run in the dir
        best_checkpoint=best or n.checkpointer.latest(),
        stop_reason=reason,
        best_metric=_best_metric(n, best, hist),
        steps_per_second=rate,
        programs_compiled=compiled,
        wall_seconds=wall,
        members=_members(n),
        programs_loaded=loaded,
    )


def _best_metric(n, best: Path | None, hist: History) -> float | None:
    """The best checkpoint's score (Lightning's `best_model_score` of `best_model_path`);
    with no ranked checkpoint (checkpointer=False, none written), the history's best."""
    ck = n.checkpointer
    if best is not None:
        for record in ck.records():
            if record.get("name") == best.name:
                score = record.get("metrics", {}).get(ck.metric)
                if isinstance(score, int | float) and not isinstance(score, bool):
                    return float(score)
    row = hist.best
    return None if row is None else row.get(ck.metric)


def _members(n) -> list[dict] | None:
    """A population's members ranked by the checkpointer's metric at the last validation,
    each with its seed, values and last metrics."""
    pop = n.spec.population
    if pop is None:
        return None
    rows = n.progress.history
    last = rows[-1] if rows else {}
    per = [
        {k[: -len(f"/{i}")]: v for k, v in last.items() if k.endswith(f"/{i}")}
        for i in range(pop.size)
    ]
    states = n.progress.early_stop
    if isinstance(states, tuple):  # per-member early stopping
        for i, row in enumerate(per):
            row["stopped_epoch"] = states[i].stopped_epoch
    metric = getattr(n.checkpointer, "metric", None)
    return population.ranked(pop, per, metric=metric, mode=getattr(n.checkpointer, "mode", "min"))


def _train(n) -> TrainResult:
    t_start = time.perf_counter()
    start = cache.cache_stats()  # programs_compiled counts auto's too
    misses_start, loads_start = start["misses"], start["persistent_hits"]
    if n.spec.autotune:  # steps_per_call="auto": measured once, before the plan is checked
        _autotune(n)
    misses0 = cache.cache_stats()["misses"]
    n.programs.reset_train()  # re-keyed at each entry point: never served stale
    n.services.control.begin()
    set_phase(n, "Starting", force=True)
    check_stale(n.spec, n.programs)
    try:
        stop_reason, steps_run, seconds_run, planned = _epochs(n)
        _wait_for_checkpoint(n)  # the last background write is complete before train returns
        set_phase(n, "Done")
    except BaseException as e:
        with contextlib.suppress(Exception):  # a pending write still lands (or says why not)
            _wait_for_checkpoint(n)
        set_phase(n, "Failed", info={"error": repr(e)})
        n.logger.finish("error", error=repr(e), step=n.step, epoch=n.epoch)
        n.display.close()
        raise
    n.services.control.clear()
    compiled = cache.cache_stats()["misses"] - misses0  # against the plan (auto's aside)
    end = cache.cache_stats()
    loaded = end["persistent_hits"] - loads_start
    total = end["misses"] - misses_start - loaded  # XLA compiles; loaded ones apart
    rate = steps_run / seconds_run if seconds_run else 0.0
    result = _result(n, stop_reason, rate, total, time.perf_counter() - t_start, loaded)
    n.logger.finish(
        stop_reason,
        stop_reason=stop_reason,
        step=n.step,
        epoch=n.epoch,
        programs_compiled=total,
        programs_loaded=loaded,
        steps_per_s=rate,
        skipped_steps=n.progress.skipped_steps,
    )
    _report(n, compiled, planned)
    curves = write_curves(n)  # run_dir/curves.png; JAXNITRO_NO_PLOT=1 skips, a failure warns
    if curves is not None and n.spec.show_curves:
        show_image(curves)  # inline in a notebook (Nitro(show_curves=...))
    _summary(n, result)
    if stop_reason == "preempted":
        preempted = Preempted(
            n.step, n.checkpointer.latest(), where=n.progress.where(), resume=_resume_call(n)
        )
        n.display.line(str(preempted))  # a script's last line: Python prints no SystemExit
        raise preempted  # exit status 143, catchable
    return result


def _resume_call(n) -> str:
    """The call that continues this run from its newest checkpoint: the experiment with the
    fields that differ from their defaults, the run dir, resume='auto'."""
    exp = n.experiment
    given = []
    for f in fields(exp):
        value = getattr(exp, f.name)
        try:
            same = bool(value == f.default)
        except Exception:  # noqa: BLE001 - an array field: compare by nothing, show it
            same = False
        if not same:
            given.append(f"{f.name}={value!r}")
    call = f"{type(exp).__name__}({', '.join(given)})"
    return (
        f"jn.Nitro({call}, run_dir={str(n.run_dir)!r}, resume='auto') (with the run's other "
        f"options as before)"
    )


def _epochs(n) -> tuple[str, int, float, int]:
    """(stop reason, steps run, seconds training, programs planned) of the epoch loop."""
    stop_reason, steps_run, seconds_run = "completed", 0, 0.0
    with graceful_stop(n.services.control):
        # Every program this run uses compiles now and must fit: OOM before step 1.
        notes = plan.notes(n.spec)
        if any("avoids it" in note for note in notes):  # say why before compiling them
            n.display.line("programs this run compiles:\n  " + "\n  ".join(notes))
        memory = plan.check_memory(
            n.spec, n.programs, n.train_state, n.device, epoch=n.epoch, step=n.step
        )
        while n.epoch < n.max_epochs:
            epoch = n.epoch  # 0-based; logs and history say epoch + 1
            run = _Epoch(n, epoch)
            losses, seconds = run.run()
            steps_run, seconds_run = steps_run + len(losses), seconds_run + seconds
            stop_reason = _end_epoch(n, epoch, losses, seconds, run.train_loss())
            if stop_reason != "completed":
                break
    return stop_reason, steps_run, seconds_run, len(memory.programs)


def _report(n, compiled: int, planned: int) -> None:
    records = [p.record for p in n.programs.compiled[-compiled:] if compiled]
    if records:
        n.display.line(report.format_table(records))
    if compiled > planned:
        n.display.line(
            f"this run compiled {compiled} programs; its plan expected {planned}. "
            f"jn.explain(n) says why."
        )


def _check_horizon(n) -> None:
    """Schedules were resolved for the steps known at setup; say so when that changed."""
    spec = n.spec
    spe = spec.steps_per_epoch or 0
    if not spec.schedules.fns or not spe or spe * n.max_epochs == spec.total_steps:
        return
    total = spec.total_steps
    warn_user(
        f"max_epochs is now {n.max_epochs}, but this handle's schedules were resolved at setup "
        f"for {total} steps ({total // spe} epochs): past step {total} they hold their last "
        f"value. To extend a scheduled run, continue in a new handle, which spans the "
        f"schedules over the new length: jn.Nitro(exp, run_dir='{n.run_dir}', "
        f"resume='auto', max_epochs={n.max_epochs}).",
    )


class _Epoch:
    """One epoch of train steps from the saved batch position.

    Dispatches run ahead of the device; their outputs wait in `pending` and are read back in
    chunks (`_drain`), which is also when the new leaves and progress are handed to the handle.
    """

    def __init__(self, n, epoch: int):
        self.n, self.spec, self.epoch = n, n.spec, epoch
        self.leaves = n.state_leaves
        self.step, self.batch = n.step, n.progress.batch_in_epoch
        self.data_state = n.progress.data_state  # a stream's iterator state (grain)
        self.skipped = n.progress.skipped_steps
        self.pending: collections.deque = collections.deque()
        self.losses: list[float | None] = []
        self.loss_sum, self.loss_count = n.progress.epoch_loss  # of the steps before a resume
        self.extras = n.device.extras
        self.lr_of = _lr_reader(self.spec, n.device)
        self.cadence = _Cadence(self.spec)
        self.compile_s = 0.0
        self.calls: dict = {}  # steps per call -> the compiled train program
        self.on_host = n.spec.mesh.devices.flat[0].platform == "cpu"  # outputs in host memory
        self.fire = False
        self.t0 = self.clock = time.perf_counter()

    def watched(self, row: dict) -> list[str]:
        """The step outputs that stop the run when not finite (each member's, for a
        population, except the members whose step was skipped)."""
        if "train_step" in self.spec.routes:
            names = sorted(k for k in row if not k.startswith("skipped") and "/" not in k)
        else:
            names = ["loss"]
        pop = self.spec.population
        if pop is None:
            return names
        return [
            f"{k}/{i}"
            for i in range(pop.size)
            if not row.get(f"skipped/{i}")
            for k in names
            if f"{k}/{i}" in row
        ]

    def run(self) -> tuple[list[float | None], float]:
        """Run the epoch's steps; returns (losses, seconds excluding compiles)."""
        n, spec = self.n, self.spec
        set_phase(n, "Training")
        loader = spec.splits["train"]
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        total = len(loader) if hasattr(loader, "__len__") else None
        n.display.start_epoch(self.epoch, n.max_epochs, total, self.batch)
        # Batches cut on the device ahead: their transfers are not the epoch's steps.
        if feed.stage_train(spec, loader, self.batch):
            self.t0 = self.clock = time.perf_counter()
        # Row indices of arrays on the device are cheap to prepare: no thread for them.
        inline = spec.direct_feed or spec.resident is not None or spec.device_batches is not None
        feed_cls = data_mod.InlineFeed if inline else data_mod.Prefetcher
        stream = feed_cls(
            feed.train_units(spec, loader, self.batch, self.epoch, self.data_state),
            feed.train_prepare(spec, self.step, n.device.hyper_base),
            in_flight=self._in_flight,
        )
        try:
            self._steps(stream, total)
            self._drain(len(self.pending))
        finally:
            stream.close()
            self._commit()
        jax.block_until_ready(self.leaves)
        seconds = time.perf_counter() - self.t0 - self.compile_s
        n.display.end_train(self.batch)  # the bar ends at the true count, then leaves (untimed)
        self._log_epoch(stream.wait_seconds, seconds)
        self._finish(total)
        return self.losses, seconds

    def _steps(self, stream, total: int | None) -> None:
        control, cadence = self.n.services.control, self.cadence.active
        callbacks = self.n.services.step_callbacks
        sync = PreemptionSync(control)  # several processes: one stop step for all
        for payloads, _, unit in stream:
            states, base = (unit[2] if len(unit) > 2 else None), self.batch
            for dev_batch, hyper, steps in payloads:
                self._dispatch(dev_batch, hyper, steps)
                sync.poll()
                if states is not None:  # the iterator state after the last batch trained on
                    self.data_state = states[self.batch - base - 1]
                if step_events.due(callbacks, self.step - steps, self.step):
                    # read back now: the callback sees its step at once, and a stop it
                    # requests (jn.request_stop) ends the run after that step
                    self._drain(len(self.pending))
                    if control.requested:
                        break
                if not cadence:
                    continue
                validate, save = self.cadence.due(self.step - steps, self.step)
                if (validate or save) and self.batch != total:  # the epoch end does both
                    self._drain(len(self.pending))
                    _mid_epoch(self.n, self.epoch, validate=validate, save=save)
                    self.cadence.saved(save)
            if len(self.pending) >= 2 * _READBACK_CHUNK:
                self._drain(_READBACK_CHUNK)
            if control.requested:
                break

    def _in_flight(self):
        """An output of the last dispatched step not yet read back (None: the device is idle);
        the feed counts a wait for data only once it is ready."""
        if not self.pending:
            return None
        return next(iter(self.pending[-1][3].values()), None)

    def _dispatch(self, dev_batch, hyper, steps: int) -> None:
        call = self.calls.get(steps)
        if call is None:
            call = self.calls[steps] = self._program(dev_batch, hyper, steps).compiled
        self.leaves, out = call(self.leaves, dev_batch, self.extras, hyper)
        self.batch += steps * self.spec.accum
        self.step += steps
        self.pending.append((self.step, self.batch, steps, out))

    def _program(self, dev_batch, hyper, steps: int):
        """The train program for `steps` per call (fetched or compiled; compiles not timed)."""
        progs = self.n.programs.train
        prog = progs.get(("train", steps))
        if prog is None:
            self._commit()  # the handle's state is this one (its shapes key the program)
            c0 = time.perf_counter()
            prog = progs[("train", steps)] = train_program(
                self.spec, self.n.programs, self.n.train_state, dev_batch, self.extras, hyper, steps
            )
            self.compile_s += time.perf_counter() - c0
        return prog

    def _commit(self) -> None:
        progress = self.n.progress.replace(
            step=self.step,
            batch_in_epoch=self.batch,
            skipped_steps=self.skipped,
            data_state=self.data_state,
            epoch_loss=(self.loss_sum, self.loss_count),
        )
        self.n._commit(leaves=self.leaves, progress=progress)

    def train_loss(self) -> float | None:
        """The epoch's mean train loss, over every step of it read (before a resume too)."""
        return self.loss_sum / self.loss_count if self.loss_count else None

    def _drain(self, count: int) -> None:
        """Read back and log the oldest `count` dispatches' outputs in one transfer; then the
        step callbacks (`jn.every`) of the steps read."""
        items = [self.pending.popleft() for _ in range(count)]
        self._commit()
        if not items:
            return
        now = time.perf_counter()
        steps_read = sum(item[2] for item in items)
        step_s = (now - self.clock) / steps_read if steps_read else None
        self.clock = now
        self.fire = step_events.has_callbacks(self.n.services.step_callbacks)
        pop = self.spec.population
        hosts = _read_back(items, on_host=self.on_host)
        for (last_step, last_batch, steps, _), host in zip(items, hosts, strict=True):
            for j in range(steps):  # a fused call returns one row per optimizer step
                if pop is not None:
                    row = _member_row(
                        {k: np.asarray(v).reshape(steps, -1)[j] for k, v in host.items()}
                    )
                else:
                    row = {
                        k: float(np.asarray(v).reshape(-1)[j] if steps > 1 else v)
                        for k, v in host.items()
                    }
                self._step_row(
                    row,
                    last_step - steps + 1 + j,
                    last_batch - (steps - j) * self.spec.accum,
                    step_s,
                )
        self._commit()
        # The bar moves with the read-back chunks: rate and ETA cost no device sync of their own.
        elapsed = now - self.t0 - self.compile_s
        rate = len(self.losses) / elapsed if elapsed > 0 else None
        self.n.display.update(items[-1][1], self.losses[-1] if self.losses else None, rate)

    def _step_row(self, row: dict, step: int, batch: int, step_s: float | None) -> None:
        n, epoch = self.n, self.epoch
        if row.get("skipped"):
            self.skipped += 1
        else:
            # the loss; with a custom train_step (no single loss) every metric it returns
            bad = [k for k in self.watched(row) if not math.isfinite(row[k])]
            if bad:
                what = "the training loss is" if bad == ["loss"] else f"train metric {bad[0]!r} is"
                raise NonFiniteLossError(
                    f"{what} {row[bad[0]]} at step {step} (epoch {epoch + 1}, batch "
                    f"{batch}). Lower the learning rate, check the data for NaN/inf, or add "
                    f"gradient clipping (or pass on_nonfinite='skip' to skip such steps). "
                    + _last_good(n)
                )
            self.losses.append(row.get("loss"))  # None: a custom step without a "loss"
            if row.get("loss") is not None:
                self.loss_sum += row["loss"]
                self.loss_count += 1
        rates = self.lr_of(step - 1)
        row.update(rates)
        n.logger.log_metrics(row, context="train", epoch=epoch + 1, step=step)
        if self.fire:
            callbacks = n.services.step_callbacks
            groups = [g for _, g in self.spec.hyper.learning_rates()]
            step_events.fire(
                callbacks,
                step_events.StepRecord(
                    step=step,
                    epoch=epoch + 1,
                    loss=row.get("loss"),
                    grad_norm=row.get("grad_norm"),
                    learning_rates=dict(zip(groups, rates.values(), strict=True))
                    if self.spec.population is None
                    else dict(rates),
                    step_seconds=step_s,
                    metrics=dict(row),
                ),
            )

    def _log_epoch(self, wait_seconds: float, seconds: float) -> None:
        wait_frac = min(1.0, wait_seconds / seconds) if seconds > 0 else 0.0
        self.n.logger.log_metrics(
            {
                "data_wait_frac": wait_frac,
                "steps_per_s": len(self.losses) / seconds if seconds else None,
                "peak_bytes_in_use": peak_memory(self.n),
                "skipped_steps": self.skipped,
            },
            context="data",
            epoch=self.epoch + 1,
            step=self.step,
        )

    def _finish(self, total: int | None) -> None:
        """The epoch's length checked; the progress moves to the next epoch unless a stop cut
        this one short (a resume then continues mid-epoch)."""
        n = self.n
        progress = _check_epoch_length(n, self.epoch, total)
        if total is None or self.batch >= total or not n.services.control.requested:
            progress = progress.next_epoch()
        n._commit(progress=progress)


def _read_back(items, *, on_host: bool) -> list[dict]:
    """The outputs as host arrays, per run of equal shapes (a fused call and the single steps
    of an epoch's tail differ). On an accelerator: one device-side stack and one transfer,
    instead of a read per scalar. On a CPU (`on_host`) the outputs already lie in host memory
    and are read as they are: there the eager stack cost ~25 µs of the training thread per
    step, a read ~3 µs."""
    hosts: list = []
    for _, run in itertools.groupby(items, key=lambda item: item[2]):
        outs = [o for *_, o in run]
        keys = list(outs[0])  # every output of one program has the same keys and shapes
        if on_host:
            host = np.stack([np.asarray(o[k]) for o in outs for k in keys])
        else:
            flat = jnp.stack([o[k] for o in outs for k in keys])  # one device op, one transfer
            host = np.asarray(jax.device_get(flat))
        host = host.reshape((len(outs), len(keys)) + host.shape[1:])
        hosts += [{k: host[i, j] for j, k in enumerate(keys)} for i in range(len(outs))]
    return hosts


class _Cadence:
    """When step-based validation and checkpoints are due (`val_every`, `checkpoint_every`,
    `checkpoint_every_minutes`), counted in optimizer steps across epochs."""

    def __init__(self, spec):
        self.val, self.ckpt = spec.val_every, spec.checkpoint_every
        minutes = spec.checkpoint_every_minutes
        self.seconds = None if minutes is None else minutes * 60
        self.last = time.monotonic()
        self.active = any(v is not None for v in (self.val, self.ckpt, self.seconds))

    def due(self, before: int, after: int) -> tuple[bool, bool]:
        validate = self.val is not None and after // self.val > before // self.val
        save = self.ckpt is not None and after // self.ckpt > before // self.ckpt
        if self.seconds is not None and time.monotonic() - self.last >= self.seconds:
            save = True
        return validate, save

    def saved(self, save: bool) -> None:
        if save:
            self.last = time.monotonic()


def _mid_epoch(n, epoch: int, *, validate: bool, save: bool) -> None:
    """Validation and/or a checkpoint inside an epoch: the checkpoint holds the batch
    position, so a resume from it continues mid-epoch exactly."""
    row: dict[str, Any] = {"epoch": epoch + 1, "step": n.step}
    if validate and "val" in n.spec.splits:
        row.update(validation(n))
        _log_validation(n, row, epoch)
        # a history row per validation (no train_loss: the epoch has not ended), before the
        # checkpoint, whose meta carries the history a resume continues
        n._commit(progress=n.progress.with_row(row))
    if save:
        set_phase(n, "Checkpointing")
        _checkpoint(n, row)
    set_phase(n, "Training")


def _log_validation(n, row: dict, epoch: int) -> None:
    """The validation line (a matrix metric as nested lists; scalar backends skip it), then
    the heatmaps of matrix metrics."""
    n.logger.log_metrics(
        {
            k: v if is_scalar(v) else jsonable(v)
            for k, v in row.items()
            if k not in ("epoch", "step") and (is_scalar(v) or np.ndim(v) == 2)
        },
        context="validate",
        epoch=epoch + 1,
        step=n.step,
    )
    render.matrices(n, row)


def _check_epoch_length(n, epoch: int, total: int | None):
    """An epoch that ends early (a source that is partly one-shot, or shrinks) says so;
    returns the progress (with the first epoch's length for a source without len())."""
    progress = n.progress
    if n.services.control.requested:
        return progress
    seen = progress.batch_in_epoch
    expected = total if total is not None else progress.first_epoch_batches
    if total is None and progress.first_epoch_batches is None:
        progress = progress.replace(first_epoch_batches=seen)
    if expected is not None and seen < expected:
        warn_user(
            f"epoch {epoch + 1} yielded {seen} train batches, but "
            + (
                f"the split's len() is {expected}"
                if total is not None
                else f"the first epoch had {expected}"
            )
            + ". A source whose iterator is shared between passes runs dry; make __iter__ "
            "start a new pass (or use jn.DataLoader).",
        )
    return progress


def _end_epoch(
    n, epoch: int, losses: list[float | None], seconds: float, train_loss: float | None
) -> str:
    """Validate, record, log, checkpoint, and decide whether to stop; returns the stop reason."""
    control = n.services.control
    row = {"epoch": epoch + 1, "step": n.step, "train_loss": train_loss}
    if "val" in n.spec.splits and not control.preempted:  # preemption leaves no time
        try:
            row.update(validation(n))
        except BaseException:
            # A failing val loader or a second Ctrl-C must not cost the epoch's training:
            # checkpoint the trained state, marked unvalidated, then let the error through.
            n._commit(progress=n.progress.with_row(row))
            with contextlib.suppress(Exception):
                _checkpoint(n, row, stop_reason="error", validated=False)
            raise
        _log_validation(n, row, epoch)
    n._commit(progress=n.progress.with_row(row))
    reason = "completed"
    finished = n.progress.batch_in_epoch == 0  # the epoch ran to its end
    es = n.spec.early_stop
    if es is not None and n.progress.early_stop is not None:
        if finished and not control.requested:
            state, stop = es.advance(n.progress.early_stop, epoch + 1, row)
            n._commit(progress=n.progress.replace(early_stop=state))
            if stop:
                reason = "early_stop"
        if isinstance(n.progress.early_stop, tuple):  # members that stopped train no more
            _members_stopped(n, es, n.progress.early_stop, epoch + 1)
    if control.requested:
        reason = "preempted" if control.preempted else "requested"
    set_phase(n, "Checkpointing")
    _checkpoint(n, row, stop_reason=None if reason == "completed" else reason)
    n.display.end_epoch(_epoch_summary(row, len(losses) / seconds if seconds else 0), row)
    return reason


def _member_row(values: dict) -> dict[str, float]:
    """One step's outputs for every member (name -> (members,)) as `name/i` per member and
    the members' mean under the name (skipped: 1 only when every member skipped)."""
    row: dict[str, float] = {}
    skipped = values.get("skipped")
    for k, arr in values.items():
        for i, v in enumerate(arr):
            row[f"{k}/{i}"] = float(v)
        if k == "skipped":
            row[k] = float(np.all(arr > 0))
            continue
        kept = arr if skipped is None else arr[skipped == 0]
        finite = kept[np.isfinite(kept)]
        row[k] = float(finite.mean()) if finite.size else float("nan")
    return row


def _members_stopped(n, es, states, epoch: int) -> None:
    """Freeze the members whose early stopping fired this epoch, and say so."""
    was = np.asarray(jax.device_get(n.device.active))
    now = es.active(states)
    for i in np.flatnonzero(was & ~now):
        best = states[i]
        n.logger.log_other(
            {"member_stopped": int(i), "epoch": epoch, f"best_{es.metric}": best.best}
        )
        n.display.line(
            f"member {i} stopped early at epoch {epoch} (best {es.metric} {best.best} at "
            f"epoch {best.best_epoch}); the others train on"
        )
    n._set_active(now)


def _lr_reader(spec, device):
    """step (0-based) -> {"lr": rate} (one group) or {"lr/<group>": rate}, as fed to the step
    (for a population, each member's as `lr/<i>` or `lr/<group>/<i>`)."""
    slots = spec.hyper.learning_rates()
    names = ["lr"] if len(slots) == 1 else [f"lr/{g}" for _, g in slots]
    base = device.hyper_base
    pop = spec.population

    def at(t: int) -> dict[str, float]:
        if pop is not None:
            out = {}
            for m, (sched, b) in enumerate(zip(pop.schedules, base, strict=True)):
                vec = spec.hyper.pack(t, sched, b)
                out.update(
                    {
                        f"{name}/{m}": float(vec[i])
                        for name, (i, _) in zip(names, slots, strict=True)
                    }
                )
            return out
        vec = spec.hyper.pack(t, spec.schedules, base)
        return {name: float(vec[i]) for name, (i, _) in zip(names, slots, strict=True)}

    if not spec.schedules.fns:
        fixed = at(0)
        return lambda t: fixed
    return at


def _last_good(n) -> str:
    latest = n.checkpointer.latest()
    return (
        f"The last good checkpoint is {latest}."
        if latest is not None
        else "There is no checkpoint yet (the first is written at the end of epoch 1)."
    )


def _epoch_summary(row: dict, rate: float) -> str:
    parts = [f"train_loss {row['train_loss']:.4f}" if row.get("train_loss") is not None else ""]
    parts += [
        f"{k} {v:.4f}"
        for k, v in row.items()
        if k not in ("epoch", "step", "train_loss") and isinstance(v, float)
    ]
    parts.append(f"{rate:,.0f} steps/s")
    return " · ".join(p for p in parts if p)


def _checkpoint(n, row: dict, *, stop_reason: str | None = None, validated: bool = True) -> None:
    spec, progress, ts = n.spec, n.progress, n.train_state
    metrics = {k: v for k, v in row.items() if isinstance(v, float)}
    meta = {
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
        "loggers": _logger_state(n),
    }
    trees = {"params": ts.params, "model_state": ts.state, "opt_state": ts.opt_state}
    if ts.ema is not None:  # the average (its decay is the run's setting, not saved)
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
        return
    # A checkpoint during training is written in the background: training waits only for the
    # copy to host memory (the stall, logged per checkpoint) and for the previous write.
    path = ck.save(
        epoch=row["epoch"], step=n.step, metrics=metrics, trees=trees, meta=meta, background=True
    )
    n.logger.log_other({"checkpoint": path.name, "checkpoint_stall_s": time.perf_counter() - t0})


def _autotune(n) -> None:
    check_stale(n.spec, n.programs)
    choice = autotune.pick(n)
    n._set_steps_per_call(choice.steps)
    n.display.line(choice.line())
    n.logger.log_other(
        {
            "steps_per_call_auto": choice.steps,
            "candidate": choice.candidate,  # steps per call weighed against one
            "candidate_timed": choice.fused_s is not None,  # False: one step is too long to gain
            "single_step_s": choice.single_s,
            "fused_step_s": choice.fused_s,
        }
    )


def _wait_for_checkpoint(n) -> None:
    wait = getattr(n.checkpointer, "wait", None)
    if callable(wait):
        wait()


def _logger_state(n) -> Any:
    """What the loggers need to reattach to their runs on a resume (see jn.Logger)."""
    state = getattr(n.logger, "state_dict", None)
    return jsonable(state()) if callable(state) else None


def _summary(n, r: TrainResult) -> None:
    metric = n.checkpointer.metric
    best = (
        f"best {metric} {r.best_metric:.4f}"
        if isinstance(r.best_metric, float)
        else "no validation"
    )
    row, kept = r.history.best, r.best_metric
    if row is not None and isinstance(kept, float):
        score = float(row[metric])
        if score < kept if n.checkpointer.mode == "min" else score > kept:
            # a validation between checkpoints scored better than every checkpoint kept
            best += f" (step {row['step']} validated {score:.4f}, not checkpointed)"
    n.display.line(
        f"done ({r.stop_reason}) · {best} · checkpoint {r.best_checkpoint} · "
        f"{r.programs_compiled} program(s) compiled"
        + (f", {r.programs_loaded} loaded from the persistent cache" if r.programs_loaded else "")
        + f" · {r.steps_per_second:,.0f} steps/s · "
        f"{r.wall_seconds:.1f}s"
    )
