"""What the commands share: the experiment from TARGET and its options, `Nitro` keywords,
checkpoints given by path or run directory, and output (a table or JSON)."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from ..experiment import DEVICE, GRAPH, fields
from ..jsonable import jsonable
from ..settings import settings
from .fields import CLASS, given, given_fields, nitro_options
from .values import from_json

#: Commands parse `--max_epochs` like `--max-epochs`.
CONTEXT = {"token_normalize_func": lambda s: s.replace("_", "-"), "show_default": False}
PROGRESS = click.Choice(["auto", "rich", "plain", "off"])


def experiment_class(ctx: click.Context) -> Any:
    return ctx.meta[CLASS]


def build_experiment(
    ctx: click.Context,
    preset: str | None,
    base: dict | None = None,
    values: dict | None = None,
) -> Any:
    """The experiment: its defaults, then `preset`, then `base` (e.g. a checkpoint's config),
    then `values` (default: the field options given). A value the experiment refuses exits 2
    with its message."""
    cls = experiment_class(ctx)
    values = {**(base or {}), **(given_fields(ctx) if values is None else values)}
    try:
        return cls.from_preset(preset, **values) if preset else cls(**values)
    except ConfigError as e:  # a bad value or preset: a usage error, like a bad option value
        raise click.UsageError(str(e), ctx=ctx) from None


def nitro_kwargs(ctx: click.Context, exp, **fixed) -> dict[str, Any]:
    """`Nitro` keywords: the command's own options that were given, fields that are also Nitro
    options (`--seed`, `--max-epochs` on an experiment with those fields), and `fixed`."""
    own = nitro_options()
    kw = {name: getattr(exp, name) for name in given_fields(ctx) if name in own}
    for name in ("max_epochs", "accum", "steps_per_call", "precision", "seed", "run_dir"):
        if name in ctx.params and given(ctx, name):
            kw[name] = ctx.params[name]
    if ctx.params.get("resume") is not None:
        kw["resume"] = resume_value(ctx.params["resume"])
    metric, mode = ctx.params.get("checkpoint_metric"), ctx.params.get("checkpoint_mode")
    if metric or mode:
        from ..checkpoint import TopKCheckpointer
        from ..runs import metric_mode

        metric = metric or "val_loss"
        kw["checkpointer"] = TopKCheckpointer(metric=metric, mode=mode or metric_mode(metric))
    kw["progress"] = progress_value(ctx)
    kw.update(fixed)
    try:  # a value given on the command line that the settings refuse is a usage error
        settings(exp, kw)
    except ConfigError as e:
        raise click.UsageError(str(e), ctx=ctx) from None
    return kw


def progress_value(ctx: click.Context) -> Any:
    """`--progress`: auto → the Nitro default; with `--json` (stdout is for JSON) off."""
    value = ctx.params.get("progress") or "auto"
    if ctx.params.get("as_json") and not given(ctx, "progress"):
        return "off"
    return None if value == "auto" else value


def resume_value(text: str) -> Any:
    """`--resume auto` (continue from the newest checkpoint if any), `true` (one must exist),
    `false`, or a checkpoint path."""
    low = text.strip().lower()
    return {"auto": "auto", "true": True, "yes": True, "false": False, "no": False}.get(low, text)


class _StepsPerCall(click.ParamType):
    """`--steps-per-call`: a whole number >= 1, or 'auto'."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = 0
        if number < 1:
            self.fail(
                f"{value!r} is not a number of steps >= 1 or 'auto' (e.g. --steps-per-call 8, "
                f"or --steps-per-call auto to measure it).",
                param,
                ctx,
            )
        return number


STEPS_PER_CALL = _StepsPerCall()


def run_options(fn: Callable) -> Callable:
    """The options of a training command (train, sweep), besides the experiment's fields."""
    options = [
        click.option(
            "--preset", metavar="NAME", help="Start from one of the experiment's presets."
        ),
        click.option("--max-epochs", type=click.IntRange(min=1), help="Epochs to train."),
        click.option(
            "--accum", type=click.IntRange(min=1), help="Micro-batches per optimizer step."
        ),
        click.option(
            "--steps-per-call",
            type=STEPS_PER_CALL,
            metavar="N|auto",
            help="Optimizer steps per compiled call, or 'auto' (measured at the first train).",
        ),
        click.option(
            "--precision", type=click.Choice(["f32", "bf16"]), help="bf16: f32 master weights."
        ),
        click.option(
            "--run-dir",
            type=click.Path(file_okay=False, path_type=Path),
            help="Where the run writes (default runs/<Class>).",
        ),
        click.option(
            "--resume",
            metavar="auto|PATH",
            help="auto: continue from the newest checkpoint in the run dir, if any.",
        ),
        click.option(
            "--checkpoint-metric",
            metavar="NAME",
            help="The metric checkpoints are ranked by (default val_loss).",
        ),
        click.option(
            "--checkpoint-mode",
            type=click.Choice(["min", "max"]),
            help="Lower or higher is better (default: min for a loss or error, else max).",
        ),
        click.option("--progress", type=PROGRESS, default="auto", help="The progress display."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def checkpoint_path(path: Path) -> Path:
    """A checkpoint directory; a run (or checkpoints) directory gives its best checkpoint
    (the library's rule for `jn.Nitro(checkpoint=...)`), a bad one a usage error (exit 2)."""
    from ..errors import CheckpointError
    from ..setup import weights_path

    try:
        return weights_path(path.absolute())
    except CheckpointError as e:
        raise click.BadParameter(str(e), param_hint="'--checkpoint'") from None


def checkpoint_config(ctx: click.Context, path: Path) -> dict[str, Any]:
    """The GraphConst values a checkpoint was trained with (the model's shapes follow them)
    and its Device values (the loss may read them), for the fields not given on the command
    line; said on stderr."""
    from ..setup import read_meta

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            meta = read_meta(path)
        except Exception:  # noqa: BLE001 - loading reports a bad checkpoint properly
            return {}
    config, device = meta.get("config") or {}, meta.get("device") or {}
    known = {f.name: f for f in fields(experiment_class(ctx))}
    out = {}
    for name, saved in config.items() if isinstance(config, dict) else ():
        if name in known and known[name].marker == GRAPH and name not in given_fields(ctx):
            # graph_key stores (type name, value) pairs
            is_pair = isinstance(saved, list) and len(saved) == 2 and isinstance(saved[0], str)
            out[name] = from_json(known[name].type, saved[1] if is_pair else saved)
    for name, saved in device.items() if isinstance(device, dict) else ():
        if name in known and known[name].marker == DEVICE and name not in given_fields(ctx):
            out[name] = from_json(known[name].type, saved)
    if out:
        listed = ", ".join(f"{k}={v!r}" for k, v in out.items())
        click.echo(f"from the checkpoint's config: {listed}", err=True)
    return out


def emit(value: Any, *, as_json: bool, text: Callable[[Any], Any]) -> None:
    """Print `value` as JSON (`--json`) or as `text(value)`: a string, or a rich renderable
    (a table)."""
    if as_json:
        click.echo(json.dumps(jsonable(value), indent=2))
        return
    out = text(value)
    if isinstance(out, str):
        click.echo(out)
    else:
        from rich.console import Console

        # Piped output is not cut to 80 columns: a table row stays one line where it fits.
        Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200).print(out)


def echo_err(message: str) -> None:
    click.echo(message, err=True)
    sys.stderr.flush()
