"""Setup's sequence: `build`, every step after the services in the documented order (see the
package docstring), returning the frozen parts of a run (`Built`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.checkpoint.record import _read_meta as checkpoint_meta
from jaxnitro._src.compile import backend_options
from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.dist import distributed
from jaxnitro._src.dist import sharding as sharding_mod
from jaxnitro._src.dist.devices import apply_env, replicated
from jaxnitro._src.experiment import remat
from jaxnitro._src.experiment.markers import DEVICE, field_values
from jaxnitro._src.optim import groups as optim
from jaxnitro._src.optim.hyper import HyperLayout
from jaxnitro._src.run import options
from jaxnitro._src.run.early_stop import EarlyStopConfig, EarlyStopping
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.run.rates import resumed_rates
from jaxnitro._src.run.services import Services
from jaxnitro._src.run.settings import Settings
from jaxnitro._src.run.setup.data import (
    Dist,
    build_data,
    check_processes_agree,
    check_splits,
    data_share,
    derive,
    device_array,
    steps_per_epoch,
)
from jaxnitro._src.run.setup.metrics import check_metrics
from jaxnitro._src.run.setup.model import (
    build_model,
    check_custom_step,
    grad_norm_setting,
    initial_state,
    schedules_of,
)
from jaxnitro._src.run.setup.population import member_device_values, member_trees, population_of
from jaxnitro._src.run.setup.resident import resident_data
from jaxnitro._src.run.setup.restore import (
    early_stop_start,
    restore,
    resume_position,
    warn_horizon,
    warn_replay,
)
from jaxnitro._src.run.setup.rundir import identity, restore_loggers, shared_resume_record
from jaxnitro._src.run.setup.weights import load_weights, loaded_weights, weights_path
from jaxnitro._src.run.spec import DeviceValues, RunSpec
from jaxnitro._src.steps import ema as ema_mod
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxnitro._src.core.types import Experiment
    from jaxnitro._src.dist.sharding.rules import Sharding
    from jaxnitro._src.experiment.hooks import Route


@dataclasses.dataclass(frozen=True)
class Built:
    """The parts of a run that setup returns to the handle."""

    spec: RunSpec
    state: TrainState
    progress: Progress
    device: DeviceValues


def build(
    exp: Experiment, s: Settings, svc: Services, named: bool, routes: Mapping[str, Route]
) -> Built:
    """Everything after the services, in the documented order."""
    # [Step 1] the run's identity (resumed or new), then the devices it runs on
    resume_path, run_id, seed = _identity(s, svc)
    sharding, mesh, dist = _devices(s)
    _check_compile_options(s)
    # [Step 2] the data, the experiment derived from it, its Device values, the model
    splits = build_data(exp, s.data, dist, seed)
    position = resume_position(resume_path)
    warn_replay(splits, position)
    exp = derive(exp, splits)
    rep = replicated(mesh)
    values = {k: device_array(k, v, rep) for k, v in field_values(exp, DEVICE).items()}
    model, params, mstate, rng = build_model(exp, seed, rep)
    split_specs = check_splits(splits, routes, len(dist.local_devices), position)
    check_processes_agree(splits, split_specs)
    # [Step 3] the optimizer, its schedules, a population, the data kept on the device
    custom = check_custom_step(s, routes)
    optimizer = optim.build(exp, params, scheduled=set(s.schedules), separate=custom)
    spe = steps_per_epoch(splits, s.accum)
    schedules, total = schedules_of(s, exp, optimizer, spe)
    layout = HyperLayout.build(optimizer, values, schedules)
    pop = population_of(s, exp, seed, optimizer, splits["train"], schedules)
    resident, device_batches = resident_data(s, splits, split_specs, mesh, dist, pop)
    _check_weights_option(s)
    # [Step 4] the spec: what setup decided, frozen
    decided = _decided(
        s, seed, sharding, optimizer, custom, pop, schedules, (model, params, mstate)
    )
    spec = RunSpec(
        experiment=exp,
        cls=type(exp),
        routes=routes,
        splits=splits,
        split_specs=split_specs,
        dist=dist,
        model=model,
        mesh=mesh,
        replicated=rep,
        batch_sharding=data_mod.batch_sharding(mesh),
        direct_feed=_direct_feed(mesh, dist),
        optimizer=optimizer,
        hyper=layout,
        steps_per_epoch=spe,
        total_steps=total,
        run_id=run_id,
        resume_path=resume_path,
        resident=resident,
        device_batches=device_batches,
        **decided,
        **_options(s, decided, mesh.devices.flat[0].platform, _rows(split_specs)),
    )
    # [Step 5] the initial train state and Device values, checked, then restored or loaded
    ts, device = _initial(spec, sharding, values, (params, mstate, rng))
    sharding_mod.check_fsdp(ts.params, sharding, mesh.size)
    check_metrics(spec, ts, device, svc, named)
    return _restored(spec, ts, device, s, svc)


def _identity(s: Settings, svc: Services) -> tuple[Path | None, str, int]:
    """The resume record, the run's id and seed (process 0's, for every process), and the
    services and environment that follow from them."""
    resume_path = shared_resume_record(svc, s.run_dir, s.resume)
    run_id, seed = identity(resume_path, s.seed)
    run_id = distributed.broadcast("run-id", run_id)  # process 0's: one run, one id
    svc.checkpointer.for_run(run_id)
    restore_loggers(svc, resume_path)
    apply_env()
    return resume_path, run_id, seed


def _devices(s: Settings) -> tuple[Sharding, Mesh, Dist]:
    """The sharding rules, the mesh, and this process's place in it (what
    `build_data(self, dist)` is handed)."""
    sharding = sharding_mod.resolve(s.sharding)
    mesh = sharding_mod.make_mesh(sharding, s.n_devices)
    me = jax.process_index()
    local = tuple(d for d in mesh.devices.flat if d.process_index == me)
    return (
        sharding,
        mesh,
        Dist(me, jax.process_count(), mesh.size, mesh, local, *data_share(mesh, me)),
    )


def _direct_feed(mesh: Mesh, dist: Dist) -> bool:
    """One CPU device in one process: batches go to the program as they are."""
    return mesh.size == 1 and mesh.devices.flat[0].platform == "cpu" and dist.process_count == 1


def _decided(
    s: Settings,
    seed: int,
    sharding: Sharding,
    optimizer: optim.Optimizer,
    custom: bool,
    pop: Any,
    schedules: Any,
    model_trees: tuple[Any, Any, Any],
) -> dict[str, Any]:
    """The options setup turns into something else; the rest are kept as they are."""
    return {
        "seed": seed,
        "run_dir": s.run_dir,
        "log_grad_norm": grad_norm_setting(s.log_grad_norm, optimizer) and not custom,
        "sharding": sharding,
        "remat": remat.plan(s.remat, s.remat_policy, *model_trees),
        "population": pop,
        "schedules": schedules,
        "ema": ema_mod.setting(s.ema, s.ema_warmup, s.ema_every, s.ema_state, s.ema_eval),
        "early_stop": early_stop_rule(s.early_stop),
    }


def _check_compile_options(s: Settings) -> None:
    """Options XLA would refuse at the first compile, refused here with its words."""
    said = None if s.compile_options is None else backend_options.refused(s.compile_options)
    if said is not None:
        raise ConfigError(
            f"compile_options={s.compile_options!r}: this jaxlib ({jax.__version__}, "
            f"{jax.default_backend()}) refuses them: {said}. Correct or drop that option "
            f"(leave compile_options out for jaxnitro's defaults, or pass {{}} for XLA's)."
        )


def _check_weights_option(s: Settings) -> None:
    if s.weights is not None and s.checkpoint is None:
        raise ConfigError(
            f"weights={s.weights!r} without checkpoint=; weights picks which weights a "
            f"checkpoint loads. Pass checkpoint='runs/...' with it, or drop weights."
        )


def _initial(
    spec: RunSpec, sharding: Sharding, values: dict[str, Any], trees: tuple[Any, Any, jax.Array]
) -> tuple[TrainState, DeviceValues]:
    """The initial train state and Device values: one model's, or a population's (each
    member's own trees and values, stacked)."""
    params, mstate, rng = trees
    pop, layout, optimizer, rep = spec.population, spec.hyper, spec.optimizer, spec.replicated
    if pop is None:
        device = DeviceValues(values, layout.base(optimizer, values))
        shardings = sharding_mod.param_shardings(params, sharding, spec.mesh)
        ts = initial_state(spec.model, params, mstate, optimizer.tx, rng, rep, shardings)
    else:
        device = member_device_values(pop, layout, optimizer, values, rep)
        params, mstate, rng = member_trees(spec.experiment, pop, rep, (params, mstate, rng))
        ts = initial_state(spec.model, params, mstate, optimizer.tx, rng, rep, members=pop.size)
        if spec.early_stop is not None:  # each member stops on its own metric
            active = sharding_mod.to_sharding(np.ones(pop.size, bool), rep)
            device = dataclasses.replace(device, active=active)
    if spec.ema is not None:  # placed and sharded as the params (their copy, in f32)
        ts = ts.replace(ema=ema_mod.init(spec.ema, ts.params, ts.state, ts.step))
    return ts, device


def _rows(split_specs: Mapping[str, Any]) -> int | None:
    """The rows of the run's batches, for the backend's compile options: the train split's,
    else the largest of the others (None: no split)."""
    if "train" in split_specs:
        return split_specs["train"].batch_size
    return max((spec.batch_size for spec in split_specs.values()), default=None)


def _options(
    s: Settings, decided: Mapping[str, Any], platform: str, rows: int | None
) -> dict[str, Any]:
    """The options a RunSpec keeps as validated: its fields named like an option that setup
    has not `decided` (steps_per_call='auto' starts at 1; the first train measures and picks,
    `train/autotune.py`; no compile_options: the backend's defaults)."""
    kept = {f.name for f in dataclasses.fields(RunSpec)} & set(options.NAMES)
    out = {k: getattr(s, k) for k in kept - set(decided)}
    if s.steps_per_call == "auto":
        out.update(steps_per_call=1, autotune=True)
    if s.compile_options is None:
        out.update(compile_options=backend_options.defaults(platform, rows))
    return out


def _restored(
    spec: RunSpec, ts: TrainState, device: DeviceValues, s: Settings, svc: Services
) -> Built:
    progress = Progress(early_stop=early_stop_start(spec))
    if spec.resume_path is not None:
        ts, progress, horizon = restore(spec, ts, spec.resume_path, svc.display.bar)
        saved = checkpoint_meta(spec.resume_path)["meta"]  # jn.set_lr's rates, the plateau's
        device, progress = resumed_rates(device, progress, saved, spec.resume_path)
        spec = spec.replace(resumed_total_steps=horizon)
        warn_horizon(spec, progress, horizon)
    elif s.checkpoint is not None:
        path = weights_path(Path(s.checkpoint).absolute())
        ts = load_weights(spec, ts, path, s.weights, svc.display.bar)
        spec = spec.replace(weights_path=path, weights_loaded=loaded_weights(path, s.weights))
    if spec.early_stop is not None and isinstance(progress.early_stop, tuple):
        # the members that had stopped stay frozen
        active = spec.early_stop.active(progress.early_stop)
        rep = spec.replicated
        device = dataclasses.replace(device, active=sharding_mod.to_sharding(active, rep))
    return Built(spec, ts, progress, device)


def early_stop_rule(value: Any) -> EarlyStopConfig | None:
    """The frozen rule of the `early_stop=` option (a `jn.EarlyStopping`, or None)."""
    if value is None or isinstance(value, EarlyStopConfig):
        return value
    if not isinstance(value, EarlyStopping):
        raise ConfigError(
            f"early_stop must be a jn.EarlyStopping, got {type(value).__name__}; pass "
            f"jn.EarlyStopping(metric='val_loss', patience=3)."
        )
    return value.config
