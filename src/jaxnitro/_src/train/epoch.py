"""One epoch of train steps: `run_epoch`.

The epoch dispatches train calls ahead of the device (batches prefetched), keeps each call's
outputs as an `InFlight` record, and reads them back a chunk behind the newest step, so
dispatch never waits on the device and one transfer serves many steps. The read-back is also
when the new leaves and progress are handed to the handle (`Nitro._commit`), the step lines
are built and logged (per chunk: one call to the loggers for its steps; every
`log_every_n_steps`-th step has a line) and the step callbacks fire. Step-based validation
and checkpoints (`val_every`, `checkpoint_every`, `checkpoint_every_minutes`) happen at
dispatch boundaries.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import NonFiniteLossError, warn_user
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.data import feed
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.observe import throughput
from jaxnitro._src.observe.events import steps as step_events
from jaxnitro._src.observe.events.phases import set_phase
from jaxnitro._src.observe.events.signals import PreemptionSync
from jaxnitro._src.observe.loggers.base import log_step_rows
from jaxnitro._src.observe.members import training as members_training
from jaxnitro._src.observe.profile import ProfileWindow
from jaxnitro._src.observe.timing import EpochClock
from jaxnitro._src.programs.builders import train_program
from jaxnitro._src.run import commands
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.train import oom, render
from jaxnitro._src.train.checkpointing import save_checkpoint
from jaxnitro._src.train.evaluation import is_scalar, validation
from jaxnitro._src.train.introspect import peak_memory
from jaxnitro._src.train.readback import (
    InFlight,
    StepRow,
    failed_call,
    read_back,
    read_columns,
    step_rows,
)

if TYPE_CHECKING:
    from jaxnitro._src.data.loader import InlineFeed, Prefetcher
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec

# Losses are read back in chunks, a chunk behind the newest step, so dispatch never waits on
# the device and one transfer serves many steps.
READBACK_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class EpochResult:
    """What one epoch of train steps did."""

    losses: list[float | None]  # per step read (None: a custom step without a "loss")
    seconds: float  # the epoch's train time, compiles excluded
    train_loss: float | None  # the epoch's mean loss (its steps before a resume too)
    steps: int  # optimizer steps run (skipped ones too)
    clock: EpochClock  # where the time went; the driver adds the epoch end's
    data_wait_s: float  # the device idle for want of data
    rates: dict[str, float]  # samples_per_s, tokens_per_s, tflops_per_s, mfu (those known)


def run_epoch(n: Nitro, epoch: int) -> EpochResult:
    """Run epoch `epoch` (0-based) from the saved batch position.

    The order is load-bearing: each call is dispatched before the previous ones are read
    back; a read-back (and the handle's commit) comes before anything that reads the handle
    (a step callback, a mid-epoch validation or checkpoint); the last read-back and the
    commit come before the epoch's line, so a stop leaves a resumable position.
    """
    spec, control = n.spec, n.services.control
    set_phase(n, "Training")
    loader = spec.splits["train"]
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    total = len(loader) if hasattr(loader, "__len__") else None
    run = _Cursor(n, epoch)
    n.display.start_epoch(epoch, n.max_epochs, total, run.batch, members=members_training(n))
    if feed.stage_train(spec, loader, run.batch):  # batches cut on the device ahead: their
        run.restart_clock()  # transfers are not the epoch's steps
    stream = _stream(n, run, loader)
    sync = PreemptionSync(control)  # several processes: one stop step for all
    try:
        for payloads, _, unit in _timed(stream, run.time):
            base = run.batch
            for call in payloads:
                # What a `jn.start` handle asked since the last dispatch (new Device values, a
                # checkpoint) is done here, before the next dispatch.
                hyper = commands.at_boundary(run, mid_epoch, call)
                if hyper is not call.hyper:  # new Device values: this call takes them
                    call = call._replace(hyper=hyper)
                run.dispatch(call)
                sync.poll()
                if unit.states is not None:  # the iterator state after the last batch trained
                    run.data_state = unit.states[run.batch - base - 1]
                # The dispatch boundary: the handle may be read here once `run.drain` has run.
                if _at_boundary(run, call.steps, total) and control.requested:
                    break
            if len(run.pending) >= 2 * READBACK_CHUNK:
                run.drain(READBACK_CHUNK)
            if control.requested:
                break
        run.drain(len(run.pending))
    finally:
        stream.close()
        run.commit()
        run.close_profile()
    t_end = time.perf_counter()
    jax.block_until_ready(run.leaves)
    run.time.readback_s += time.perf_counter() - t_end
    seconds = time.perf_counter() - run.t0 - run.time.compile_s
    n.display.end_train(run.batch)  # the bar ends at the true count, then leaves (untimed)
    _log_epoch(n, run, stream.wait_seconds, seconds)
    _finish(n, epoch, run.batch, total)
    steps = run.step - run.first_step
    rates = run.throughput().rates(steps, seconds)
    return EpochResult(
        run.losses, seconds, run.train_loss(), steps, run.time, stream.wait_seconds, rates
    )


def _timed(stream: InlineFeed | Prefetcher, clock: EpochClock) -> Iterator[Any]:
    """The stream's items, the time spent asking for each added to `clock.fetch_s`."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(stream)
        except StopIteration:
            clock.fetch_s += time.perf_counter() - t0
            return
        clock.fetch_s += time.perf_counter() - t0
        yield item


def _stream(n: Nitro, run: _Cursor, loader: Any) -> InlineFeed | Prefetcher:
    """The epoch's train calls, prepared ahead (in a thread, unless preparing is cheap)."""
    spec = n.spec
    # Row indices of arrays on the device are cheap to prepare: no thread for them.
    inline = spec.direct_feed or spec.resident is not None or spec.device_batches is not None
    feed_cls = data_mod.InlineFeed if inline else data_mod.Prefetcher
    return feed_cls(
        feed.train_units(spec, loader, run.batch, run.epoch, run.data_state),
        feed.train_prepare(spec, run.step, n.device.hyper_base),
        in_flight=run.in_flight,
    )


def _at_boundary(run: _Cursor, steps: int, total: int | None) -> bool:
    """After a call: the step callbacks due read back at once (True: they did, so a stop they
    request ends the epoch after that step); a mid-epoch validation/checkpoint when due."""
    n = run.n
    drained = False
    callbacks = n.services.step_callbacks
    if step_events.has_callbacks(callbacks) and step_events.due(
        callbacks, run.step - steps, run.step
    ):
        run.drain(len(run.pending))  # the callback sees its step at once
        drained = True
    if run.cadence.active:
        validate, save = run.cadence.due(run.step - steps, run.step)
        if (validate or save) and run.batch != total:  # the epoch end does both
            run.drain(len(run.pending))
            mid_epoch(n, run.epoch, validate=validate, save=save, clock=run.time)
            run.cadence.saved(save)
    return drained


class _Cursor:
    """Where the epoch is: the train state's leaves as last dispatched, the step and batch
    position, the calls in flight, and the losses read so far."""

    def __init__(self, n: Nitro, epoch: int):
        self.n, self.spec, self.epoch = n, n.spec, epoch
        self.leaves = n.state_leaves
        self.step, self.batch = n.step, n.progress.batch_in_epoch
        self.data_state = n.progress.data_state  # a stream's iterator state (grain)
        self.skipped = n.progress.skipped_steps
        self.pending: collections.deque[InFlight] = collections.deque()
        self.losses: list[float | None] = []
        self.loss_sum, self.loss_count = n.progress.epoch_loss  # of the steps before a resume
        self.extras = n.device.extras
        self.accum = n.spec.accum
        self.lr_of = _lr_reader(self.spec, n.device)
        self.lr_fixed = None if self.spec.schedules.fns else self.lr_of(0)  # no schedule
        self._watched: dict[tuple[str, ...], list[str]] = {}  # output names -> those checked
        self.cadence = Cadence(self.spec)
        self.calls: dict[int, Any] = {}  # steps per call -> the compiled train program
        self.flops: dict[int, float | None] = {}  # steps per call -> the program's FLOPs
        self.on_host = n.spec.mesh.devices.flat[0].platform == "cpu"  # outputs in host memory
        self.fire = False
        self.first_step = self.step
        self.profile = ProfileWindow(n.spec.profile, n.spec.run_dir)
        self.time = EpochClock()
        self.t0 = self.clock = self.time.t0
        self._throughput: throughput.Throughput | None = None
        self.rates: dict[str, float] = {}  # of the last read-back chunk

    def rates_changed(self) -> None:
        """The learning rates fed from the next dispatch on changed (`run/commands.py`): the
        steps dispatched before are read back, and logged, first; the lr column reads anew."""
        self.drain(len(self.pending))
        self.lr_of = _lr_reader(self.spec, self.n.device)
        self.lr_fixed = None if self.spec.schedules.fns else self.lr_of(0)

    def restart_clock(self) -> None:
        self.time.restart()
        self.t0 = self.clock = self.time.t0

    def throughput(self) -> throughput.Throughput:
        """What a step carries (samples, tokens, FLOPs) and the peak: from the program used
        for most steps (the fused one), known once it is fetched."""
        if self._throughput is None or self._throughput.flops is None:
            steps = max(self.flops, default=None)
            flops = None if steps is None else self.flops[steps]
            self._throughput = throughput.for_run(self.spec, flops, self.spec.peak_tflops)
        return self._throughput

    def close_profile(self) -> None:
        if self.profile.close(self.leaves):
            self.n.logger.log_other({"profile": str(self.profile.dir), "step": self.step})

    def in_flight(self) -> Any:
        """An output of the last dispatched call not yet read back (None: the device is
        idle); the feed counts a wait for data only once it is ready."""
        return self.pending[-1].first_output() if self.pending else None

    def dispatch(self, call: feed.Call) -> None:
        compiled = self.calls.get(call.steps)
        if compiled is None:
            prog = self._program(call)
            compiled = self.calls[call.steps] = prog.compiled
            self.flops[call.steps] = prog.record.flops
        profile = self.profile
        if not profile.done and profile.before_dispatch(self.step):
            self.n.display.line(f"profiling steps {self.step + 1}.. into {profile.dir}")
        t0 = time.perf_counter()
        try:
            self.leaves, out = compiled(self.leaves, call.batch, self.extras, call.hyper)
        except Exception as e:  # an earlier call's failure surfaces here: name its step
            oom.at_steps(e, failed_call(self.pending) or (self.step + 1, self.step + call.steps))
            raise
        self.time.dispatch_s += time.perf_counter() - t0
        self.batch += call.steps * self.accum
        self.step += call.steps
        self.pending.append(InFlight(self.step, self.batch, call.steps, out))
        if profile.active and profile.after_dispatch(self.step, out):
            self.n.logger.log_other({"profile": str(self.profile.dir), "step": self.step})
            self.n.display.line(f"profile of steps up to {self.step} written to {self.profile.dir}")

    def _program(self, call: feed.Call) -> Any:
        """The train program for `call.steps` per call (fetched or compiled; compiles are
        not timed)."""
        progs = self.n.programs.train
        prog = progs.get(("train", call.steps))
        if prog is None:
            self.commit()  # the handle's state is this one (its shapes key the program)
            c0 = time.perf_counter()
            prog = progs[("train", call.steps)] = train_program(
                self.spec,
                self.n.programs,
                self.n.train_state,
                call.batch,
                self.extras,
                call.hyper,
                call.steps,
            )
            self.time.compile_s += time.perf_counter() - c0
        return prog

    def commit(self) -> None:
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

    def drain(self, count: int) -> None:
        """Read back and log the oldest `count` calls' outputs in one transfer; then the step
        callbacks (`jn.every`) of the steps read."""
        items = [self.pending.popleft() for _ in range(count)]
        self.commit()
        if not items:
            return
        now = time.perf_counter()
        steps_read = sum(item.steps for item in items)
        step_s = (now - self.clock) / steps_read if steps_read else None
        self.clock = now
        self.fire = step_events.has_callbacks(self.n.services.step_callbacks)
        members = self.spec.population is not None
        # One row per step, built and logged per chunk; per step where a callback may see
        # each step as it is logged, or a population's rows are built per member.
        try:
            columns = None if members or self.fire else read_columns(items, on_host=self.on_host)
            hosts = None if columns is not None else read_back(items, on_host=self.on_host)
        except Exception as e:
            first = (items[0].step - items[0].steps + 1, items[0].step)
            oom.at_steps(e, failed_call(items) or first)
            raise
        self.time.readback_s += time.perf_counter() - now  # blocked on the device, mostly
        if step_s is not None:  # per chunk: the rates each of its step lines carries
            self.rates = self.throughput().rates(1, step_s)
        if columns is not None:
            self._chunk_rows(items, columns)
        else:
            assert hosts is not None
            for item, host in zip(items, hosts, strict=True):
                for row in step_rows(item, host, accum=self.spec.accum, members=members):
                    self._step_row(row, step_s)
        self.commit()
        # The bar moves with the read-back chunks: rate and ETA cost no device sync of their own.
        elapsed = now - self.t0 - self.time.compile_s
        rate = len(self.losses) / elapsed if elapsed > 0 else None
        self.n.display.update(items[-1].batch, self.losses[-1] if self.losses else None, rate)

    def _chunk_rows(self, items: list[InFlight], columns: dict[str, np.ndarray]) -> None:
        """A chunk's steps (one column per output): counted, checked, and their lines logged
        at once; what `_step_row` does per step, with the same rows and the same error."""
        first = items[0].step - items[0].steps + 1  # the chunk's calls are consecutive
        count = items[-1].step - first + 1
        skipped = columns.get("skipped")
        kept = None if skipped is None else skipped == 0
        key = tuple(columns)
        watched = self._watched.get(key)
        if watched is None:
            watched = self._watched[key] = _watched(self.spec, columns)
        stop = count  # the steps taken: those before a non-finite one (then it raises)
        if watched:
            finite = np.isfinite(np.stack([columns[k] for k in watched])).all(axis=0)
            if kept is not None:
                finite |= ~kept
            if not finite.all():
                stop = int(np.argmin(finite))
        # float64 first: the values as float() reads each (an int or bool output too)
        names = list(columns)
        lists = [columns[k][:stop].astype(np.float64).tolist() for k in names]
        loss = lists[names.index("loss")] if "loss" in columns else None
        if kept is None:
            taken = loss if loss is not None else [None] * stop
        else:
            mask = kept[:stop].tolist()
            self.skipped += stop - sum(mask)
            taken = [v for v, m in zip(loss or [None] * stop, mask, strict=True) if m]
        self.losses += taken
        if loss is not None and taken:  # in step order, one addition at a time, as per step
            self.loss_count += len(taken)
            self.loss_sum = functools.reduce(operator.add, taken, self.loss_sum)
        self._log_chunk(first, names, lists)
        if stop < count:  # the first non-finite step: the error `_step_row` raises
            at = _step_at(items, stop, self.spec.accum)
            row = {k: float(v[stop]) for k, v in columns.items()}
            _check_finite(self.n, row, watched, at, self.epoch)

    def _log_chunk(self, first: int, names: list[str], lists: list[list[float]]) -> None:
        """The lines of the steps from `first` on (`lists`: one column per output name), every
        `log_every_n_steps`-th step's, in one call to the loggers."""
        every, count = self.spec.log_every_n_steps, len(lists[0]) if lists else 0
        steps = list(range(first, first + count))
        if every > 1:
            picked = [j for j, step in enumerate(steps) if step % every == 0]
            lists = [[column[j] for j in picked] for column in lists]
            steps = [steps[j] for j in picked]
        if not steps:
            return
        rows = [dict(zip(names, values, strict=True)) for values in zip(*lists, strict=True)]
        if self.lr_fixed is not None:  # no schedule: the same rates on every line
            extra = {**self.lr_fixed, **self.rates}
            for row in rows:
                row.update(extra)
        else:
            for row, step in zip(rows, steps, strict=True):
                row.update(self.lr_of(step - 1))
                row.update(self.rates)
        log_step_rows(self.n.logger, rows, context="train", epoch=self.epoch + 1, steps=steps)

    def _step_row(self, step_row: StepRow, step_s: float | None) -> None:
        n, epoch, row, step = self.n, self.epoch, step_row.values, step_row.step
        if row.get("skipped"):
            self.skipped += 1
        else:
            _check_finite(n, row, _watched(self.spec, row), step_row, epoch)
            self.losses.append(row.get("loss"))  # None: a custom step without a "loss"
            if row.get("loss") is not None:
                self.loss_sum += row["loss"]
                self.loss_count += 1
        rates = self.lr_of(step - 1)
        row.update(rates)
        row.update(self.rates)
        if step % self.spec.log_every_n_steps == 0:
            n.logger.log_metrics(row, context="train", epoch=epoch + 1, step=step)
        if not self.fire:
            return
        groups = [g for _, g in self.spec.hyper.learning_rates()]
        step_events.fire(
            n.services.step_callbacks,
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


def _step_at(items: list[InFlight], index: int, accum: int) -> StepRow:
    """The `index`-th step of a chunk's calls (its step count and batch position)."""
    for item in items:
        if index < item.steps:
            j = index
            return StepRow(
                item.step - item.steps + 1 + j, item.batch - (item.steps - j) * accum, {}
            )
        index -= item.steps
    raise IndexError(index)


def _watched(spec: RunSpec, row: Mapping[str, Any]) -> list[str]:
    """The step outputs that stop the run when not finite (each member's, for a population,
    except the members whose step was skipped)."""
    if "train_step" in spec.routes:
        names = sorted(k for k in row if not k.startswith("skipped") and "/" not in k)
    else:
        names = ["loss"]
    pop = spec.population
    if pop is None:
        return names
    return [
        f"{k}/{i}"
        for i in range(pop.size)
        if not row.get(f"skipped/{i}")
        for k in names
        if f"{k}/{i}" in row
    ]


def _check_finite(n: Nitro, row: dict, watched: list[str], at: StepRow, epoch: int) -> None:
    """The loss (with a custom train_step, every metric it returns) is finite, or the run
    stops naming the step."""
    bad = [k for k in watched if not math.isfinite(row[k])]
    if not bad:
        return
    what = "the training loss is" if bad == ["loss"] else f"train metric {bad[0]!r} is"
    raise NonFiniteLossError(
        f"{what} {row[bad[0]]} at step {at.step} (epoch {epoch + 1}, batch {at.batch}). Lower "
        f"the learning rate, check the data for NaN/inf, or add gradient clipping (or pass "
        f"on_nonfinite='skip' to skip such steps). " + last_good(n)
    )


def _log_epoch(n: Nitro, run: _Cursor, wait_seconds: float, seconds: float) -> None:
    wait_frac = min(1.0, wait_seconds / seconds) if seconds > 0 else 0.0
    n.logger.log_metrics(
        {
            "data_wait_frac": wait_frac,
            "steps_per_s": len(run.losses) / seconds if seconds else None,
            "peak_bytes_in_use": peak_memory(n),
            "skipped_steps": run.skipped,
        },
        context="data",
        epoch=run.epoch + 1,
        step=run.step,
    )


def _finish(n: Nitro, epoch: int, batch: int, total: int | None) -> None:
    """The epoch's length checked; the progress moves to the next epoch unless a stop cut
    this one short (a resume then continues mid-epoch)."""
    progress = _check_epoch_length(n, epoch, total)
    if total is None or batch >= total or not n.services.control.requested:
        progress = progress.next_epoch()
    n._commit(progress=progress)


def _check_epoch_length(n: Nitro, epoch: int, total: int | None) -> Progress:
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


class Cadence:
    """When step-based validation and checkpoints are due (`val_every`, `checkpoint_every`,
    `checkpoint_every_minutes`), counted in optimizer steps across epochs."""

    def __init__(self, spec: RunSpec):
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


def mid_epoch(
    n: Nitro,
    epoch: int,
    *,
    validate: bool,
    save: bool,
    clock: EpochClock | None = None,
    requested: bool = False,
) -> None:
    """Validation and/or a checkpoint inside an epoch: the checkpoint holds the batch
    position, so a resume from it continues mid-epoch exactly. `requested`: the user asked
    for the checkpoint (retention keeps it)."""
    clock = clock if clock is not None else EpochClock()
    # the epoch of the last step taken: a checkpoint asked for before an epoch's first step
    # has the name of the previous epoch's end, at the same step
    row: dict[str, Any] = {"epoch": n.progress.epoch_number, "step": n.step}
    if validate and "val" in n.spec.splits:
        t0 = time.perf_counter()
        row.update(validation(n))
        clock.eval_s += time.perf_counter() - t0
        log_validation(n, row, epoch)
        # a history row per validation (no train_loss: the epoch has not ended), before the
        # checkpoint, whose meta carries the history a resume continues
        n._commit(progress=n.progress.with_row(row))
    if save:
        set_phase(n, "Checkpointing")
        clock.checkpoint_stall_s += save_checkpoint(n, row, requested=requested)
    set_phase(n, "Training")


def log_validation(n: Nitro, row: dict, epoch: int) -> None:
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


def _lr_reader(spec: RunSpec, device: Any) -> Callable[[int], dict[str, float]]:
    """step (0-based) -> {"lr": rate} (one group) or {"lr/<group>": rate}, as fed to the step
    (for a population, each member's as `lr/<i>` or `lr/<group>/<i>`)."""
    slots = spec.hyper.learning_rates()
    names = ["lr"] if len(slots) == 1 else [f"lr/{g}" for _, g in slots]
    base = device.hyper_base
    pop = spec.population

    def at(t: int) -> dict[str, float]:
        if pop is not None:
            out = {}
            assert pop.schedules is not None  # with_run resolved each member's
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


def last_good(n: Nitro) -> str:
    latest = n.checkpointer.latest()
    return (
        f"The last good checkpoint is {latest}."
        if latest is not None
        else "There is no checkpoint yet (the first is written at the end of epoch 1)."
    )
