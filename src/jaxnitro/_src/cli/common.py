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

from jaxnitro._src.cli.fields import CLASS, CONFIG, given, given_fields, nitro_options
from jaxnitro._src.cli.values import from_json
from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.experiment.markers import DEVICE, GRAPH, fields
from jaxnitro._src.run import config, options
from jaxnitro._src.run.settings import settings

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
    values = {
        **config_fields(ctx),
        **(base or {}),
        **(given_fields(ctx) if values is None else values),
    }
    preset = preset or config_data(ctx).get("preset")
    try:
        return cls.from_preset(preset, **values) if preset else cls(**values)
    except ConfigError as e:  # a bad value or preset: a usage error, like a bad option value
        raise click.UsageError(str(e), ctx=ctx) from None


def nitro_kwargs(ctx: click.Context, exp, **fixed) -> dict[str, Any]:
    """`Nitro` keywords: a config file's `[options]`, then the options given as flags (a flag
    wins), fields that are also Nitro options (`--seed` on an experiment with that field),
    then `fixed`."""
    own = nitro_options()
    kw = dict(config_data(ctx).get("options") or {})
    kw.update({name: getattr(exp, name) for name in given_fields(ctx) if name in own})
    for name in own:
        if name in ctx.params and given(ctx, name):
            kw[name] = ctx.params[name]
    metric, mode = ctx.params.get("checkpoint_metric"), ctx.params.get("checkpoint_mode")
    if metric or mode:
        from jaxnitro._src.checkpoint.store import TopKCheckpointer
        from jaxnitro._src.observe.runs import metric_mode

        metric = metric or "val_loss"
        kw["checkpointer"] = TopKCheckpointer(metric=metric, mode=mode or metric_mode(metric))
    kw["progress"] = progress_value(ctx, kw.get("progress"))
    kw.update(fixed)
    try:  # a value given on the command line that the settings refuse is a usage error
        settings(exp, kw)
    except ConfigError as e:
        raise click.UsageError(str(e), ctx=ctx) from None
    return kw


def need_target(ctx: click.Context) -> None:
    """TARGET, or a `--config` file naming one, is required (a usage error otherwise)."""
    if CLASS not in ctx.meta:
        raise click.UsageError(
            "give TARGET (path/to/file.py:Class or pkg.module:Class), or --config FILE.toml "
            'with a target = "pkg.mod:Class" line.',
            ctx=ctx,
        )


def config_data(ctx: click.Context) -> dict[str, Any]:
    """The `--config` file's contents (checked when the arguments were parsed), or {}."""
    return ctx.meta.get(CONFIG, (None, {}))[1]


def config_target(ctx: click.Context) -> str | None:
    """The `--config` file's target (a relative file path resolved against the file's
    directory: `config.target_in`), or None."""
    if CONFIG not in ctx.meta:
        return None
    path, data = ctx.meta[CONFIG]
    return config.target_in(data, path)


def config_fields(ctx: click.Context) -> dict[str, Any]:
    """The `[fields]` of the `--config` file as the experiment takes them."""
    if CONFIG not in ctx.meta:
        return {}
    path, data = ctx.meta[CONFIG]
    try:
        return config.field_values(data, experiment_class(ctx), path)
    except ConfigError as e:
        raise click.UsageError(str(e), ctx=ctx) from None


def progress_value(ctx: click.Context, current: Any = None) -> Any:
    """`--progress` if given (auto → the Nitro default); else off with `--json` (stdout is
    for JSON); else the command's own default, or `current` (a config file's)."""
    value = ctx.params.get("progress")
    if given(ctx, "progress"):
        return None if value == "auto" else value
    if ctx.params.get("as_json"):
        return "off"
    return value if value not in (None, "auto") else current


class OptionType(click.ParamType):
    """A `jn.Nitro` option's flag: the text parsed and checked as `jn.Nitro` checks it (a bad
    value exits 2 with the option's message)."""

    def __init__(self, option: options.Option):
        self.option, self.name = option, option.metavar

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            parsed = self.option.parse(value) if self.option.parse else value
            self.option.check(parsed)
        except ConfigError as e:
            self.fail(str(e), param, ctx)
        return parsed


def option_flags(exclude: tuple[str, ...] = ()) -> list[Callable]:
    """One flag per value option of `jn.Nitro` (`--val-every N`, `--log-grad-norm/--no-...`)."""
    out = []
    for o in options.OPTIONS:
        if not o.value or o.name in exclude:
            continue
        default = f" [default: {o.default!r}]" if o.default is not None else ""
        if o.is_bool:
            decl = f"{o.flag}/--no-{o.flag[2:]}"
            out.append(click.option(decl, o.name, default=None, help=o.doc + default))
        else:
            out.append(
                click.option(
                    o.flag, o.name, type=OptionType(o), metavar=o.metavar, help=o.doc + default
                )
            )
    return out


def run_options(
    fn: Callable | None = None,
    *,
    exclude: tuple[str, ...] = (),
    config: bool = False,
    print_config: bool = False,
):
    """The options of a training command (train, sweep), besides the experiment's fields: the
    value options of `jn.Nitro` (but `exclude`), `--config` and `--print-config`."""

    def decorate(fn: Callable) -> Callable:
        own = [
            click.option(
                "--preset", metavar="NAME", help="Start from one of the experiment's presets."
            ),
            *option_flags(exclude),
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
            click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
        ]
        if config:
            own.append(
                click.option(
                    "--config",
                    "config_file",
                    type=click.Path(dir_okay=False, path_type=Path),
                    help="A TOML file: target, preset, [fields], [options] (flags win).",
                )
            )
        if print_config:
            own.append(
                click.option(
                    "--print-config",
                    is_flag=True,
                    help="Print the resolved config (TOML) and exit without training.",
                )
            )
        return functools.reduce(lambda f, opt: opt(f), reversed(own), fn)

    return decorate(fn) if fn is not None else decorate


def checkpoint_path(path: Path) -> Path:
    """A checkpoint directory; a run (or checkpoints) directory gives its best checkpoint
    (the library's rule for `jn.Nitro(checkpoint=...)`), a bad one a usage error (exit 2)."""
    from jaxnitro._src.core.errors import CheckpointError
    from jaxnitro._src.run.setup import weights_path

    try:
        return weights_path(path.absolute())
    except CheckpointError as e:
        raise click.BadParameter(str(e), param_hint="'--checkpoint'") from None


def checkpoint_config(ctx: click.Context, path: Path) -> dict[str, Any]:
    """The GraphConst values a checkpoint was trained with (the model's shapes follow them)
    and its Device values (the loss may read them), for the fields not given on the command
    line; said on stderr."""
    from jaxnitro._src.run.setup import read_meta

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
