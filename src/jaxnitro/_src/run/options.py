"""Every option of `jn.Nitro(...)`, declared once.

Each `Option` says its name, default, type, one-line doc, how a given value is checked, and
whether it is a *value option* (an int, float, str, bool, path or a list of them). From this
one list come `Nitro`'s validation and `help(jn.Nitro)`, the experiment-field overrides (a
field named like a value option sets it: keyword > field > default), the flags of `jaxnitro
train` and `sweep`, the `[options]` of a TOML config file (`run/config.py`) and `docs/options.md`.
Adding an option touches this list and the code that acts on it.

Regenerate the docs page with `python -m jaxnitro._src.run.options > docs/options.md`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnitro._src.core.errors import MODES, ConfigError, check_int, did_you_mean
from jaxnitro._src.core.units import parse_bytes
from jaxnitro._src.core.words import bool_word, vocabulary

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Experiment
    from jaxnitro._src.dist.sharding.rules import Sharding


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of `jn.Nitro(...)`.

    Attributes:
        name: the keyword (and, kebab-cased, the flag `--name`).
        default: the value when neither a keyword nor an experiment field gives one.
        type: the type as the docs write it.
        doc: one line for `help(jn.Nitro)`, `--help` and `docs/options.md`.
        check: a given value -> the setting setup uses; a `ConfigError` for a bad one.
        parse: command-line text -> a value (None: not a value option: Python only).
        metavar: the flag's value as `--help` shows it.
        from_field: an experiment field of the same name sets it (default: value options).
    """

    name: str
    default: Any
    type: str
    doc: str
    check: Callable[[Any], Any] = _same
    parse: Callable[[str], Any] | None = None
    metavar: str = ""
    from_field: bool | None = None

    @property
    def value(self) -> bool:
        """A value option: a flag, an experiment field and a config-file entry may set it."""
        return self.parse is not None

    @property
    def reads_field(self) -> bool:
        return self.value if self.from_field is None else self.from_field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.parse is _bool


# -- checks ---------------------------------------------------------------------------------
def _int(name: str, minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        return check_int(
            name, value, minimum=minimum, fix=f"pass a whole number, e.g. {name}={max(minimum, 1)}"
        )

    return check


def _log_every(value: Any) -> int:
    return check_int(
        "log_every_n_steps",
        value,
        minimum=1,
        fix="pass how many optimizer steps apart the train lines are, e.g. "
        "log_every_n_steps=50 (the default, 1, logs every step)",
    )


def _optional_int(name: str) -> Callable[[Any], int | None]:
    inner = _int(name, 1)
    return lambda value: None if value is None else inner(value)


def _choice(name: str, options: dict[str, str]) -> Callable[[Any], str]:
    def check(value: Any) -> Any:
        if value not in options:
            listed = " or ".join(f"{k!r} ({why})" for k, why in options.items())
            raise ConfigError(
                f"{name}={value!r}; use {listed}." + did_you_mean(str(value), options)
            )
        return value

    return check


def _path(name: str, *, optional: bool) -> Callable[[Any], Any]:
    def check(value: Any) -> Path | None:
        if value is None and optional:
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(
                f"{name} must be a path (str or pathlib.Path), got {type(value).__name__} "
                f"{value!r}; e.g. {name}='runs/<Class>'."
            )
        if not str(os.fspath(value)).strip():
            raise ConfigError(
                f"{name} is empty; pass a directory, e.g. {name}='runs/<Class>' (or leave it "
                f"out for that default)."
            )
        return Path(value)

    return check


def _bool_or_none(name: str) -> Callable[[Any], bool | None]:
    def check(value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}; use True, False or None (the default).")
        return value

    return check


def _ema_decay(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(
            f"ema={value!r}; the decay is a number strictly between 0 and 1 (the weight of the "
            f"old average per step), e.g. ema=0.999 (about the last 1,000 steps), or None (off)."
        )
    return float(value)


def _ema_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"ema_every={value!r}; pass a whole number of optimizer steps >= 1 between "
            f"updates, e.g. ema_every=10 (the decay is compounded to match)."
        )
    return value


def _strict_bool(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}; use True or False.")
        return value

    return check


def _ema_eval(value: Any) -> bool | str:
    if value not in (True, False, "both") or (value != "both" and not isinstance(value, bool)):
        raise ConfigError(
            f"ema_eval={value!r}; use True (validate with the EMA weights), False (the raw "
            f"weights) or 'both' (val_* for the EMA weights, val_raw_* for the raw ones)."
        )
    return value


def _ema_eval_text(text: str) -> bool | str:
    return "both" if text.strip().lower() == "both" else _bool(text)


def _weights(value: Any) -> str | None:
    from jaxnitro._src.steps.ema import weights_setting

    return weights_setting(value)


def _show_curves(value: Any) -> bool:
    if value is None:
        from jaxnitro._src.observe.display import in_notebook

        return in_notebook()
    if not isinstance(value, bool):
        raise ConfigError(
            f"show_curves={value!r}; use True (show the curves inline when jn.train returns, "
            f"in a notebook), False, or None (on in a Jupyter kernel, off elsewhere)."
        )
    return value


def _steps_per_call(value: Any) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, str):
        raise ConfigError(
            f"steps_per_call={value!r}; pass a number of optimizer steps per dispatch (e.g. "
            f"steps_per_call=8) or 'auto' (measured at the first train)."
        )
    return _int("steps_per_call", 1)(value)


def _bytes(value: Any) -> int | None:
    """Bytes as an int, or a string such as "1GB", "512MiB", "1.5 GiB"."""
    return None if value is None else parse_bytes("memory_budget", value, error=ConfigError)


def _minutes(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ConfigError(
            f"checkpoint_every_minutes must be a number > 0, got {value!r}; e.g. "
            f"checkpoint_every_minutes=30."
        )
    return value


def _peak_tflops(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ConfigError(
            f"peak_tflops must be a number of TFLOP/s > 0 (the device's peak for the run's "
            f"precision), got {value!r}; e.g. peak_tflops=989 for an H100 SXM in bf16."
        )
    return None if value is None else float(value)


def _profile(value: Any) -> tuple[int, int] | None:
    """`profile=`: None, (start_step, end_step) or the text 'START:END'."""
    if value is None:
        return None
    pair = value.split(":") if isinstance(value, str) else value
    try:
        start, end = (int(v) for v in pair)
        ok = all(not isinstance(v, bool) for v in pair) and 0 <= start < end
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"profile={value!r}; give the optimizer steps to trace as (start_step, end_step) "
            f"with 0 <= start < end, e.g. profile=(10, 20) (on the command line --profile "
            f"10:20)."
        )
    return start, end


def _progress(value: Any) -> Any:
    if not (value is None or isinstance(value, bool) or value in ("rich", "plain", "off")):
        raise ConfigError(
            f"progress={value!r}; use True (a live display on a terminal, plain lines "
            f"otherwise), 'rich', 'plain' or False/'off'."
            + did_you_mean(str(value), ["rich", "plain", "off"])
        )
    return value


def _compile_options(value: Any) -> dict:
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


def _sharding(value: Any) -> Sharding:
    from jaxnitro._src.dist.sharding import resolve

    return resolve(value)


def _remat(value: Any) -> Any:
    from jaxnitro._src.experiment.remat import check

    return check(value, "full")[0]


def _remat_policy(value: Any) -> Any:
    from jaxnitro._src.experiment.remat import check

    return check(None, value)[1]


def _population(value: Any) -> int | dict | None:
    """`population=`: None, a member count >= 1, or {field: [values]} (checked at setup)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, Mapping)):
        raise ConfigError(
            f"population={value!r}; pass a number of members (population=8: seeds seed..seed+7) "
            f"or a dict of per-member values, e.g. population={{'smoothing': [0.0, 0.1]}}."
        )
    if isinstance(value, Mapping):
        if not value:
            raise ConfigError("population={} names no field; give {field: [v1, v2, ...]}.")
        return {str(k): v for k, v in value.items()}
    if value < 1:
        raise ConfigError(f"population={value}; a population has at least 1 member.")
    return int(value)


def _data_on_device(value: Any) -> Any:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"data_on_device={value!r}; use None (the default: keep the train arrays on the "
            f"device when they fit), True (require it) or False (send each batch)."
        )
    return value


def _resume(value: Any) -> Any:
    if value is None:
        return False
    if isinstance(value, bool) or value == "auto":
        return value
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip():
        raise ConfigError(
            f"resume={value!r}; use False (a fresh run), 'auto' (continue from the newest "
            f"checkpoint if any), True (one must exist) or a checkpoint path."
        )
    return value


#: The loggers `logger="jsonl,csv"` (and `--logger`) name, each with its defaults.
LOGGERS = {
    "jsonl": "JSONLogger",
    "csv": "CSVLogger",
    "tensorboard": "TensorBoardLogger",
    "mlflow": "MLflowLogger",
    "wandb": "WandbLogger",
}


def _logger(value: Any) -> Any:
    """A string or list of names ("jsonl,csv") becomes those loggers; any other value is
    checked at setup (None: the default JSONLogger, False: none, a logger or list of them)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
        if not value:
            raise ConfigError(
                f"logger='' names no logger; use names from {sorted(LOGGERS)} (e.g. "
                f"'jsonl,csv'), or False to log nothing."
            )
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        from jaxnitro._src.observe import loggers

        out = []
        for name in value:
            if name not in LOGGERS:
                raise ConfigError(
                    f"logger names {name!r}; the built-in loggers are {sorted(LOGGERS)} (e.g. "
                    f"logger='jsonl,csv')." + did_you_mean(name, LOGGERS)
                )
            out.append(getattr(loggers, LOGGERS[name])())
        return out
    return value


def _early_stop(value: Any) -> Any:
    """ "METRIC:PATIENCE[:min|max]" becomes a `jn.EarlyStopping`; other values pass."""
    if not isinstance(value, str):
        return value
    from jaxnitro._src.observe.runs import metric_mode
    from jaxnitro._src.train.early_stop import EarlyStopping

    parts = value.split(":")
    fix = "write METRIC:PATIENCE[:min|max], e.g. 'val_loss:3' or 'acc:5:max'"
    if len(parts) not in (2, 3) or not parts[0].strip():
        raise ConfigError(f"early_stop={value!r}; {fix}.")
    metric = parts[0].strip()
    try:
        patience = int(parts[1])
    except ValueError:
        raise ConfigError(
            f"early_stop={value!r}: patience {parts[1]!r} is no number; {fix}."
        ) from None
    mode = parts[2].strip() if len(parts) == 3 else metric_mode(metric)
    if mode not in MODES:
        raise ConfigError(
            f"early_stop={value!r}: mode {mode!r}; {fix}." + did_you_mean(mode, MODES)
        )
    return EarlyStopping(metric=metric, mode=mode, patience=patience)


def _plateau(value: Any) -> Any:
    """ "METRIC:PATIENCE:FACTOR[:min|max]" becomes the rule (`train/plateau.py`)."""
    from jaxnitro._src.train.plateau import PlateauRule

    return PlateauRule.parse(value)


# -- command-line text -> value --------------------------------------------------------------
def _bool(text: str) -> bool:
    value = bool_word(text)
    if value is None:
        raise ConfigError(f"{text!r} is not a bool; use {vocabulary()}.")
    return value


def _int_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a whole number.") from None


def _float_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number.") from None


def _int_or_auto(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a number of steps >= 1 or 'auto' (e.g. --steps-per-call 8, or "
            f"--steps-per-call auto to measure it)."
        ) from None


def _resume_text(text: str) -> Any:
    """'auto', a word of the bool vocabulary (`--resume on` is True, not a path named 'on'),
    else a checkpoint path (write `./on` for a directory named like a bool word)."""
    if text.strip().lower() == "auto":
        return "auto"
    word = bool_word(text)
    return text if word is None else word


def _progress_text(text: str) -> Any:
    low = text.strip().lower()
    if low in ("auto", "rich", "plain"):
        return None if low == "auto" else low
    word = bool_word(low)  # "off" (and "no", "0") is False
    return low if word is None else word


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _str(text: str) -> str:
    return text


# -- the declaration ------------------------------------------------------------------------
OPTIONS: tuple[Option, ...] = (
    Option(
        "seed",
        42,
        "int",
        "Initialization, shuffling and dropout.",
        _int("seed", 0),
        _int_text,
        "INT",
    ),
    Option(
        "run_dir",
        None,
        "path",
        "Where the run writes (default runs/<Class>).",
        _path("run_dir", optional=True),
        _str,
        "DIR",
    ),
    Option(
        "n_devices",
        None,
        "int",
        "Devices to use (default: all of this backend's).",
        _optional_int("n_devices"),
        _int_text,
        "N",
    ),
    Option(
        "accum",
        1,
        "int",
        "Micro-batches per optimizer step (gradient accumulation).",
        _int("accum", 1),
        _int_text,
        "K",
    ),
    Option(
        "steps_per_call",
        1,
        "int | 'auto'",
        "Optimizer steps per compiled call; 'auto' measures at the first train.",
        _steps_per_call,
        _int_or_auto,
        "N|auto",
    ),
    Option("max_epochs", 1, "int", "Epochs to train.", _int("max_epochs", 1), _int_text, "N"),
    Option(
        "schedules",
        None,
        "dict",
        "Replaces the experiment's schedules() table (Python only).",
        lambda v: v,
    ),
    Option(
        "precision",
        "f32",
        "'f32' | 'bf16'",
        "bf16: bf16 compute, f32 master weights and optimizer state.",
        _choice(
            "precision",
            {"f32": "the default", "bf16": "bf16 compute, f32 master weights and optimizer state"},
        ),
        _str,
        "f32|bf16",
    ),
    Option(
        "logger",
        None,
        "names | Logger | list | False",
        "Built-in loggers by name ('jsonl,csv,tensorboard,mlflow,wandb'), jn.Logger objects, "
        "or False (default: jsonl).",
        _logger,
        _str,
        "NAME,...",
    ),
    Option(
        "checkpointer",
        None,
        "Checkpointer | False",
        "Default jn.TopKCheckpointer(); False: none (Python only).",
        from_field=True,
    ),
    Option(
        "early_stop",
        None,
        "'METRIC:PATIENCE[:min|max]' | EarlyStopping",
        "Stop when a validation metric stops improving.",
        _early_stop,
        _str,
        "METRIC:PATIENCE[:min|max]",
    ),
    Option(
        "reduce_lr_on_plateau",
        None,
        "'METRIC:PATIENCE:FACTOR[:min|max]'",
        "Multiply the learning rate by FACTOR when a validation metric has not improved for "
        "PATIENCE epochs (no recompile).",
        _plateau,
        _str,
        "METRIC:PATIENCE:FACTOR[:min|max]",
    ),
    Option(
        "resume",
        False,
        "bool | 'auto' | path",
        "'auto': continue from the newest checkpoint if any; True: one must exist; or a "
        "checkpoint path (a bool word is the bool: ./on for a path named 'on').",
        _resume,
        _resume_text,
        "auto|true|false|PATH",
    ),
    Option(
        "checkpoint",
        None,
        "path",
        "Load weights only from this checkpoint (or a run dir's best).",
        _path("checkpoint", optional=True),
        _str,
        "PATH",
    ),
    Option(
        "data",
        None,
        "dict of splits",
        "Use these splits instead of build_data (Python only).",
        from_field=False,
    ),
    Option(
        "memory_budget",
        None,
        "int | '2GiB'",
        "Refuse a program whose planned memory exceeds this many bytes.",
        _bytes,
        _str,
        "BYTES",
    ),
    Option(
        "compile_options",
        None,
        "dict",
        "XLA options for every program (Python only).",
        _compile_options,
    ),
    Option(
        "progress",
        None,
        "bool | 'rich' | 'plain' | 'off'",
        "The progress display (default: live on a terminal).",
        _progress,
        _progress_text,
        "auto|rich|plain|off",
    ),
    Option(
        "show_curves",
        None,
        "bool",
        "Show the curves inline when jn.train returns (default: in a Jupyter kernel).",
        _show_curves,
        _bool,
    ),
    Option(
        "on_nonfinite",
        "error",
        "'error' | 'skip'",
        "A NaN/inf loss stops the run, or skips the update and is counted.",
        _choice(
            "on_nonfinite",
            {"error": "stop with the step and epoch", "skip": "skip the update and count it"},
        ),
        _str,
        "error|skip",
    ),
    Option(
        "val_every",
        None,
        "int",
        "Also validate every N optimizer steps inside an epoch.",
        _optional_int("val_every"),
        _int_text,
        "N",
    ),
    Option(
        "checkpoint_every",
        None,
        "int",
        "Also checkpoint every N optimizer steps inside an epoch.",
        _optional_int("checkpoint_every"),
        _int_text,
        "N",
    ),
    Option(
        "checkpoint_every_minutes",
        None,
        "float",
        "Also checkpoint every M minutes inside an epoch.",
        _minutes,
        _float_text,
        "M",
    ),
    Option(
        "log_grad_norm",
        None,
        "bool",
        "Log the gradient's global norm per step (default: when clipping).",
        _bool_or_none("log_grad_norm"),
        _bool,
    ),
    Option(
        "log_every_n_steps",
        1,
        "int",
        "Log every N-th step's train line (default 1: every step keeps its line).",
        _log_every,
        _int_text,
        "N",
    ),
    Option(
        "sharding",
        "dp",
        "'dp' | 'fsdp' | Sharding",
        "dp: replicated parameters; fsdp: parameters and optimizer state split.",
        _sharding,
        _str,
        "dp|fsdp",
    ),
    Option(
        "remat",
        None,
        "list[str]",
        "Block classes recomputed in the backward pass.",
        _remat,
        _names,
        "CLASS,...",
    ),
    Option(
        "remat_policy",
        "full",
        "str",
        "What a rematerialised block keeps: 'full' or 'dots_saveable'.",
        _remat_policy,
        _str,
        "POLICY",
    ),
    Option(
        "population",
        None,
        "int | {field: [values]}",
        "Train N members (or per-member field values) in one program.",
        _population,
        _int_text,
        "N",
    ),
    Option(
        "data_on_device",
        None,
        "bool",
        "Keep the train arrays on the device (default: when they fit).",
        _data_on_device,
        _bool,
    ),
    Option(
        "ema",
        None,
        "float",
        "Average the weights in the train step with this decay, e.g. 0.999 (default: off).",
        _ema_decay,
        _float_text,
        "DECAY",
    ),
    Option(
        "ema_warmup",
        True,
        "bool",
        "Ramp the EMA decay as min(decay, (1 + t) / (10 + t)) over the first steps.",
        _strict_bool("ema_warmup"),
        _bool,
    ),
    Option(
        "ema_every",
        1,
        "int",
        "Update the EMA every k optimizer steps (the decay compounded to match).",
        _ema_every,
        _int_text,
        "K",
    ),
    Option(
        "ema_state",
        False,
        "bool",
        "Average the model state (BatchNorm statistics) too; else it is copied.",
        _strict_bool("ema_state"),
        _bool,
    ),
    Option(
        "ema_eval",
        True,
        "bool | 'both'",
        "Validate with the EMA weights; 'both' also logs val_raw_* for the raw ones.",
        _ema_eval,
        _ema_eval_text,
        "true|false|both",
    ),
    Option(
        "peak_tflops",
        None,
        "float",
        "The device's peak TFLOP/s for mfu (default: a table of known accelerators).",
        _peak_tflops,
        _float_text,
        "TFLOPS",
    ),
    Option(
        "profile",
        None,
        "(start, end) | 'START:END'",
        "Record a jax.profiler trace of these steps into run_dir/profile/.",
        _profile,
        _str,
        "START:END",
    ),
    Option(
        "weights",
        None,
        "'ema' | 'raw'",
        "Which weights checkpoint= loads (default: those its validation used).",
        _weights,
        _str,
        "ema|raw",
    ),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def lookup(name: str, *, where: str) -> Option:
    """The option `name`; a ConfigError with a did-you-mean names `where` it was asked for."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ConfigError(
            f"{where} has no option {name!r}; options: {list(NAMES)}." + did_you_mean(name, NAMES)
        ) from None


def resolve(exp: Experiment, given: Mapping[str, Any]) -> dict[str, Any]:
    """Each option as given: keyword > experiment field of the same name > default (a keyword
    of None counts as not given)."""
    out = {}
    for o in OPTIONS:
        value = given.get(o.name)
        if value is None and o.reads_field:
            value = getattr(exp, o.name, None)
        out[o.name] = o.default if value is None else value
    return out


def checked(exp: Experiment, given: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved options, each checked; a bad field value names the field."""
    raw, out = resolve(exp, given), {}
    for o in OPTIONS:
        try:
            out[o.name] = o.check(raw[o.name])
        except ConfigError as error:  # examples name the experiment's class
            e = ConfigError(str(error).replace("<Class>", type(exp).__name__))
            field = o.reads_field and given.get(o.name) is None
            if field and getattr(exp, o.name, None) is not None:
                cls = type(exp).__name__
                raise ConfigError(
                    f"experiment field {cls}.{o.name}={raw[o.name]!r} sets jn.Nitro's option "
                    f"{o.name!r} (a field named like an option sets it), and {e} Change the "
                    f"field's value, or pass {o.name}=... to jn.Nitro."
                ) from None
            raise e from None
    return out


def _default_text(o: Option) -> str:
    return "runs/<Class>" if o.name == "run_dir" else repr(o.default)


def docstring(indent: str = "    ") -> str:
    """The options part of `help(jn.Nitro)` (indented like the class docstring's body)."""
    lines = [
        "Options (keyword > an experiment field of the same name, for value options > default;",
        "value options are also `jaxnitro train` flags and config-file entries; docs/options.md):",
    ]
    for o in OPTIONS:
        lines.append(f"    {o.name} ({o.type}) = {_default_text(o)}: {o.doc}")
    return "\n".join(indent + line for line in lines)


def markdown() -> str:
    """`docs/options.md`."""
    rows = [
        "# The options of `jn.Nitro`",
        "",
        "<!-- Generated from src/jaxnitro/_src/run/options.py: "
        "python -m jaxnitro._src.run.options > "
        "docs/options.md -->",
        "",
        "Each option is declared once, in `jaxnitro._src.run.options`. A keyword of "
        "`jn.Nitro(exp, ...)` wins over an experiment field of the same name (value options, "
        "and `checkpointer`), "
        "which wins over the default. A value option (an int, float, str, bool, path or list of "
        "them) is also a flag of `jaxnitro train` and `jaxnitro sweep` and an entry of a config "
        "file's `[options]` table; on the command line a flag wins over the config file.",
        "",
        "## Text to values",
        "",
        "Text becomes a value the same way on the command line, in a config file and over "
        "MCP, for options and experiment fields alike, by the type each declares:",
        "",
        "- **bool**: one vocabulary, case-insensitive: `true`, `yes`, `y`, `on`, `1` and "
        "`false`, `no`, `n`, `off`, `0` (`jaxnitro._src.core.words`). A bool flag takes it as "
        "`--log-grad-norm y`, `--log-grad-norm=off`, or as the flag alone (`--log-grad-norm`, "
        "`--no-log-grad-norm`).",
        "- **bool | 'auto' | path** (`resume`): `auto`, then a bool word (`--resume on` and "
        "`--resume 1` mean True: a checkpoint must exist), else a checkpoint path. A directory "
        "named like a bool word is written as a path: `--resume ./on`.",
        "- **int**, **float**: numbers as Python writes them (`1_000`, `1e-3`); **list**: "
        "comma-separated (`--remat Block,Attention`); a field's **X | None**: `none`.",
        "",
        "| option | type | default | flag | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in OPTIONS:
        if not o.value:
            flag = "Python only"
        elif o.is_bool:
            flag = f"`{o.flag}` / `--no-{o.flag[2:]}`"
        else:
            flag = f"`{o.flag} {o.metavar}`"
        typ = o.type.replace("|", "\\|")
        rows.append(f"| `{o.name}` | {typ} | `{_default_text(o)}` | {flag} | {o.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
