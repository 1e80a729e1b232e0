"""One epoch of train steps: `run_epoch`, one function read top to bottom.

The epoch dispatches train calls ahead of the device (batches prefetched), keeps each call's
outputs as an `InFlight` record, and reads them back a chunk behind the newest step, so
dispatch never waits on the device and one transfer serves many steps. The read-back is also
when the new leaves and progress are handed to the handle (`Nitro.take`), the step lines are
logged (`train/steplines.py`) and the step callbacks fire. What a `jn.start` handle asked
(`run/commands.py`), step-based validation and checkpoints (`val_every`, `checkpoint_every`,
`checkpoint_every_minutes`) happen at dispatch boundaries.

The order is load-bearing; do not change it: each call is dispatched before the previous
ones are read back; a read-back (and the handover to the handle) comes before anything that
reads the handle (a step callback, a mid-epoch validation or checkpoint, a checkpoint a
`jn.start` handle asked); the last read-back and the handover come before the epoch's line,
so a stop leaves a resumable position.

The epoch's state is local to `run_epoch`: the train state as last dispatched (`StateCarry`), the
newest call (`InFlight`: its step and batch position), the calls in flight, and a `Tally`
(frozen, replaced per chunk) of the steps read. What stays fixed through the epoch is an
`Epoch` record. The handle takes the state where the epoch hands it over; the epoch returns
an `EpochResult`."""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.compile import cache
from jaxnitro._src.core.errors import warn_user
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.data import feed
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.observe import throughput
from jaxnitro._src.observe.events import steps as step_events
from jaxnitro._src.observe.events.phases import set_phase
from jaxnitro._src.observe.events.signals import PreemptionSync
from jaxnitro._src.observe.members import training as members_training
from jaxnitro._src.observe.profile import ProfileWindow
from jaxnitro._src.observe.timing import EpochClock
from jaxnitro._src.programs.builders import train_layout, train_program
from jaxnitro._src.run import commands
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.train import oom, render
from jaxnitro._src.train.carry import StateCarry
from jaxnitro._src.train.checkpointing import save_checkpoint
from jaxnitro._src.train.evaluation import is_scalar, validation
from jaxnitro._src.train.introspect import peak_memory
from jaxnitro._src.train.readback import InFlight, failed_call, read_back, read_columns
from jaxnitro._src.train.steplines import Chunk, Lines, chunk_lines, step_lines

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


@dataclasses.dataclass(frozen=True)
class Tally:
    """The epoch's steps read back so far, as the handle's progress counts them (its loss
    over the steps before a resume too), and when the last chunk was read."""

    loss_sum: float
    loss_count: int
    skipped: int
    read_at: float  # perf_counter at the last read-back: the next chunk's steps ran since

    @classmethod
    def of(cls, progress: Progress, t0: float) -> Tally:
        return cls(*progress.epoch_loss, progress.skipped_steps, t0)

    def add(self, chunk: Chunk, now: float) -> Tally:
        """With a chunk's steps (their losses summed in step order, one at a time)."""
        taken = [v for v in chunk.losses if v is not None]
        total = functools.reduce(operator.add, taken, self.loss_sum)
        return Tally(total, self.loss_count + len(taken), self.skipped + chunk.skipped, now)

    @property
    def train_loss(self) -> float | None:
        """The epoch's mean train loss, over every step of it read (before a resume too)."""
        return self.loss_sum / self.loss_count if self.loss_count else None


@dataclasses.dataclass(frozen=True)
class Epoch:
    """What stays fixed through one epoch, with the caches it fills as it runs: the compiled
    train program and its FLOPs per steps per call, the throughput per FLOPs known."""

    n: Nitro
    loader: Any  # the train split, set to this epoch
    total: int | None  # its batches (None: a source without len())
    first_step: int  # the step count the epoch started from
    lines: Lines
    clock: EpochClock  # where the epoch's time goes (its fields add up as it runs)
    profile: ProfileWindow
    sync: PreemptionSync  # several processes: one stop step for all
    cadence: Cadence  # as the epoch starts (the loop holds the one after each checkpoint)
    accum: int
    on_host: bool  # the outputs lie in host memory (a CPU backend)
    programs: dict[int, Any] = dataclasses.field(default_factory=dict)
    layouts: dict[int, Any] = dataclasses.field(default_factory=dict)
    flops: dict[int, float | None] = dataclasses.field(default_factory=dict)
    rates_of: dict[float | None, throughput.Throughput] = dataclasses.field(default_factory=dict)


def run_epoch(n: Nitro, epoch: int) -> EpochResult:
    """Run epoch `epoch` (0-based) from the saved batch position, in the order the module
    says (a read-back and the handover before anything that reads the handle)."""
    ep = _start(n, epoch)
    control, callbacks = n.services.control, n.services.step_callbacks
    carry, extras, repack = StateCarry(n.state_leaves, n.step), n.device.extras, None
    device = n.device  # the Device values and learning rates the calls take
    last = InFlight(n.step, n.progress.batch_in_epoch, 0, {})  # the newest call's position
    data_state = n.progress.data_state  # a stream's iterator state (grain)
    pending: collections.deque[InFlight] = collections.deque()  # calls not read back
    losses: list[float | None] = []  # of the steps read
    tally, cadence = Tally.of(n.progress, ep.clock.t0), ep.cadence

    def hand_over(counted: Tally | None = None) -> None:  # the handle shows the epoch so far
        n.take(leaves=carry.handed(), progress=_progress(n.progress, last, data_state, counted))

    def drain(count: int | None = None) -> None:  # the oldest calls (all) read back, counted
        nonlocal tally
        tally = _drain(ep, pending, count, tally, losses, hand_over)

    stream = _stream(ep, last, data_state, pending)
    try:
        for payloads, _, unit in _timed(stream, ep.clock):
            base = last.batch
            for call in payloads:
                asked = commands.at_boundary(n, last.step)  # what a jn.start handle asked
                if n.device is not device:  # new values (asked, or a callback's set_lr)
                    ep, extras, repack = _new_values(ep, drain)  # this call and the next
                    device = n.device
                if asked is not None and asked.checkpoints:  # with every step dispatched
                    _asked_checkpoint(n, epoch, asked, drain)
                if repack is not None:
                    call = call._replace(hyper=repack.at(last.step, call.steps))
                fn = ep.programs.get(call.steps) or _program(ep, call, extras, hand_over)
                last = _dispatch(ep, fn, carry, last, call, extras, pending)
                pending.append(last)
                ep.sync.poll()
                if unit.states is not None:  # the iterator state after the last batch trained
                    data_state = unit.states[last.batch - base - 1]
                # The dispatch boundary: what reads the handle reads it after a read-back.
                seen = _callbacks_due(callbacks, last.step - call.steps, last.step)
                if seen:  # the callback sees its step at once (a stop it asks ends here)
                    drain()
                if cadence.active:
                    cadence = _mid_epoch_due(ep, cadence, last, call.steps, drain)
                if control.requested:  # (a unit may hold several calls: none after a stop)
                    break
                if len(pending) >= 2 * READBACK_CHUNK:  # (per call: a unit may hold many)
                    drain(READBACK_CHUNK)
            if control.requested:
                break
        drain()
    finally:
        stream.close()
        hand_over()
        _close_profile(ep, carry.moving, last.step)
    seconds = _settle(ep.clock, carry.moving)
    n.display.end_train(last.batch)  # the bar ends at the true count, then leaves (untimed)
    done = _result(ep, losses, tally, last.step, seconds, stream.wait_seconds)
    _log_epoch(n, epoch, last.step, done, tally.skipped)
    _finish(n, epoch, last.batch, ep.total)
    return done


def _new_values(ep: Epoch, drain: Callable[[], None]) -> tuple[Epoch, Any, feed.HyperFeed]:
    """New Device values or learning rates in the handle (asked through `run/commands.py`, or
    set by `jn.set_lr` / `jn.set_device` from a step callback): the steps sent before are
    read back and logged with the rates they took; the next calls take the new extras and
    hyperparameters, and their lines read the new rates."""
    drain()
    n = ep.n
    ep = dataclasses.replace(ep, lines=ep.lines.reread_rates())
    return ep, n.device.extras, feed.HyperFeed(n.spec, n.device.hyper_base)


def _start(n: Nitro, epoch: int) -> Epoch:
    """The epoch set up: the Training phase, the train split set to `epoch`, its clock
    started, the bar shown, the epoch's batches staged on the device (the clock restarts
    after: their transfers are not the epoch's steps)."""
    spec = n.spec
    set_phase(n, "Training")
    loader = spec.splits["train"]
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    total = len(loader) if hasattr(loader, "__len__") else None
    ep = Epoch(
        n=n,
        loader=loader,
        total=total,
        first_step=n.step,
        lines=Lines.of(n, epoch),
        clock=EpochClock(),
        profile=ProfileWindow(spec.profile, spec.run_dir),
        sync=PreemptionSync(n.services.control),
        cadence=Cadence.of(spec),
        accum=spec.accum,
        on_host=spec.mesh.devices.flat[0].platform == "cpu",
    )
    batch = n.progress.batch_in_epoch
    n.display.start_epoch(epoch, n.max_epochs, total, batch, members=members_training(n))
    if feed.stage_train(spec, loader, batch):  # the train data on the device, in place
        ep.clock.restart()
    return ep


def _callbacks_due(callbacks: list, before: int, after: int) -> bool:
    """A step callback (`jn.every`) is due at a step in (before, after]."""
    return step_events.has_callbacks(callbacks) and step_events.due(callbacks, before, after)


def _result(
    ep: Epoch, losses: list, tally: Tally, step: int, seconds: float, wait: float
) -> EpochResult:
    steps = step - ep.first_step
    rates = _throughput(ep).rates(steps, seconds)
    return EpochResult(losses, seconds, tally.train_loss, steps, ep.clock, wait, rates)


def _progress(progress: Progress, last: InFlight, data_state: Any, tally: Tally | None) -> Progress:
    """`progress` at the newest call's position (and with `tally`'s counts, when given)."""
    if tally is None:
        return progress.replace(step=last.step, batch_in_epoch=last.batch, data_state=data_state)
    return progress.replace(
        step=last.step,
        batch_in_epoch=last.batch,
        data_state=data_state,
        skipped_steps=tally.skipped,
        epoch_loss=(tally.loss_sum, tally.loss_count),
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


def _stream(
    ep: Epoch, last: InFlight, data_state: Any, pending: collections.deque[InFlight]
) -> InlineFeed | Prefetcher:
    """The epoch's train calls from `last`'s position, prepared ahead (in a thread, unless
    preparing is cheap); the feed counts a wait for data only once the newest call in
    `pending` is done."""
    n, spec = ep.n, ep.n.spec
    units = feed.train_units(spec, ep.loader, last.batch, ep.lines.epoch, data_state)
    prepare = feed.train_prepare(spec, last.step, n.device.hyper_base)
    in_flight = functools.partial(_newest_output, pending)
    # Row indices of arrays on the device are cheap to prepare (no thread for them), and
    # never block on work elsewhere (the wait clock asks the device once per batch).
    rows_only = spec.resident is not None or spec.device_batches is not None
    if spec.direct_feed or rows_only:
        return data_mod.InlineFeed(units, prepare, in_flight=in_flight, may_block=not rows_only)
    return data_mod.Prefetcher(units, prepare, in_flight=in_flight)


def _newest_output(pending: collections.deque[InFlight]) -> Any:
    """An output of the last dispatched call not yet read back (None: the device is idle)."""
    return pending[-1].first_output() if pending else None


def _program(ep: Epoch, call: feed.Call, extras: Any, hand_over: Callable[[], None]) -> Any:
    """The compiled train program for `call.steps` per call, kept for the epoch (fetched or
    compiled; compiles are not timed)."""
    n = ep.n
    progs = n.programs.train
    prog = progs.get(("train", call.steps))
    if prog is None:
        hand_over()  # the handle's state is this one (its shapes key the program)
        c0 = time.perf_counter()
        prog = progs[("train", call.steps)] = train_program(
            n.spec, n.programs, n.train_state, call.batch, extras, call.hyper, call.steps
        )
        ep.clock.compile_s += time.perf_counter() - c0
    ep.flops[call.steps] = prog.record.flops
    ep.layouts[call.steps] = train_layout(prog)  # which state leaves it keeps
    ep.programs[call.steps] = cache.direct_call(prog.compiled)  # (made by an earlier epoch)
    return prog.compiled


def _dispatch(
    ep: Epoch,
    fn: Any,
    carry: StateCarry,
    last: InFlight,
    call: feed.Call,
    extras: Any,
    pending: collections.deque[InFlight],
) -> InFlight:
    """One train call after `last`; returns it in flight. Its new leaves replace the old in
    `carry.moving` (the loop's own list) within the call's time: the old are freed there, as the
    epoch's time split has always counted them (device time, not the host's)."""
    profile, step = ep.profile, last.step
    if not profile.done and profile.before_dispatch(step):
        ep.n.display.line(f"profiling steps {step + 1}.. into {profile.dir}")
    t0 = time.perf_counter()
    try:
        out = carry.run(fn, ep.layouts[call.steps], call.steps, call.batch, extras, call.hyper)
    except Exception as e:  # an earlier call's failure surfaces here: name its step
        oom.at_steps(e, failed_call(pending) or (step + 1, step + call.steps))
        raise
    ep.clock.dispatch_s += time.perf_counter() - t0
    flight = InFlight(step + call.steps, last.batch + call.steps * ep.accum, call.steps, out)
    if profile.active and profile.after_dispatch(flight.step, out):
        ep.n.logger.log_other({"profile": str(profile.dir), "step": flight.step})
        ep.n.display.line(f"profile of steps up to {flight.step} written to {profile.dir}")
    return flight


def _drain(
    ep: Epoch,
    pending: collections.deque[InFlight],
    count: int | None,
    tally: Tally,
    losses: list[float | None],
    hand_over: Callable[..., None],
) -> Tally:
    """Read back and log the oldest `count` calls in flight (None: all) in one transfer,
    their losses appended to `losses`; the handle takes the epoch after them (and before,
    what a step callback reads); returns the tally with them."""
    items = [pending.popleft() for _ in range(len(pending) if count is None else count)]
    n, clock = ep.n, ep.clock
    fire = step_events.has_callbacks(n.services.step_callbacks)
    if fire or not items:  # a step callback, or the caller, reads the handle next
        hand_over()
    if not items:
        return tally
    now = time.perf_counter()
    steps_read = items[-1].step - items[0].step + items[0].steps  # (consecutive calls)
    step_s = (now - tally.read_at) / steps_read if steps_read else None
    members = n.spec.population is not None
    # One row per step, built and logged per chunk; per step where a callback may see
    # each step as it is logged, or a population's rows are built per member.
    try:
        columns = None if members or fire else read_columns(items, on_host=ep.on_host)
        hosts = None if columns is not None else read_back(items, on_host=ep.on_host)
    except Exception as e:
        first = (items[0].step - items[0].steps + 1, items[0].step)
        oom.at_steps(e, failed_call(items) or first)
        raise
    clock.readback_s += time.perf_counter() - now  # blocked on the device, mostly
    rates = _throughput(ep).rates(1, step_s) if step_s is not None else {}
    if columns is not None:
        chunk = chunk_lines(ep.lines, items, columns, rates)
    else:
        assert hosts is not None
        chunk = step_lines(ep.lines, items, hosts, rates, step_s=step_s, fire=fire)
    losses += chunk.losses
    tally = tally.add(chunk, now)
    hand_over(tally)
    if chunk.error is not None:
        raise chunk.error
    # The bar moves with the read-back chunks: rate and ETA cost no device sync of their own.
    elapsed = now - clock.t0 - clock.compile_s
    rate = len(losses) / elapsed if elapsed > 0 else None
    n.display.update(items[-1].batch, losses[-1] if losses else None, rate)
    return tally


def _throughput(ep: Epoch) -> throughput.Throughput:
    """What a step carries (samples, tokens, FLOPs) and the peak: from the program used for
    most steps (the fused one), known once it is fetched."""
    steps = max(ep.flops, default=None)
    flops = None if steps is None else ep.flops[steps]
    known = ep.rates_of.get(flops)
    if known is None:
        spec = ep.n.spec
        known = ep.rates_of[flops] = throughput.for_run(spec, flops, spec.peak_tflops)
    return known


def _asked_checkpoint(
    n: Nitro, epoch: int, asked: commands.Asked, drain: Callable[[], None]
) -> None:
    """The checkpoints a `jn.start` handle asked: one, holding every step dispatched (the
    calls in flight read back first); each waiting future gets its path or the error."""
    drain()
    try:
        mid_epoch(n, epoch, validate=False, save=True, requested=True)
    except BaseException as e:
        asked.failed(e)
        raise
    asked.written(n.checkpointer.latest())


def _mid_epoch_due(
    ep: Epoch, cadence: Cadence, last: InFlight, steps: int, drain: Callable[[], None]
) -> Cadence:
    """A mid-epoch validation/checkpoint when one is due after the call `last` (of `steps`
    steps), with every call read back first; returns the cadence after it."""
    validate, save = cadence.due(last.step - steps, last.step)
    if not (validate or save) or last.batch == ep.total:  # the epoch end does both
        return cadence
    drain()
    mid_epoch(ep.n, ep.lines.epoch, validate=validate, save=save, clock=ep.clock)
    return cadence.saved(save)


def _close_profile(ep: Epoch, leaves: list, step: int) -> None:
    if ep.profile.close(leaves):
        ep.n.logger.log_other({"profile": str(ep.profile.dir), "step": step})


def _settle(clock: EpochClock, leaves: list) -> float:
    """The epoch's train time (compiles apart), once its last step has run: the wait for it
    counted as read-back."""
    t_end = time.perf_counter()
    jax.block_until_ready(leaves)
    clock.readback_s += time.perf_counter() - t_end
    return time.perf_counter() - clock.t0 - clock.compile_s


def _log_epoch(n: Nitro, epoch: int, step: int, done: EpochResult, skipped: int) -> None:
    """The epoch's `data` line."""
    seconds = done.seconds
    wait_frac = min(1.0, done.data_wait_s / seconds) if seconds > 0 else 0.0
    n.logger.log_metrics(
        {
            "data_wait_frac": wait_frac,
            "steps_per_s": len(done.losses) / seconds if seconds else None,
            "peak_bytes_in_use": peak_memory(n),
            "skipped_steps": skipped,
        },
        context="data",
        epoch=epoch + 1,
        step=step,
    )


def _finish(n: Nitro, epoch: int, batch: int, total: int | None) -> None:
    """The epoch's length checked; the progress moves to the next epoch unless a stop cut
    this one short (a resume then continues mid-epoch)."""
    progress = _check_epoch_length(n, epoch, total)
    if total is None or batch >= total or not n.services.control.requested:
        progress = progress.next_epoch()
    n.take(progress=progress)


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


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When step-based validation and checkpoints are due (`val_every`, `checkpoint_every`,
    `checkpoint_every_minutes`), counted in optimizer steps across epochs; the minutes from
    the epoch's start or its last checkpoint (`saved` gives the cadence after one)."""

    val: int | None
    ckpt: int | None
    seconds: float | None
    last: float  # time.monotonic() at the epoch's start or its last checkpoint
    active: bool  # any of them is set (read per dispatch)

    @classmethod
    def of(cls, spec: RunSpec) -> Cadence:
        minutes = spec.checkpoint_every_minutes
        seconds = None if minutes is None else minutes * 60
        val, ckpt = spec.val_every, spec.checkpoint_every
        active = any(v is not None for v in (val, ckpt, seconds))
        return cls(val, ckpt, seconds, time.monotonic(), active)

    def due(self, before: int, after: int) -> tuple[bool, bool]:
        """(validate, save) after the steps (before, after]."""
        validate = self.val is not None and after // self.val > before // self.val
        save = self.ckpt is not None and after // self.ckpt > before // self.ckpt
        if self.seconds is not None and time.monotonic() - self.last >= self.seconds:
            save = True
        return validate, save

    def saved(self, save: bool) -> Cadence:
        return dataclasses.replace(self, last=time.monotonic()) if save else self


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
        n.take(progress=n.progress.with_row(row))
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
