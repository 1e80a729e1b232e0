"""`jaxnitro launch --nproc N [--devices-per-process K] script.py [args...]`: a local
multi-process run (see `jaxnitro._src.dist.launcher`)."""

from __future__ import annotations

import click

from jaxnitro._src.core.errors import ConfigError


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    required=True,
    help="How many processes (ranks) to start on this machine.",
)
@click.option(
    "--devices-per-process",
    type=click.IntRange(min=1),
    default=None,
    help="Give each rank K fake CPU devices (XLA_FLAGS device count; JAX_PLATFORMS=cpu).",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Coordinator port (default: a free one).",
)
@click.option(
    "-m",
    "--module",
    "module",
    is_flag=True,
    help="SCRIPT is a module name, run as python -m SCRIPT.",
)
@click.option(
    "--grace",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds the other ranks get to checkpoint after one is preempted.",
)
@click.option(
    "--kill-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when stopping ranks after a failure.",
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(
    nproc: int,
    devices_per_process: int | None,
    port: int | None,
    module: bool,
    grace: float,
    kill_timeout: float,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Run SCRIPT as NPROC processes of one jax.distributed run on this machine.

    The script calls jn.distributed.initialize() first: each rank finds the coordinator,
    the process count and its id in $JAXNITRO_COORDINATOR, $JAXNITRO_NUM_PROCESSES and
    $JAXNITRO_PROCESS_ID. Output lines are prefixed [rank i]; SIGINT/SIGTERM go to every
    rank; when a rank fails the others are stopped and the exit status is the first failure's
    (a rank that raised is named with its exception). The ranks die with the launcher.

    Example: jaxnitro launch --nproc 2 --devices-per-process 2 train.py --epochs 3
    """
    from jaxnitro._src.dist import launcher

    try:
        cmd = launcher.command(script, args, module=module)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    run = launcher.Launch(
        cmd,
        nproc,
        devices_per_process=devices_per_process,
        port=port,
        grace=grace,
        kill_timeout=kill_timeout,
    )
    outcome = run.run()
    if outcome.status:
        run.note(outcome.message)
    raise SystemExit(outcome.status)
