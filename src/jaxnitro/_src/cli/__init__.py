"""The `jaxnitro` command: train, evaluate, sweep and look at runs from the shell.

It may import every part: nothing imports it but `__main__`.

Built on click. The options of `train`, `sweep`, `validate`... are the TARGET experiment's
fields, known only once TARGET is loaded: click lets a command build `click.Option` objects at
run time (`ExperimentCommand` adds them just before parsing), and then does the rest of the
work a hand-written parser gets wrong: typed conversion with errors that name the option
(exit status 2), a did-you-mean for a misspelled option, `--name/--no-name` flags, help text
with sections (fields grouped by marker), and a group of subcommands that `export`, `serve`
and `launch` join later with `cli.add_command(...)`. argparse cannot add options after
reading the first argument without parsing twice; typer, built on click, derives options
from a function's signature, which is fixed before TARGET is known.

Exit status: 0 on success, 1 on a jaxnitro error (a short message, no traceback), 2 on a
usage error (a bad TARGET, option or value), 143 on preemption (SIGTERM; `--resume auto`
continues), 130 on a second Ctrl-C.

Example:
    $ jaxnitro train examples/mnist.py:MnistMLP --width 256 --max-epochs 3
    $ jaxnitro runs
"""

from __future__ import annotations

import importlib.metadata
import os

import click

from jaxnitro._src.cli import browse, run, sweep
from jaxnitro._src.cli.cache import cache_command
from jaxnitro._src.cli.common import echo_err
from jaxnitro._src.cli.env import env_command
from jaxnitro._src.cli.export import export
from jaxnitro._src.cli.fields import ExperimentCommand
from jaxnitro._src.cli.launch import launch
from jaxnitro._src.cli.mcp_server import mcp_command
from jaxnitro._src.core.errors import JaxnitroError
from jaxnitro._src.dist import peer_watch
from jaxnitro._src.observe.events.signals import Preempted
from jaxnitro._src.serve.command import serve_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(importlib.metadata.version("jaxnitro"), prog_name="jaxnitro")
@click.option(
    "--compilation-cache",
    metavar="DIR|0",
    default=None,
    help="Where compiled programs persist between runs (0: off). Default: "
    "$JAXNITRO_COMPILATION_CACHE, else the user cache directory.",
)
@click.pass_context
def cli(ctx: click.Context, compilation_cache: str | None) -> None:
    """JAX-first training: declare the experiment, compile once, train.

    TARGET is path/to/file.py:Class or pkg.module:Class (an @jn.experiment class); its
    fields become options: jaxnitro train TARGET --help lists them.
    """
    if compilation_cache is not None:  # the run (and `launch`'s ranks) read it at setup
        os.environ["JAXNITRO_COMPILATION_CACHE"] = compilation_cache
    if ctx.invoked_subcommand == "serve" and "--help" not in ctx.args:
        # A served model's warm-up compiles persist too (a container mounts the directory)
        from jaxnitro._src.dist.devices import apply_env

        apply_env()


def _http_port_alias(command: click.Command) -> click.Command:
    """`--http-port`, KServe's and Triton's name for the REST port, as a second name of
    `jaxnitro serve --port` (the container's entrypoint uses it; the last value given
    wins, so a pod's `args` override the image's)."""
    port = next(p for p in command.params if p.name == "port")
    if "--http-port" not in port.opts:
        port.opts.append("--http-port")
    return command


for _command in [
    *run.COMMANDS,
    sweep.sweep,
    *browse.COMMANDS,
    export,
    _http_port_alias(serve_command),
    launch,
    cache_command,
    env_command,
    mcp_command,
]:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """The console script: run the command line `argv` (default `sys.argv[1:]`) and exit."""
    try:
        code = cli.main(args=argv, prog_name="jaxnitro", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    except click.Abort:
        echo_err("Aborted.")
        raise SystemExit(130) from None
    except Preempted as e:
        echo_err(f"{e} From the shell: the same command with --resume auto.")
        raise SystemExit(143) from None
    except JaxnitroError as e:
        echo_err(f"Error: {type(e).__name__}: {e}")
        peer_watch.fail(e)  # one process of several: the others stop now, not in 5 minutes
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)


__all__ = ["ExperimentCommand", "cli", "main"]
