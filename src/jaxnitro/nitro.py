"""`Nitro(exp, ...)`: the handle of one run, made of a few typed parts.

- `spec` (`RunSpec`, frozen): everything setup decided (`setup.py` builds it).
- the `TrainState` (params, model state, optimizer state, step, RNG), kept as its flat leaves
  because the train program takes them so;
- `progress` (`Progress`, frozen): epoch, batch, step, history; the loop returns new ones;
- `services` (`Services`): logger, checkpointer, display, run lock, phase, stop request;
- `programs` (`ProgramSet`): the run's compiled programs.

Only this module assigns the handle's attributes: the loop hands back a new state and progress
through `_commit`, `jn.set_device` new Device values through `_set_device`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax

from . import hooks, population
from . import settings as settings_mod
from . import setup as setup_mod
from .checkpoint import read_manifest
from .compile.programs import ProgramSet
from .errors import ConfigArgumentError, ConfigError, did_you_mean
from .events.phases import set_phase
from .events.signals import SetupTerminated, terminate_during_setup
from .experiment import is_experiment
from .plot import preload as preload_plotting
from .progress import Progress
from .runlock import RunLock
from .setup import Dist
from .sharding import to_sharding
from .spec import DeviceValues, RunSpec
from .state import TrainState


class Nitro:
    """The handle of one run. `Nitro(exp, ...)` runs setup only; see `jn.train`.

    Example:
        >>> n = jn.Nitro(MnistMLP(), checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"))
        >>> result = jn.train(n)
        >>> n.step, n.epoch, n.run_dir
    """

    __slots__ = (
        "_spec",
        "_leaves",
        "_state_def",
        "_progress",
        "_device",
        "_experiment",
        "services",
        "programs",
    )

    def __init__(
        self,
        exp,
        *,
        seed: int | None = None,
        run_dir=None,
        n_devices: int | None = None,
        accum: int = 1,
        steps_per_call: int | str = 1,
        max_epochs: int | None = None,
        schedules=None,
        precision: str | None = None,
        logger=None,
        checkpointer=None,
        early_stop=None,
        resume: bool | str = False,
        checkpoint=None,
        data=None,
        memory_budget: int | None = None,
        compile_options: dict | None = None,
        progress: bool | str | None = None,
        on_nonfinite: str = "error",
        val_every: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_every_minutes: float | None = None,
        log_grad_norm: bool | None = None,
        sharding="dp",
        remat: list[str] | None = None,
        remat_policy: str = "full",
        population=None,
        data_on_device: bool | None = None,
        ema: float | None = None,
        ema_warmup: bool = True,
        ema_every: int = 1,
        ema_state: bool = False,
        ema_eval: bool | str = True,
        weights: str | None = None,
        **unknown,
    ):
        _check_arguments(exp, unknown)
        given = {k: v for k, v in locals().items() if k not in ("self", "exp", "unknown")}
        routes = hooks.check_hooks(type(exp))
        s = settings_mod.settings(exp, given)
        with terminate_during_setup():
            try:
                setup_mod.make_run_dir(s.run_dir)
                self.services, named = setup_mod.services(s)
                built = setup_mod.build(exp, s, self.services, named, routes)
            except SetupTerminated:
                _log_terminated(getattr(self, "services", None), s)
                raise SystemExit(143) from None
        self._spec: RunSpec = built.spec
        self._commit(state=built.state, progress=built.progress)
        self._device: DeviceValues = built.device
        self._experiment = built.spec.experiment
        self.programs = ProgramSet(log=self.services.log_other, on_compile=self._compiling)
        self.services.describe(setup_mod.params_line(built.spec), built.spec.resume_path)

    # -- the parts ------------------------------------------------------------------------
    @property
    def spec(self) -> RunSpec:
        """What setup decided (frozen)."""
        return self._spec

    @property
    def progress(self) -> Progress:
        """Where the run is (frozen): epoch, batch, step, history."""
        return self._progress

    @property
    def device(self) -> DeviceValues:
        """The current Device values (traced inputs; `jn.set_device` replaces them)."""
        return self._device

    @property
    def train_state(self) -> TrainState:
        """All training state as one `jn.TrainState` pytree."""
        return jax.tree.unflatten(self._state_def, self._leaves)

    @property
    def state_leaves(self) -> list:
        """The train state as the train program takes it: a flat list of arrays (flattening
        NNX states and optax states on every call would cost more than a small step)."""
        return self._leaves

    # -- read-only views ------------------------------------------------------------------
    @property
    def params(self):
        return self.train_state.params

    @property
    def state(self):
        """The model state (batch statistics, RNG streams)."""
        return self.train_state.state

    @property
    def opt_state(self):
        return self.train_state.opt_state

    @property
    def step(self) -> int:
        """Optimizer steps taken (counted on the host: reading the device would wait)."""
        return self._progress.step

    @property
    def epoch(self) -> int:
        """Completed epochs."""
        return self._progress.epoch

    @property
    def run_dir(self) -> Path:
        return self._spec.run_dir

    @property
    def experiment(self):
        """The experiment, with the current Device values."""
        return self._experiment

    @property
    def optimizer(self):
        return self._spec.optimizer

    @property
    def model(self):
        return self._spec.model

    @property
    def splits(self) -> Mapping[str, Any]:
        """The data splits (read-only: the run's batch specs and programs were set up from
        them; pass other data with `jn.Nitro(exp, data=...)`)."""
        return MappingProxyType(dict(self._spec.splits))

    @property
    def mesh(self):
        return self._spec.mesh

    @property
    def seed(self) -> int:
        return self._spec.seed

    @property
    def total_steps(self) -> int:
        return self._spec.total_steps

    @property
    def checkpointer(self):
        return self.services.checkpointer

    @property
    def logger(self):
        return self.services.logger

    @property
    def display(self):
        return self.services.display

    @property
    def phase(self) -> str:
        return self.services.phases.current

    @property
    def max_epochs(self) -> int:
        return self._spec.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: int) -> None:
        """Raise it to train further with `jn.train(n)` (schedules keep their horizon)."""
        self._spec = self._spec.replace(max_epochs=settings_mod.max_epochs(value))

    def __repr__(self) -> str:
        return (
            f"Nitro({self._spec.cls.__name__}, step={self.step}, epoch={self.epoch}, "
            f"phase={self.phase}, run_dir='{self.run_dir}')"
        )

    # -- the handle's own updates ---------------------------------------------------------
    def _commit(
        self,
        *,
        leaves: list | None = None,
        state: TrainState | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Take the new train state (or its leaves) and progress the loop hands back."""
        if state is not None:
            self._leaves, self._state_def = jax.tree.flatten(state)
        if leaves is not None:
            self._leaves = leaves
        if progress is not None:
            self._progress = progress

    def _set_device(self, values: dict[str, Any], experiment) -> None:
        """New Device values (checked by `jn.set_device`), and the experiment showing them."""
        merged = {**self._device.values, **values}
        spec = self._spec
        if spec.population is None:
            base = spec.hyper.base(spec.optimizer, merged)
        else:  # (the values carry a member axis)
            base = population.member_bases(spec.population, spec.hyper, spec.optimizer, merged)
        self._device = dataclasses.replace(self._device, values=merged, hyper_base=base)
        self._experiment = experiment

    def _set_steps_per_call(self, steps: int) -> None:
        """steps_per_call="auto", measured: the steps per dispatch from now on."""
        self._spec = self._spec.replace(steps_per_call=steps, autotune=False)

    def _set_active(self, active) -> None:
        """A population's members that still train (per-member early stopping)."""
        rep = self._spec.replicated
        self._device = dataclasses.replace(self._device, active=to_sharding(active, rep))

    @contextlib.contextmanager
    def _compiling(self, kind: str, label: str):
        """The Compiling phase (and the display) while XLA compiles; the phase before, after."""
        previous = self.phase
        set_phase(self, "Compiling", info={"program": kind, "label": label})
        preload_plotting()  # matplotlib's import, for the end-of-train curves, meanwhile
        try:
            with self.display.compiling(kind, label):
                yield
        finally:
            if previous in ("Training", "Evaluating"):  # a compile mid-run returns to it
                set_phase(self, previous)


def _check_arguments(exp, unknown: dict) -> None:
    if not is_experiment(exp) or isinstance(exp, type):
        what = f"the class {exp.__name__}" if isinstance(exp, type) else type(exp).__name__
        raise ConfigError(
            f"Nitro takes an experiment instance, got {what}. Decorate the class with "
            f"@jn.experiment and pass an instance: jn.Nitro(MyExp())."
        )
    if unknown:
        name = next(iter(unknown))
        options = sorted(
            p
            for p in inspect.signature(Nitro.__init__).parameters
            if p not in ("self", "exp", "unknown")
        )
        raise ConfigArgumentError(
            f"Nitro has no option {name!r}; options: {options}." + did_you_mean(name, options)
        )


def _log_terminated(services, s) -> None:
    """SIGTERM during setup: a `finish` line (status preempted) if the run dir is free."""
    with contextlib.suppress(Exception):
        log = services.logger if services is not None else setup_mod.logger_of(s.logger)
        lock = RunLock(s.run_dir)
        if lock.try_acquire("setup"):
            try:
                log.open(s.run_dir, resume=True)
                log.finish("preempted", phase="setup", step=0)
                log.close()
            finally:
                lock.release()


__all__ = ["Dist", "Nitro", "read_manifest"]
