"""The `jaxnitro serve` command (registered in the `jaxnitro` group by the CLI; also
`python -m jaxnitro._src.serve`)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import click

from jaxnitro._src.serve.batcher import MAX_QUEUE_SIZE
from jaxnitro._src.serve.body import MAX_BODY_BYTES, READ_TIMEOUT_S

# the defaults of serve(), repeated so that --help needs neither uvicorn nor grpcio:
# tests/unit/serve/test_serve_limits.py checks they agree
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1000
DRAIN_TIMEOUT_S = 30.0
EXIT_CUT = 3
REPOSITORY_POLL_SECS = 15.0
MODEL_LOAD_TIMEOUT_S = 600.0
#: Triton's default ports for gRPC and metrics.
GRPC_PORT = 8001
METRICS_PORT = 8002


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument(
    "dirs",
    nargs=-1,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="[DIR ...]",
)
@click.option(
    "--model-repository",
    default=None,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Serve DIR/<model>/<version>/ (a bundle per version) instead of bundle DIRs.",
)
@click.option(
    "--model-control-mode",
    default="none",
    show_default=True,
    type=click.Choice(["none", "poll", "explicit"]),
    help="none: load all at start; poll: rescan, load added and unload removed versions; "
    "explicit: load --load-model and what the load API asks for.",
)
@click.option(
    "--repository-poll-secs",
    default=REPOSITORY_POLL_SECS,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds between rescans of the repository (poll mode).",
)
@click.option(
    "--load-model",
    multiple=True,
    metavar="NAME",
    help="A model explicit mode loads at start (repeat for several).",
)
@click.option(
    "--version-policy",
    default=None,
    metavar="POLICY",
    help="Versions served of a model without policy.json: latest:N, all, specific:1,3. "
    "[default: latest:1]",
)
@click.option(
    "--model-load-timeout",
    default=MODEL_LOAD_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="Seconds a model version gets to load and warm up; past it, it is UNAVAILABLE "
    "with that reason while the other models load and unload.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="REST port (0: a free one, printed at start-up).",
)
@click.option(
    "--grpc-port",
    default=GRPC_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="gRPC (inference.GRPCInferenceService) port (0: a free one).",
)
@click.option("--no-grpc", is_flag=True, help="Serve no gRPC.")
@click.option(
    "--metrics-port",
    default=METRICS_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Also serve /metrics on this port (0: a free one); always on the REST port too.",
)
@click.option("--no-metrics-port", is_flag=True, help="Serve /metrics on the REST port only.")
@click.option(
    "--max-batch-size",
    default=None,
    type=click.IntRange(min=1),
    help="Merge concurrent requests into model calls of up to N rows. [default: off]",
)
@click.option(
    "--max-batch-delay-ms",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="How long a request may wait for others to join its call.",
)
@click.option(
    "--max-body-bytes",
    default=MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest request body (also after decompression) and decoded input.",
)
@click.option(
    "--max-queue-size",
    default=MAX_QUEUE_SIZE,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests waiting per model before new ones get 503.",
)
@click.option(
    "--max-inflight-bytes",
    default=None,
    type=click.IntRange(min=1),
    help="Request bytes answered at once (REST and gRPC) before new requests get 503. "
    "[default: 4 x --max-body-bytes]",
)
@click.option(
    "--body-timeout",
    default=READ_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a request body gets to arrive, on every endpoint (else 408 and closed).",
)
@click.option(
    "--header-timeout",
    default=HEADER_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a REST connection gets to send its request line and headers (else 408).",
)
@click.option(
    "--max-connections",
    default=MAX_CONNECTIONS,
    show_default=True,
    type=click.IntRange(min=1),
    help="REST connections open at once; one more gets 503 and is closed.",
)
@click.option(
    "--drain-timeout",
    default=DRAIN_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help=f"Seconds requests in progress get after SIGTERM; the rest are cut (exit {EXIT_CUT}).",
)
@click.option("--log-requests", is_flag=True, help="Log one line per request.")
def serve_command(
    dirs: tuple[Path, ...],
    model_repository: Path | None,
    no_grpc: bool,
    no_metrics_port: bool,
    **options: Any,
) -> None:
    """Serve exported bundles over the Open Inference Protocol (KServe V2).

    Each DIR is a bundle written by jn.export_model, served under its manifest name at
    /v2/models/<name>; or --model-repository DIR serves DIR/<model>/<version>/, with
    version swaps that fail no request. Standard clients work unchanged (tritonclient.http
    / .grpc), Triton's config, statistics and repository calls included.
    Ready (/v2/health/ready) once every model has compiled its batch sizes; SIGTERM
    finishes the requests in flight, then exits 0 (3 when the drain timeout cut some).

    \b
    Example:
        jaxnitro serve bundles/mnist --port 8000 --grpc-port 8001 --max-batch-size 32
        jaxnitro serve --model-repository models --model-control-mode poll
    """
    if bool(dirs) == (model_repository is not None):
        raise click.UsageError(
            "give bundle directories (jaxnitro serve DIR ...) or --model-repository DIR, "
            "one of the two."
        )
    from jaxnitro._src.serve.server import serve  # starlette, uvicorn, grpcio: only when serving

    cut = serve(list(dirs), **_serve_options(model_repository, no_grpc, no_metrics_port, options))
    _exit(EXIT_CUT if cut else 0)


#: The options that apply to a model repository only: passed on only with one.
REPOSITORY_OPTIONS = (
    "model_control_mode",
    "repository_poll_secs",
    "load_model",
    "version_policy",
    "model_load_timeout",
)


def _serve_options(
    model_repository: Path | None, no_grpc: bool, no_metrics_port: bool, options: dict[str, Any]
) -> dict[str, Any]:
    """The keywords of `serve` from the command line's options."""
    given = dict(options)
    repository = {name: given.pop(name) for name in REPOSITORY_OPTIONS}
    if model_repository is not None:
        given.update(model_repository=model_repository, **repository)
    if no_grpc:
        given["grpc_port"] = None
    if no_metrics_port:
        given["metrics_port"] = None
    return given


def _exit(code: int) -> None:
    """Return (exit 0) or raise SystemExit(code); without waiting for a hung model thread."""
    # a model worker still running now is a load or warm-up left behind (hung): exiting
    # normally would wait for it forever (the interpreter joins executor threads at exit)
    left = [
        t for t in threading.enumerate() if t.name.startswith("jaxnitro-serve-") and not t.daemon
    ]
    if any(t.is_alive() for t in left):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)
