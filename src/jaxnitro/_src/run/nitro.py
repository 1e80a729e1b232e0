"""`Nitro(exp, ...)`: the handle of one run, made of a few typed parts.

- `spec` (`RunSpec`, frozen): everything setup decided (`run/setup/` builds it).
- the `TrainState` (params, model state, optimizer state, step, RNG), kept as its flat leaves
  because the train program takes them so;
- `progress` (`Progress`, frozen): epoch, batch, step, history; the loop returns new ones;
- `services` (`Services`): logger, checkpointer, display, run lock, phase, stop request;
- `programs` (`ProgramSet`): the run's compiled programs.

Only this module assigns the handle's attributes, in one method: the loop hands back a new
state and progress through `take`, `jn.set_device` new Device values (`run.live.with_values`)
and the driver a measured `steps_per_call` or a population's active members the same way.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic

import jax
import numpy as np

from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.checkpoint.store import read_manifest
from jaxnitro._src.core.errors import ConfigArgumentError, ConfigError, did_you_mean
from jaxnitro._src.core.types import ExperimentT
from jaxnitro._src.experiment import hooks
from jaxnitro._src.experiment.markers import is_experiment, replace
from jaxnitro._src.observe.events.phases import set_phase
from jaxnitro._src.observe.events.signals import SetupTerminated, terminate_during_setup
from jaxnitro._src.observe.plot import preload as preload_plotting
from jaxnitro._src.optim.schedules import constant
from jaxnitro._src.programs.keys import ProgramSet
from jaxnitro._src.run import config as config_mod
from jaxnitro._src.run import options
from jaxnitro._src.run import settings as settings_mod
from jaxnitro._src.run import setup as setup_mod
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.run.setup import Dist
from jaxnitro._src.run.spec import DeviceValues, RunSpec
from jaxnitro._src.steps import population
from jaxnitro._src.steps.leaf_layout import Unmerged
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterator, Sequence
    from typing import Literal

    from jax.sharding import Mesh

    from jaxnitro._src.core.types import Experiment, Model, PyTree, Source
    from jaxnitro._src.dist.sharding import Sharding
    from jaxnitro._src.observe.display import Display
    from jaxnitro._src.observe.loggers.base import Logger
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.run.early_stop import EarlyStopping
    from jaxnitro._src.run.services import Checkpointer, Services
    from jaxnitro._src.run.settings import Settings


class Nitro(Generic[ExperimentT]):
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
        "_config",
    )
    _leaves: list | Unmerged  # the train state's leaves (`Unmerged`: handed over mid-epoch)

    if TYPE_CHECKING:
        # The signature checkers see: a misspelled option is a type error. The options are
        # declared in `run/options.py`; this copy is kept equal to it (names, order, defaults,
        # keyword-only) by tests/unit/run/test_nitro_signature.py. Every option takes None too:
        # at run time None means "not given" (an experiment field of that name, else the
        # default). At run time `__init__` takes `**given`, and `help(jn.Nitro)` shows the
        # signature made from the declarations (`__signature__` below).
        def __init__(
            self,
            exp: ExperimentT,
            *,
            seed: int | None = 42,
            run_dir: str | os.PathLike[str] | None = None,
            n_devices: int | None = None,
            accum: int | None = 1,
            steps_per_call: int | Literal["auto"] | None = 1,
            max_epochs: int | None = 1,
            schedules: Mapping[str, Callable[[int], Callable[[Any], Any]]] | None = None,
            precision: Literal["f32", "bf16"] | None = "f32",
            logger: str | Logger | Sequence[str | Logger] | Literal[False] | None = None,
            checkpointer: Checkpointer | Literal[False] | None = None,
            early_stop: str | EarlyStopping | None = None,
            reduce_lr_on_plateau: str | None = None,
            resume: bool | Literal["auto"] | str | os.PathLike[str] | None = False,
            checkpoint: str | os.PathLike[str] | None = None,
            data: Mapping[str, Source] | None = None,
            memory_budget: int | str | None = None,
            compile_options: Mapping[str, bool | int | float | str] | None = None,
            progress: bool | Literal["rich", "plain", "off"] | None = None,
            show_curves: bool | None = None,
            on_nonfinite: Literal["error", "skip"] | None = "error",
            val_every: int | None = None,
            checkpoint_every: int | None = None,
            checkpoint_every_minutes: float | None = None,
            log_grad_norm: bool | None = None,
            log_every_n_steps: int | None = 1,
            sharding: Literal["dp", "fsdp"] | Sharding | None = "dp",
            remat: Sequence[str] | None = None,
            remat_policy: Literal["full", "dots_saveable"] | None = "full",
            population: int | Mapping[str, Sequence[Any]] | None = None,
            data_on_device: bool | None = None,
            ema: float | None = None,
            ema_warmup: bool | None = True,
            ema_every: int | None = 1,
            ema_state: bool | None = False,
            ema_eval: bool | Literal["both"] | None = True,
            peak_tflops: float | None = None,
            profile: tuple[int, int] | str | None = None,
            weights: Literal["ema", "raw"] | None = None,
        ) -> None: ...
    else:

        def __init__(self, exp, **given):
            self._setup(exp, given)

    def _setup(self, exp: ExperimentT, given: dict[str, Any]) -> None:
        """Setup: the options checked, the run dir, services, model, data, state, programs."""
        _check_arguments(exp, given)
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
        self.take(state=built.state, progress=built.progress)
        self._device: DeviceValues = built.device
        self._experiment = built.spec.experiment
        self.programs = ProgramSet(log=self.services.log_other, on_compile=self._compiling)
        self.services.describe(setup_mod.params_line(built.spec), built.spec.resume_path)
        if built.spec.resume_path is not None:
            self.display.line(f"resumed from {built.spec.resume_path} ({self.progress.where()})")
        self._config = config_mod.run_config(exp, given)

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
        return jax.tree.unflatten(self._state_def, self.state_leaves)

    @property
    def state_leaves(self) -> list:
        """The train state as the train program takes it: a flat list of arrays (flattening
        NNX states and optax states on every call would cost more than a small step)."""
        leaves = self._leaves
        if isinstance(leaves, Unmerged):  # handed over mid-epoch, merged where first read
            leaves = self._leaves = leaves.leaves()
        return leaves

    # -- read-only views ------------------------------------------------------------------
    @property
    def params(self) -> PyTree:
        return self.train_state.params

    @property
    def state(self) -> PyTree:
        """The model state (batch statistics, RNG streams)."""
        return self.train_state.state

    @property
    def opt_state(self) -> PyTree:
        return self.train_state.opt_state

    @property
    def step(self) -> int:
        """Optimizer steps taken (counted on the host: reading the device would wait)."""
        return self._progress.step

    @property
    def epoch(self) -> int:
        """Completed epochs (the loop's count; reports name `progress.epoch_number`, the
        epoch of the last step taken)."""
        return self._progress.epoch

    @property
    def run_dir(self) -> Path:
        return self._spec.run_dir

    @property
    def experiment(self) -> ExperimentT:
        """The experiment, with the current Device values."""
        return self._experiment

    @property
    def optimizer(self) -> Optimizer:
        return self._spec.optimizer

    @property
    def model(self) -> Model:
        return self._spec.model

    @property
    def splits(self) -> Mapping[str, Any]:
        """The data splits (read-only: the run's batch specs and programs were set up from
        them; pass other data with `jn.Nitro(exp, data=...)`)."""
        return MappingProxyType(dict(self._spec.splits))

    @property
    def mesh(self) -> Mesh:
        return self._spec.mesh

    @property
    def seed(self) -> int:
        return self._spec.seed

    @property
    def total_steps(self) -> int:
        return self._spec.total_steps

    @property
    def checkpointer(self) -> Checkpointer:
        return self.services.checkpointer

    @property
    def logger(self) -> Logger:
        return self.services.logger

    @property
    def display(self) -> Display:
        return self.services.display

    @property
    def phase(self) -> str:
        return self.services.phases.current

    @property
    def config(self) -> dict[str, Any]:
        """What `run_dir/config.toml` holds (written by `jn.train`): target, preset, fields
        and options; `jaxnitro train --config run_dir/config.toml` repeats the run."""
        return self._config

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

    # -- the one way in ----------------------------------------------------------------
    def take(
        self,
        *,
        leaves: list | Unmerged | None = None,
        state: TrainState | None = None,
        progress: Progress | None = None,
        device: DeviceValues | None = None,
        experiment: Experiment | None = None,
        spec: RunSpec | None = None,
    ) -> None:
        """Take the new parts handed over: the train state (or its flat leaves, or the loop's
        `Unmerged` ones, merged where first read) and progress from the loop, Device values
        and the experiment showing them from `jn.set_device` (built by `run.live.with_values`),
        a spec (`steps_per_call="auto"` measured). The handle computes nothing here: each part
        is a value its maker checked."""
        if state is not None:
            self._leaves, self._state_def = jax.tree.flatten(state)
        if leaves is not None:
            self._leaves = leaves
        if progress is not None:
            self._progress = progress
        if device is not None:
            self._device = device
        if experiment is not None:
            self._experiment = experiment
        if spec is not None:
            self._spec = spec

    @contextlib.contextmanager
    def _compiling(self, kind: str, label: str) -> Iterator[Any]:
        """The Compiling phase (and the display) while XLA compiles; the phase before, after."""
        previous = self.phase
        set_phase(self, "Compiling", info={"program": kind, "label": label})
        preload_plotting()  # matplotlib's import, for the end-of-train curves, meanwhile
        try:
            with self.display.compiling(kind, label) as note:
                yield note
        finally:
            if previous in ("Training", "Evaluating"):  # a compile mid-run returns to it
                set_phase(self, previous)


def _check_arguments(exp: object, given: dict) -> None:
    if not is_experiment(exp) or isinstance(exp, type):
        what = f"the class {exp.__name__}" if isinstance(exp, type) else type(exp).__name__
        raise ConfigError(
            f"Nitro takes an experiment instance, got {what}. Decorate the class with "
            f"@jn.experiment and pass an instance: jn.Nitro(MyExp())."
        )
    unknown = [name for name in given if name not in options.BY_NAME]
    if unknown:
        name = unknown[0]
        names = sorted(options.NAMES)
        raise ConfigArgumentError(
            f"Nitro has no option {name!r}; options: {names}." + did_you_mean(name, names)
        )


def _log_terminated(services: Services | None, s: Settings) -> None:
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


Nitro.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("exp", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(
            inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
            for o in options.OPTIONS
        ),
    ]
)
Nitro.__doc__ = f"{Nitro.__doc__}\n{options.docstring()}\n"


def member(n: Nitro, i: int) -> Nitro:
    """A normal handle for member `i` of a population: its parameters, model and optimizer
    state, its seed and values; to predict, evaluate, export or serve (or train further).

    The handle reads the run's data and writes nothing of its own (no logger, no
    checkpointer); its run dir is `<run_dir>/members/<i>`.

    Args:
        n: a population run (`jn.Nitro(exp, population=...)`).
        i: the member's index, 0 ... population size - 1.

    Returns:
        A `jn.Nitro` of one model, member `i`'s.

    Raises:
        ConfigError: `n` is not a population, or `i` is out of range.

    Example:
        >>> result = jn.train(jn.Nitro(exp, population=8))
        >>> best = jn.member(n, result.members[0]["member"])
        >>> jn.export_model(best, "bundles/best")
    """
    pop = n.spec.population
    if pop is None:
        raise ConfigError(
            "jn.member(n, i) picks one member of a population (jn.Nitro(exp, population=...)); "
            "this handle trains one model: use it as it is."
        )
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < pop.size:
        raise ConfigError(f"member {i!r}: the population has members 0..{pop.size - 1}.")
    spec = n.spec
    splits = dict(spec.splits)
    if pop.loaders is not None:  # own_data: each member's own train loader
        splits["train"] = pop.loaders[i]
    m = Nitro(
        replace(n.experiment, **pop.member_values(i)),
        seed=pop.seeds[i],
        run_dir=spec.run_dir / "members" / str(i),
        data=splits,
        logger=False,
        checkpointer=False,
        progress=False,
        max_epochs=spec.max_epochs,
        accum=spec.accum,
        steps_per_call=spec.steps_per_call,
        on_nonfinite=spec.on_nonfinite,
        schedules=_member_schedules(spec, pop, int(i), constant),
        **(spec.ema.options() if spec.ema is not None else {}),
    )
    ts = n.train_state
    mine = m.train_state.replace(
        params=population.take(ts.params, i),
        state=population.take(ts.state, i),
        opt_state=population.take(ts.opt_state, i),
        step=ts.step[i],
        rng=ts.rng[i],
        ema=population.take(ts.ema, i),  # (each member keeps its own average)
    )
    m.take(state=mine, progress=n.progress.replace(early_stop=None))  # it has no rule
    return m


def _member_schedules(
    spec: RunSpec, pop: population.Population, i: int, constant: Callable[..., Any]
) -> dict:
    """The run's schedules as member i follows them (its own rates as constant multipliers
    of the group's rate), for a handle that trains on like the member."""
    out: dict[str, Any] = {}
    sched = pop.schedules[i] if pop.schedules is not None else spec.schedules
    for key, fn in sched.fns.items():
        scale = sched.multiplier.get(key, 1.0) / spec.schedules.multiplier.get(key, 1.0)
        out[key] = lambda total, fn=fn, scale=scale: lambda t: fn(t) * scale
    for key, rates in pop.rates.items():
        if key not in out:
            group, _ = spec.optimizer.hyper_paths[key]
            rate = spec.optimizer.groups[group].rate
            out[key] = constant(rates[i] / rate) if rate else constant(0.0)
    return out


__all__ = ["Dist", "Nitro", "member", "read_manifest"]
