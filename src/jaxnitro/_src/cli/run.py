"""`jaxnitro train`, and the commands that load a checkpoint: validate, evaluate, predict,
inspect (which only looks)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from jaxnitro._src.cli.common import (
    CONTEXT,
    PROGRESS,
    build_experiment,
    checkpoint_config,
    checkpoint_path,
    config_data,
    config_target,
    emit,
    need_target,
    nitro_kwargs,
    run_options,
)
from jaxnitro._src.cli.fields import ExperimentCommand

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target", required=False)
@run_options(config=True, print_config=True)
@click.pass_context
def train(ctx: click.Context, target: str | None, **_: Any) -> None:
    """Train TARGET (path/to/file.py:Class or pkg.module:Class); options set its fields.

    \b
      jaxnitro train examples/mnist.py:MnistMLP --width 256 --smoothing 0.1 --max-epochs 3
      jaxnitro train mypkg.exps:Big --preset small --precision bf16 --resume auto
      jaxnitro train --config runs/MnistMLP/config.toml --run-dir runs/again   # a repeat
    """
    import jaxnitro as jn
    from jaxnitro._src.run import config

    need_target(ctx)
    preset = ctx.params["preset"] or config_data(ctx).get("preset")
    exp = build_experiment(ctx, preset)
    kwargs = nitro_kwargs(ctx, exp)
    named = {"target": target or config_target(ctx), "preset": preset}
    if ctx.params["print_config"]:
        click.echo(config.to_toml({**config.run_config(exp, kwargs), **named}), nl=False)
        return
    n = jn.Nitro(exp, **kwargs)
    n.config.update(named)
    result = jn.train(n)
    summary = train_summary(n, result)
    emit(summary, as_json=ctx.params["as_json"], text=lambda s: _train_text(s, n.display.mode))


def train_summary(n: Nitro, result) -> dict[str, Any]:
    """What a finished `jn.train` reports, as plain data (the JSON of `train --json`)."""
    curves = Path(n.run_dir) / "curves.png"
    return {
        "experiment": n.spec.cls.__name__,
        "run_dir": str(n.run_dir),
        "stop_reason": result.stop_reason,
        "epoch": n.epoch,
        "step": n.step,
        "metric": n.checkpointer.metric,
        "best_metric": result.best_metric,
        "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
        "programs_compiled": result.programs_compiled,
        "steps_per_second": result.steps_per_second,
        "wall_seconds": result.wall_seconds,
        "curves": str(curves) if curves.is_file() else None,
    }


def _train_text(s: dict, display_mode: str) -> str:
    lines = []
    if display_mode == "off":  # the display printed no summary of its own
        best = s["best_metric"]
        lines.append(
            f"done ({s['stop_reason']}) · epoch {s['epoch']} · step {s['step']} · "
            + (f"best {s['metric']} {best:.4f}" if isinstance(best, float) else "no validation")
            + f" · {s['programs_compiled']} program(s) compiled · checkpoint {s['best_checkpoint']}"
        )
    extra = " · curves.png" if s["curves"] else ""
    lines.append(f"run dir {s['run_dir']} (metrics.jsonl{extra})")
    return "\n".join(lines)


# -- commands on a checkpoint -----------------------------------------------------------------
def _checkpoint_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="Print JSON.")(fn)
    fn = click.option("--progress", type=PROGRESS, default="off", help="The progress display.")(fn)
    fn = click.option(
        "--run-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="Where to log (default: a temporary directory, removed afterwards).",
    )(fn)
    fn = click.option("--preset", metavar="NAME", help="Start from one of the presets.")(fn)
    return fn


def _checkpoint_option(required: bool):
    return click.option(
        "--checkpoint",
        type=click.Path(exists=True, path_type=Path),
        required=required,
        help="A checkpoint directory, or a run directory (its best checkpoint).",
    )


@contextlib.contextmanager
def loaded(ctx: click.Context) -> Iterator[Any]:
    """A `Nitro` on the checkpoint (GraphConst values from its config unless given), in
    `--run-dir` or a temporary directory."""
    import jaxnitro as jn

    path = ctx.params.get("checkpoint")
    path = checkpoint_path(path) if path is not None else None
    base = checkpoint_config(ctx, path) if path is not None else {}
    exp = build_experiment(ctx, ctx.params["preset"], base)
    with contextlib.ExitStack() as stack:
        run_dir = ctx.params.get("run_dir") or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxnitro-"))
        )
        yield jn.Nitro(exp, **nitro_kwargs(ctx, exp, run_dir=run_dir, checkpoint=path))


def _metrics_text(values: dict) -> str:
    width = max((len(k) for k in values), default=0)
    return "\n".join(
        f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
        for k, v in values.items()
    )


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target")
@_checkpoint_option(required=True)
@_checkpoint_options
@click.pass_context
def validate(ctx: click.Context, target: str, **_: Any) -> None:
    """Metrics of the 'val' split for a checkpoint of TARGET."""
    import jaxnitro as jn

    with loaded(ctx) as n:
        emit(jn.validate(n), as_json=ctx.params["as_json"], text=_metrics_text)


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target")
@_checkpoint_option(required=True)
@click.option("--split", default="test", show_default=True, help="The split to evaluate.")
@_checkpoint_options
@click.pass_context
def evaluate(ctx: click.Context, target: str, split: str, **_: Any) -> None:
    """Metrics of any split (default 'test') for a checkpoint of TARGET."""
    import jaxnitro as jn

    with loaded(ctx) as n:
        emit(jn.evaluate(n, split=split), as_json=ctx.params["as_json"], text=_metrics_text)


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target")
@_checkpoint_option(required=True)
@click.option("--split", default="val", show_default=True, help="The split to predict on.")
@click.option("--batches", type=click.IntRange(min=0), default=1, show_default=True, help="0: all.")
@click.option("--rows", type=click.IntRange(min=0), default=3, show_default=True)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the outputs (.npz)."
)
@_checkpoint_options
@click.pass_context
def predict(ctx: click.Context, target: str, split: str, batches: int, rows: int, **_: Any):
    """`forward` outputs on the first batch(es) of a split: shapes and first rows, or a .npz."""
    import jax

    import jaxnitro as jn
    from jaxnitro._src.train.evaluation import check_split

    with loaded(ctx) as n:
        check_split(n, split)
        outs = list(itertools.islice(jn.predict(n, n.splits[split]), batches or None))
    if not outs:
        raise click.UsageError(f"split {split!r} yielded no batch.")
    joined = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *outs)
    flat = jax.tree_util.tree_flatten_with_path(joined)[0]
    leaves: dict[str, Any] = {_leaf_name(p): np.asarray(v) for p, v in flat}
    out = ctx.params.get("out")
    if out is not None:
        np.savez(out, allow_pickle=False, **leaves)
        click.echo(f"wrote {out}: " + ", ".join(f"{k} {v.shape}" for k, v in leaves.items()))
        return
    report = {
        k: {"shape": list(v.shape), "dtype": str(v.dtype), "first_rows": v[:rows]}
        for k, v in leaves.items()
    }
    emit(report, as_json=ctx.params["as_json"], text=_predict_text)


def _leaf_name(path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(parts) or "output"


def _predict_text(report: dict) -> str:
    lines = []
    for name, r in report.items():
        lines.append(f"{name}: shape {tuple(r['shape'])} {r['dtype']}")
        text = np.array2string(np.asarray(r["first_rows"]), precision=4, threshold=60, edgeitems=4)
        lines += ["  " + line for line in text.splitlines()]
    return "\n".join(lines)


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target")
@_checkpoint_option(required=False)
@_checkpoint_options
@click.pass_context
def inspect(ctx: click.Context, target: str, **_: Any) -> None:
    """Binding report, parameter groups, compile report and memory plan; no training."""
    import jaxnitro as jn

    with loaded(ctx) as n:
        report = jn.inspect(n, show=False)
    emit(dataclasses.asdict(report), as_json=ctx.params["as_json"], text=lambda _: str(report))


COMMANDS = [train, validate, evaluate, predict, inspect]
