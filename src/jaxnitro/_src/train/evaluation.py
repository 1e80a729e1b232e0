"""`jn.validate` and `jn.evaluate`: exact metrics over a split with the eval program.

Per batch the program adds (sum, count) totals on the device; the totals are read back and
divided once at the end, so a metric over a split is exact (not a mean of batch means), and
a ragged last batch is padded and masked in a program of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, DataError, did_you_mean
from jaxnitro._src.data import feed, prefetch
from jaxnitro._src.observe.events.phases import set_phase
from jaxnitro._src.programs.builders import eval_program, eval_totals
from jaxnitro._src.programs.stale import check_stale
from jaxnitro._src.steps import ema, population
from jaxnitro._src.steps import metrics as metrics_mod

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro


def check_split(n: Nitro, split: str) -> None:
    splits = n.spec.splits
    if split not in splits:
        raise DataError(
            f"no split {split!r}; the data has {sorted(splits)}." + did_you_mean(split, splits)
        )


def run_eval(
    n: Nitro, split: str, weights: str | None = None, *, begin: bool = True
) -> dict[str, Any]:
    """The metrics of `split` (no logging): totals on the device, divided once. `weights`:
    "ema", "raw" or None (those validation uses). `begin`: an entry-point call of its own
    (False: the validation of a running `jn.train`, which checked its programs already)."""
    check_split(n, split)
    spec, ps = n.spec, n.programs
    check_stale(spec, ps, begin=begin)
    params, model_state = ema.pick(n, weights)
    set_phase(n, "Evaluating", info={"split": split})
    bs = spec.split_specs[split].batch_size
    # (the average has the params' shapes and dtypes: the same eval program serves both)
    ts, extras = n.train_state.replace(params=params, state=model_state), n.device.extras
    batches, keys = feed.eval_batches(spec, split)
    stream = prefetch.Prefetcher(batches, feed.eval_prepare(spec, split, bs, keys))
    totals = eval_totals(spec, ts, split, extras)
    progs: dict = {}
    loader = spec.splits[split]
    total = len(loader) if hasattr(loader, "__len__") else None
    label = "validating" if split == "val" else f"evaluating {split!r}"
    with contextlib.ExitStack() as bar:
        advance = bar.enter_context(n.display.bar(label, total))
        bar.callback(stream.close)
        for dev_batch, size, _ in stream:
            if size > bs:
                raise DataError(
                    f"a {split!r} batch has {size} rows, more than the first batch's {bs}; "
                    f"batches of a split share one size (the last may be shorter)."
                )
            if size != bs and jax.process_count() > 1:
                raise DataError(
                    f"a {split!r} batch has {size} rows, not {bs}: with several processes "
                    f"every batch must be full (a short one would be padded and masked per "
                    f"process). Give each process a share that its batch size divides."
                )
            n_valid = None if size == bs else size
            prog = progs.get(n_valid)
            if prog is None:
                prog = progs[n_valid] = eval_program(
                    spec, ps, ts, split, dev_batch, extras, totals, n_valid
                )
            totals = prog(ts.params, ts.state, dev_batch, extras, totals)
            advance(1)  # batches dispatched: the bar adds no device sync
    host = jax.device_get(totals)
    pop = spec.population
    if pop is None:
        return _finalize(n, split, metrics_mod.finalize(host))
    rows = [
        _finalize(n, split, metrics_mod.finalize(population.take(host, i))) for i in range(pop.size)
    ]
    metric, mode = getattr(n.checkpointer, "metric", None), getattr(n.checkpointer, "mode", "min")
    return population.member_metrics(rows, metric=metric, mode=mode)


def _finalize(n: Nitro, split: str, values: dict) -> dict[str, Any]:
    if split != "val" and "val_loss" in values:  # the loss is named after its split
        values[f"{split}_loss"] = values.pop("val_loss")
    fin = getattr(n.spec.cls, "finalize_metrics", None)
    if fin is None:
        return values
    out = fin(n.experiment, values, split)
    if not isinstance(out, Mapping):
        raise ConfigError(
            f"finalize_metrics must return a dict, got {type(out).__name__}; return the dict "
            f"of metrics it was given, changed (name -> value)."
        )
    return {k: _host_value(v) for k, v in out.items()}


def _host_value(v: Any) -> Any:
    """0-d numpy/jax values become Python floats (logged, compared, JSON-safe)."""
    if hasattr(v, "shape") and getattr(v, "shape", None) == ():
        return float(np.asarray(v))
    return v


def is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) or v is None


def validation(n: Nitro) -> dict[str, Any]:
    """The training loop's validation row: the metrics of the weights validation uses (the
    checkpointer ranks by these); with `ema_eval="both"` also the raw weights' as
    `val_raw_<name>` (`acc` -> `val_raw_acc`, `val_loss` -> `val_raw_loss`)."""
    row = run_eval(n, "val", begin=False)
    avg = n.spec.ema
    if avg is not None and avg.eval == "both":
        raw = run_eval(n, "val", "raw", begin=False)
        row.update({f"val_raw_{k.removeprefix('val_')}": v for k, v in raw.items()})
    return row


def validate(n: Nitro, *, weights: str | None = None) -> dict[str, Any]:
    """Evaluate the 'val' split; returns {metric: value} (exact: totals divided once).

    Args:
        n: the run (`jn.Nitro`).
        weights: as in `jn.evaluate`.

    Returns:
        {metric: value}, the experiment's metrics and the validation loss.

    Raises:
        DataError: the data has no 'val' split.

    Example:
        >>> jn.validate(n)
        {'acc': 0.91, 'val_loss': 0.31}
    """
    return evaluate(n, split="val", weights=weights)


def evaluate(n: Nitro, split: str = "test", *, weights: str | None = None) -> dict[str, Any]:
    """Evaluate any split with the eval program; returns {metric: value}, and logs it when
    the run dir is free to write.

    Args:
        n: the run (`jn.Nitro`).
        split: the split to evaluate.
        weights: with `Nitro(ema=...)`, "ema" (the averaged weights) or "raw" (the trained
            ones); None: those validation uses.

    Returns:
        {metric: value}: the experiment's metrics over the whole split (totals divided once).

    Raises:
        DataError: the data has no such split (close names suggested).
        ConfigError: `weights` is not available (no `Nitro(ema=...)`, or an unknown choice).

    Example:
        >>> jn.evaluate(n, split="test")["acc"]
        >>> jn.evaluate(n, split="test", weights="raw")["acc"]  # an ema run's raw weights
    """
    check_split(n, split)
    phase = n.phase
    values = run_eval(n, split, weights)
    with n.services.writing("evaluate", step=n.step, required=False) as may_write:
        if may_write:
            n.logger.log_metrics(
                {"split": split, **{k: v for k, v in values.items() if is_scalar(v)}},
                context="validate",
                epoch=n.epoch,
                step=n.step,
            )
    set_phase(n, phase if phase not in ("Starting", "Evaluating") else "Done")
    return values
