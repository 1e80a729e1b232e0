"""The options of `jn.Nitro(...)`, validated into one frozen `Settings`.

A keyword wins over an experiment field of the same name (`seed`, `run_dir`, `max_epochs`,
`logger`, `checkpointer`, `early_stop`), which wins over the default. Every bad value is a
`ConfigError` that names the option, what it got, and a value that works.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, check_int, did_you_mean

# Options that may also come from an experiment field of the same name.
_FROM_EXPERIMENT = (
    "seed",
    "run_dir",
    "n_devices",
    "max_epochs",
    "logger",
    "checkpointer",
    "early_stop",
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every option of `jn.Nitro(...)`, validated (services and data are built from these)."""

    seed: int
    run_dir: Path
    n_devices: int | None
    max_epochs: int
    accum: int
    steps_per_call: int | str  # or "auto": measured at the first train (autotune.py)
    precision: str
    schedules: Mapping[str, Any]
    memory_budget: int | None
    compile_options: Mapping[str, Any]
    on_nonfinite: str
    val_every: int | None
    checkpoint_every: int | None
    checkpoint_every_minutes: float | None
    progress: Any
    sharding: Any
    remat: tuple[str, ...]
    remat_policy: str
    log_grad_norm: bool | None
    logger: Any
    checkpointer: Any
    early_stop: Any
    resume: Any
    checkpoint: Any
    data: Any
    population: Any = None  # None, a member count, or {field: [per-member values]}
    data_on_device: bool | None = None  # None: when the train arrays fit (see setup)
    ema: Any = None  # ema.Ema: weight averaging, or None (off)
    weights: str | None = None  # checkpoint= loads these: "ema", "raw", None (as validated)


def settings(exp, given: Mapping[str, Any]) -> Settings:
    """Validate the keywords of `jn.Nitro(exp, **given)` against the experiment's fields."""
    cls = type(exp)
    s = {
        k: (given[k] if given.get(k) is not None else getattr(exp, k, None))
        for k in _FROM_EXPERIMENT
    }
    table = given.get("schedules")
    if table is None:  # Nitro(schedules=...) replaces the experiment's table; it does not merge
        table = (exp.schedules() if hasattr(cls, "schedules") else {}) or {}
    return Settings(
        seed=42 if s["seed"] is None else _int_setting("seed", s["seed"], minimum=0),
        run_dir=_run_dir_setting(s["run_dir"], cls.__name__),
        n_devices=s["n_devices"],
        max_epochs=1
        if s["max_epochs"] is None
        else _int_setting("max_epochs", s["max_epochs"], minimum=1),
        accum=_int_setting("accum", given.get("accum", 1), minimum=1),
        steps_per_call=_steps_per_call_setting(given.get("steps_per_call", 1)),
        precision=_choice(
            "precision",
            given.get("precision") or "f32",
            {"f32": "the default", "bf16": "bf16 compute, f32 master weights and optimizer state"},
        ),
        schedules=dict(table),
        memory_budget=_bytes_setting("memory_budget", given.get("memory_budget")),
        compile_options=_compile_options_setting(given.get("compile_options")),
        on_nonfinite=_choice(
            "on_nonfinite",
            given.get("on_nonfinite", "error"),
            {"error": "stop with the step and epoch", "skip": "skip the update and count it"},
        ),
        val_every=_optional_int("val_every", given.get("val_every")),
        checkpoint_every=_optional_int("checkpoint_every", given.get("checkpoint_every")),
        checkpoint_every_minutes=_minutes_setting(given.get("checkpoint_every_minutes")),
        progress=_progress_setting(given.get("progress")),
        sharding=_sharding_setting(given.get("sharding")),
        **_remat_setting(given.get("remat"), given.get("remat_policy", "full")),
        log_grad_norm=given.get("log_grad_norm"),
        logger=s["logger"],
        checkpointer=s["checkpointer"],
        early_stop=s["early_stop"],
        resume=given.get("resume", False),
        checkpoint=given.get("checkpoint"),
        data=given.get("data"),
        population=_population_setting(given.get("population")),
        data_on_device=_data_on_device_setting(given.get("data_on_device")),
        ema=_ema_setting(given),
        weights=_weights_setting(given.get("weights"), given.get("checkpoint")),
    )


def _ema_setting(given: Mapping[str, Any]):
    from .ema import setting

    return setting(
        given.get("ema"),
        given.get("ema_warmup"),
        given.get("ema_every"),
        given.get("ema_state"),
        given.get("ema_eval"),
    )


def _weights_setting(value, checkpoint):
    from .ema import weights_setting

    if value is not None and checkpoint is None:
        raise ConfigError(
            f"weights={value!r} without checkpoint=; weights picks which weights a checkpoint "
            f"loads. Pass checkpoint='runs/...' with it, or drop weights."
        )
    return weights_setting(value)


def _steps_per_call_setting(value) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, str):
        raise ConfigError(
            f"steps_per_call={value!r}; pass a number of optimizer steps per dispatch (e.g. "
            f"steps_per_call=8) or 'auto' (measured at the first train)."
        )
    return _int_setting("steps_per_call", value, minimum=1)


def _data_on_device_setting(value):
    if value not in (None, True, False):
        raise ConfigError(
            f"data_on_device={value!r}; use None (the default: keep the train arrays on the "
            f"device when they fit), True (require it) or False (send each batch)."
        )
    return value


def _population_setting(value):
    from .population import check_setting

    return check_setting(value)


def _sharding_setting(value):
    from .sharding import resolve

    return resolve(value)


def _remat_setting(blocks, policy) -> dict:
    from .remat import check

    names, policy = check(blocks, policy)
    return {"remat": names, "remat_policy": policy}


def max_epochs(value) -> int:
    """A new `max_epochs` for a live handle (to train further)."""
    return _int_setting("max_epochs", value, minimum=1)


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


def _int_setting(name: str, value, *, minimum: int) -> int:
    return check_int(
        name, value, minimum=minimum, fix=f"pass a whole number, e.g. {name}={max(minimum, 1)}"
    )
