"""The driver: `jn.train`.

For each epoch, in this order: train steps (prefetched; losses read back a few steps behind
so dispatch never waits), validation, a history row, the log line, the checkpoint, the stop
check. It ends with a `finish` log line and a short summary. The loop works on the handle's
parts: it reads the `RunSpec`, runs the programs on the train state's leaves, and hands the
new leaves and a new `Progress` back to the handle (`Nitro.take`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.compile import cache, report
from jaxnitro._src.core.errors import DataError, warn_user
from jaxnitro._src.dist.sharding import to_sharding
from jaxnitro._src.experiment.markers import fields
from jaxnitro._src.observe import members as population_view
from jaxnitro._src.observe.display import show_image
from jaxnitro._src.observe.events.phases import set_phase
from jaxnitro._src.observe.events.signals import Preempted, graceful_stop
from jaxnitro._src.observe.plot import write_curves
from jaxnitro._src.observe.timing import Goodput, host_bound_hint
from jaxnitro._src.programs import plan
from jaxnitro._src.programs.stale import check_stale
from jaxnitro._src.run import config, plateau
from jaxnitro._src.run.history import History
from jaxnitro._src.run.live import history
from jaxnitro._src.steps import population
from jaxnitro._src.train import autotune, oom
from jaxnitro._src.train.checkpointing import save_checkpoint
from jaxnitro._src.train.epoch import EpochResult, log_validation, run_epoch
from jaxnitro._src.train.evaluation import validation

if TYPE_CHECKING:
    from jaxnitro._src.run.early_stop import EarlyStopConfig, EarlyStopState
    from jaxnitro._src.run.nitro import Nitro


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
    # the fraction of wall time in train programs producing kept steps (observe/timing.py)
    goodput: float | None = None


def train(n: Nitro) -> TrainResult:
    """Train to `max_epochs` (or a stop); validate, log and checkpoint after each epoch.

    The order is fixed: check for stale programs; compile every planned program and check the
    memory plan (before step 1); then per epoch: train steps, validation, history row, log,
    checkpoint, early-stopping check, stop check. Ctrl-C stops after the current step (twice
    aborts); SIGTERM checkpoints the current step and raises `jn.Preempted` (exit status 143).

    Args:
        n: the run (`jn.Nitro`); training resumes from where it stands.

    Returns:
        A `TrainResult`: the history, the best checkpoint and its metric, the stop reason,
        steps per second, programs compiled and wall seconds.

    Raises:
        MemoryPlanError: the programs would not fit in the device's memory (before step 1).
        NonFiniteLossError: the loss became NaN or inf (with `on_nonfinite="raise"`).
        Preempted: SIGTERM arrived; the run was checkpointed and resumes with
            `resume="auto"`.

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
    n: Nitro,
    reason: str,
    rate: float,
    compiled: int,
    wall: float,
    loaded: int = 0,
    goodput: float | None = None,
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
        goodput=goodput,
    )


def _best_metric(n: Nitro, best: Path | None, hist: History) -> float | None:
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


def _members(n: Nitro) -> list[dict] | None:
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


def _train(n: Nitro) -> TrainResult:
    t_start = time.perf_counter()
    good = Goodput(t_start)
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
        stop_reason, steps_run, seconds_run, planned = _epochs(n, good)
        # run_dir/curves.png (JAXNITRO_NO_PLOT=1 skips, a failure warns), drawn from the log
        # while the last checkpoint is written in the background: one waits on the other's
        # I/O, not after it (a cold one-epoch run: about 0.3 s less)
        curves = write_curves(n)
        _wait_for_checkpoint(n)  # the last background write is complete before train returns
        set_phase(n, "Done")
    except BaseException as e:
        with contextlib.suppress(Exception):  # a pending write still lands (or says why not)
            _wait_for_checkpoint(n)
        set_phase(n, "Failed", info={"error": repr(e)})
        n.logger.finish("error", error=repr(e), step=n.step, epoch=n.progress.epoch_number)
        n.display.close()
        raise
    n.services.control.clear()
    compiled = cache.cache_stats()["misses"] - misses0  # against the plan (auto's aside)
    end = cache.cache_stats()
    loaded = end["persistent_hits"] - loads_start
    total = end["misses"] - misses_start - loaded  # XLA compiles; loaded ones apart
    rate = steps_run / seconds_run if seconds_run else 0.0
    spent = good.record()
    wall = time.perf_counter() - t_start
    result = _result(n, stop_reason, rate, total, wall, loaded, spent["goodput"])
    n.logger.finish(
        stop_reason,
        stop_reason=stop_reason,
        step=n.step,
        epoch=n.progress.epoch_number,
        programs_compiled=total,
        programs_loaded=loaded,
        steps_per_s=rate,
        skipped_steps=n.progress.skipped_steps,
        goodput=spent["goodput"],
        time={k: v for k, v in spent.items() if k != "goodput"},
    )
    _report(n, compiled, planned)
    _members_table(n, result)
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


def _resume_call(n: Nitro) -> str:
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


def _epochs(n: Nitro, good: Goodput) -> tuple[str, int, float, int]:
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
            with oom.reported(n, memory):  # out of memory: what was alive, and the fixes
                done = run_epoch(n, epoch)
                stop_reason = _end_epoch(n, epoch, done)
            steps_run, seconds_run = steps_run + len(done.losses), seconds_run + done.seconds
            split = _log_epoch_time(n, epoch, done)
            good.add(split)
            hint = None if good.hinted else _hint(n, split, done.steps)
            if hint is not None:  # once a run
                n.display.line(hint)
                good.hinted = True
            if stop_reason != "completed":
                break
    return stop_reason, steps_run, seconds_run, len(memory.programs)


def _hint(n: Nitro, split: dict[str, float], steps: int) -> str | None:
    """The host-bound hint from an epoch of `steps` steps that measured it (none traced by
    the profiler: its start and stop count as the driver's time)."""
    window, first = n.spec.profile, n.step - steps
    profiled = window is not None and window[0] <= n.step and window[1] >= first
    return host_bound_hint(split, n.spec.steps_per_call, steps=steps, profiled=profiled)


def _report(n: Nitro, compiled: int, planned: int) -> None:
    records = [p.record for p in n.programs.compiled[-compiled:] if compiled]
    if records:
        n.display.line(report.format_table(records, width=n.display.width))
    if compiled > planned:
        n.display.line(
            f"this run compiled {compiled} programs; its plan expected {planned}. "
            f"jn.explain(n) says why."
        )


def _check_horizon(n: Nitro) -> None:
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


def _end_epoch(n: Nitro, epoch: int, done: EpochResult) -> str:
    """Validate, record, log, checkpoint, and decide whether to stop; returns the stop reason."""
    control = n.services.control
    row = {"epoch": epoch + 1, "step": n.step, "train_loss": done.train_loss}
    if "val" in n.spec.splits and not control.preempted:  # preemption leaves no time
        t0 = time.perf_counter()
        try:
            row.update(validation(n))
        except BaseException:
            # A failing val loader or a second Ctrl-C must not cost the epoch's training:
            # checkpoint the trained state, marked unvalidated, then let the error through.
            n.take(progress=n.progress.with_row(row))
            with contextlib.suppress(Exception):
                save_checkpoint(n, row, stop_reason="error", validated=False)
            raise
        done.clock.eval_s += time.perf_counter() - t0
        log_validation(n, row, epoch)
    n.take(progress=n.progress.with_row(row))
    reason = "completed"
    finished = n.progress.batch_in_epoch == 0  # the epoch ran to its end
    es = n.spec.early_stop
    if es is not None and n.progress.early_stop is not None:
        if finished and not control.requested:
            state, stop = es.advance(n.progress.early_stop, epoch + 1, row)
            n.take(progress=n.progress.replace(early_stop=state))
            if stop:
                reason = "early_stop"
        if isinstance(n.progress.early_stop, tuple):  # members that stopped train no more
            _members_stopped(n, es, n.progress.early_stop, epoch + 1)
    if n.spec.reduce_lr_on_plateau is not None and finished and not control.requested:
        plateau.after_epoch(n, epoch + 1, row)  # the rates the next epoch takes
    if control.requested:
        reason = "preempted" if control.preempted else "requested"
    set_phase(n, "Checkpointing")
    stall = save_checkpoint(n, row, stop_reason=None if reason == "completed" else reason)
    done.clock.checkpoint_stall_s += stall
    rate = len(done.losses) / done.seconds if done.seconds else 0
    pop, mfu = n.spec.population, done.rates.get("mfu")
    if pop is None:
        summary = _epoch_summary(row, rate, mfu)
    else:  # the best member's metrics and the spread, never every member's `name/i`
        summary = population_view.epoch_summary(
            row, size=pop.size, metric=_ranking_metric(n), rate=rate, mfu=mfu
        )
    n.display.end_epoch(summary, row)
    return reason


def _ranking_metric(n: Nitro) -> str:
    """The metric that ranks a population's members (as validation picks the best one)."""
    return getattr(n.checkpointer, "metric", None) or "val_loss"


def _members_table(n: Nitro, r: TrainResult) -> None:
    """A population's members, ranked, once at the end (the data of `r.members`)."""
    pop = n.spec.population
    if pop is None or not r.members:
        return
    shown = population_view.table(pop, r.members, metric=_ranking_metric(n))
    if shown is not None:
        n.display.table(*shown)


def _log_epoch_time(n: Nitro, epoch: int, done: EpochResult) -> dict[str, float]:
    """The epoch line: its throughput and where its wall time went, from its start to the
    end of its checkpoint (observe/timing.py); returns the split."""
    split = done.clock.split(done.data_wait_s)
    n.logger.log_metrics(
        {
            "steps_per_s": done.steps / done.seconds if done.seconds else None,
            **done.rates,
            **split,
        },
        context="epoch",
        epoch=epoch + 1,
        step=n.step,
    )
    return split


def _members_stopped(
    n: Nitro, es: EarlyStopConfig, states: tuple[EarlyStopState, ...], epoch: int
) -> None:
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
    active = to_sharding(now, n.spec.replicated)
    n.take(device=dataclasses.replace(n.device, active=active))


def _epoch_summary(row: dict, rate: float, mfu: float | None = None) -> str:
    parts = [f"train_loss {row['train_loss']:.4f}" if row.get("train_loss") is not None else ""]
    parts += [
        f"{k} {v:.4f}"
        for k, v in row.items()
        if k not in ("epoch", "step", "train_loss") and isinstance(v, float)
    ]
    parts.append(f"{rate:,.0f} steps/s")
    if mfu is not None:
        parts.append(f"MFU {mfu:.1%}")
    return " · ".join(p for p in parts if p)


def _autotune(n: Nitro) -> None:
    check_stale(n.spec, n.programs)
    choice = autotune.pick(n)
    n.take(spec=n.spec.replace(steps_per_call=choice.steps, autotune=False))
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


def _wait_for_checkpoint(n: Nitro) -> None:
    wait = getattr(n.checkpointer, "wait", None)
    if callable(wait):
        wait()


def _summary(n: Nitro, r: TrainResult) -> None:
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
