"""A run's compiled programs: traced functions built from its hooks, keyed by `ProgramKey`.

Builders take a `ProgramSpec` (what setup decided; a `RunSpec` is one), a `ProgramSet` (this
run's bookkeeping) and the current `TrainState`; traced hooks run against the compile view
(GraphConst values, Device tracers, Host refused). The functions built here close over the
model structure and the optimizer, which the key covers, so a cached program is correct for
every run whose key is the same. The hook calls they trace are in `calls`, their keys and
the run's bookkeeping in `keys`, what they trace and its fingerprints in `traced`, and the
check for edited code at an entry point in `stale`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxnitro._src.compile import cache
from jaxnitro._src.dist.sharding import to_sharding
from jaxnitro._src.experiment import models, remat
from jaxnitro._src.optim import groups as optim
from jaxnitro._src.programs.calls import _forward, custom_step_fn, eval_metrics_fn, train_loss_fn
from jaxnitro._src.programs.keys import ProgramSet, _acquire, _state_arrays, program_key
from jaxnitro._src.steps import custom, leaf_layout
from jaxnitro._src.steps import metrics as metrics_mod
from jaxnitro._src.steps.ema import averaging
from jaxnitro._src.steps.step import (
    fuse,
    kept_if,
    make_eval_step,
    make_train_step,
)

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.programs.spec import ProgramSpec
    from jaxnitro._src.steps.state import TrainState
    from jaxnitro._src.steps.step import StepFn


def train_program(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    hyper: Any,
    steps: int,
) -> cache.Program:
    """The fused train step for these shapes: `(changed state leaves, kept state leaves,
    batch, extras, hyper) -> (changed state leaves, outputs)`, compiled once per process.

    With one step per call (`steps_per_call=1`) the program keeps the leaves a step does not
    change, and the step counter where the step never reads its key (`steps/leaf_layout.py`;
    `train_layout` says which); with several, every leaf travels, so that a run's fused
    program and its single steps take the state alike."""
    options = {
        "accum": spec.accum,
        "steps_per_call": steps,
        "precision": spec.precision,
        "on_nonfinite": spec.on_nonfinite,
        "log_grad_norm": spec.log_grad_norm,
        "remat": spec.remat.key() if spec.remat is not None else None,
        "population": spec.population.key() if spec.population is not None else None,
        "early stopping per member": spec.population is not None and spec.early_stop is not None,
        "data on device": spec.resident is not None,
        "ema": spec.ema.key() if spec.ema is not None else None,  # (the decay is traced)
        "state leaves kept": (kept := spec.steps_per_call == 1),
    }
    inputs = {"batch": batch, "extras": extras["device"]}
    if spec.resident is not None:  # the arrays are not stacked per step: not batch inputs
        rows = {k: v for k, v in batch.items() if k != "data"}  # (and a block's "index")
        inputs = {"batch": rows, "train arrays on the device": batch["data"]}
        inputs["extras"] = extras["device"]
    key = program_key(
        spec,
        ps,
        "train",
        "train",
        inputs,
        options,
        avals=cache.avals((_state_arrays(ts), batch, extras, hyper)),
        optimizer=(optim.describe(spec.optimizer), cache.optimizer_key(spec.tx)),
    )
    step = _train_step(spec, steps, gathered=spec.resident is not None)
    leaves, passed = jax.tree.leaves(ts), _passed(spec, ts) if kept else ()  # flat lists

    def lower() -> tuple[jax.stages.Traced, leaf_layout.Layout]:
        with remat.applied(spec.remat):  # named blocks recompute in the backward pass
            return leaf_layout.lower(
                step,
                ts,
                leaves,
                (batch, extras, hyper),
                passed=passed,
                host_counts=kept,
                # the state comes back placed as it went in (FSDP shards stay shards)
                out_shardings=lambda moving: ([x.sharding for x in moving], spec.replicated),
            )

    label = spec.cls.__name__ + (f", {steps} steps per call" if steps > 1 else "")
    return leaf_layout.acquired(lambda traced: _acquire(spec, ps, key, traced, label=label), lower)


def _passed(spec: ProgramSpec, ts: TrainState) -> tuple[int, ...]:
    """The state leaves a train step passes through: the RNG, and the injected optimizer
    hyperparameters no step writes."""
    written = {hp for _, hp in spec.hyper.groups.values()}
    return leaf_layout.positions(ts)[1] + leaf_layout.constant_hyperparameters(ts, written)


def train_layout(prog: cache.Program) -> leaf_layout.Layout:
    """Which state leaves the train program `prog` keeps (`train_program`)."""
    return leaf_layout.chosen(prog)


def _train_step(spec: ProgramSpec, steps: int, *, gathered: bool = False) -> StepFn:
    """The built-in step (forward, loss, one gradient and update) or the experiment's own;
    for a population, that step under `vmap` over the members; `steps` of it per call,
    each on its batch gathered from the arrays on the device when `gathered`."""
    if "train_step" in spec.routes:
        one = custom.make_custom_step(
            custom_step_fn(spec),
            custom.Tools(spec.optimizer.labels, spec.optimizer.parts or {}),
            write_hyper=spec.hyper.write,
            unpack_hyper=spec.hyper.unpack,
            skip_nonfinite=spec.on_nonfinite == "skip",
        )
    else:
        one = make_train_step(
            train_loss_fn(spec),
            spec.tx,
            accum=spec.accum,
            write_hyper=spec.hyper.write,
            unpack_hyper=spec.hyper.unpack,
            skip_nonfinite=spec.on_nonfinite == "skip",
            grad_norm=spec.log_grad_norm,
        )
    if spec.ema is not None:  # the average moves in the same program, after the update
        one = averaging(one, spec.ema)
    pop = spec.population
    if pop is not None and spec.early_stop is not None:
        one = _frozen_when_stopped(one)
    if pop is not None:  # state, Device values and hyperparameters per member; batch shared
        one = jax.vmap(one, in_axes=(0, 0 if pop.own_data else None, 0, 0))
    return _gathering(one, steps) if gathered else fuse(one, steps)


def _gathering(one: Any, steps: int) -> StepFn:
    """`steps` of `one` per call, each on its batch gathered from the arrays kept on the
    device: the payload is {"rows": indices (steps, micro-batches, batch), "data": {field:
    array}}, or on one CPU device {"rows": a block of such indices, "index": this call's
    in it, "data": ...} (`feed.RowBlocks`). Each step gathers its own rows (inside the loop
    of a fused call), so a call holds one step's batch at a time, not all of them."""

    def gathered(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        data = batch["data"]

        def on_rows(
            ts: TrainState, b: Any, extras: dict[str, Any], h: Any
        ) -> tuple[TrainState, Any]:
            got = {f: jnp.take(a, b["rows"], axis=0, mode="clip") for f, a in data.items()}
            return one(ts, got, extras, h)

        rows = batch["rows"]
        if "index" in batch:  # a block of a unit's calls' rows (`feed.RowBlocks`): this call's
            rows = jax.lax.dynamic_index_in_dim(rows, batch["index"], keepdims=False)
        return fuse(on_rows, steps)(ts, {"rows": rows}, extras, hyper)

    return gathered


def _frozen_when_stopped(one: Any) -> StepFn:
    """A member's step whose update is dropped once the member stopped early (`active`)."""

    def step(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        new, out = one(ts, batch, extras, hyper)
        return kept_if(extras["active"], new, ts), out  # (its step counter runs on)

    return step


def eval_metric_shapes(
    spec: ProgramSpec, ts: TrainState, split: str, extras: dict[str, Any]
) -> dict:
    """Abstract {name: (sum, count)} of the eval step on the split's first batch."""
    info = spec.split_specs[split]
    batch = {
        k: jax.ShapeDtypeStruct(info.first[k].shape, jnp.asarray(info.first[k][:1]).dtype)
        for k in info.fields
    }
    fn = eval_metrics_fn(spec, split)
    params, state = ts.params, ts.state
    if spec.population is not None:  # one member's shapes (the totals gain a member axis)
        params, state, extras = jax.eval_shape(
            lambda t: jax.tree.map(lambda x: x[0], t), (params, state, extras)
        )
    return jax.eval_shape(lambda p, s, b, e: fn(p, s, b, e, None), params, state, batch, extras)


def eval_totals(spec: ProgramSpec, ts: TrainState, split: str, extras: dict[str, Any]) -> PyTree:
    """Zero running totals of the eval step, on the mesh (one set per population member)."""
    zeros = metrics_mod.zeros_like_totals(eval_metric_shapes(spec, ts, split, extras))
    if spec.population is not None:
        size = spec.population.size
        zeros = jax.tree.map(lambda z: jnp.broadcast_to(z, (size, *z.shape)), zeros)
    return jax.tree.map(lambda x: to_sharding(x, spec.replicated), zeros)


def eval_program(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    split: str,
    batch: Batch,
    extras: dict[str, Any],
    totals: Any,
    n_valid: int | None,
) -> cache.Program:
    """Forward + metrics added into running totals; one program per ragged width."""
    args = (ts.params, ts.state, batch, extras, totals)
    key = program_key(
        spec,
        ps,
        "eval",
        split,
        {"batch": batch, "extras": extras["device"]},
        {
            "rows": n_valid,
            "on the train split": split == "train",
            "loss": spec.split_specs[split].has_loss,
            "population": spec.population.key() if spec.population is not None else None,
        },
        avals=cache.avals(args),
    )
    step = make_eval_step(eval_metrics_fn(spec, split), n_valid)
    if spec.population is not None:  # every member on the same batch, totals per member
        step = jax.vmap(step, in_axes=(0, 0, None, 0, 0))
    label = split if n_valid is None else f"{split}, last batch of {n_valid}"
    return _acquire(
        spec,
        ps,
        key,
        lambda: jax.jit(step, donate_argnums=(4,), out_shardings=spec.replicated).trace(*args),
        label=label,
    )


def predict_program(
    spec: ProgramSpec, ps: ProgramSet, ts: TrainState, batch: Batch, extras: dict[str, Any]
) -> cache.Program:
    """Forward in inference mode, on a batch padded to a bucket (the host slices padding)."""

    def predict_step(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any]
    ) -> Any:
        with models.mode(train=False):
            outputs, _ = _forward(spec, extras["device"], params, model_state, batch)
        return outputs

    args = (ts.params, ts.state, batch, extras)
    key = program_key(
        spec,
        ps,
        "predict",
        None,
        {"batch": batch, "extras": extras["device"]},
        {"rows": None},
        avals=cache.avals(args),
    )
    # Each padded size (a bucket) is a planned program of its own, not a recompile.
    bucket = next(iter(batch.values())).shape[0]
    return _acquire(
        spec,
        ps,
        key,
        lambda: jax.jit(predict_step).trace(*args),
        label=spec.cls.__name__,
        bucket=bucket,
    )
