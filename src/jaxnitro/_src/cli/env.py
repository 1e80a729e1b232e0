"""`jaxnitro env`: the process layout this process would start with, and who says so, without
starting anything (see `jaxnitro._src.dist.layout`)."""

from __future__ import annotations

import click

from jaxnitro._src.cli.common import CONTEXT, emit


def _text(layout) -> str:
    devices = (
        "all visible"
        if layout.local_device_ids is None
        else ",".join(str(i) for i in layout.local_device_ids)
    )
    read = f" ({', '.join(layout.variables)})" if layout.variables else ""
    lines = [
        f"source:        {layout.source}{read}",
        f"processes:     {layout.num_processes}",
        f"process id:    {layout.process_id}",
        f"coordinator:   {layout.coordinator_address or 'none (one process: nothing to start)'}",
        f"local devices: {devices} ({layout.devices_from})",
    ]
    lines += [f"note: {note}" for note in layout.notes]
    return "\n".join(lines)


@click.command("env", context_settings=CONTEXT)
@click.option("--coordinator", default=None, help="host:port of process 0 (explicit).")
@click.option("--num-processes", type=click.IntRange(min=1), default=None, help="(explicit)")
@click.option("--process-id", type=click.IntRange(min=0), default=None, help="(explicit)")
@click.option(
    "--local-device-ids", default=None, help="Comma-separated device ids (explicit), e.g. 0,1."
)
@click.option("--json", "as_json", is_flag=True, help="Print a dict.")
def env_command(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: str | None,
    as_json: bool,
) -> None:
    """Print the process layout jn.distributed.initialize() would start: the number of
    processes, this process's id, the coordinator, the local devices, and the source
    (explicit, kubeflow, jaxjob, openmpi, slurm, tpu, k8s, launch or single), tried in that
    order. Nothing is started: run it as a step of the job (srun jaxnitro env) to see what
    each process would do.
    """
    from jaxnitro._src.core.errors import ConfigError
    from jaxnitro._src.dist.layout import resolve

    ids = None
    if local_device_ids is not None:
        try:
            ids = [int(x) for x in local_device_ids.split(",")]
        except ValueError:
            raise click.BadParameter(
                f"{local_device_ids!r} is not a comma-separated list of ids, e.g. 0,1.",
                param_hint="--local-device-ids",
            ) from None
    try:
        layout = resolve(coordinator, num_processes, process_id, ids)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    emit(layout.as_dict(), as_json=as_json, text=lambda _: _text(layout))
