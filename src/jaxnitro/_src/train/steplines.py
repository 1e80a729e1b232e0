"""A read-back chunk of train steps as step lines: logged, their losses taken, checked finite.

The epoch (`train/epoch.py`) reads its calls' outputs back a chunk at a time and hands them
here: as columns over the chunk's steps (`chunk_lines`: one call to the loggers for the
chunk; every `log_every_n_steps`-th step has a line), or per call where a population's members
or step callbacks need one row per step (`step_lines`: a line per step, then its callbacks).
Both give the same lines and return the same `Chunk`: the losses of the steps taken, the
steps skipped, and the error of the first non-finite step (the epoch raises it once the steps
before it are counted, as a stop leaves them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnitro._src.core.errors import NonFiniteLossError
from jaxnitro._src.observe.events import steps as step_events
from jaxnitro._src.observe.loggers.base import log_step_columns, log_step_rows
from jaxnitro._src.train.readback import InFlight, StepRow, step_rows

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class Lines:
    """How one epoch's step lines are made: fixed through the epoch (`watched` fills as
    output names are first seen)."""

    n: Nitro
    epoch: int  # 0-based; the lines say epoch + 1
    lr_of: Callable[[int], dict[str, float]]  # step (0-based) -> its learning rates
    lr_fixed: dict[str, float] | None  # no schedule: the rates every step has
    watched: dict[tuple[str, ...], list[str]]  # output names -> those checked finite

    @classmethod
    def of(cls, n: Nitro, epoch: int) -> Lines:
        lr_of = _lr_reader(n.spec, n.device)
        fixed = None if n.spec.schedules.fns else lr_of(0)
        return cls(n, epoch, lr_of, fixed, {})

    def reread_rates(self) -> Lines:
        """The same lines with the learning rates read anew from the handle (after
        `jn.set_lr`, or new Device values a rate hook reads): for the steps sent from now on."""
        lr_of = _lr_reader(self.n.spec, self.n.device)
        fixed = None if self.n.spec.schedules.fns else lr_of(0)
        return dataclasses.replace(self, lr_of=lr_of, lr_fixed=fixed)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What a read-back chunk's steps add to the epoch."""

    losses: list[float | None]  # of the steps taken (None: a custom step without a "loss")
    skipped: int  # steps the program skipped (on_nonfinite="skip")
    error: NonFiniteLossError | None = None  # the first non-finite step (its steps stop there)


def chunk_lines(
    lines: Lines, items: list[InFlight], columns: dict[str, np.ndarray], rates: dict[str, float]
) -> Chunk:
    """A chunk's steps (one column per output): counted, checked, and their lines logged
    at once; what `step_lines` does per step, with the same rows and the same error."""
    spec = lines.n.spec
    first = items[0].step - items[0].steps + 1  # the chunk's calls are consecutive
    count = items[-1].step - first + 1
    skipped = columns.get("skipped")
    kept = None if skipped is None else skipped == 0
    key = tuple(columns)
    watched = lines.watched.get(key)
    if watched is None:
        watched = lines.watched[key] = _watched(spec, columns)
    names = list(columns)
    lists = [_floats(columns[k]) for k in names]
    stop = count  # the steps taken: those before a non-finite one (then it is the error)
    # (a sum is finite only if every value is: the exact search runs only when one is not)
    if watched and not all(math.isfinite(sum(lists[names.index(k)])) for k in watched):
        finite = np.isfinite(np.stack([columns[k] for k in watched])).all(axis=0)
        if kept is not None:
            finite |= ~kept
        if not finite.all():
            stop = int(np.argmin(finite))
            lists = [column[:stop] for column in lists]
    loss: list[Any] | None = lists[names.index("loss")] if "loss" in columns else None
    dropped = 0
    taken: list[float | None]
    if kept is None:
        taken = loss if loss is not None else [None] * stop
    else:
        mask = kept[:stop].tolist()
        dropped = stop - sum(mask)
        taken = [v for v, m in zip(loss or [None] * stop, mask, strict=True) if m]
    _log_chunk(lines, first, names, lists, rates)
    error = None
    if stop < count:  # the first non-finite step: the error `step_lines` gives
        row = {k: float(v[stop]) for k, v in columns.items()}
        error = _nonfinite(lines, row, watched, _step_at(items, stop, spec.accum))
    return Chunk(taken, dropped, error)


def _floats(column: np.ndarray) -> list[float]:
    """A column as Python floats, as float() reads each value (an int or bool output too)."""
    if column.dtype.kind == "f":  # (a float32's value is exact as a float64)
        return column.tolist()
    return column.astype(np.float64).tolist()


def _log_chunk(
    lines: Lines, first: int, names: list[str], lists: list[list[float]], rates: dict[str, float]
) -> None:
    """The lines of the steps from `first` on (`lists`: one column per output name), every
    `log_every_n_steps`-th step's, in one call to the loggers."""
    every, count = lines.n.spec.log_every_n_steps, len(lists[0]) if lists else 0
    steps = list(range(first, first + count))
    if every > 1:
        picked = [j for j, step in enumerate(steps) if step % every == 0]
        lists = [[column[j] for j in picked] for column in lists]
        steps = [steps[j] for j in picked]
    if not steps:
        return
    epoch = lines.epoch + 1
    if lines.lr_fixed is not None:  # no schedule: the same rates on every line
        extra = {**lines.lr_fixed, **rates}
        log_step_columns(
            lines.n.logger, names, lists, extra, context="train", epoch=epoch, steps=steps
        )
        return
    rows = [dict(zip(names, values, strict=True)) for values in zip(*lists, strict=True)]
    for row, step in zip(rows, steps, strict=True):
        row.update(lines.lr_of(step - 1))
        row.update(rates)
    log_step_rows(lines.n.logger, rows, context="train", epoch=epoch, steps=steps)


def step_lines(
    lines: Lines,
    items: list[InFlight],
    hosts: list[dict[str, np.ndarray]],
    rates: dict[str, float],
    *,
    step_s: float | None,
    fire: bool,
) -> Chunk:
    """A chunk's steps one row at a time (`hosts`: one per call): each counted, checked,
    logged, then its step callbacks (`fire`) called; stops at a non-finite step."""
    spec = lines.n.spec
    members = spec.population is not None
    taken: list[float | None] = []
    skipped = 0
    for item, host in zip(items, hosts, strict=True):
        for step_row in step_rows(item, host, accum=spec.accum, members=members):
            row = step_row.values
            if row.get("skipped"):
                skipped += 1
            else:
                bad = _nonfinite(lines, row, _watched(spec, row), step_row)
                if bad is not None:
                    return Chunk(taken, skipped, bad)
                taken.append(row.get("loss"))  # None: a custom step without a "loss"
            _step_line(lines, step_row, rates, step_s=step_s, fire=fire)
    return Chunk(taken, skipped)


def _step_line(
    lines: Lines, step_row: StepRow, rates: dict[str, float], *, step_s: float | None, fire: bool
) -> None:
    n, row, step, spec = lines.n, step_row.values, step_row.step, lines.n.spec
    learning_rates = lines.lr_of(step - 1)
    row.update(learning_rates)
    row.update(rates)
    if step % spec.log_every_n_steps == 0:
        n.logger.log_metrics(row, context="train", epoch=lines.epoch + 1, step=step)
    if not fire:
        return
    groups = [g for _, g in spec.hyper.learning_rates()]
    step_events.fire(
        n.services.step_callbacks,
        step_events.StepRecord(
            step=step,
            epoch=lines.epoch + 1,
            loss=row.get("loss"),
            grad_norm=row.get("grad_norm"),
            learning_rates=dict(zip(groups, learning_rates.values(), strict=True))
            if spec.population is None
            else dict(learning_rates),
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


def _nonfinite(
    lines: Lines, row: dict, watched: list[str], at: StepRow
) -> NonFiniteLossError | None:
    """None when the loss (with a custom train_step, every metric it returns) is finite;
    else the error that stops the run, naming the step."""
    bad = [k for k in watched if not math.isfinite(row[k])]
    if not bad:
        return None
    what = "the training loss is" if bad == ["loss"] else f"train metric {bad[0]!r} is"
    return NonFiniteLossError(
        f"{what} {row[bad[0]]} at step {at.step} (epoch {lines.epoch + 1}, batch {at.batch}). "
        f"Lower the learning rate, check the data for NaN/inf, or add gradient clipping (or "
        f"pass on_nonfinite='skip' to skip such steps). " + last_good(lines.n)
    )


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
