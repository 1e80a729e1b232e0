"""Every option of `jn.Nitro(...)`, declared once.

Each `Option` says its name, default, type, one-line doc, how a given value is checked, and
whether it is a *value option* (an int, float, str, bool, path or a list of them). From this
one list come `Nitro`'s validation and `help(jn.Nitro)`, the experiment-field overrides (a
field named like a value option sets it: keyword > field > default), the flags of `jaxnitro
train` and `sweep`, the `[options]` of a TOML config file (`run/config.py`) and `docs/options.md`.
Adding an option touches this list and the code that acts on it.

How a given value or a flag's text becomes a setting: `run/option_values.py`. Regenerate the
docs page with `python -m jaxnitro._src.run.options > docs/options.md`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.experiment import markers
from jaxnitro._src.run import option_values as v

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Experiment


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
        return self.parse is v.bool_text


# -- the declaration ------------------------------------------------------------------------
OPTIONS: tuple[Option, ...] = (
    Option(
        "seed",
        42,
        "int",
        "Initialization, shuffling and dropout.",
        v.int_check("seed", 0),
        v.int_text,
        "INT",
    ),
    Option(
        "run_dir",
        None,
        "path",
        "Where the run writes (default runs/<Class>).",
        v.path_check("run_dir", optional=True),
        v.as_text,
        "DIR",
    ),
    Option(
        "n_devices",
        None,
        "int",
        "Devices to use (default: all of this backend's).",
        v.optional_int("n_devices"),
        v.int_text,
        "N",
    ),
    Option(
        "accum",
        1,
        "int",
        "Micro-batches per optimizer step (gradient accumulation).",
        v.int_check("accum", 1),
        v.int_text,
        "K",
    ),
    Option(
        "steps_per_call",
        1,
        "int | 'auto'",
        "Optimizer steps per compiled call; 'auto' measures at the first train.",
        v.steps_per_call,
        v.int_or_auto,
        "N|auto",
    ),
    Option(
        "max_epochs", 1, "int", "Epochs to train.", v.int_check("max_epochs", 1), v.int_text, "N"
    ),
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
        v.choice(
            "precision",
            {"f32": "the default", "bf16": "bf16 compute, f32 master weights and optimizer state"},
        ),
        v.as_text,
        "f32|bf16",
    ),
    Option(
        "logger",
        None,
        "names | Logger | list | False",
        "Built-in loggers by name ('jsonl,csv,tensorboard,mlflow,wandb'), jn.Logger objects, "
        "or False (default: jsonl).",
        v.logger,
        v.as_text,
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
        v.early_stop,
        v.as_text,
        "METRIC:PATIENCE[:min|max]",
    ),
    Option(
        "reduce_lr_on_plateau",
        None,
        "'METRIC:PATIENCE:FACTOR[:min|max]'",
        "Multiply the learning rate by FACTOR when a validation metric has not improved for "
        "PATIENCE epochs (no recompile).",
        v.plateau,
        v.as_text,
        "METRIC:PATIENCE:FACTOR[:min|max]",
    ),
    Option(
        "resume",
        False,
        "bool | 'auto' | path",
        "'auto': continue from the newest checkpoint if any; True: one must exist; or a "
        "checkpoint path (a bool word is the bool: ./on for a path named 'on').",
        v.resume,
        v.resume_text,
        "auto|true|false|PATH",
    ),
    Option(
        "checkpoint",
        None,
        "path",
        "Load weights only from this checkpoint (or a run dir's best).",
        v.path_check("checkpoint", optional=True),
        v.as_text,
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
        v.byte_count,
        v.as_text,
        "BYTES",
    ),
    Option(
        "compile_options",
        None,
        "dict",
        "XLA options for every program (Python only); default: the backend's (on a CPU, "
        "batches of <= 512 rows: YNNPACK fusion off, and one-thread Eigen for programs under "
        "1e6 FLOPs), {} for XLA's own.",
        v.compile_options,
    ),
    Option(
        "progress",
        None,
        "bool | 'rich' | 'plain' | 'off'",
        "The progress display (default: live on a terminal).",
        v.progress,
        v.progress_text,
        "auto|rich|plain|off",
    ),
    Option(
        "show_curves",
        None,
        "bool",
        "Show the curves inline when jn.train returns (default: in a Jupyter kernel).",
        v.show_curves,
        v.bool_text,
    ),
    Option(
        "on_nonfinite",
        "error",
        "'error' | 'skip'",
        "A NaN/inf loss stops the run, or skips the update and is counted.",
        v.choice(
            "on_nonfinite",
            {"error": "stop with the step and epoch", "skip": "skip the update and count it"},
        ),
        v.as_text,
        "error|skip",
    ),
    Option(
        "val_every",
        None,
        "int",
        "Also validate every N optimizer steps inside an epoch.",
        v.optional_int("val_every"),
        v.int_text,
        "N",
    ),
    Option(
        "checkpoint_every",
        None,
        "int",
        "Also checkpoint every N optimizer steps inside an epoch.",
        v.optional_int("checkpoint_every"),
        v.int_text,
        "N",
    ),
    Option(
        "checkpoint_every_minutes",
        None,
        "float",
        "Also checkpoint every M minutes inside an epoch.",
        v.minutes,
        v.float_text,
        "M",
    ),
    Option(
        "log_grad_norm",
        None,
        "bool",
        "Log the gradient's global norm per step (default: when clipping).",
        v.bool_or_none("log_grad_norm"),
        v.bool_text,
    ),
    Option(
        "log_every_n_steps",
        1,
        "int",
        "Log every N-th step's train line (default 1: every step keeps its line).",
        v.log_every,
        v.int_text,
        "N",
    ),
    Option(
        "sharding",
        "dp",
        "'dp' | 'fsdp' | Sharding",
        "dp: replicated parameters; fsdp: parameters and optimizer state split.",
        v.sharding,
        v.as_text,
        "dp|fsdp",
    ),
    Option(
        "remat",
        None,
        "list[str]",
        "Block classes recomputed in the backward pass.",
        v.remat,
        v.name_list,
        "CLASS,...",
    ),
    Option(
        "remat_policy",
        "full",
        "str",
        "What a rematerialised block keeps: 'full' or 'dots_saveable'.",
        v.remat_policy,
        v.as_text,
        "POLICY",
    ),
    Option(
        "population",
        None,
        "int | {field: [values]}",
        "Train N members (or per-member field values) in one program.",
        v.population,
        v.int_text,
        "N",
    ),
    Option(
        "data_on_device",
        None,
        "bool",
        "Keep the train arrays on the device (default: when they fit).",
        v.data_on_device,
        v.bool_text,
    ),
    Option(
        "ema",
        None,
        "float",
        "Average the weights in the train step with this decay, e.g. 0.999 (default: off).",
        v.ema_decay,
        v.float_text,
        "DECAY",
    ),
    Option(
        "ema_warmup",
        True,
        "bool",
        "Ramp the EMA decay as min(decay, (1 + t) / (10 + t)) over the first steps.",
        v.strict_bool("ema_warmup"),
        v.bool_text,
    ),
    Option(
        "ema_every",
        1,
        "int",
        "Update the EMA every k optimizer steps (the decay compounded to match).",
        v.ema_every,
        v.int_text,
        "K",
    ),
    Option(
        "ema_state",
        False,
        "bool",
        "Average the model state (BatchNorm statistics) too; else it is copied.",
        v.strict_bool("ema_state"),
        v.bool_text,
    ),
    Option(
        "ema_eval",
        True,
        "bool | 'both'",
        "Validate with the EMA weights; 'both' also logs val_raw_* for the raw ones.",
        v.ema_eval,
        v.ema_eval_text,
        "true|false|both",
    ),
    Option(
        "peak_tflops",
        None,
        "float",
        "The device's peak TFLOP/s for mfu (default: a table of known accelerators).",
        v.peak_tflops,
        v.float_text,
        "TFLOPS",
    ),
    Option(
        "profile",
        None,
        "(start, end) | 'START:END'",
        "Record a jax.profiler trace of these steps into run_dir/profile/.",
        v.profile,
        v.as_text,
        "START:END",
    ),
    Option(
        "weights",
        None,
        "'ema' | 'raw'",
        "Which weights checkpoint= loads (default: those its validation used).",
        v.weights,
        v.as_text,
        "ema|raw",
    ),
)
markers.declare_driver_fields(o.name for o in OPTIONS if o.reads_field)

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
