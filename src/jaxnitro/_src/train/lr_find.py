"""`jn.lr_find`: the learning-rate range test, on a copy of the state, in the run's own program.

The rate rises exponentially from `min_lr` to `max_lr` over `steps` optimizer steps. It is a
traced input (the per-step hyperparameter vector), so the test reuses the run's compiled train
program: no new compile. It runs on a copy of the train state and hands nothing back, so the
handle's parameters, optimizer state and progress are exactly as before (Lightning's finder
leaves them changed). It stops early once the smoothed loss diverges, and suggests the rate
where the smoothed loss falls fastest, before the divergence.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.core.errors import ConfigError, DataError
from jaxnitro._src.data import feed
from jaxnitro._src.programs.builders import train_layout, train_program
from jaxnitro._src.programs.stale import check_stale
from jaxnitro._src.steps import population

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from jaxnitro._src.compile.cache import Program
    from jaxnitro._src.core.types import Batch
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class LRFindResult:
    """The range test's result (what `jn.lr_find` returns).

    Attributes:
        rates: the learning rate of each step run, rising from `min_lr` (for several groups:
            the largest group's rate; the others keep their ratio to it).
        losses: the training loss of each step, one per rate.
        smoothed: the bias-corrected exponential moving average of `losses` (what the
            suggestion and the divergence stop read).
        suggestion: the rate where the smoothed loss falls fastest, before any divergence;
            None when the test ran too few steps to tell.
        stopped_early: True when the smoothed loss diverged (or a loss was not finite)
            before `steps` steps.
        plot: `run_dir/lr_find.png` (loss against rate, the suggestion marked), or None
            without matplotlib.

    Example:
        >>> found = jn.lr_find(n, min_lr=1e-6, max_lr=1.0, steps=100)
        >>> found.suggestion, len(found.rates) == len(found.losses)
        (0.0031622776, True)
    """

    rates: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    suggestion: float | None
    stopped_early: bool
    plot: Path | None


def lr_find(
    n: Nitro,
    min_lr: float = 1e-7,
    max_lr: float = 1.0,
    steps: int = 100,
    *,
    smoothing: float = 0.9,
    diverge: float = 4.0,
) -> LRFindResult:
    """Run the range test on a copy of the run's state; the handle is left untouched.

    Every parameter group keeps its ratio to the largest group rate; the largest follows the
    exponential ramp.

    Args:
        n: the run (`jn.Nitro`), with a 'train' split.
        min_lr: the first rate of the ramp.
        max_lr: the last rate of the ramp.
        steps: the steps of the ramp (>= 10).
        smoothing: the loss's moving-average factor.
        diverge: stop when the smoothed loss exceeds that many times its best.

    Returns:
        An `LRFindResult`: `rates` (one per step run), `losses` (each step's training
        loss), `smoothed` (their moving average), `suggestion` (a rate, or None),
        `stopped_early` (the loss diverged first) and `plot` (`run_dir/lr_find.png`, or
        None without matplotlib).

    Raises:
        ConfigError: the ramp is out of range, the experiment has its own `train_step`, or
            `n` is a population.
        DataError: the data has no 'train' split.

    Example:
        To use the suggestion, give the experiment a field its `learning_rate` hook returns:

        >>> @jn.experiment
        ... class Tuned(MnistMLP):
        ...     lr: float = 1e-3
        ...
        ...     def learning_rate(self, group):
        ...         return self.lr
        >>> found = jn.lr_find(jn.Nitro(Tuned()))
        >>> found.suggestion, found.stopped_early
        (0.0031622776, True)
        >>> result = jn.train(jn.Nitro(Tuned(lr=found.suggestion)))
    """
    _check_runnable(n, min_lr, max_lr, steps)
    ramp = np.geomspace(min_lr, max_lr, steps)
    rates, losses, smoothed, stopped = _ramp(n, ramp, smoothing=smoothing, diverge=diverge)
    result = LRFindResult(
        tuple(rates), tuple(losses), tuple(smoothed), _suggest(rates, smoothed), stopped, None
    )
    return dataclasses.replace(result, plot=_plot(n, result))


def _check_runnable(n: Nitro, min_lr: Any, max_lr: Any, steps: Any) -> None:
    """Raise for a run the range test cannot take, or a ramp out of range, before any step."""
    spec = n.spec
    population.refuse(n, "jn.lr_find")
    if "train_step" in spec.routes:
        raise ConfigError(
            f"jn.lr_find needs one training loss, but {spec.cls.__name__} has its own "
            f"train_step (several optimizers and metrics). Run the range test on each model "
            f"with a plain experiment, or sweep the rates with `jaxnitro sweep`."
        )
    _check(spec, min_lr, max_lr, steps)
    check_stale(spec, n.programs)


def _group_ratios(n: Nitro) -> dict[int, float]:
    """Each learning-rate slot's rate over the largest: the ratio it keeps along the ramp."""
    spec = n.spec
    lr_slots = spec.hyper.learning_rates()
    base = n.device.hyper_base
    assert not isinstance(base, tuple)  # one model's: a population was refused above
    top = max(float(base[spec.hyper.slots[i][1]]) for i, _ in lr_slots) or 1.0
    return {i: float(base[spec.hyper.slots[i][1]]) / top for i, _ in lr_slots}


def _ramp(
    n: Nitro, ramp: np.ndarray, *, smoothing: float, diverge: float
) -> tuple[list[float], list[float], list[float], bool]:
    """One step per rate of ``ramp`` on a copy of the state: the rates run, their losses,
    the smoothed losses, and whether the loss diverged before the ramp's end."""
    spec, steps = n.spec, len(ramp)
    ratio = _group_ratios(n)
    leaves = [jnp.copy(x) for x in n.state_leaves]  # the handle's buffers are never donated
    rates: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg, best, stopped, call = 0.0, math.inf, False, None
    kept: list = []  # the kept leaves the program takes (`train_layout`)
    with n.display.bar("lr_find", steps) as advance:  # each step reads its loss anyway
        for batch, hyper, _ in _payloads(spec, n, steps):
            t = len(rates)
            vec = np.array(hyper, np.float32)
            for i, r in ratio.items():
                vec[i] = ramp[t] * r
            if call is None:  # the run's own train program (a cache hit after training)
                prog = _program(spec, n, batch, vec)
                layout = train_layout(prog)
                call, (leaves, kept) = prog.compiled, layout.split(leaves)
                kept = layout.taken(kept)  # (what the program takes of them)
            hv = feed.put(spec, vec, spec.replicated)
            leaves, out = call(leaves, kept, batch, n.device.extras, hv)
            loss = float(jax.device_get(out["loss"]))
            rates.append(float(ramp[t]))
            losses.append(loss)
            avg = smoothing * avg + (1 - smoothing) * loss
            smooth = avg / (1 - smoothing ** (t + 1))
            smoothed.append(smooth)
            advance(1)
            best = min(best, smooth)
            if not math.isfinite(loss) or (t > 5 and smooth > diverge * best):
                stopped = True
                break
            if len(rates) == steps:
                break
    return rates, losses, smoothed, stopped


def _check(spec: RunSpec, min_lr: Any, max_lr: Any, steps: Any) -> None:
    if "train" not in spec.splits:
        raise DataError("jn.lr_find needs a 'train' split; return one from build_data.")
    if not (0 < min_lr < max_lr) or not math.isfinite(max_lr):
        raise ConfigError(
            f"lr_find needs 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}; e.g. "
            f"jn.lr_find(n, min_lr=1e-7, max_lr=1.0)."
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 10:
        raise ConfigError(f"lr_find steps={steps!r}; give at least 10 steps, e.g. steps=100.")
    if spec.steps_per_call != 1:
        raise ConfigError(
            f"lr_find runs one optimizer step per call, but this run fuses "
            f"steps_per_call={spec.steps_per_call}; build the handle with steps_per_call=1 "
            f"for the range test."
        )
    if not spec.hyper.learning_rates():
        raise ConfigError(
            "lr_find found no learning rate to ramp: every group is frozen or a ready optax "
            "transformation. Return the optax factory from optimizer(self, group)."
        )


def _payloads(spec: RunSpec, n: Nitro, steps: int) -> Iterator[Any]:
    """(device batch, packed hyperparameters, steps) for `steps` optimizer steps, over as
    many epochs of the train split as that takes (a copy of the shuffle: epochs 0, 1, ...)."""
    loader = spec.splits["train"]
    prepare = feed.train_prepare(spec, 0, n.device.hyper_base)
    for epoch in itertools.count():
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        taken = 0
        for unit in feed.train_units(spec, loader, 0, epoch):
            for payload in prepare(unit)[0]:
                taken += 1
                yield payload
        if not taken:
            raise DataError("lr_find: the 'train' split yielded no batch.")
        if epoch > steps:  # cannot happen with a non-empty split; a guard against a loop
            return


def _program(spec: RunSpec, n: Nitro, batch: Batch, vec: Any) -> Program:
    return train_program(spec, n.programs, n.train_state, batch, n.device.extras, vec, 1)


def _suggest(rates: list[float], smoothed: list[float]) -> float | None:
    """The rate where the smoothed loss falls fastest per log-rate, before its minimum's
    divergence (skipping the noisy first tenth)."""
    if len(rates) < 10:
        return None
    end = int(np.argmin(smoothed)) + 1
    start = max(1, len(rates) // 10)
    if end - start < 3:
        return None
    grad = np.gradient(np.asarray(smoothed[start:end]), np.log(rates[start:end]))
    return float(rates[start + int(np.argmin(grad))])


def _plot(n: Nitro, r: LRFindResult) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    from jaxnitro._src.train.render import save

    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    ax.plot(r.rates, r.losses, color="C0", alpha=0.3, lw=1, label="loss")
    ax.plot(r.rates, r.smoothed, color="C0", lw=1.6, label="smoothed")
    if r.suggestion is not None:
        ax.axvline(r.suggestion, color="C3", ls="--", label=f"suggested {r.suggestion:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend(fontsize="small")
    fig.subplots_adjust(left=0.15, bottom=0.15, right=0.97, top=0.95)
    return save(fig, Path(n.run_dir) / "lr_find.png")
