"""`Nitro(exp, ...)`: setup only. Validates everything it can before anything compiles.

Setup order (fixed): settings → resume record → data → derive → mesh and Device values →
model → routing checks on the first batches → optimizer → checkpointer and metric checks →
restore → logger. Programs compile lazily on the first batch (`programs.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import data as data_mod
from . import hooks, optim, signals
from .checkpoint import TopKCheckpointer, load_checkpoint, read_manifest, validate_int
from .checkpoint import _read_meta as checkpoint_meta
from .devices import apply_env, make_mesh, replicated
from .errors import (
    CheckpointError,
    ConfigArgumentError,
    ConfigError,
    DataError,
    HookError,
    check_int,
    did_you_mean,
)
from .experiment import DEVICE, field_values, fields, graph_key, is_experiment, replace
from .jsonable import jsonable as _jsonable
from .loggers import JSONLogger, make_logger
from .programs import ProgramSet
from .progress import Display
from .runlock import RunLock
from .services import Services, check_resumable, make_checkpointer
from .step import Carry


@dataclasses.dataclass(frozen=True)
class Dist:
    """What `build_data(self, dist)` learns about the run, so each process loads its shard."""

    process_index: int
    process_count: int
    n_devices: int
    mesh: Any


_SETTINGS = ("seed", "run_dir", "n_devices", "max_epochs", "logger", "checkpointer", "early_stop")


class Nitro:
    """The handle of one run. `Nitro(exp, ...)` runs setup only; see `jn.train`.

    Example:
        >>> n = jn.Nitro(MnistMLP(), checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"))
        >>> result = jn.train(n)
    """

    def __init__(
        self,
        exp,
        *,
        seed: int | None = None,
        run_dir=None,
        n_devices: int | None = None,
        accum: int = 1,
        steps_per_call: int = 1,
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
        **unknown,
    ):
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
        settings = {k: v for k, v in locals().items() if k not in ("self", "exp", "unknown")}
        with signals.terminate_during_setup():
            try:
                self._setup(exp, **settings)
            except signals.SetupTerminated:
                self._log_terminated(exp, logger, run_dir)
                raise SystemExit(143) from None

    def _log_terminated(self, exp, logger, run_dir) -> None:
        """SIGTERM during setup: a `finish` line (status preempted) if the run dir is free."""
        with contextlib.suppress(Exception):
            services = getattr(self, "services", None)
            log = (
                services.logger
                if services is not None
                else _make_logger(logger if logger is not None else getattr(exp, "logger", None))
            )
            path = getattr(self, "run_dir", None) or _run_dir_setting(
                run_dir if run_dir is not None else getattr(exp, "run_dir", None),
                type(exp).__name__,
            )
            lock = RunLock(path)
            if lock.try_acquire("setup"):
                try:
                    log.open(path, resume=True)
                    log.finish("preempted", phase="setup", step=getattr(self, "host_step", 0))
                    log.close()
                finally:
                    lock.release()

    def _setup(
        self,
        exp,
        *,
        seed,
        run_dir,
        n_devices,
        accum,
        steps_per_call,
        max_epochs,
        schedules,
        precision,
        logger,
        checkpointer,
        early_stop,
        resume,
        checkpoint,
        data,
        memory_budget,
        compile_options,
        progress,
        on_nonfinite,
        val_every,
        checkpoint_every,
        checkpoint_every_minutes,
        log_grad_norm,
    ) -> None:
        cls = type(exp)
        self.routes = hooks.check_hooks(cls)
        given = {
            "seed": seed,
            "run_dir": run_dir,
            "n_devices": n_devices,
            "max_epochs": max_epochs,
            "logger": logger,
            "checkpointer": checkpointer,
            "early_stop": early_stop,
        }
        # A keyword wins over an experiment field of the same name, which wins over the default.
        s = {k: (v if v is not None else getattr(exp, k, None)) for k, v in given.items()}
        self.seed = 42 if s["seed"] is None else _int_setting("seed", s["seed"], minimum=0)
        self.max_epochs = (
            1 if s["max_epochs"] is None else _int_setting("max_epochs", s["max_epochs"], minimum=1)
        )
        self.run_dir = _run_dir_setting(s["run_dir"], cls.__name__)
        self.accum = _int_setting("accum", accum, minimum=1)
        self.steps_per_call = _int_setting("steps_per_call", steps_per_call, minimum=1)
        self.precision = _choice(
            "precision",
            precision or "f32",
            {"f32": "the default", "bf16": "bf16 compute, f32 master weights and optimizer state"},
        )
        # Nitro(schedules=...) replaces the experiment's schedules() table; it does not merge.
        self._schedule_table = dict(
            schedules
            if schedules is not None
            else (exp.schedules() if hasattr(cls, "schedules") else {}) or {}
        )
        self.memory_budget = _bytes_setting("memory_budget", memory_budget)
        self.compile_options = _compile_options_setting(compile_options)
        self.on_nonfinite = _choice(
            "on_nonfinite",
            on_nonfinite,
            {"error": "stop with the step and epoch", "skip": "skip the update and count it"},
        )
        # Step-based validation and checkpoints, for runs whose epochs are long.
        self.val_every = _optional_int("val_every", val_every)
        self.checkpoint_every = _optional_int("checkpoint_every", checkpoint_every)
        self.checkpoint_every_minutes = _minutes_setting(checkpoint_every_minutes)
        self.skipped_steps = 0
        self.preempted = False
        display = Display(_progress_setting(progress))
        self.phase = "Starting"
        self.stop_requested = False
        self.history_rows: list[dict] = []
        self.program_set = ProgramSet()
        self.epoch_lengths: dict[str, int] = {}  # batches seen in epoch 1 (a source without len)
        self._hyper_cache: dict | None = None

        # Run directory first: an unusable one fails before any work.
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(
                f"run_dir {self.run_dir} is a file; give a directory path (run_dir='runs/x')."
            )
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create run_dir {self.run_dir}: {e}. Pick a writable path."
            ) from e

        checkpointer, self._checkpointer_named = make_checkpointer(
            s["checkpointer"], default=TopKCheckpointer
        )
        check_resumable(checkpointer, resume)
        # Setup never writes the run's files: the run lock (one writer per run dir) is taken
        # by `jn.train` and by an evaluation that logs. Only finding the checkpoint to resume
        # from takes it briefly, since that may move a corrupted checkpoint aside.
        self.services = Services(
            logger=_make_logger(s["logger"]),
            checkpointer=checkpointer,
            display=display,
            lock=RunLock(self.run_dir),
            run_dir=self.run_dir,
            params_line={},
        )
        self.checkpointer.bind(self.run_dir, writer=False)
        self.resume_path = self._resume_record(resume)
        self.services.resume_path = self.resume_path
        self.run_id = uuid.uuid4().hex[:12]
        if self.resume_path is not None:
            meta = _read_meta(self.resume_path)
            self.run_id = _resumed_run_id(meta, self.run_id)
            if meta.get("seed") is not None and meta["seed"] != self.seed:
                warnings.warn(
                    f"resuming with seed {meta['seed']} from the checkpoint instead of "
                    f"{self.seed}: the shuffle order and dropout must continue as they were.",
                    stacklevel=4,
                )
                self.seed = validate_int(meta, "seed", self.resume_path)
        self.checkpointer.for_run(self.run_id)

        # Data, then derived values (e.g. class weights) assigned to existing fields.
        apply_env()
        self.mesh = make_mesh(s["n_devices"])
        self.n_devices = self.mesh.size
        self.dist = Dist(jax.process_index(), jax.process_count(), self.n_devices, self.mesh)
        self.splits = self._build_data(exp, data)
        exp = self._derive(exp)
        self.experiment = exp
        self.cls = cls

        self._rep = replicated(self.mesh)
        # One CPU device: programs take numpy batches directly (no transfer to make).
        self.direct_feed = self.n_devices == 1 and self.mesh.devices.flat[0].platform == "cpu"
        self.batch_sharding = data_mod.batch_sharding(self.mesh)
        self.device_values = {
            k: self._device_value(k, v) for k, v in field_values(exp, DEVICE).items()
        }

        # Model.
        init_key, rng = jax.random.split(jax.random.PRNGKey(self.seed))
        self.rng = jax.device_put(rng, replicated(self.mesh))
        built = exp.build_model(init_key)
        if not (isinstance(built, tuple) and len(built) == 3):
            raise HookError(
                f"{cls.__name__}.build_model must return (model, params, state), got "
                f"{type(built).__name__}. Wrap your module: return jn.split_model(module)."
            )
        self.model = built[0]
        params = self._replicate(built[1])
        model_state = self._replicate(built[2] if built[2] is not None else {})

        self.batch_info = self._check_splits()

        # Optimizer: param groups, decay, clipping; schedules resolved against total steps.
        self.optimizer = optim.build(exp, params, scheduled=set(self._schedule_table))
        self.tx = self.optimizer.tx
        # The gradient norm per step costs a pass over the gradients (~15% of a small MLP's
        # step on CPU): logged when clipping computes it anyway, or when asked for.
        if log_grad_norm not in (None, True, False):
            raise ConfigError(
                f"log_grad_norm={log_grad_norm!r}; use True, False or None "
                f"(the default: on when gradient_clip_norm is set)."
            )
        self.log_grad_norm = self.optimizer.clip > 0 if log_grad_norm is None else log_grad_norm
        self.steps_per_epoch = self._steps_per_epoch()
        self.total_steps = (self.steps_per_epoch or 0) * self.max_epochs
        if self._schedule_table and not self.steps_per_epoch:
            raise ConfigError(
                "schedules need the number of steps per epoch, but the 'train' "
                "split has no len(); use a jn.DataLoader or give it __len__."
            )
        markers = {f.name: f.marker for f in fields(exp)}
        self.schedules = optim.resolve_schedules(
            self._schedule_table,
            opt=self.optimizer,
            device_fields=markers,
            total_steps=max(self.total_steps, 1),
        )
        # Scalar float Device fields travel with the per-step hyperparameters, scheduled or
        # not, so scheduling one (or not) never changes the program.
        self.hyper_keys = [("opt", k) for k in sorted(self.optimizer.hyper_paths)] + [
            ("device", k)
            for k, v in self.device_values.items()
            if v.shape == () and jnp.issubdtype(v.dtype, jnp.floating)
        ]
        for key in self.schedules.fns:
            if key.startswith("device.") and ("device", key[7:]) not in self.hyper_keys:
                raise ConfigError(
                    f"schedule {key!r}: only scalar float Device fields can be scheduled."
                )
        opt_state = jax.jit(self.tx.init, out_shardings=self._rep)(params)
        # Every leaf of the carry lives replicated on the mesh, as the train step returns it,
        # so the program's input avals (and key) are the same at step 1 and step N.
        self.carry = jax.device_put(
            Carry(params, model_state, opt_state, jnp.zeros((), jnp.int32)), self._rep
        )
        self.epoch = 0
        self.batch_in_epoch = 0
        self.host_step = 0
        self._early_stop_state = None

        self._check_checkpoint_metric()
        if self.resume_path is not None:
            self._restore(self.resume_path, full=True)
            horizon = self.resumed_total_steps
            if self.schedules.fns and isinstance(horizon, int) and horizon != self.total_steps:
                warnings.warn(
                    f"resuming a run whose schedules spanned {horizon} steps into one of "
                    f"{self.total_steps} (max_epochs={self.max_epochs}): the schedules are "
                    f"stretched to the new length, so from step {self.host_step} on the "
                    f"scheduled values differ from the original run's.",
                    stacklevel=4,
                )
        elif checkpoint is not None:
            self._restore(Path(checkpoint).absolute(), full=False)

        self.services.params_line = {
            "experiment": cls.__name__,
            "seed": self.seed,
            "max_epochs": self.max_epochs,
            "n_devices": self.n_devices,
            "backend": jax.default_backend(),
            "run_id": self.run_id,
            "config": {f.name: _jsonable(getattr(exp, f.name)) for f in fields(exp)},
            "markers": {f.name: f.marker for f in fields(exp)},
        }
        self.early_stop = s["early_stop"]
        if self.early_stop is not None:
            self._check_early_stop()
            if self._early_stop_state is not None:
                self.early_stop.load_state_dict(self._early_stop_state)

    # -- handle attributes -------------------------------------------------------------
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
    def carry(self) -> Carry:
        """All training state as one pytree (rebuilt from the flat leaves the step takes)."""
        return jax.tree.unflatten(self._carry_def, self._leaves)

    @carry.setter
    def carry(self, value: Carry) -> None:
        # The train program takes the carry as a flat list of arrays: flattening NNX states
        # and optax NamedTuples on every call would cost more than the step on small models.
        self._leaves, self._carry_def = jax.tree.flatten(value)

    @property
    def params(self):
        return self.carry.params

    @property
    def state(self):
        return self.carry.model_state

    @property
    def opt_state(self):
        return self.carry.opt_state

    @property
    def step(self) -> int:
        # Counted on the host: reading carry.step would wait for the newest dispatched step.
        return self.host_step

    def __repr__(self) -> str:
        return (
            f"Nitro({type(self.experiment).__name__}, step={self.step}, epoch={self.epoch}, "
            f"phase={self.phase}, run_dir='{self.run_dir}')"
        )

    # -- setup pieces ------------------------------------------------------------------
    def _resume_record(self, resume) -> Path | None:
        if resume in (False, None):
            return None
        if resume in (True, "auto"):
            # The newest checkpoint that verifies: a truncated or corrupted newest one (a kill
            # mid-write on a filesystem without atomic rename) is reported and moved aside,
            # which writes: a run that another writer holds cannot be resumed now.
            self.services.lock.acquire("resume", what=f"run_dir {self.run_dir}")
            try:
                self.checkpointer.bind(self.run_dir, writer=True)
                latest = self.checkpointer.latest_valid()
            finally:
                self.services.lock.release()
            if latest is None and resume is True:
                raise CheckpointError(
                    f"resume=True but {self.checkpointer.dir} holds no checkpoint. Use "
                    f"resume='auto' to start fresh when there is none."
                )
            return latest
        if not isinstance(resume, (str, os.PathLike)):
            raise ConfigError(
                f"resume={resume!r}; use False, 'auto' (continue from the newest "
                f"checkpoint in run_dir if any), True (it must exist) or a "
                f"checkpoint path."
            )
        path = Path(resume).absolute()
        if not path.exists():
            raise CheckpointError(
                f"resume={resume!r}: no such checkpoint. Pass a checkpoint directory (e.g. "
                f"TopKCheckpointer(dir=...).latest()), or resume='auto' to continue from the "
                f"newest one in run_dir."
            )
        return path

    def _build_data(self, exp, data) -> dict[str, Any]:
        splits = data if data is not None else exp.build_data(self.dist)
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
                src.seed = self.seed  # the Nitro seed controls shuffling
        return splits

    def _derive(self, exp):
        derive = getattr(type(exp), "derive", None)
        if derive is None:
            return exp
        updates = derive(exp, self.splits) or {}
        if not isinstance(updates, Mapping):
            raise HookError(
                f"derive must return a dict field -> value, got {type(updates).__name__}."
            )
        return replace(exp, **updates)

    def _device_value(self, name: str, value) -> jax.Array:
        # Strongly typed: a Python float would be weak and could retrace on a change of type.
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64:
            arr = arr.astype(np.int32)
        elif arr.dtype.kind not in "biuf":
            raise ConfigError(f"Device field {name!r} holds {value!r}, which is not numeric.")
        return jax.device_put(arr, self._rep)

    def _replicate(self, tree):
        return jax.tree.map(
            lambda x: (
                jax.device_put(x, self._rep, may_alias=False)
                if isinstance(x, (jax.Array, np.ndarray))
                else x
            ),
            tree,
        )

    def _check_splits(self) -> dict[str, dict]:
        """Route every split's first batch through the hooks; check sizes and devices."""
        info = {}
        for split, src in self.splits.items():
            # Peek once: every later use of the first batch (programs, memory plan) reads it
            # from batch_info, so a source is iterated by setup exactly once.
            it = iter(src)
            if it is iter(src):
                raise DataError(
                    f"split {split!r} ({type(src).__name__}) returns the same iterator each "
                    f"time it is iterated, so it would be empty after the first epoch. Make "
                    f"__iter__ start a new pass (e.g. a generator function), or pass a "
                    f"jn.DataLoader or a list of batches."
                )
            first = next(it, None)
            close = getattr(it, "close", None)
            if close is not None:
                close()
            if first is None:
                raise DataError(
                    f"split {split!r} is empty (it yielded no batch). Remove the "
                    f"split, or check what build_data loads."
                )
            bs = data_mod.check_batch(first, split)
            train = split == "train"
            needed = (
                ("forward", "loss", "train_metrics") if train else ("forward", "loss", "metrics")
            )
            hooks.check_batch(
                self.routes, first, split, hooks=needed if train else ("forward", "metrics")
            )
            loss_ok = all(f in first for f in self.routes["loss"].required)
            use = needed if loss_ok else ("forward", "metrics")
            fields = hooks.device_fields(self.routes, first, hooks=use)
            if train and isinstance(src, data_mod.DataLoader) and src.ragged:
                raise DataError(
                    f"the 'train' split has {src.num_samples} samples, which batch_size="
                    f"{src.batch_size} does not divide: the last train batch would be short "
                    f"({src.num_samples % src.batch_size}) and need its own program. Pass "
                    f"drop_last=True to the train DataLoader."
                )
            if bs % self.n_devices:
                raise DataError(
                    f"the {split!r} batch size {bs} does not divide by the {self.n_devices} "
                    f"devices of the data mesh. Use a batch size that is a multiple of "
                    f"{self.n_devices}."
                )
            info[split] = {
                "batch_size": bs,
                "fields": fields,
                "keys": frozenset(first),
                "has_loss": loss_ok,
                "first": first,
                "specs": data_mod.batch_specs(first, split),
            }
        if "train" in info:  # every split feeds the same model: the same per-sample fields
            for split, sinfo in info.items():
                if split != "train":
                    data_mod.check_same_specs(sinfo["specs"], info["train"]["specs"], split)
        return info

    def _steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch; `accum` must divide the batches of an epoch."""
        loader = self.splits.get("train")
        if loader is None or not hasattr(loader, "__len__"):
            return None
        batches = len(loader)
        if batches % self.accum:
            near = sorted(
                {d for d in range(1, batches + 1) if batches % d == 0},
                key=lambda d: (abs(d - self.accum), d),
            )[:3]
            raise ConfigError(
                f"accum={self.accum} does not divide the {batches} train batches of an epoch, "
                f"so the last optimizer step would be short. Use accum in {sorted(near)}, or "
                f"change the batch size or the number of samples (drop_last=True drops a "
                f"final partial batch)."
            )
        return batches // self.accum

    def hyper_values(self, step: int) -> np.ndarray:
        """The packed per-step vector (learning rates, decays, scalar Device values) for `step`."""
        scheduled = self.schedules.values(step) if self.schedules.fns else {}
        base = self._hyper_base
        out = np.empty(len(self.hyper_keys), np.float32)
        for i, (kind, key) in enumerate(self.hyper_keys):
            full = key if kind == "opt" else f"device.{key}"
            out[i] = scheduled[full] if full in scheduled else base[full]
        return out

    @property
    def _hyper_base(self) -> dict[str, np.float32]:
        """Unscheduled values; cached (reading Device values back each step would sync)."""
        cached = self._hyper_cache
        if cached is None:
            cached = dict(optim.host_hyper(self.optimizer))
            for kind, key in self.hyper_keys:
                if kind == "device":
                    cached[f"device.{key}"] = np.float32(np.asarray(self.device_values[key]))
            self._hyper_cache = cached
        return cached

    def invalidate_hyper(self) -> None:
        """Device values changed (`jn.set_device`): rebuild the unscheduled values."""
        self._hyper_cache = None

    def unpack_hyper(self, vec) -> dict:
        """Inside the traced step: the packed vector back into {"opt": ..., "device": ...}."""
        out: dict = {"opt": {}, "device": {}}
        for i, (kind, key) in enumerate(self.hyper_keys):
            v = vec[i]
            if kind == "device":
                v = v.astype(self.device_values[key].dtype)
            out[kind][key] = v
        return out

    def eval_metric_names(self, split: str) -> list[str]:
        """The metric names validation produces (traced abstractly; nothing compiles)."""
        from .programs import eval_metric_shapes

        return sorted(eval_metric_shapes(self, split))

    def _check_checkpoint_metric(self) -> None:
        metric = self.checkpointer.metric
        if "val" not in self.splits:
            if self._checkpointer_named and metric is not None:
                raise ConfigError(
                    f"the checkpointer monitors {metric!r} but the data has no 'val' split, so "
                    f"no metric is ever produced. Add a 'val' split, or use the default "
                    f"checkpointer (keeps the newest)."
                )
            return
        names = self.eval_metric_names("val")
        if metric not in names:
            if self._checkpointer_named:
                raise ConfigError(
                    f"the checkpointer monitors {metric!r}, which this run never produces; "
                    f"validation produces {names}." + did_you_mean(metric, names)
                )
            self.checkpointer.metric = names[0] if names else metric

    def _check_early_stop(self) -> None:
        es = self.early_stop
        assert es is not None  # called only when one was given
        if not (hasattr(es, "update") and hasattr(es, "metric")):
            raise ConfigError(f"early_stop must be a jn.EarlyStopping, got {type(es).__name__}.")
        produced = ["train_loss"] + (self.eval_metric_names("val") if "val" in self.splits else [])
        if es.metric not in produced:
            raise ConfigError(
                f"early stopping monitors {es.metric!r}, which this run never produces; it "
                f"produces {produced}."
                + did_you_mean(es.metric, produced)
                + ("" if "val" in self.splits else " Add a 'val' split for validation metrics.")
            )

    def _restore(self, path: Path, *, full: bool) -> None:
        templates = {"params": self.carry.params, "model_state": self.carry.model_state}
        if full:
            templates["opt_state"] = self.carry.opt_state
            # The config check reads meta.json only: report changed fields, not array shapes.
            meta = _read_meta(path)
            want = _jsonable(dict(graph_key(self.experiment)))
            have = meta.get("config")
            if have is not None and have != want:
                diff = {
                    k: (have.get(k), want.get(k))
                    for k in set(have) | set(want)
                    if have.get(k) != want.get(k)
                }
                raise CheckpointError(
                    f"cannot resume from {path}: its GraphConst config differs from this run's "
                    f"(field: checkpoint → now): {diff}. Resume with the same config, or start "
                    f"a new run_dir."
                )
        try:
            trees, meta = load_checkpoint(path, templates)
        except CheckpointError as e:
            what = {
                "params": "the model structure (layers, widths, parameter names)",
                "model_state": "the model state (batch statistics, RNG streams)",
                "opt_state": "the optimizer state layout (param groups, optimizer rules, "
                "clipping or scheduled hyperparameters)",
            }
            tree = next((t for t in what if f"tree '{t}' does not match" in str(e)), None)
            if tree is None:
                raise
            fix = (
                "Resume with the same settings, or pass checkpoint=path to load the weights only."
                if tree == "opt_state"
                else "Resume with the same model."
            )
            raise CheckpointError(
                f"cannot {'resume' if full else 'load weights'} from {path}: "
                f"{what[tree]} differs from this run's. {fix}\n{e}"
            ) from e
        except Exception as e:  # noqa: BLE001 - add which checkpoint and why
            raise CheckpointError(f"cannot load checkpoint {path}: {e}") from e
        params = self._replicate(trees["params"])
        mstate = self._replicate(trees["model_state"])
        if full:
            self.carry = jax.device_put(
                Carry(params, mstate, trees["opt_state"], jnp.asarray(meta["step"], jnp.int32)),
                self._rep,
            )
            self.host_step = validate_int(meta, "step", path)
            # Every epoch takes at least one step: a larger epoch is a damaged or edited meta.
            self.epoch = validate_int(meta, "epoch", path, maximum=self.host_step)
            self.batch_in_epoch = validate_int(
                meta,
                "batch_in_epoch",
                path,
                default=0,
                maximum=self.steps_per_epoch and self.steps_per_epoch * self.accum,
            )
            self.skipped_steps = validate_int(meta, "skipped_steps", path, default=0)
            history = meta.get("history", [])
            if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
                raise CheckpointError(
                    f"checkpoint {path}: meta field 'history' must be a list "
                    f"of rows, got {type(history).__name__}."
                )
            self.history_rows = list(history)
            self._early_stop_state = meta.get("early_stop")
            self.resumed_total_steps = meta.get("total_steps")
        else:
            self.carry = self.carry._replace(params=params, model_state=mstate)

    # -- traced pieces -----------------------------------------------------------------
    def extras(self) -> dict:
        return {"device": dict(self.device_values), "rng": self.rng}


def _read_meta(path: Path) -> dict:
    """The user meta of a checkpoint, read without its arrays (errors name what is wrong)."""
    full = checkpoint_meta(Path(path))
    return full.get("meta", full)


def _resumed_run_id(meta: dict, fallback: str) -> str:
    run_id = meta.get("run_id")
    return (
        run_id
        if isinstance(run_id, str) and re.fullmatch(r"[0-9a-zA-Z_-]{1,64}", run_id)
        else fallback
    )


def _run_dir_setting(value, default_name: str) -> Path:
    if value is None:
        return Path("runs") / default_name
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"run_dir must be a path (str or pathlib.Path), got "
            f"{type(value).__name__} {value!r}; e.g. run_dir='runs/{default_name}'."
        )
    if not str(os.fspath(value)).strip():
        raise ConfigError(
            f"run_dir is empty; pass a directory, e.g. run_dir='runs/{default_name}' "
            f"(or leave it out for that default)."
        )
    return Path(value)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _bytes_setting(name: str, value) -> int | None:
    """Bytes as an int, or a string such as "1GB", "512MiB", "1.5 GiB"."""
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size; pass bytes as an int or a "
                f"string like '1GB' or '512MiB' (units: B, KB, MB, GB, TB, KiB, "
                f"MiB, GiB, TiB)."
            )
        value = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(value):
            raise ConfigError(f"{name} is not finite.")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(
            f"{name} must be a positive number of bytes (or '1GB', '512MiB'), got {value!r}."
        )
    return int(value)


def _choice(name: str, value, options: dict[str, str]) -> str:
    if value not in options:
        listed = " or ".join(f"{k!r} ({why})" for k, why in options.items())
        raise ConfigError(f"{name}={value!r}; use {listed}." + did_you_mean(str(value), options))
    return value


def _optional_int(name: str, value) -> int | None:
    return None if value is None else _int_setting(name, value, minimum=1)


def _minutes_setting(value) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ConfigError(
            f"checkpoint_every_minutes must be a number > 0, got {value!r}; e.g. "
            f"checkpoint_every_minutes=30."
        )
    return value


def _progress_setting(value):
    if value not in (None, True, False, "rich", "plain", "off"):
        raise ConfigError(
            f"progress={value!r}; use True (a live display on a terminal, plain lines "
            f"otherwise), 'rich', 'plain' or False/'off'."
            + did_you_mean(str(value), ["rich", "plain", "off"])
        )
    return value


def _compile_options_setting(value) -> dict:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(
            f"compile_options must be a dict of XLA options, got {type(value).__name__}; e.g. "
            f"{{'xla_cpu_enable_fast_math': False}}."
        )
    options = dict(value or {})
    for k, v in options.items():  # XLA flags: name -> bool/int/float/str
        if not isinstance(k, str) or not isinstance(v, (bool, int, float, str)):
            raise ConfigError(
                f"compile_options maps XLA option names to bool, int, float or str, got "
                f"{k!r}: {v!r}; e.g. {{'xla_cpu_enable_fast_math': False}}."
            )
    return options


def _make_logger(value):
    return make_logger(value, JSONLogger)


def _int_setting(name: str, value, *, minimum: int) -> int:
    return check_int(
        name, value, minimum=minimum, fix=f"pass a whole number, e.g. {name}={max(minimum, 1)}"
    )


__all__ = ["Nitro", "Dist", "read_manifest"]
