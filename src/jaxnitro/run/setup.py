"""Setup: from an experiment and the options of `jn.Nitro(...)` to the parts of a run.

The order is fixed and each step is a small function returning a frozen piece: settings →
run dir and services → resume record → data → derive → mesh and Device values → model →
routing checks on the first batches → optimizer, schedules and hyperparameter layout →
checkpointer and metric checks → restore. Setup validates everything it can before anything
compiles, and writes none of the run's files (only a resume may move a corrupted checkpoint
aside, under the run lock).
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxnitro.checkpoint.runlock import FollowerLock, RunLock
from jaxnitro.checkpoint.store import TopKCheckpointer, load_checkpoint, validate_int
from jaxnitro.checkpoint.record import _read_meta as checkpoint_meta
from jaxnitro.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    HookError,
    did_you_mean,
    warn_user,
)
from jaxnitro.core.jsonable import jsonable
from jaxnitro.data import grain_source
from jaxnitro.data import loader as data_mod
from jaxnitro.data.device_batches import DeviceBatches
from jaxnitro.dist import distributed
from jaxnitro.dist import sharding as sharding_mod
from jaxnitro.dist.devices import apply_env, replicated
from jaxnitro.experiment import hooks, remat
from jaxnitro.experiment.markers import DEVICE, field_values, fields, graph_key, replace
from jaxnitro.observe.display import Display
from jaxnitro.observe.loggers import JSONLogger, make_logger
from jaxnitro.optim import groups as optim
from jaxnitro.optim.hyper import HyperLayout
from jaxnitro.run import options
from jaxnitro.run.progress import Progress
from jaxnitro.run.services import Services, check_resumable, make_checkpointer
from jaxnitro.run.settings import Settings
from jaxnitro.run.spec import DeviceValues, RunSpec, SplitSpec
from jaxnitro.steps import ema as ema_mod
from jaxnitro.steps import population as population_mod
from jaxnitro.steps.state import TrainState
from jaxnitro.train.early_stop import EarlyStopping


@dataclasses.dataclass(frozen=True)
class Dist:
    """What `build_data(self, dist)` learns about the run, so each process loads its shard.

    With several processes each process's loader yields its own rows of every global batch
    (the global batch is the processes' batches in process order), so the batch size a
    loader gives is the global one divided by `data_count` (`process_count`, unless a `model`
    mesh axis spans processes: those feed identical rows).

    Example:
        >>> def build_data(self, dist):
        ...     rows = slice(dist.data_index, None, dist.data_count)  # this process's share
        ...     return {"train": jn.DataLoader({"x": x[rows], "y": y[rows]}, batch_size=64)}
    """

    process_index: int
    process_count: int
    n_devices: int  # of the mesh, over every process
    mesh: Any
    local_devices: tuple = ()  # this process's devices of the mesh
    # Which share of each global batch this process feeds: its position along the mesh's
    # `data` axis among `data_count` shares. The process index and count on a data mesh; with
    # a `model` axis spanning processes, the processes along it feed the same rows.
    data_index: int = 0
    data_count: int = 1


def data_share(mesh, process: int) -> tuple[int, int]:
    """(index, count) of the share of each batch `process` feeds: its devices' positions
    along the `data` axis, as one block of the axis (the feed builds global arrays so)."""
    if "data" not in mesh.axis_names:
        return 0, 1
    axis = mesh.axis_names.index("data")
    mine = sorted({i[axis] for i, d in np.ndenumerate(mesh.devices) if d.process_index == process})
    if not mine:
        return 0, 1
    per = len(mine)
    return mine[0] // per, mesh.shape["data"] // per


@dataclasses.dataclass(frozen=True)
class Built:
    """The parts of a run that setup returns to the handle."""

    spec: RunSpec
    state: TrainState
    progress: Progress
    device: DeviceValues


# -- run dir and services -------------------------------------------------------------------
def make_run_dir(path: Path) -> None:
    """An unusable run dir fails before any work."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file; give a directory path (run_dir='runs/x').")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create run_dir {path}: {e}. Pick a writable path.") from e


def services(s: Settings) -> tuple[Services, bool]:
    """(the run's services, whether the user named the checkpointer). With several processes
    only process 0 logs and shows progress (the others' logger and display are off); every
    process checkpoints (together), and only process 0 writes the run's files."""
    checkpointer, named = make_checkpointer(s.checkpointer, default=TopKCheckpointer)
    check_resumable(checkpointer, s.resume)
    writer = jax.process_index() == 0
    svc = Services(
        logger=logger_of(s.logger) if writer else logger_of(False),
        checkpointer=checkpointer,
        display=Display(s.progress if writer else False),
        lock=RunLock(s.run_dir) if writer else FollowerLock(s.run_dir),
        run_dir=s.run_dir,
        params_line={},
    )
    checkpointer.bind(s.run_dir, writer=False)
    return svc, named


def logger_of(value):
    return make_logger(value, JSONLogger)


def resume_record(svc: Services, run_dir: Path, resume) -> Path | None:
    """The checkpoint to resume from (None: a fresh run)."""
    if resume in (False, None):
        return None
    if resume in (True, "auto"):
        # The newest checkpoint that verifies: a truncated or corrupted newest one is reported
        # and moved aside, which writes: a run another writer holds cannot be resumed now.
        svc.lock.acquire("resume", what=f"run_dir {run_dir}")
        try:
            svc.checkpointer.bind(run_dir, writer=True)
            latest = svc.checkpointer.latest_valid()
        finally:
            svc.lock.release()
        if latest is None and resume is True:
            raise CheckpointError(
                f"resume=True but {svc.checkpointer.dir} holds no checkpoint. Use "
                f"resume='auto' to start fresh when there is none."
            )
        return latest
    if not isinstance(resume, (str, os.PathLike)):
        raise ConfigError(
            f"resume={resume!r}; use False, 'auto' (continue from the newest checkpoint in "
            f"run_dir if any), True (it must exist) or a checkpoint path."
        )
    path = Path(resume).absolute()
    if not path.exists():
        raise CheckpointError(
            f"resume={resume!r}: no such checkpoint. Pass a checkpoint directory (e.g. "
            f"TopKCheckpointer(dir=...).latest()), or resume='auto' to continue from the "
            f"newest one in run_dir."
        )
    return path


def shared_resume_record(svc: Services, run_dir: Path, resume) -> Path | None:
    """`resume_record`, decided by process 0 alone (it may move a corrupted checkpoint
    aside) and the same on every process; one process: `resume_record` itself."""
    if jax.process_count() == 1:
        return resume_record(svc, run_dir, resume)
    found = distributed.decided_by_process_zero(
        "resume", lambda: _path_str(resume_record(svc, run_dir, resume))
    )
    return None if found is None else Path(found)


def _path_str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def check_processes_agree(splits: Mapping, split_specs: Mapping[str, SplitSpec]) -> None:
    """With several processes: every process has the same splits, each with as many batches
    of the same shapes (else one would wait in a collective for a batch its peers never
    send); a last short evaluation batch is refused (its padding would be masked per process,
    which the eval program does not do)."""
    if jax.process_count() == 1:
        return
    mine = {
        name: {
            "batches": len(splits[name]) if hasattr(splits[name], "__len__") else None,
            "batch_size": info.batch_size,
            "fields": {f: [list(shape), str(dtype)] for f, (shape, dtype) in info.specs.items()},
        }
        for name, info in split_specs.items()
    }
    try:
        distributed.check_same(
            "splits",
            mine,
            what="the data (split: batches, batch size, per-sample fields)",
            fix="Give every process an equal share of every split (e.g. rows[dist."
            "process_index::dist.process_count] of a length that divides), with drop_last="
            "True for training.",
        )
    except distributed.DistributedError as e:
        raise DataError(str(e)) from e
    for name, src in splits.items():
        if name != "train" and getattr(src, "ragged", False):
            raise DataError(
                f"split {name!r} ends with a short batch ({src.num_samples} samples, "
                f"batch_size {src.batch_size}); with {jax.process_count()} processes every "
                f"batch must be full. Pick a batch size that divides each process's share, "
                f"or drop_last=True."
            )


def identity(resume_path: Path | None, seed: int) -> tuple[str, int]:
    """(run id, seed): a resumed run keeps its checkpoint's id and seed."""
    run_id = uuid.uuid4().hex[:12]
    if resume_path is None:
        return run_id, seed
    meta = read_meta(resume_path)
    saved = meta.get("run_id")
    if isinstance(saved, str) and re.fullmatch(r"[0-9a-zA-Z_-]{1,64}", saved):
        run_id = saved
    if meta.get("seed") is not None and meta["seed"] != seed:
        warn_user(
            f"resuming with seed {meta['seed']} from the checkpoint instead of {seed}: the "
            f"shuffle order and dropout must continue as they were.",
        )
        seed = validate_int(meta, "seed", resume_path)
    return run_id, seed


def read_meta(path: Path) -> dict:
    """The user meta of a checkpoint, read without its arrays (errors name what is wrong)."""
    full = checkpoint_meta(Path(path))
    return full.get("meta", full)


def restore_loggers(svc: Services, resume_path: Path | None) -> None:
    """A resume hands the loggers the state its checkpoint saved (`meta["loggers"]`), so they
    reattach to their runs: the same TensorBoard dir, MLflow run, W&B run."""
    load = getattr(svc.logger, "load_state_dict", None)
    if resume_path is None or not callable(load):
        return
    state = read_meta(resume_path).get("loggers")
    if isinstance(state, dict):
        load(state)


# -- data -----------------------------------------------------------------------------------
def build_data(exp, data, dist: Dist, seed: int) -> dict[str, Any]:
    """The splits: `Nitro(data=...)` or `build_data(self, dist)`, checked as re-iterables."""
    splits = data if data is not None else exp.build_data(dist)
    if not isinstance(splits, Mapping):
        raise HookError(
            f"build_data must return a dict of splits like {{'train': loader, 'val': loader}}, "
            f"got {type(splits).__name__}."
        )
    splits = dict(splits)
    if splits and "train" not in splits:
        raise DataError(
            f"the data has splits {sorted(splits)} but no 'train' split, which is required."
            + did_you_mean("train", splits)
        )
    for name, src in splits.items():
        if isinstance(src, Iterator):
            raise DataError(
                f"split {name!r} is a one-shot iterator ({type(src).__name__}): it would be "
                f"empty after the first epoch. Pass a re-iterable (a list of batches or a "
                f"jn.DataLoader)."
            )
        if isinstance(src, data_mod.DataLoader) and src.seed is None:
            src.seed = seed  # the Nitro seed controls shuffling
        grain_source.check(name, src, dist)
    return splits


def derive(exp, splits):
    """`derive(self, splits)` -> field updates (e.g. class weights), applied to the experiment."""
    fn = getattr(type(exp), "derive", None)
    if fn is None:
        return exp
    updates = fn(exp, splits) or {}
    if not isinstance(updates, Mapping):
        raise HookError(
            f"derive must return a dict field -> value, got {type(updates).__name__}; "
            f"return e.g. {{'class_weights': w}} (or None to change nothing)."
        )
    return replace(exp, **updates)


def device_array(name: str, value, rep) -> jax.Array:
    """A Device field's value as a strongly typed replicated array (a Python float would be
    weakly typed and could retrace on a change of type)."""
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif arr.dtype == np.int64:
        arr = arr.astype(np.int32)
    elif arr.dtype.kind not in "biuf":
        raise ConfigError(
            f"Device field {name!r} holds {value!r}, which is not numeric; give it a number or "
            f"an array, or mark it GraphConst/Host."
        )
    return sharding_mod.to_sharding(arr, rep)


def check_splits(
    splits: Mapping, routes, n_devices: int, position: tuple = (0, 0, None)
) -> dict[str, SplitSpec]:
    """Route every split's first batch through the hooks; check sizes and devices. The
    train split's batch is the one at `position` (a resume's)."""
    info = {
        split: _split_spec(split, src, routes, n_devices, position if split == "train" else None)
        for split, src in splits.items()
    }
    if "train" in info:  # every split feeds the same model: the same per-sample fields
        for split, sinfo in info.items():
            if split != "train":
                data_mod.check_same_specs(sinfo.specs, info["train"].specs, split)
    return info


def _peek(split: str, src, position: tuple | None = None) -> dict:
    """The first batch, iterating the source once (every later use reads the SplitSpec).
    A DataLoader or a grain split reads the batch at `position` (epoch, batch, state) alone."""
    epoch, start, state = position or (0, 0, None)
    if grain_source.kind(src) is not None:
        first = grain_source.peek(src, epoch, start, state)
        if first is None:
            raise DataError(f"split {split!r} is empty (the grain dataset yielded no batch).")
        return first
    if isinstance(src, data_mod.DataLoader):
        return src.first_batch()  # in this process: no transform workers start at setup
    it = iter(src)
    if it is iter(src):
        raise DataError(
            f"split {split!r} ({type(src).__name__}) returns the same iterator each time it is "
            f"iterated, so it would be empty after the first epoch. Make __iter__ start a new "
            f"pass (e.g. a generator function), or pass a jn.DataLoader or a list of batches."
        )
    first = next(it, None)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    if first is None:
        raise DataError(
            f"split {split!r} is empty (it yielded no batch). Remove the split, or check "
            f"what build_data loads."
        )
    return first


def _split_spec(split: str, src, routes, n_devices: int, position=None) -> SplitSpec:
    first = _peek(split, src, position)
    bs = data_mod.check_batch(first, split)
    train = split == "train"
    if train and "train_step" in routes:  # a custom step names the fields it trains on
        needed: tuple[str, ...] = ("train_step",)
        hooks.check_batch(routes, first, split, hooks=needed)
        use, loss_ok = needed, False
    else:
        needed = ("forward", "loss", "train_metrics") if train else ("forward", "loss", "metrics")
        hooks.check_batch(routes, first, split, hooks=needed if train else ("forward", "metrics"))
        loss_ok = "loss" in routes and all(f in first for f in routes["loss"].required)
        use = needed if loss_ok else ("forward", "metrics")
    if train and isinstance(src, data_mod.DataLoader) and src.ragged:
        raise DataError(
            f"the 'train' split has {src.num_samples} samples, which batch_size="
            f"{src.batch_size} does not divide: the last train batch would be short "
            f"({src.num_samples % src.batch_size}) and need its own program. Pass "
            f"drop_last=True to the train DataLoader."
        )
    if bs % n_devices:
        raise DataError(
            f"the {split!r} batch size {bs} does not divide by the {n_devices} devices of the "
            f"data mesh. Use a batch size that is a multiple of {n_devices}."
        )
    return SplitSpec(
        batch_size=bs,
        fields=tuple(hooks.device_fields(routes, first, hooks=use)),
        keys=frozenset(first),
        has_loss=loss_ok,
        first=first,
        specs=data_mod.batch_specs(first, split),
    )


def steps_per_epoch(splits: Mapping, accum: int) -> int | None:
    """Optimizer steps per epoch; `accum` must divide the batches of an epoch."""
    loader = splits.get("train")
    if loader is None or not hasattr(loader, "__len__"):
        return None
    batches = len(loader)
    if batches % accum:
        near = sorted(
            {d for d in range(1, batches + 1) if batches % d == 0},
            key=lambda d: (abs(d - accum), d),
        )[:3]
        raise ConfigError(
            f"accum={accum} does not divide the {batches} train batches of an epoch, so the "
            f"last optimizer step would be short. Use accum in {sorted(near)}, or change the "
            f"batch size or the number of samples (drop_last=True drops a final partial batch)."
        )
    return batches // accum


# -- model and optimizer --------------------------------------------------------------------
def build_model(exp, seed: int, rep) -> tuple[Any, Any, Any, jax.Array]:
    """(model, params, model state, the run's RNG key). The model state and key are
    replicated on the mesh; the params are placed once, by their shardings, in
    `initial_state` (a replicated copy first would hold every parameter twice)."""
    init_key, rng = jax.random.split(jax.random.PRNGKey(seed))
    built = exp.build_model(init_key)
    if not (isinstance(built, tuple) and len(built) == 3):
        raise HookError(
            f"{type(exp).__name__}.build_model must return (model, params, state), got "
            f"{type(built).__name__}. Wrap your module: return jn.split_model(module)."
        )
    state = built[2] if built[2] is not None else {}
    state = sharding_mod.place(state, jax.tree.map(lambda _: rep, state))
    return built[0], built[1], state, sharding_mod.to_sharding(rng, rep)


def check_custom_step(s: Settings, routes) -> bool:
    """A custom `train_step` is selected; the options that assume one loss are refused."""
    if "train_step" not in routes:
        return False
    refused = {
        "accum": (s.accum > 1, f"accum={s.accum}", "accumulate inside train_step (a lax.scan "
                  "over micro-batches) or raise the batch size"),
        "precision": (s.precision != "f32", f"precision={s.precision!r}", "cast the params "
                      "and inputs to bfloat16 inside train_step"),
        "log_grad_norm": (s.log_grad_norm is True, "log_grad_norm=True", "return the norm "
                          "you want among train_step's metrics (optax.tree.norm(grads))"),
    }  # fmt: skip
    for bad, what, fix in refused.values():
        if bad:
            raise ConfigError(
                f"{what} applies to the built-in train step (one loss, one gradient); this "
                f"experiment defines its own train_step. Drop the option, and {fix}."
            )
    return True


def grad_norm_setting(value, optimizer) -> bool:
    """The gradient norm per step costs a pass over the gradients (~15% of a small MLP's step
    on CPU): logged when clipping computes it anyway, or when asked for."""
    if value not in (None, True, False):
        raise ConfigError(
            f"log_grad_norm={value!r}; use True, False or None (the default: on when "
            f"gradient_clip_norm is set)."
        )
    return optimizer.clip > 0 if value is None else value


def schedules_of(s: Settings, exp, optimizer, spe: int | None):
    """(resolved schedules, total steps): resolved against the run's optimizer steps."""
    total = (spe or 0) * s.max_epochs
    if s.schedules and not spe:
        raise ConfigError(
            "schedules need the number of steps per epoch, but the 'train' split has no len(); "
            "use a jn.DataLoader or give it __len__."
        )
    markers = {f.name: f.marker for f in fields(exp)}
    resolved = optim.resolve_schedules(
        s.schedules, opt=optimizer, device_fields=markers, total_steps=max(total, 1)
    )
    return resolved, total


def initial_state(
    model, params, state, tx, rng, rep, shardings=None, *, members: int | None = None
) -> TrainState:
    """Every leaf lives on the mesh as the train step returns it (parameters by their
    shardings, optimizer state after its parameter, the rest replicated), so the program's
    input avals (and key) are the same at step 1 and step N. With `members`, the trees
    carry a leading member axis (replicated) and each member gets its optimizer state."""
    if members is not None:
        opt_state = jax.jit(jax.vmap(tx.init), out_shardings=rep)(params)
        step = sharding_mod.to_sharding(np.zeros((members,), np.int32), rep)
        return TrainState(params, state, opt_state, step, rng, model=model, tx=tx)
    if shardings is None:
        shardings = jax.tree.map(lambda _: rep, params)
    params = sharding_mod.place(params, shardings)
    opt_sh = sharding_mod.opt_state_shardings(tx, params, shardings, rep)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    step = sharding_mod.to_sharding(np.zeros((), np.int32), rep)
    return TrainState(params, state, opt_state, step, rng, model=model, tx=tx)


# -- the train split on the device ----------------------------------------------------------
#: The share of the device's capacity the train arrays may take to stay on it by default.
RESIDENT_FRACTION = 0.25
#: The smallest call's worth of batches (steps_per_call × accum batches, all fields) an
#: in-order split is cut into on the device; below it the batches are gathered in the program
#: like a shuffled split's. Measured on a 2-core CPU: each piece put costs about 85 µs and
#: gathering about 0.35 ms per MB in the step, so a piece from about 256 KiB repays its
#: transfer within the first epoch (at 100 KiB, cut and gathered batches train equally fast
#: and gathering sets up faster).
CUT_MIN_CALL_BYTES = 256 * 1024


def resident_data(s: Settings, splits, split_specs, mesh, dist, pop) -> tuple[Any, Any]:
    """(the train arrays placed on the device whole, the train batches cut on the device),
    at most one of them set; (None, None): each batch is sent. By default when the train
    split is a `jn.DataLoader` over in-memory arrays, the run has one device and one process,
    and the arrays take at most `RESIDENT_FRACTION` of the device's capacity;
    `data_on_device=True` requires it, False turns it off. A shuffled split keeps its arrays
    whole and the train program gathers each batch's rows; an in-order one is cut into its
    batches once (`data/device_batches.py`) when a call's batches take at least
    `CUT_MIN_CALL_BYTES`.
    Either way the same rows, bitwise."""
    arrays = _resident_arrays(s, splits, split_specs, mesh, dist, pop)
    if arrays is None:
        return None, None
    loader = splits["train"]
    spc = s.steps_per_call if isinstance(s.steps_per_call, int) else 1  # "auto": not known
    call_bytes = s.accum * spc * loader.batch_size * sum(a[:1].nbytes for a in arrays.values())
    if loader.shuffle or call_bytes < CUT_MIN_CALL_BYTES:
        rep = replicated(mesh)
        return {f: jax.device_put(a, rep) for f, a in arrays.items()}, None
    kept = DeviceBatches(arrays, loader.batch_size, data_mod.batch_sharding(mesh))
    return None, kept


def _resident_arrays(s: Settings, splits, split_specs, mesh, dist, pop):
    """The train split's host arrays when they can stay on the device, else None."""
    if s.data_on_device is False or "train" not in splits:
        return None
    loader, info = splits["train"], split_specs["train"]
    arrays = (
        loader.resident_arrays(info.fields) if isinstance(loader, data_mod.DataLoader) else None
    )
    why = None
    if arrays is None:
        why = "the train split is not a jn.DataLoader over in-memory numpy arrays"
    elif mesh.size != 1 or dist.process_count != 1:
        why = f"the run has {mesh.size} devices over {dist.process_count} process(es)"
    elif pop is not None:
        why = "a population trains on the arrays as they are sent"
    if why is None and arrays is not None:
        from jaxnitro.compile.memory import device_capacity, format_bytes

        size = sum(a.nbytes for a in arrays.values())
        capacity, source = device_capacity(mesh.devices.flat[0], s.memory_budget)
        if size > RESIDENT_FRACTION * capacity and s.data_on_device is not True:
            return None  # does not fit comfortably: send the batches
        if size > capacity:
            why = f"its arrays take {format_bytes(size)}, more than the {source}"
    if why is not None or arrays is None:
        if s.data_on_device:
            raise ConfigError(
                f"data_on_device=True, but {why}. Drop the option (batches are then sent "
                f"per step), or train from a jn.DataLoader over numpy arrays on one device."
            )
        return None
    return arrays


# -- a population of members ----------------------------------------------------------------
def population_of(s: Settings, exp, seed: int, optimizer, train, schedules):
    """`population=`: the members (seeds, per-member values and rates), or None."""
    if s.population is None:
        return None
    if s.sharding.fsdp or s.sharding.rules:
        raise ConfigError(
            "population= trains small models side by side on replicated parameters; it does "
            "not combine with sharding='fsdp' or sharding rules. Use sharding='dp'."
        )
    markers = {f.name: f.marker for f in fields(exp)}
    rate_keys = [k for k in optimizer.hyper_paths if k.endswith(".learning_rate")]
    pop = population_mod.resolve(
        s.population, seed=seed, device_fields=markers, rate_keys=rate_keys
    )
    return population_mod.with_run(pop, train, seed, schedules)


def member_trees(exp, pop, rep, first: tuple) -> tuple:
    """(params, model state, RNG key) with a member axis: member i built from its seed (the
    first from the run's seed, as built already); one build repeated when seeds are equal."""
    if len(set(pop.seeds)) == 1:
        stacked = population_mod.broadcast(first, pop.size)
    else:
        built = [first] + [build_model(exp, sd, rep)[1:] for sd in pop.seeds[1:]]
        stacked = population_mod.stack(built)
    return jax.tree.map(lambda x: sharding_mod.to_sharding(x, rep), stacked)


def member_device_values(pop, layout, optimizer, values: Mapping, rep) -> DeviceValues:
    """Every Device value with a member axis (a population's own per member), and each
    member's unscheduled hyperparameters (its Device values and learning rates)."""
    per_member = []
    for i in range(pop.size):
        mine = dict(values)
        for k, v in pop.member_values(i).items():
            arr = device_array(k, v, rep)
            if np.can_cast(arr.dtype, values[k].dtype, casting="same_kind"):  # 0 for 0.0
                arr = arr.astype(values[k].dtype)
            mine[k] = arr
        for k, v in mine.items():
            if v.shape != values[k].shape or v.dtype != values[k].dtype:
                raise ConfigError(
                    f"population[{k!r}][{i}] is {v.dtype}{list(v.shape)}, but the field holds "
                    f"{values[k].dtype}{list(values[k].shape)}; give every member a value of "
                    f"the field's type and shape."
                )
        per_member.append(mine)
    stacked = {
        k: sharding_mod.to_sharding(np.stack([np.asarray(m[k]) for m in per_member]), rep)
        for k in values
    }
    return DeviceValues(stacked, population_mod.member_bases(pop, layout, optimizer, stacked))


def on_targets(tree, like):
    """A restored host tree placed like `like` (this run's shardings: a checkpoint from
    another device count or sharding lands on this run's)."""
    return jax.tree.map(lambda x, t: sharding_mod.to_sharding(x, t.sharding), tree, like)


# -- checks on the metrics the run produces -------------------------------------------------
def eval_metric_names(spec: RunSpec, ts: TrainState, device: DeviceValues, split: str):
    """The metric names validation produces (traced abstractly; nothing compiles)."""
    from jaxnitro.compile.programs import eval_metric_shapes

    names = list(eval_metric_shapes(spec, ts, split, device.extras))
    if spec.ema is not None and spec.ema.eval == "both" and split == "val":  # the raw weights'
        names += [f"val_raw_{k.removeprefix('val_')}" for k in names]
    return sorted(names)


def check_metrics(spec: RunSpec, ts, device, svc: Services, named: bool) -> None:
    """The checkpointer's and early stopping's metrics are produced by this run."""
    metric = svc.checkpointer.metric
    has_val = "val" in spec.splits
    names = eval_metric_names(spec, ts, device, "val") if has_val else []
    if not has_val and named and metric is not None:
        raise ConfigError(
            f"the checkpointer monitors {metric!r} but the data has no 'val' split, so no "
            f"metric is ever produced. Add a 'val' split, or use the default checkpointer "
            f"(keeps the newest)."
        )
    if has_val and metric not in names:
        if named:
            raise ConfigError(
                f"the checkpointer monitors {metric!r}, which this run never produces; "
                f"validation produces {names}." + did_you_mean(metric, names)
            )
        svc.checkpointer.metric = names[0] if names else metric
    es = spec.early_stop
    if es is not None:
        if not (hasattr(es, "update") and hasattr(es, "check_metric")):
            raise ConfigError(
                f"early_stop must be a jn.EarlyStopping, got {type(es).__name__}; pass "
                f"jn.EarlyStopping(metric='val_loss', patience=3)."
            )
        es.check_metric(["train_loss", *names], has_val=has_val)


# -- restore --------------------------------------------------------------------------------
_TREES = {
    "params": "the model structure (layers, widths, parameter names)",
    "model_state": "the model state (batch statistics, RNG streams)",
    "opt_state": "the optimizer state layout (param groups, optimizer rules, clipping or "
    "scheduled hyperparameters)",
    "ema": "the weight average (ema_state=True also averages the model state)",
}


def check_config(spec: RunSpec, path: Path) -> None:
    """A resume needs the same GraphConst config: report changed fields, not array shapes."""
    have = read_meta(path).get("config")
    want = jsonable(dict(graph_key(spec.experiment)))
    if have is not None and have != want:
        diff = {
            k: (have.get(k), want.get(k))
            for k in set(have) | set(want)
            if have.get(k) != want.get(k)
        }
        raise CheckpointError(
            f"cannot resume from {path}: its GraphConst config differs from this run's "
            f"(field: checkpoint → now): {diff}. Resume with the same config, or start a new "
            f"run_dir."
        )


def check_members(spec: RunSpec, path: Path, *, resume: bool) -> None:
    """A checkpoint of a population holds every member: its member count must be the run's."""
    have = read_meta(path).get("population")
    want = spec.population.size if spec.population is not None else None
    if have == want or not isinstance(have, (int, type(None))):
        return
    what = "resume from" if resume else "load the weights of"
    held = f"a population of {have} members" if have else "one model"
    runs = f"a population of {want}" if want else "one model"
    if have and resume:
        fix = f"Resume with population={have}."
    elif have:
        fix = (
            f"Load it into a population of {have}, or resume that population and take one "
            f"member with jn.member(n, i)."
        )
    else:
        fix = "Start the population in a new run_dir (its members start from their seeds)."
    raise CheckpointError(
        f"cannot {what} {path}: it holds {held}, and this run trains {runs}. {fix}"
    )


def load_trees(ts: TrainState, path: Path, *, full: bool, ema: bool = False) -> tuple[dict, dict]:
    """(trees, meta) of a checkpoint, restored onto this run's templates (with `ema`, the
    weight average too, when the checkpoint holds one)."""
    templates = {"params": ts.params, "model_state": ts.state}
    if full:
        templates["opt_state"] = ts.opt_state
    if ema and "ema" in checkpoint_meta(path)["trees"]:
        templates["ema"] = _ema_template(ts, path)
    try:
        return load_checkpoint(path, templates)
    except CheckpointError as e:
        tree = next((t for t in _TREES if f"tree '{t}' does not match" in str(e)), None)
        if tree is None:
            raise
        fix = {
            "opt_state": "Resume with the same settings, or pass checkpoint=path to load the "
            "weights only.",
            "ema": "Resume with the same ema_state, or pass checkpoint=path to load the "
            "weights only.",
        }.get(tree, "Resume with the same model.")
        raise CheckpointError(
            f"cannot {'resume' if full else 'load weights'} from {path}: {_TREES[tree]} "
            f"differs from this run's. {fix}\n{e}"
        ) from e
    except Exception as e:  # noqa: BLE001 - add which checkpoint and why
        raise CheckpointError(
            f"cannot load checkpoint {path}: {e}. Pass another checkpoint (or resume=False)."
        ) from e


def restore(spec: RunSpec, ts: TrainState, path: Path) -> tuple[TrainState, Progress, Any]:
    """Resume: the state, the progress and the schedules' horizon saved in the checkpoint."""
    check_config(spec, path)
    check_members(spec, path, resume=True)
    trees, meta = load_trees(ts, path, full=True, ema=spec.ema is not None)
    step = validate_int(meta, "step", path)
    ts = ts.replace(
        params=on_targets(trees["params"], ts.params),
        state=on_targets(trees["model_state"], ts.state),
        opt_state=on_targets(trees["opt_state"], ts.opt_state),
        # (a population keeps one step counter per member)
        step=sharding_mod.to_sharding(np.full(ts.step.shape, step, np.int32), spec.replicated),
    )
    if spec.ema is not None:  # the saved average continues; a run without one starts it here
        ts = ts.replace(ema=_restored_ema(spec, ts, trees.get("ema")))
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise CheckpointError(
            f"checkpoint {path}: meta field 'history' must be a list of rows, got "
            f"{type(history).__name__}. Resume from another checkpoint."
        )
    spe = spec.steps_per_epoch
    progress = Progress(
        step=step,
        # Every epoch takes at least one step: a larger epoch is a damaged or edited meta.
        epoch=validate_int(meta, "epoch", path, maximum=step),
        batch_in_epoch=validate_int(
            meta, "batch_in_epoch", path, default=0, maximum=spe and spe * spec.accum
        ),
        skipped_steps=validate_int(meta, "skipped_steps", path, default=0),
        history=tuple(history),
        early_stop=meta.get("early_stop"),
        data_state=_data_state(meta, path),
        epoch_loss=_epoch_loss(meta, path),
    )
    return ts, progress, meta.get("total_steps")


def _epoch_loss(meta: Mapping, path: Path) -> tuple[float, int]:
    """The saved epoch's losses so far, [sum, count] (absent in older checkpoints: (0, 0),
    so such a resume's epoch mean covers the steps after it only)."""
    value = meta.get("epoch_loss", [0.0, 0])
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], (int, float))
        and type(value[1]) is int
        and value[1] >= 0
    )
    if not ok:
        raise CheckpointError(
            f"checkpoint {path}: meta field 'epoch_loss' must be [sum, count] of the epoch's "
            f"train losses so far, got {value!r}. Resume from another checkpoint."
        )
    return float(value[0]), int(value[1])


def _data_state(meta: Mapping, path: Path) -> Mapping | None:
    state = meta.get("data_state")
    if state is not None and not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {path}: meta field 'data_state' (the data iterator's state) must be "
            f"a JSON object, got {type(state).__name__}. Resume from another checkpoint."
        )
    return state


def resume_position(path: Path | None) -> tuple[int, int, Mapping | None]:
    """(epoch, batch in epoch, iterator state) a resume continues from; (0, 0, None) fresh.
    Read before the data is checked, so the first batch looked at is the one training reads
    first (a resumed stream never reads what precedes its position)."""
    if path is None:
        return 0, 0, None
    meta = read_meta(path)
    try:
        epoch = validate_int(meta, "epoch", path)
        batch = validate_int(meta, "batch_in_epoch", path, default=0)
    except CheckpointError:
        return 0, 0, None  # restore() reports the damage with its context
    return epoch, batch, _data_state(meta, path)


def warn_replay(splits: Mapping, position: tuple[int, int, Any]) -> None:
    """A resume mid-epoch from a train source that cannot seek: say what happens, and what
    to use instead, rather than replaying silently."""
    epoch, batch, _ = position
    src = splits.get("train")
    if batch and src is not None and data_mod.replays(src):
        warn_user(
            f"resuming mid-epoch (epoch {epoch + 1}, batch {batch}) from a 'train' split of "
            f"type {type(src).__name__}, which cannot report or seek to a position: the "
            f"resume replays its first {batch} batches of the epoch (reading them again) and "
            f"trusts that every pass yields the same batches in the same order. Use "
            f"jn.DataLoader (arrays, memory maps, datasets.Dataset), a grain dataset or "
            f"grain.DataLoader, or a list of batches, which resume at the position directly.",
        )


def weights_path(path: Path) -> Path:
    """`checkpoint=`: a checkpoint directory, or a run (or checkpoints) directory, whose best
    checkpoint (by its checkpointer's metric; else the newest) is used."""
    if not path.exists():
        raise CheckpointError(
            f"checkpoint={str(path)!r} does not exist; pass a checkpoint directory or a run "
            f"directory (its best checkpoint), e.g. checkpoint='runs/MyExp'."
        )
    if (path / "meta.json").is_file() or not path.is_dir():
        return path  # a checkpoint; anything else is reported by the load
    from jaxnitro.observe.runs import checkpoint_metric

    ck_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    run_dir = ck_dir.parent if ck_dir != path else path
    metric, mode = checkpoint_metric(run_dir, None)
    ck = TopKCheckpointer(metric=metric, mode=mode, dir=ck_dir)
    ck.bind(run_dir, writer=False)
    found = ck.best() or ck.latest()
    if found is None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no meta.json), nor a directory holding "
            f"checkpoints; pass a path returned by TopKCheckpointer.save(), latest() or best(), "
            f"or a run directory."
        )
    return found


def load_weights(
    spec: RunSpec, ts: TrainState, path: Path, weights: str | None = None
) -> TrainState:
    """`checkpoint=path`: the weights (params and model state) only; a fresh optimizer.
    `weights="ema"` loads the checkpoint's weight average (None: the weights its validation
    used); an averaging run starts its own average from what was loaded."""
    check_members(spec, path, resume=False)
    meta = checkpoint_meta(path)
    has_ema = "ema" in meta["trees"]
    if weights is None:
        weights = meta["meta"].get("weights", "raw") if has_ema else "raw"
    if weights == "ema" and not has_ema:
        raise CheckpointError(
            f"weights='ema', but checkpoint {path} holds no weight average (its run trained "
            f"without ema=); pass weights='raw' (or leave it out), or a checkpoint of a run "
            f"with Nitro(ema=0.999)."
        )
    trees, _ = load_trees(ts, path, full=False, ema=weights == "ema")
    ts = ts.replace(
        params=on_targets(trees["params"], ts.params),
        state=on_targets(trees["model_state"], ts.state),
    )
    if weights == "ema":
        avg = {"params": trees["ema"]["params"], **({"state": trees["ema"]["state"]}
               if "state" in trees["ema"] else {})}  # fmt: skip
        params, state = ema_mod.as_model(avg, ts.params, ts.state)
        ts = ts.replace(params=on_targets(params, ts.params), state=on_targets(state, ts.state))
    if spec.ema is not None:
        ts = ts.replace(ema=ema_mod.init(spec.ema, ts.params, ts.state, ts.step))
    return ts


def _ema_template(ts: TrainState, path: Path) -> dict:
    """The saved average's layout: this run's when it averages, else f32 params (and model
    state, which a checkpoint of an ema_state=True run holds too)."""
    if ts.ema is not None:
        return {k: v for k, v in ts.ema.items() if k != "decay"}
    leaves = checkpoint_meta(path)["trees"]["ema"]["leaves"]
    averaged = {"params": ts.params}
    if any(leaf["path"].startswith("['state']") for leaf in leaves):
        averaged["state"] = ts.state
    return jax.eval_shape(lambda t: jax.tree.map(ema_mod.f32, t), averaged)


def _restored_ema(spec: RunSpec, ts: TrainState, saved) -> dict:
    fresh = ema_mod.init(spec.ema, ts.params, ts.state, ts.step)
    if saved is None:
        return fresh
    return {"decay": fresh["decay"], **{k: on_targets(saved[k], fresh[k]) for k in saved}}


def warn_horizon(spec: RunSpec, progress: Progress, horizon) -> None:
    if spec.schedules.fns and isinstance(horizon, int) and horizon != spec.total_steps:
        warn_user(
            f"resuming a run whose schedules spanned {horizon} steps into one of "
            f"{spec.total_steps} (max_epochs={spec.max_epochs}): the schedules are stretched "
            f"to the new length, so from step {progress.step} on the scheduled values differ "
            f"from the original run's.",
        )


def params_line(spec: RunSpec) -> dict:
    """The `params` log line: what this run is."""
    exp = spec.experiment
    return {
        "experiment": spec.cls.__name__,
        "seed": spec.seed,
        "max_epochs": spec.max_epochs,
        "n_devices": spec.n_devices,
        "backend": jax.default_backend(),
        "run_id": spec.run_id,
        "config": {f.name: jsonable(getattr(exp, f.name)) for f in fields(exp)},
        "markers": {f.name: f.marker for f in fields(exp)},
    }


# -- the sequence ---------------------------------------------------------------------------
def build(exp, s: Settings, svc: Services, named: bool, routes) -> Built:
    """Everything after the services, in the documented order."""
    resume_path = shared_resume_record(svc, s.run_dir, s.resume)
    run_id, seed = identity(resume_path, s.seed)
    run_id = distributed.broadcast("run-id", run_id)  # process 0's: one run, one id
    svc.checkpointer.for_run(run_id)
    restore_loggers(svc, resume_path)
    apply_env()
    sharding = sharding_mod.resolve(s.sharding)
    mesh = sharding_mod.make_mesh(sharding, s.n_devices)
    me = jax.process_index()
    local = tuple(d for d in mesh.devices.flat if d.process_index == me)
    dist = Dist(me, jax.process_count(), mesh.size, mesh, local, *data_share(mesh, me))
    splits = build_data(exp, s.data, dist, seed)
    position = resume_position(resume_path)
    warn_replay(splits, position)
    exp = derive(exp, splits)
    rep = replicated(mesh)
    values = {k: device_array(k, v, rep) for k, v in field_values(exp, DEVICE).items()}
    model, params, mstate, rng = build_model(exp, seed, rep)
    split_specs = check_splits(splits, routes, len(local), position)
    check_processes_agree(splits, split_specs)
    custom = check_custom_step(s, routes)
    optimizer = optim.build(exp, params, scheduled=set(s.schedules), separate=custom)
    spe = steps_per_epoch(splits, s.accum)
    schedules, total = schedules_of(s, exp, optimizer, spe)
    layout = HyperLayout.build(optimizer, values, schedules)
    pop = population_of(s, exp, seed, optimizer, splits["train"], schedules)
    resident, device_batches = resident_data(s, splits, split_specs, mesh, dist, pop)
    if s.weights is not None and s.checkpoint is None:
        raise ConfigError(
            f"weights={s.weights!r} without checkpoint=; weights picks which weights a "
            f"checkpoint loads. Pass checkpoint='runs/...' with it, or drop weights."
        )
    decided = {  # the options setup turns into something else; the rest are kept as they are
        "seed": seed,
        "run_dir": s.run_dir,
        "log_grad_norm": grad_norm_setting(s.log_grad_norm, optimizer) and not custom,
        "sharding": sharding,
        "remat": remat.plan(s.remat, s.remat_policy, model, params, mstate),
        "population": pop,
        "schedules": schedules,
        "ema": ema_mod.setting(s.ema, s.ema_warmup, s.ema_every, s.ema_state, s.ema_eval),
    }
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
        direct_feed=(
            mesh.size == 1 and mesh.devices.flat[0].platform == "cpu" and dist.process_count == 1
        ),
        optimizer=optimizer,
        hyper=layout,
        steps_per_epoch=spe,
        total_steps=total,
        run_id=run_id,
        resume_path=resume_path,
        resident=resident,
        device_batches=device_batches,
        **decided,
        **_options(s, decided),
    )
    if pop is None:
        device = DeviceValues(values, layout.base(optimizer, values))
        shardings = sharding_mod.param_shardings(params, sharding, mesh)
        ts = initial_state(model, params, mstate, optimizer.tx, rng, rep, shardings)
    else:
        device = member_device_values(pop, layout, optimizer, values, rep)
        params, mstate, rng = member_trees(exp, pop, rep, (params, mstate, rng))
        ts = initial_state(model, params, mstate, optimizer.tx, rng, rep, members=pop.size)
        if isinstance(spec.early_stop, EarlyStopping):  # each member stops on its own metric
            stopping = population_mod.MemberStopping(spec.early_stop, pop.size)
            spec = spec.replace(early_stop=stopping)
            active = sharding_mod.to_sharding(stopping.active(), rep)
            device = dataclasses.replace(device, active=active)
    if spec.ema is not None:  # placed and sharded as the params (their copy, in f32)
        ts = ts.replace(ema=ema_mod.init(spec.ema, ts.params, ts.state, ts.step))
    sharding_mod.check_fsdp(ts.params, sharding, mesh.size)
    check_metrics(spec, ts, device, svc, named)
    return _restored(spec, ts, device, s)


def _options(s: Settings, decided: Mapping[str, Any]) -> dict[str, Any]:
    """The options a RunSpec keeps as validated: its fields named like an option that setup
    has not `decided` (steps_per_call='auto' starts at 1; the first train measures and picks,
    `compile/autotune.py`)."""
    kept = {f.name for f in dataclasses.fields(RunSpec)} & set(options.NAMES)
    out = {k: getattr(s, k) for k in kept - set(decided)}
    if s.steps_per_call == "auto":
        out.update(steps_per_call=1, autotune=True)
    return out


def _restored(spec: RunSpec, ts: TrainState, device: DeviceValues, s: Settings) -> Built:
    progress = Progress()
    if spec.resume_path is not None:
        ts, progress, horizon = restore(spec, ts, spec.resume_path)
        spec = spec.replace(resumed_total_steps=horizon)
        warn_horizon(spec, progress, horizon)
    elif s.checkpoint is not None:
        path = weights_path(Path(s.checkpoint).absolute())
        ts = load_weights(spec, ts, path, s.weights)
        spec = spec.replace(weights_path=path)
    if spec.early_stop is not None and progress.early_stop is not None:
        spec.early_stop.load_state_dict(progress.early_stop)
        if device.active is not None:  # the members that had stopped stay frozen
            active = sharding_mod.to_sharding(spec.early_stop.active(), spec.replicated)
            device = dataclasses.replace(device, active=active)
    return Built(spec, ts, progress, device)
