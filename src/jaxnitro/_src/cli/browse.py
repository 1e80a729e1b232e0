"""`jaxnitro runs` (a table of the runs under a directory) and `jaxnitro plot` (their curves)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from jaxnitro._src.cli.common import CONTEXT, emit

_STYLE = {
    "completed": "green",
    "running": "cyan",
    "early_stop": "green",
    "error": "red",
    "killed": "red",
    "preempted": "yellow",
    "requested": "yellow",
}


@click.command("runs", context_settings=CONTEXT)
@click.argument("directory", default="runs", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a list of dicts.")
def runs_command(directory: Path, as_json: bool) -> None:
    """The runs under DIRECTORY (default runs/), newest first.

    A run is any directory holding a metrics.jsonl. Its status comes from its last finish
    line: completed, early_stop, preempted, error, requested; running while a writer holds
    the run lock; killed when the log just stops.
    """
    from jaxnitro._src.observe.display import Display
    from jaxnitro._src.observe.runs import list_runs

    if not directory.is_dir():
        raise click.BadParameter(
            f"no directory {str(directory)!r} (from {Path.cwd()}); runs are listed from a "
            f"directory such as runs/.",
            param_hint="'DIRECTORY'",
        )
    infos = list_runs(directory, display=Display(None, file=sys.stderr))
    if not infos and not as_json:
        click.echo(f"no runs under {directory} (a run directory holds a metrics.jsonl)")
        return
    emit([i.to_dict() for i in infos], as_json=as_json, text=lambda _: _table(infos))


def _table(infos):
    from rich.table import Table

    table = Table(title=f"{len(infos)} run(s), newest first")
    from jaxnitro._src.observe.timing import format_split

    cols = ("experiment", "status", "epoch", "step", "best", "time (last epoch)", "updated")
    for col in (*cols, "run dir"):
        table.add_column(
            col,
            overflow="fold",
            no_wrap=col != "run dir",
            justify="right" if col in ("epoch", "step") else "left",
        )
    for r in infos:
        best = f"{r.metric} {r.best:.4g}" if r.best is not None else "-"
        style = _STYLE.get(r.status, "")
        table.add_row(
            r.experiment or "?",
            f"[{style}]{r.status}[/]" if style else r.status,
            "-" if r.epoch is None else str(r.epoch),
            "-" if r.step is None else str(r.step),
            best,
            "-" if r.time_split is None else format_split(r.time_split, short=True),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated)),
            str(r.run_dir),
        )
    return table


@click.command("plot", context_settings=CONTEXT)
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--metrics", metavar="NAME,...", help="e.g. loss,acc (default: all logged).")
@click.option("--x", type=click.Choice(["step", "epoch"]), default="step", show_default=True)
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The PNG (default: RUN/curves.png for one run, curves.png for several).",
)
def plot_command(runs: tuple[Path, ...], metrics: str | None, x: str, out: Path | None) -> None:
    """Training and validation curves of one or several RUNs overlaid, into a PNG.

    Each RUN is a run directory or its metrics.jsonl.
    """
    from jaxnitro._src.observe.display import Display
    from jaxnitro._src.observe.plot import plot

    shown = Display(None, file=sys.stderr)  # stdout keeps the one "wrote" line
    click.echo(f"wrote {plot(list(runs), metrics=metrics, out=out, x=x, display=shown)}")


COMMANDS = [runs_command, plot_command]
