"""`jaxnitro cache info|clear`: the persistent compilation cache from the shell."""

from __future__ import annotations

import click

from jaxnitro._src.cli.common import CONTEXT, emit

_DIR = click.option(
    "--dir",
    "directory",
    default=None,
    help="The cache directory (default: $JAXNITRO_COMPILATION_CACHE, else the user cache "
    "directory, as a run would use).",
)


def _directory(directory: str | None) -> str:
    from jaxnitro._src.dist.devices import cache_dir_choice

    path = cache_dir_choice(directory)
    if path is None:
        raise click.UsageError(
            "the compilation cache is off (JAXNITRO_COMPILATION_CACHE=0); pass --dir DIR to "
            "look at a cache directory anyway."
        )
    return path


@click.group("cache", context_settings=CONTEXT)
def cache_command() -> None:
    """The persistent compilation cache: a second run of a script loads its programs
    instead of compiling them. On by default; JAXNITRO_COMPILATION_CACHE=0 (or
    jn.setup_devices(compilation_cache=False)) turns it off."""


@cache_command.command("info", context_settings=CONTEXT)
@_DIR
@click.option("--json", "as_json", is_flag=True, help="Print a dict.")
def info_command(directory: str | None, as_json: bool) -> None:
    """Where the cache is, its size, its entries and how often it served."""
    from jaxnitro._src.compile.persistent import info
    from jaxnitro._src.core.units import format_bytes
    from jaxnitro._src.dist.devices import DEFAULT_CACHE_MAX_SIZE

    got = info(_directory(directory))

    def text(_) -> str:
        rate = "-" if got.hit_rate is None else f"{got.hit_rate:.0%}"
        return "\n".join(
            [
                f"directory  {got.directory}" + ("" if got.exists else " (not created yet)"),
                f"entries    {got.entries}",
                f"size       {format_bytes(got.size_bytes)} (cap "
                f"{format_bytes(DEFAULT_CACHE_MAX_SIZE)} unless "
                "JAXNITRO_COMPILATION_CACHE_MAX_SIZE says otherwise)",
                f"hit rate   {rate} ({got.loaded} loaded, {got.compiled} compiled, over "
                f"{got.processes} process(es))",
                "trusted    "
                + (
                    f"no: {' and '.join(got.untrusted)} (runs do not use it)"
                    if got.untrusted
                    else "yes: a private path; entries load only when signed with your key"
                ),
            ]
        )

    emit(got.to_dict(), as_json=as_json, text=text)


@cache_command.command("clear", context_settings=CONTEXT)
@_DIR
def clear_command(directory: str | None) -> None:
    """Remove every entry: the next run of each program compiles it again."""
    from jaxnitro._src.compile.persistent import clear

    path = _directory(directory)
    click.echo(f"removed {clear(path)} entr(ies) from {path}")
