"""Options made from the TARGET experiment's fields, and the command class that adds them.

`ExperimentCommand` finds TARGET among the arguments before click parses them, loads the class
and adds one option per field (`--width 256`; `--flag/--no-flag` for bools; in a sweep, a
comma-separated list). Click then parses everything at once: typed conversion, did-you-mean
for a misspelled option, and `--help` with the fields grouped by marker and the presets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from jaxnitro._src.cli.target import load_target, looks_like_target
from jaxnitro._src.cli.values import FieldType, ListOf, supported
from jaxnitro._src.core.errors import ConfigError, closest
from jaxnitro._src.core.words import bool_word, vocabulary
from jaxnitro._src.experiment.markers import DEVICE, GRAPH, HOST, FieldInfo, fields
from jaxnitro._src.run import config, options

CLASS, FIELDS, CONFIG = "jaxnitro.class", "jaxnitro.fields", "jaxnitro.run.config"
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
_FLAGS = {"--help", "-h", "--json"}
_SECTIONS = {
    GRAPH: "GraphConst fields (baked into the program; a new value compiles new programs)",
    DEVICE: "Device fields (traced inputs; a new value never recompiles)",
    HOST: "Host fields (read by the driver only)",
}


def kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def nitro_options() -> set[str]:
    """The keywords of `jn.Nitro(...)`: a field of the same name sets that keyword too."""
    return set(options.NAMES)


class FieldOption(click.Option):
    """An option that sets one experiment field."""

    def __init__(self, info: FieldInfo, owner: str, *, sweep: bool, nitro: bool):
        self.field = info
        flag = info.type is bool and not sweep
        name = kebab(info.name)
        decl = f"{name}/--no-{name[2:]}" if flag else name
        ftype = FieldType(info, owner)
        super().__init__(
            [decl, f"field__{info.name}"],
            type=None if flag else (ListOf(ftype) if sweep else ftype),
            default=None,
            help=_help(info, nitro=nitro),
            metavar=None if flag else ftype.name.upper() + (",..." if sweep else ""),
        )


def _help(info: FieldInfo, *, nitro: bool) -> str:
    doc = info.doc or ""
    if nitro:  # the driver reads it: the Nitro keyword wins over the field anyway
        doc = (doc + " " if doc else "") + f"(also jn.Nitro({info.name}=...))"
    extra = "[required]" if info.default is dataclasses.MISSING else f"[default: {info.default!r}]"
    return f"{doc}  {extra}" if doc else extra


def field_options(cls: type, *, sweep: bool, taken: set[str]) -> list[FieldOption]:
    """One option per field whose type the shell can write, except where one of the
    command's own options (`taken`, not a Nitro option) already uses the name."""
    own = nitro_options()
    return [
        FieldOption(info, cls.__name__, sweep=sweep, nitro=info.name in own)
        for info in fields(cls)
        if supported(info.type) and (kebab(info.name) not in taken or info.name in own)
    ]


def given_fields(ctx: click.Context) -> dict[str, Any]:
    """{field: value} of the field options given on the command line (defaults are not)."""
    out = {}
    for p in ctx.meta.get(FIELDS, []):
        if p.name is not None and ctx.get_parameter_source(p.name) in _GIVEN:
            out[p.field.name] = ctx.params[p.name]
    return out


def given(ctx: click.Context, name: str) -> bool:
    """Whether the command's own option `name` was given (not left at its default)."""
    return ctx.get_parameter_source(name) in _GIVEN


class ExperimentCommand(click.Command):
    """A click command taking TARGET and the options of its experiment's fields.

    Subcommands that run an experiment (train, validate, sweep, and later export or serve)
    use it: `@cli.command(cls=ExperimentCommand)` with a `target` argument."""

    sweep = False

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        target = self._find_target(args)
        path = _config_path(args) if any(p.name == "config_file" for p in self.params) else None
        if path is not None:  # --config FILE.toml: its target unless TARGET is given
            try:
                ctx.meta[CONFIG] = (path, config.read(path))
            except ConfigError as e:
                raise click.UsageError(str(e), ctx=ctx) from None
            target = target or config.target_in(ctx.meta[CONFIG][1], path)
        if target is not None:
            try:
                cls = load_target(target)
            except click.UsageError as e:
                e.ctx = ctx
                raise
            taken = {o for p in self.params for o in p.opts}
            ctx.meta[CLASS] = cls
            ctx.meta[FIELDS] = field_options(cls, sweep=self.sweep, taken=taken)
        args = _flag_words(args, self.get_params(ctx))
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            raise _no_such_option(ctx, e) from None

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        extra = ctx.meta.get(FIELDS, [])
        replaced = {o for p in extra for o in p.opts}
        base = [p for p in super().get_params(ctx) if not set(p.opts) & replaced]
        return base + extra

    def _find_target(self, args: list[str]) -> str | None:
        """TARGET: the first positional token of TARGET's shape (field options, not known
        yet, may come before it), else the first token that is no option's value."""
        takes_value = {
            o
            for p in self.params
            if isinstance(p, click.Option) and not p.is_flag and not p.count
            for o in p.opts
        }
        loose: list[str] = []
        after = ""  # the option token before this one, if it may take this one as its value
        for i, tok in enumerate(args):
            if tok == "--":
                loose += args[i + 1 : i + 2]
                break
            if tok.startswith("-"):
                name = tok.replace("_", "-")
                flag = name in _FLAGS or name.startswith("--no-")
                after = "" if "=" in tok or flag else name
                continue
            if after in takes_value:  # a known option's value
                after = ""
                continue
            if looks_like_target(tok):
                return tok
            if not after:  # after an unknown option it is probably that option's value
                loose.append(tok)
            after = ""
        return loose[0] if loose else None

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        extra = ctx.meta.get(FIELDS, [])
        own = [p for p in self.get_params(ctx) if p not in extra]
        records = (p.get_help_record(ctx) for p in own if not isinstance(p, click.Argument))
        rows = [r for r in records if r is not None]
        with formatter.section("Options"):
            formatter.write_dl(rows)
        cls = ctx.meta.get(CLASS)
        if cls is None:
            with formatter.section("Experiment fields"):
                formatter.write_text(
                    "Give TARGET to list its fields as options, grouped by marker, and its "
                    f"presets: jaxnitro {ctx.info_name} path/to/file.py:Class --help"
                )
            return
        for marker, title in _SECTIONS.items():
            group = [p for p in extra if p.field.marker == marker]
            if group:
                with formatter.section(f"{cls.__name__}: {title}"):
                    formatter.write_dl([r for p in group if (r := p.get_help_record(ctx))])
        shown = {p.field.name for p in extra}
        hidden = [f.name for f in fields(cls) if f.name not in shown]
        if hidden:
            formatter.write_paragraph()
            formatter.write_text(f"Not settable from the shell (type or name): {', '.join(hidden)}")
        _format_presets(cls, formatter)


def _flag_words(args: list[str], params: list[click.Parameter]) -> list[str]:
    """A bool flag given a word of the bool vocabulary (`--log-grad-norm y`, `--shuffle=off`,
    `core.words`) as the flag it means (`--log-grad-norm`, `--no-shuffle`): every bool, field
    or option, reads the same words as a config file's or an MCP value."""
    pairs = {
        o: (p.opts[0], p.secondary_opts[0])
        for p in params
        if isinstance(p, click.Option) and p.is_flag and p.secondary_opts
        for o in p.opts
    }
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            return out + args[i:]
        name, eq, text = tok.partition("=")
        pair = pairs.get(name)
        if pair is not None and eq:
            word = bool_word(text)
            if word is None:
                raise click.BadParameter(
                    f"{text!r} is not a bool; use {vocabulary()}", param_hint=name
                )
            out.append(pair[0] if word else pair[1])
        elif pair is not None and i + 1 < len(args) and bool_word(args[i + 1]) is not None:
            out.append(pair[0] if bool_word(args[i + 1]) else pair[1])
            i += 1
        else:
            out.append(tok)
        i += 1
    return out


def _config_path(args: list[str]) -> Path | None:
    """The value of `--config` among the arguments (click parses them later)."""
    for i, tok in enumerate(args):
        if tok == "--":
            break
        if tok == "--config" and i + 1 < len(args):
            return Path(args[i + 1])
        if tok.startswith("--config="):
            return Path(tok.split("=", 1)[1])
    return None


def _format_presets(cls: Any, formatter: click.HelpFormatter) -> None:
    table = cls.presets() or {}
    with formatter.section(f"{cls.__name__}: presets (--preset NAME)"):
        if not table:
            formatter.write_text("none (define a presets() classmethod to add some)")
            return
        formatter.write_dl(
            [
                (name, ", ".join(f"{k}={v!r}" for k, v in values.items()) or "(defaults)")
                for name, values in table.items()
            ]
        )


def _no_such_option(ctx: click.Context, e: click.NoSuchOption) -> click.UsageError:
    """Click's message, with the closest field (or option) named, and where to see them all."""
    params = ctx.command.get_params(ctx)
    extra = ctx.meta.get(FIELDS, [])
    names = [o for p in params for o in p.opts + p.secondary_opts if o.startswith("--")]
    asked = e.option_name.split("=", 1)[0]
    match = closest(asked, names, cutoff=0.5)
    cls = ctx.meta.get(CLASS)
    message = f"No such option {asked!r}."
    if match is not None:
        by = next((p for p in extra if match in p.opts + p.secondary_opts), None)
        owner = getattr(cls, "__name__", "the experiment")
        what = f" ({by.field.marker} field {by.field.name!r} of {owner})" if by else ""
        message += f" Did you mean {match}{what}?"
    if cls is not None:
        listed = ", ".join(kebab(p.field.name) for p in extra)
        message += f" Fields of {cls.__name__}: {listed}."
    return click.NoSuchOption(asked, message=message, ctx=ctx)
