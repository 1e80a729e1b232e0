"""Run phases and the monitors that watch them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from jaxnitro._src.core.errors import ConfigArgumentError, warn_user
from jaxnitro._src.observe.events import registry

_global_monitors: list[Callable] = []


def on_phase(fn: Callable, *, nitro=None) -> Callable[[], None]:
    """Call `fn(phase, step, epoch, info)` on each phase change (of one run, or of all runs).

    Phases: "Starting", "Compiling", "Training", "Evaluating", "Checkpointing", "Done",
    "Failed". A monitor that raises is reported once and never stops the run. Without
    `nitro` it watches every later run of the process: registering a function defined at
    the same place again (a notebook cell run again) replaces the earlier registration
    instead of adding a second.

    Args:
        fn: called as `fn(phase, step, epoch, info)`, `info` a dict of details.
        nitro: only this run (`jn.Nitro`); None: every run of the process.

    Returns:
        `remove()`, which unregisters `fn`.

    Raises:
        ConfigError: `fn` is not callable.

    Example:
        >>> seen = []
        >>> remove = jn.on_phase(lambda phase, step, epoch, info: seen.append(phase), nitro=n)
        >>> result = jn.train(n)
        >>> seen[0], seen[-1]
        ('Starting', 'Done')
        >>> remove()
    """
    if not callable(fn):
        raise ConfigArgumentError(
            f"on_phase takes a callable fn(phase, step, epoch, info), got {fn!r}; pass a "
            f"function, e.g. jn.on_phase(lambda phase, step, epoch, info: print(phase))."
        )
    target = _global_monitors if nitro is None else nitro.services.phases.monitors
    return registry.add(target, fn, fn, replace_same_site=nitro is None)


class PhaseTracker:
    """A run's current phase and its own monitors (a monitor that raises is reported once)."""

    def __init__(self) -> None:
        self.current = "Starting"
        self.monitors: list[Callable] = []
        self._failed: set[int] = set()

    def enter(self, phase: str, *, step: int, epoch: int, info: dict, force: bool = False) -> None:
        """Record `phase` and call the monitors (on a change, or when forced)."""
        if phase == self.current and len(info) <= 1 and not force:  # info holds the handle
            return
        self.current = phase
        for fn in [*_global_monitors, *self.monitors]:
            try:
                fn(phase, step, epoch, info)
            except Exception as e:  # noqa: BLE001 - a monitor must never kill the run
                if id(fn) not in self._failed:
                    self._failed.add(id(fn))
                    warn_user(
                        f"phase monitor {getattr(fn, '__qualname__', fn)!r} raised {e!r}; "
                        f"it stays registered, this is reported once.",
                    )


class _Phases(Protocol):
    @property
    def phases(self) -> PhaseTracker: ...


class _EpochNumber(Protocol):
    @property
    def epoch_number(self) -> int: ...


class Phased(Protocol):
    """What `set_phase` reads of a run (a `jn.Nitro` is one): its tracker (`services.phases`),
    its step and epoch. Monitors get the run itself in `info["nitro"]`."""

    @property
    def services(self) -> _Phases: ...
    @property
    def step(self) -> int: ...
    @property
    def progress(self) -> _EpochNumber: ...


def set_phase(n: Phased, phase: str, *, info: dict | None = None, force: bool = False) -> None:
    """Enter `phase` on a handle's tracker: its monitors see the step, epoch and the handle."""
    n.services.phases.enter(
        phase,
        step=n.step,
        epoch=n.progress.epoch_number,
        info={"nitro": n, **(info or {})},
        force=force,
    )
