"""`jaxnitro sweep`: a grid of runs in one process, each point in its own run directory.

Every field option takes comma-separated values (`--smoothing 0.0,0.05 --width 64,128`, bools
as `true,false`), `--seed` too; the grid is their product, in field order with the seed last.
Points run one after another in this process, so the process-wide compile cache serves every
point after the first whose GraphConst values were seen: a sweep over Device and Host fields
compiles only the first point's programs.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import click

from jaxnitro._src.cli.common import (
    CONTEXT,
    build_experiment,
    config_data,
    echo_err,
    emit,
    need_target,
    nitro_kwargs,
    run_options,
)
from jaxnitro._src.cli.fields import ExperimentCommand, given, given_fields
from jaxnitro._src.cli.values import ListOf
from jaxnitro._src.core.errors import JaxnitroError


class SweepCommand(ExperimentCommand):
    """Field options take lists of values."""

    sweep = True


@click.command(cls=SweepCommand, context_settings=CONTEXT)
@click.argument("target", required=False)
@run_options(exclude=("seed",), config=True)
@click.option(
    "--seed", type=ListOf(click.IntRange(min=0)), metavar="INT,...", help="Seeds to sweep."
)
@click.pass_context
def sweep(ctx: click.Context, target: str | None, **_: Any) -> None:
    """Train TARGET at every point of a grid of field values; a table ranks the points.

    Every field option takes comma-separated values (bools as true,false), --seed too; the
    grid is their product. --config FILE.toml gives the target, fields and options the grid
    starts from (flags win). Point k runs in <run-dir or runs/Class>/sweep-<k>-<field>=<value>...
    (the fields that vary), in this process: a sweep over Device and Host fields compiles only
    the first point's programs.

    \b
      jaxnitro sweep examples/mnist.py:MnistMLP --smoothing 0.0,0.05,0.1 --seed 1,2
    """
    import jaxnitro as jn

    need_target(ctx)
    cls = ctx.meta["jaxnitro.class"]
    from_file = (config_data(ctx).get("options") or {}).get("run_dir")
    base = Path(ctx.params["run_dir"] or from_file or Path("runs") / cls.__name__)
    points = grid(given_fields(ctx), ctx.params.get("seed") if given(ctx, "seed") else None)
    varying = [name for name in points[0] if len({repr(p[name]) for p in points}) > 1]
    rows: list[dict] = []
    for k, point in enumerate(points):
        run_dir = base / point_name(k, {name: point[name] for name in varying})
        echo_err(
            f"sweep point {k + 1}/{len(points)}: {_values_text(point)} → {run_dir}"
            + _best_so_far(rows)
        )
        values = {f: v for f, v in point.items() if f != "seed" or f in _field_names(cls)}
        exp = build_experiment(ctx, ctx.params["preset"], values=values)
        fixed: dict[str, Any] = {"run_dir": run_dir}
        if "seed" in point:
            fixed["seed"] = point["seed"]
        row: dict[str, Any] = {"point": k, "values": point, "run_dir": str(run_dir)}
        try:
            n = jn.Nitro(exp, **nitro_kwargs(ctx, exp, **fixed))
            result = jn.train(n)
        except JaxnitroError as e:  # one failed point does not end the sweep
            echo_err(f"  point {k} failed: {type(e).__name__}: {e}")
            rows.append({**row, "stop_reason": "error", "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(
            {
                **row,
                "stop_reason": result.stop_reason,
                "metric": n.checkpointer.metric,
                "mode": n.checkpointer.mode,
                "best_metric": result.best_metric,
                "programs_compiled": result.programs_compiled,
                "steps_per_second": result.steps_per_second,
                "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
            }
        )
        if result.stop_reason == "requested":  # Ctrl-C: the user wants the sweep to end
            echo_err("stop requested: the remaining points are skipped.")
            break
    rows = ranked(rows)
    emit(rows, as_json=ctx.params["as_json"], text=lambda r: _table(r, varying))
    if any(r.get("error") for r in rows):
        ctx.exit(1)


def grid(axes: dict[str, list], seeds: list[int] | None) -> list[dict[str, Any]]:
    """Every combination of the axes' values (a field given once is one value), seeds last.

    Example:
        >>> grid({"width": [64, 128], "smoothing": [0.0]}, [1, 2])[1]
        {'width': 64, 'smoothing': 0.0, 'seed': 2}
    """
    axes = {**axes, **({"seed": seeds} if seeds else {})}
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*axes.values())]


def point_name(k: int, point: dict[str, Any]) -> str:
    """`sweep-<k>-<field>=<value>-...` for the fields that vary (path separators replaced)."""
    parts = [f"{name}={_fmt(v)}" for name, v in point.items()]
    return "-".join([f"sweep-{k}", *parts])


def _fmt(v: Any) -> str:
    text = repr(v) if isinstance(v, (tuple, list, float)) else str(v)
    for ch in (os.sep, "/", " "):
        text = text.replace(ch, "_" if ch != " " else "")
    return text


def ranked(rows: list[dict]) -> list[dict]:
    """Best first by each row's checkpointer metric and mode; points without one last."""

    def key(r: dict):
        v = r.get("best_metric")
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return (1, 0.0, r["point"])
        return (0, v if r.get("mode", "min") == "min" else -v, r["point"])

    return sorted(rows, key=key)


def _best_so_far(rows: list[dict]) -> str:
    """` · best so far: val_loss 0.31 (point 0)`, once a finished point has a metric."""
    if not rows:
        return ""
    best = ranked(rows)[0]
    v = best.get("best_metric")
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return ""
    return f" · best so far: {best['metric']} {v:.4g} (point {best['point']})"


def _field_names(cls: type) -> set[str]:
    from jaxnitro._src.experiment.markers import fields

    return {f.name for f in fields(cls)}


def _values_text(point: dict) -> str:
    return " ".join(f"{k}={v!r}" for k, v in point.items()) or "(defaults)"


def _table(rows: list[dict], names: list[str]) -> Any:
    from rich.table import Table

    metric = next((r["metric"] for r in rows if r.get("metric")), "val_loss")
    table = Table(title=f"sweep: {len(rows)} point(s), best {metric} first")
    for col in ["#", *names, f"best {metric}", "stop", "compiled", "steps/s", "run dir"]:
        table.add_column(col, overflow="fold")
    for r in rows:
        best = r.get("best_metric")
        table.add_row(
            str(r["point"]),
            *[repr(r["values"].get(n)) for n in names],
            f"{best:.4f}" if isinstance(best, float) else "-",
            r["stop_reason"] if not r.get("error") else f"error: {r['error']:.60}",
            str(r.get("programs_compiled", "-")),
            f"{r['steps_per_second']:,.0f}" if r.get("steps_per_second") else "-",
            r["run_dir"],
        )
    return table
