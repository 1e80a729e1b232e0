"""`ProgramSpec`: what the program builders and the plan read of a run's frozen decisions.

A Protocol, so that this layer names the 26 values it needs and never imports `run`: the
run's `RunSpec` (45 fields, its loaders among them) satisfies it, and so does any record
with these attributes. mypy checks a `RunSpec` against it where `run/` and `train/` pass one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding

    from jaxnitro._src.core.types import Hooked, Model, Source
    from jaxnitro._src.data.device_batches import DeviceBatches
    from jaxnitro._src.data.splits import SplitSpec
    from jaxnitro._src.experiment.hooks import Route
    from jaxnitro._src.experiment.remat import RematPlan
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.optim.hyper import HyperLayout
    from jaxnitro._src.steps.ema import Ema
    from jaxnitro._src.steps.population import Population


class ProgramSpec(Protocol):
    """The decisions of setup a run's programs are built from (read-only)."""

    # the experiment, its hooks and the model
    @property
    def experiment(self) -> Hooked: ...
    @property
    def cls(self) -> type[Hooked]: ...
    @property
    def routes(self) -> Mapping[str, Route]: ...
    @property
    def model(self) -> Model: ...
    @property
    def remat(self) -> RematPlan | None: ...

    # the data: sources, what their first batches showed, batches kept on the device
    @property
    def splits(self) -> Mapping[str, Source]: ...
    @property
    def split_specs(self) -> Mapping[str, SplitSpec]: ...
    @property
    def resident(self) -> Mapping[str, jax.Array] | None: ...
    @property
    def device_batches(self) -> DeviceBatches | None: ...
    @property
    def steps_per_epoch(self) -> int | None: ...

    # devices
    @property
    def mesh(self) -> Mesh: ...
    @property
    def replicated(self) -> NamedSharding: ...
    @property
    def n_devices(self) -> int: ...
    @property
    def direct_feed(self) -> bool: ...

    # the optimization and the step
    @property
    def optimizer(self) -> Optimizer: ...
    @property
    def tx(self) -> optax.GradientTransformation: ...
    @property
    def hyper(self) -> HyperLayout: ...
    @property
    def accum(self) -> int: ...
    @property
    def steps_per_call(self) -> int: ...
    @property
    def precision(self) -> str: ...
    @property
    def on_nonfinite(self) -> str: ...
    @property
    def log_grad_norm(self) -> bool: ...
    @property
    def compile_options(self) -> Mapping[str, Any]: ...
    @property
    def memory_budget(self) -> int | None: ...

    # what the run keeps beside the weights
    @property
    def ema(self) -> Ema | None: ...
    @property
    def population(self) -> Population | None: ...
    @property
    def early_stop(self) -> object | None:
        """The early-stopping rule (`run.early_stop.EarlyStopConfig`), or None (off); the
        programs only ask whether there is one."""
