"""`jaxnitro export TARGET --checkpoint PATH DIR`: a checkpoint to a servable bundle."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from jaxnitro._src.cli.common import emit
from jaxnitro._src.cli.fields import ExperimentCommand
from jaxnitro._src.cli.run import CONTEXT, _checkpoint_option, _checkpoint_options, loaded


@click.command(cls=ExperimentCommand, context_settings=CONTEXT)
@click.argument("target")
@click.argument("out_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@_checkpoint_option(required=True)
@click.option("--name", help="The bundle's name (default: the experiment class, lowercased).")
@click.option(
    "--platforms",
    default="cpu,cuda",
    show_default=True,
    help="Comma-separated platforms to lower for (cpu, cuda, rocm, tpu).",
)
@_checkpoint_options
@click.pass_context
def export(
    ctx: click.Context, target: str, out_dir: Path, name: str | None, platforms: str, **_: Any
) -> None:
    """Export a checkpoint of TARGET as a bundle in DIR (jaxnitro serve DIR serves it)."""
    import jaxnitro as jn

    wanted = tuple(p.strip() for p in platforms.split(",") if p.strip())
    with loaded(ctx) as n:
        path = jn.export_model(n, out_dir, name=name, platforms=wanted)
        manifest = jn.load_bundle(path).manifest
    summary = {
        "bundle": str(path),
        "name": manifest["name"],
        "inputs": manifest["inputs"],
        "outputs": manifest["outputs"],
        "platforms": manifest["platforms"],
    }
    emit(summary, as_json=ctx.params["as_json"], text=_text)


def _text(s: dict) -> str:
    def sig(t: dict) -> str:
        return f"{t['name']} {t['dtype']}[{', '.join(map(str, t['shape']))}]"

    return (
        f"exported {s['name']} to {s['bundle']} ({', '.join(s['platforms'])})\n"
        f"  inputs:  {'; '.join(sig(t) for t in s['inputs'])}\n"
        f"  outputs: {'; '.join(sig(t) for t in s['outputs'])}\n"
        f"serve it: jaxnitro serve {shlex.quote(s['bundle'])}"  # pasted into a shell
    )
