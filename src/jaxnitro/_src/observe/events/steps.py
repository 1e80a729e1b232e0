"""Step events: `jn.every(n_steps, fn)` calls `fn(record)` with a frozen `StepRecord`.

Records are made when a step's outputs are read back from the device, which the driver does
in chunks a few steps behind the newest dispatch (so dispatch never waits), and at once after a
step some callback is due at: a callback sees its step as soon as it ran, in step order, and a
stop it requests (`jn.request_stop`) ends the run after that step (after its call, with
`steps_per_call`). A callback that raises stops the run, as any user code in the loop does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxnitro._src.core.errors import ConfigError, check_int
from jaxnitro._src.observe.events import registry


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as a callback sees it.

    Attributes:
        step: the optimizer step (1-based); epoch: the epoch it belongs to (1-based).
        loss: the training loss (None for a custom train_step that returns no "loss"; its
            metrics are in `metrics`); grad_norm: the global norm of the gradient (before clipping).
        learning_rates: group -> learning rate used by this step (schedules applied).
        step_seconds: wall seconds per step, averaged over the chunk read back with it.
        metrics: everything the step logged (train_metrics included).

    Example:
        >>> jn.every(50, lambda r: print(f"step {r.step}: loss {r.loss:.3f}"), nitro=n)
    """

    step: int
    epoch: int
    loss: float | None
    grad_norm: float | None
    learning_rates: Mapping[str, float]
    step_seconds: float | None
    metrics: Mapping[str, Any]


_global: list[tuple[int, Callable[[StepRecord], Any]]] = []


def every(n_steps: int, fn: Callable[[StepRecord], Any], *, nitro=None) -> Callable[[], None]:
    """Call `fn(record)` every `n_steps` optimizer steps (of every run, or of one `nitro`).

    Without `nitro` it watches every later run of the process: registering a function
    defined at the same place again (a notebook cell run again) replaces the earlier
    registration instead of adding a second.

    Args:
        n_steps: how many optimizer steps apart (>= 1).
        fn: called with a `jn.StepRecord` (step, loss, learning rates, ...).
        nitro: only this run (`jn.Nitro`); None: every run of the process.

    Returns:
        `remove()`, which unregisters `fn`.

    Raises:
        ConfigError: `n_steps` is not an int >= 1, or `fn` is not callable.

    Example:
        >>> remove = jn.every(100, lambda r: print(r.step, r.loss, r.learning_rates), nitro=n)
        >>> remove()  # no longer called
    """
    check_int(
        "n_steps", n_steps, minimum=1, fix="pass how many steps apart, e.g. jn.every(100, fn)"
    )
    if not callable(fn):
        raise ConfigError(f"jn.every(..., fn={fn!r}): fn must be callable as fn(record).")
    target = _global if nitro is None else nitro.services.step_callbacks
    return registry.add(target, (n_steps, fn), fn, replace_same_site=nitro is None)


def fire(local: list, record: StepRecord) -> None:
    """Call the callbacks due at `record.step`: global ones first, then the run's."""
    for n_steps, fn in (*_global, *local):
        if record.step % n_steps == 0:
            fn(record)


def due(local: list, after: int, upto: int) -> bool:
    """Whether a callback is due at a step in (after, upto]."""
    return any((upto // n_steps) > (after // n_steps) for n_steps, _ in (*_global, *local))


def has_callbacks(local: list) -> bool:
    return bool(_global or local)
