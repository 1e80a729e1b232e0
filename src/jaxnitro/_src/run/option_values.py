"""How a value given to an option of `jn.Nitro(...)` is checked, and how command-line text
becomes one: the `check` and `parse` functions `run/options.py` declares each option with.

A check takes what the user gave (a keyword, an experiment field, a config entry) and returns
the setting setup uses, or raises a `ConfigError` that names the option and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnitro._src.core.errors import MODES, ConfigError, check_int, did_you_mean
from jaxnitro._src.core.units import parse_bytes
from jaxnitro._src.core.words import bool_word, vocabulary

if TYPE_CHECKING:
    from jaxnitro._src.dist.sharding.rules import Sharding


# -- values ---------------------------------------------------------------------------------
def int_check(name: str, minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        return check_int(
            name, value, minimum=minimum, fix=f"pass a whole number, e.g. {name}={max(minimum, 1)}"
        )

    return check


def log_every(value: Any) -> int:
    return check_int(
        "log_every_n_steps",
        value,
        minimum=1,
        fix="pass how many optimizer steps apart the train lines are, e.g. "
        "log_every_n_steps=50 (the default, 1, logs every step)",
    )


def optional_int(name: str) -> Callable[[Any], int | None]:
    inner = int_check(name, 1)
    return lambda value: None if value is None else inner(value)


def choice(name: str, options: dict[str, str]) -> Callable[[Any], str]:
    def check(value: Any) -> Any:
        if value not in options:
            listed = " or ".join(f"{k!r} ({why})" for k, why in options.items())
            raise ConfigError(
                f"{name}={value!r}; use {listed}." + did_you_mean(str(value), options)
            )
        return value

    return check


def path_check(name: str, *, optional: bool) -> Callable[[Any], Any]:
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


def bool_or_none(name: str) -> Callable[[Any], bool | None]:
    def check(value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}; use True, False or None (the default).")
        return value

    return check


def ema_decay(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(
            f"ema={value!r}; the decay is a number strictly between 0 and 1 (the weight of the "
            f"old average per step), e.g. ema=0.999 (about the last 1,000 steps), or None (off)."
        )
    return float(value)


def ema_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"ema_every={value!r}; pass a whole number of optimizer steps >= 1 between "
            f"updates, e.g. ema_every=10 (the decay is compounded to match)."
        )
    return value


def strict_bool(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}; use True or False.")
        return value

    return check


def ema_eval(value: Any) -> bool | str:
    if value not in (True, False, "both") or (value != "both" and not isinstance(value, bool)):
        raise ConfigError(
            f"ema_eval={value!r}; use True (validate with the EMA weights), False (the raw "
            f"weights) or 'both' (val_* for the EMA weights, val_raw_* for the raw ones)."
        )
    return value


def ema_eval_text(text: str) -> bool | str:
    return "both" if text.strip().lower() == "both" else bool_text(text)


def weights(value: Any) -> str | None:
    from jaxnitro._src.steps.ema import weights_setting

    return weights_setting(value)


def show_curves(value: Any) -> bool:
    if value is None:
        from jaxnitro._src.observe.display import in_notebook

        return in_notebook()
    if not isinstance(value, bool):
        raise ConfigError(
            f"show_curves={value!r}; use True (show the curves inline when jn.train returns, "
            f"in a notebook), False, or None (on in a Jupyter kernel, off elsewhere)."
        )
    return value


def steps_per_call(value: Any) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, str):
        raise ConfigError(
            f"steps_per_call={value!r}; pass a number of optimizer steps per dispatch (e.g. "
            f"steps_per_call=8) or 'auto' (measured at the first train)."
        )
    return int_check("steps_per_call", 1)(value)


def byte_count(value: Any) -> int | None:
    """Bytes as an int, or a string such as "1GB", "512MiB", "1.5 GiB"."""
    return None if value is None else parse_bytes("memory_budget", value, error=ConfigError)


def minutes(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ConfigError(
            f"checkpoint_every_minutes must be a number > 0, got {value!r}; e.g. "
            f"checkpoint_every_minutes=30."
        )
    return value


def peak_tflops(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ConfigError(
            f"peak_tflops must be a number of TFLOP/s > 0 (the device's peak for the run's "
            f"precision), got {value!r}; e.g. peak_tflops=989 for an H100 SXM in bf16."
        )
    return None if value is None else float(value)


def profile(value: Any) -> tuple[int, int] | None:
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


def progress(value: Any) -> Any:
    if not (value is None or isinstance(value, bool) or value in ("rich", "plain", "off")):
        raise ConfigError(
            f"progress={value!r}; use True (a live display on a terminal, plain lines "
            f"otherwise), 'rich', 'plain' or False/'off'."
            + did_you_mean(str(value), ["rich", "plain", "off"])
        )
    return value


def compile_options(value: Any) -> dict | None:
    """The XLA options as given (None: the backend's defaults, `compile/backend_options.py`)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"compile_options must be a dict of XLA options, got {type(value).__name__}; e.g. "
            f"{{'xla_cpu_enable_fast_math': False}}."
        )
    options = dict(value)
    for k, v in options.items():  # XLA flags: name -> bool/int/float/str
        if not isinstance(k, str) or not isinstance(v, (bool, int, float, str)):
            raise ConfigError(
                f"compile_options maps XLA option names to bool, int, float or str, got "
                f"{k!r}: {v!r}; e.g. {{'xla_cpu_enable_fast_math': False}}."
            )
    return options


def sharding(value: Any) -> Sharding:
    from jaxnitro._src.dist.sharding import resolve

    return resolve(value)


def remat(value: Any) -> Any:
    from jaxnitro._src.experiment.remat import check

    return check(value, "full")[0]


def remat_policy(value: Any) -> Any:
    from jaxnitro._src.experiment.remat import check

    return check(None, value)[1]


def population(value: Any) -> int | dict | None:
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


def data_on_device(value: Any) -> Any:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"data_on_device={value!r}; use None (the default: keep the train arrays on the "
            f"device when they fit), True (require it) or False (send each batch)."
        )
    return value


def resume(value: Any) -> Any:
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


def logger(value: Any) -> Any:
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


def early_stop(value: Any) -> Any:
    """ "METRIC:PATIENCE[:min|max]" becomes a `jn.EarlyStopping`; other values pass."""
    if not isinstance(value, str):
        return value
    from jaxnitro._src.observe.runs import metric_mode
    from jaxnitro._src.run.early_stop import EarlyStopping

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


def plateau(value: Any) -> Any:
    """ "METRIC:PATIENCE:FACTOR[:min|max]" becomes the rule (`run/plateau.py`)."""
    from jaxnitro._src.run.plateau import PlateauRule

    return PlateauRule.parse(value)


# -- command-line text -> value --------------------------------------------------------------
def bool_text(text: str) -> bool:
    value = bool_word(text)
    if value is None:
        raise ConfigError(f"{text!r} is not a bool; use {vocabulary()}.")
    return value


def int_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a whole number.") from None


def float_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number.") from None


def int_or_auto(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a number of steps >= 1 or 'auto' (e.g. --steps-per-call 8, or "
            f"--steps-per-call auto to measure it)."
        ) from None


def resume_text(text: str) -> Any:
    """'auto', a word of the bool vocabulary (`--resume on` is True, not a path named 'on'),
    else a checkpoint path (write `./on` for a directory named like a bool word)."""
    if text.strip().lower() == "auto":
        return "auto"
    word = bool_word(text)
    return text if word is None else word


def progress_text(text: str) -> Any:
    low = text.strip().lower()
    if low in ("auto", "rich", "plain"):
        return None if low == "auto" else low
    word = bool_word(low)  # "off" (and "no", "0") is False
    return low if word is None else word


def name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def as_text(text: str) -> str:
    return text
