"""`RunSpec`: everything setup decides about a run, frozen.

Setup (`run/setup/`) builds one; the program builders (`programs/builders.py`), the feed, the loop
and the checkpoint writer read it and never change it. Only `max_epochs` (a handle setting a
user may raise to train further) and the Device values of `jn.set_device` change after setup,
each by replacing the part that holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from jaxnitro._src.core.types import Hooked, Model, Source
from jaxnitro._src.data.splits import SplitSpec

if TYPE_CHECKING:
    from jaxnitro._src.data.device_batches import DeviceBatches
    from jaxnitro._src.dist.sharding.rules import Sharding
    from jaxnitro._src.experiment.hooks import Route
    from jaxnitro._src.experiment.remat import RematPlan
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.optim.hyper import HyperLayout
    from jaxnitro._src.optim.schedules import Schedules
    from jaxnitro._src.run.early_stop import EarlyStopConfig
    from jaxnitro._src.run.plateau import PlateauRule
    from jaxnitro._src.run.setup.data import Dist
    from jaxnitro._src.steps.ema import Ema
    from jaxnitro._src.steps.population import Population


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The frozen decisions of setup: experiment, data, model, mesh, optimizer, options.

    The mesh and shardings (`mesh`, `replicated`, `batch_sharding`) are where sharding and
    many processes plug in; `optimizer`, `hyper` and `schedules` are the optimization; the
    rest are the options of `jn.Nitro(...)` after validation.
    """

    # the experiment and its routing
    experiment: Hooked  # after `derive`; Device values live in the handle's `DeviceValues`
    cls: type[Hooked]
    routes: Mapping[str, Route]
    # data
    splits: Mapping[str, Source]
    split_specs: Mapping[str, SplitSpec]
    dist: Dist
    # the model and where it runs
    model: Model
    mesh: Mesh
    replicated: NamedSharding
    batch_sharding: NamedSharding
    direct_feed: bool  # one CPU device: programs take numpy batches (no transfer)
    # optimization
    optimizer: Optimizer
    hyper: HyperLayout
    schedules: Schedules
    steps_per_epoch: int | None
    total_steps: int
    # options
    seed: int
    run_dir: Path
    run_id: str
    max_epochs: int
    accum: int = 1
    steps_per_call: int = 1
    autotune: bool = False  # steps_per_call="auto", not yet measured (autotune.py)
    precision: str = "f32"
    on_nonfinite: Literal["error", "skip"] = "error"
    log_grad_norm: bool = False
    log_every_n_steps: int = 1  # the train lines logged: steps that are multiples of it
    compile_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    memory_budget: int | None = None
    sharding: Sharding | None = None  # the mesh axes, rules, FSDP
    remat: RematPlan | None = None  # blocks recomputed in the backward pass
    val_every: int | None = None
    checkpoint_every: int | None = None
    checkpoint_every_minutes: float | None = None
    peak_tflops: float | None = None  # the device's peak for mfu (None: the known table's)
    profile: tuple[int, int] | None = None  # steps traced by jax.profiler (observe/profile.py)
    early_stop: EarlyStopConfig | None = None  # the rule; its counters are in `Progress`
    reduce_lr_on_plateau: PlateauRule | None = None  # the rule; its counters are in `Progress`
    show_curves: bool = False  # the curves shown inline when train returns (a notebook)
    resume_path: Path | None = None
    weights_path: Path | None = None  # checkpoint=: the weights were loaded from there
    weights_loaded: str | None = None  # checkpoint=: which of its weights, "raw" or "ema"
    resumed_total_steps: int | None = None
    population: Population | None = None  # members trained in one program
    ema: Ema | None = None  # the weight average kept in TrainState.ema, or None (off)
    # The train split's arrays on the device ({field: array}); the train program gathers each
    # batch's rows from them (only the row indices are sent per step). None: batches are sent.
    resident: Mapping[str, jax.Array] | None = None
    # An in-order train split's batches, cut once and kept on the device (device_batches.py):
    # the program takes each as it is. None: gathered (`resident`) or sent.
    device_batches: DeviceBatches | None = None

    @property
    def n_devices(self) -> int:
        return int(self.mesh.size)

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.optimizer.tx

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class DeviceValues:
    """The current values of the Device fields (replicated arrays, traced inputs of every
    program) and the unscheduled per-step hyperparameters packed from them and the optimizer.
    `jn.set_device` replaces it; nothing recompiles."""

    values: Mapping[str, jax.Array]
    # {slot: value}; for a population, a tuple of one such dict per member
    hyper_base: Mapping[str, Any] | tuple[Mapping[str, Any], ...]
    active: jax.Array | None = None  # a population with early stopping: which members still train
    # {group: rate} set mid-run (jn.set_lr, the plateau rule): wins over the learning_rate hook
    rates: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def extras(self) -> dict:
        """The programs' `extras` argument."""
        if self.active is not None:
            return {"device": dict(self.values), "active": self.active}
        return {"device": dict(self.values)}
