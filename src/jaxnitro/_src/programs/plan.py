"""The programs a run will compile, planned from its first batches before step 1.

`planned` compiles (or fetches) every program the run uses and `notes` says why each exists;
`memory_plan` adds up their bytes against the device's capacity and `check_memory` refuses a
run that will not fit, before it trains. Nothing here trains or writes the run's files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxnitro._src.compile import memory
from jaxnitro._src.data import feed
from jaxnitro._src.programs.builders import eval_program, eval_totals, train_program
from jaxnitro._src.programs.keys import ProgramSet

if TYPE_CHECKING:
    from typing import Any

    from jaxnitro._src.programs.spec import ProgramSpec
    from jaxnitro._src.steps.state import TrainState


def planned(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    device: Any,
    *,
    epoch: int,
    step: int,
    train: bool = True,
) -> dict:
    """Compile (or fetch) every program the run will use, from the first batches' shapes.

    The train step for the first dispatch unit, single steps for an epoch's tail that does not
    fill `steps_per_call`, and the eval step for 'val' (plus its ragged last batch).
    """
    out = {}
    extras = device.extras
    if train and "train" in spec.splits:
        loader = spec.splits["train"]
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        unit = feed.first_unit(spec, loader)
        stacked = unit.batches
        prepare = feed.train_prepare(spec, step, device.hyper_base)
        (batch, hyper, steps), *_ = prepare(unit)[0]
        out["train"] = train_program(spec, ps, ts, batch, extras, hyper, steps)
        spe = spec.steps_per_epoch
        if steps > 1 and spe and spe % steps:
            one = {f: a[: spec.accum] for f, a in stacked.items()}
            (single,) = prepare(feed.Unit(one, spec.accum))[0]
            out["train (single steps)"] = train_program(
                spec, ps, ts, single[0], extras, single[1], 1
            )
    if "val" in spec.splits:
        out.update(_planned_eval(spec, ps, ts, extras))
    return out


def _planned_eval(
    spec: ProgramSpec, ps: ProgramSet, ts: TrainState, extras: dict[str, Any]
) -> dict:
    info = spec.split_specs["val"]
    dev, _ = feed.eval_prepare(spec, "val", info.batch_size)(info.first)
    totals = eval_totals(spec, ts, "val", extras)
    out = {"eval": eval_program(spec, ps, ts, "val", dev, extras, totals, None)}
    loader = spec.splits["val"]
    if getattr(loader, "ragged", False):
        rows = loader.num_samples % loader.batch_size
        out["eval (last batch)"] = eval_program(spec, ps, ts, "val", dev, extras, totals, rows)
    return out


def notes(spec: ProgramSpec, *, train: bool = True) -> list[str]:
    """Every program the run will compile, and why: one line each (nothing compiles here).

    The extra programs are the ones a user can avoid: a tail of single steps when
    `steps_per_call` does not divide the steps of an epoch, and the ragged last val batch.
    """
    out = []
    spe, spc = spec.steps_per_epoch, spec.steps_per_call
    if train and "train" in spec.splits:
        out.append(
            f"train: {spc} optimizer steps per call"
            if spc > 1
            else "train: one optimizer step per call"
        )
        if spc > 1 and spe and spe % spc:
            divisors = [d for d in range(2, spe + 1) if spe % d == 0][:4]
            out.append(
                f"train (single steps): {spe} steps per epoch leave a tail of {spe % spc} that "
                f"does not fill steps_per_call={spc}; it runs as single steps, a second train "
                f"program. A steps_per_call dividing {spe}"
                + (f" (e.g. {', '.join(map(str, divisors))})" if divisors else "")
                + " avoids it."
            )
    if "val" in spec.splits:
        out.append("eval: the 'val' split")
        loader = spec.splits["val"]
        if getattr(loader, "ragged", False):
            rows = loader.num_samples % loader.batch_size
            out.append(
                f"eval (last batch): the 'val' split's {loader.num_samples} samples leave a last "
                f"batch of {rows} (batch_size {loader.batch_size}), padded in a program of its "
                f"own; a batch size dividing {loader.num_samples} avoids it."
            )
    return out


def memory_plan(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    device: Any,
    *,
    epoch: int,
    step: int,
    prefetch_depth: int = 2,
) -> memory.MemoryPlan:
    """Where the bytes go, from the compiled programs' memory analysis, against capacity."""
    train = "train" in spec.splits
    progs = planned(spec, ps, ts, device, epoch=epoch, step=step, train=train)
    batch_bytes = 0
    if train:
        info = spec.split_specs["train"]
        unit = spec.accum * spec.steps_per_call
        batch_bytes = sum(info.first[f].nbytes for f in info.fields) * unit
        if spec.resident is not None:  # only row indices travel (the arrays are arguments)
            batch_bytes = unit * info.batch_size * 4
            if feed.row_blocks(spec):  # a unit's calls' rows in blocks (`feed.RowBlocks`)
                batch_bytes *= feed.rows_calls(spec)
    in_flight, kept = prefetch_depth + 1, 0
    if train and spec.device_batches is not None:  # the batches in flight are kept ones
        in_flight, kept = 0, max(spec.device_batches.nbytes - batch_bytes, 0)
    capacity, source = memory.device_capacity(spec.mesh.devices.flat[0], spec.memory_budget)
    return memory.plan(
        {name: p.compiled for name, p in progs.items()},
        params=ts.params,
        opt_state=(ts.opt_state, ts.ema),  # the weight average is kept per param, like it
        model_state=ts.state,
        batch_bytes=batch_bytes,
        batches_in_flight=in_flight,
        checkpoint_staging_bytes=memory.tree_bytes((ts.params, ts.opt_state, ts.state, ts.ema)),
        capacity=capacity,
        capacity_source=source,
        members=spec.population.size if spec.population is not None else None,
        kept_batches_bytes=kept,
    )


def check_memory(
    spec: ProgramSpec, ps: ProgramSet, ts: TrainState, device: Any, *, epoch: int, step: int
) -> memory.MemoryPlan:
    """The plan, raising MemoryPlanError (with the table and what to change) if it won't fit."""
    plan = memory_plan(spec, ps, ts, device, epoch=epoch, step=step)
    bs = spec.split_specs["train"].batch_size if "train" in spec.split_specs else 0
    memory.check(plan, batch_size=bs, n_devices=spec.n_devices)
    return plan
