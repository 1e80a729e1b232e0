"""`jaxnitro mcp`: the tools of `cli/drive.py` served over the Model Context Protocol.

Built on the official `mcp` SDK (`MCPServer`: each tool's JSON schema comes from its typed
signature; the run options' schema from `run/options.py`). stdio by default (the SDK points
fd 1 at stderr while it serves, so a print cannot corrupt the protocol); `--http PORT` serves
streamable HTTP on 127.0.0.1. The SDK is the optional extra `jaxnitro[mcp]` and is imported
here only.
"""

# (No `from __future__ import annotations`: the SDK reads the tools' annotations at runtime.)

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import click
from pydantic import Field

from jaxnitro.cli.common import CONTEXT
from jaxnitro.cli.drive import Workspace, options_schema

RunId = Annotated[str, Field(description="the id setup returned (e.g. 'Tiny-3f2a9c1b7e40')")]


def _sdk():
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError as e:
        raise click.ClickException(
            f"jaxnitro mcp needs the Model Context Protocol SDK, which is not installed "
            f"({e}). Install it with: pip install 'jaxnitro[mcp]'"
        ) from None
    return MCPServer, ToolError


def build_server(workspace: Workspace) -> Any:
    """An `MCPServer` whose tools drive `workspace`'s runs, and its resources (each run's
    metrics.jsonl and curves.png)."""
    MCPServer, ToolError = _sdk()
    server = MCPServer(
        name="jaxnitro",
        instructions=(
            "Drive jaxnitro training runs: setup (a run id, nothing compiled), train "
            "(background; returns at once), status (poll), stop, checkpoint, set_device, "
            "validate, evaluate, predict, export, runs, inspect, logs. Paths are relative to "
            f"the root {workspace.root}."
        ),
    )

    def tool(fn: Callable) -> Callable:
        """Register `fn`; a jaxnitro (or any) error becomes a tool error with its message."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except ToolError:
                raise
            except Exception as e:  # noqa: BLE001 - the message is the answer; the server lives
                raise ToolError(f"{type(e).__name__}: {e}") from e

        server.add_tool(call, name=fn.__name__, description=fn.__doc__, structured_output=True)
        return call

    _run_tools(workspace, tool)
    _result_tools(workspace, tool)
    # The run options' schema, typed from their declaration (clients show it).
    registered = server._tool_manager.get_tool("setup")
    registered.parameters["properties"]["options"] = {
        "anyOf": [options_schema(), {"type": "null"}],
        "default": None,
        "description": "jn.Nitro options by name",
    }
    _resources(workspace, server)
    return server


def _run_tools(ws: Workspace, tool: Callable) -> None:
    """setup, train, status, stop, checkpoint, set_device."""

    @tool
    def setup(
        target: Annotated[
            str, Field(description="path/to/file.py:Class or pkg.module:Class (under the root)")
        ],
        preset: Annotated[
            str | None, Field(description="one of the experiment's presets()")
        ] = None,
        fields: Annotated[
            dict[str, Any] | None, Field(description="experiment field values by name")
        ] = None,
        options: Annotated[
            dict[str, Any] | None, Field(description="jn.Nitro options (see the schema)")
        ] = None,
        overrides: Annotated[
            str | None, Field(description="fields and options as text: 'a=1, b=[2, 3]'")
        ] = None,
    ) -> dict[str, Any]:
        """Set up a run of TARGET (nothing compiled); returns its id, run_dir and typed fields.
        An unknown or twice-given key is an error naming the valid ones."""
        return ws.setup(target, preset, fields, options, overrides)

    @tool
    def train(run_id: RunId) -> dict[str, Any]:
        """Start training in the background; returns at once with the run's status."""
        return ws.train(run_id)

    @tool
    def status(run_id: RunId) -> dict[str, Any]:
        """phase, epoch, step, steps_per_second, eta_seconds, latest train and validation
        metrics, best_checkpoint, stop_reason once ended."""
        return ws.status(run_id)

    @tool
    def stop(run_id: RunId, wait: bool = False, timeout: float = 300.0) -> dict[str, Any]:
        """Stop gracefully: the step finishes, validation and a checkpoint follow;
        stop_reason 'requested'. wait=true returns once it ended."""
        return ws.stop(run_id, wait, timeout)

    @tool
    def checkpoint(run_id: RunId, timeout: float = 300.0) -> dict[str, Any]:
        """Write a checkpoint at the next step boundary without stopping; returns its path."""
        return ws.checkpoint(run_id, timeout)

    @tool
    def set_device(
        run_id: RunId,
        values: Annotated[dict[str, Any], Field(description="Device field values by name")],
    ) -> dict[str, Any]:
        """Change Device fields of a run from its next step on (no recompile)."""
        return ws.set_device(run_id, values)


def _result_tools(ws: Workspace, tool: Callable) -> None:
    """validate, evaluate, predict, export, runs, inspect, logs."""

    @tool
    def validate(run_id: RunId) -> dict[str, Any]:
        """The validation metrics of the run's current weights."""
        return ws.validate(run_id)

    @tool
    def evaluate(run_id: RunId, split: str = "test") -> dict[str, Any]:
        """The metrics on a split (default 'test')."""
        return ws.evaluate(run_id, split)

    @tool
    def predict(
        run_id: RunId,
        inputs: Annotated[
            dict[str, Any], Field(description="forward's batch fields as JSON arrays, by name")
        ],
    ) -> dict[str, Any]:
        """The model's outputs (JSON arrays) for a batch."""
        return ws.predict(run_id, inputs)

    @tool
    def export(
        run_id: RunId,
        directory: Annotated[str, Field(description="the bundle directory, under the root")],
        name: str | None = None,
    ) -> dict[str, Any]:
        """Export the run's model as a bundle (loadable with jn.load_bundle, servable)."""
        return ws.export(run_id, directory, name)

    @tool
    def runs(
        directory: Annotated[str, Field(description="where runs are, under the root")] = "runs",
    ) -> dict[str, Any]:
        """The runs under a directory (as `jaxnitro runs` lists them), with this server's ids."""
        return ws.runs(directory)

    @tool
    def inspect(run_id: RunId) -> dict[str, Any]:
        """The compile report (one record per program) and the memory plan."""
        return ws.inspect(run_id)

    @tool
    def logs(
        run_id: RunId,
        lines: int = 20,
        context: Annotated[
            str | None, Field(description="train, validate, data, ... (default: all)")
        ] = None,
    ) -> dict[str, Any]:
        """The last lines of the run's metrics.jsonl."""
        return ws.logs(run_id, lines, context)


def _resources(ws: Workspace, server: Any) -> None:
    """Each run's metrics.jsonl and curves.png."""

    @server.resource(
        "jaxnitro://runs/{run_id}/metrics",
        name="metrics",
        description="A run's metrics.jsonl",
        mime_type="application/jsonl",
    )
    def metrics_resource(run_id: str) -> str:
        path = ws.log_path(run_id)
        return path.read_text() if path.is_file() else ""

    @server.resource(
        "jaxnitro://runs/{run_id}/curves.png",
        name="curves",
        description="A run's training and validation curves",
        mime_type="image/png",
    )
    def curves_resource(run_id: str) -> bytes:
        return Path(ws.curves_path(run_id)).read_bytes()


@click.command("mcp", context_settings=CONTEXT)
@click.option(
    "--root",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=".",
    show_default=True,
    help="Every path (targets, run dirs, exports) stays under this directory.",
)
@click.option(
    "--http",
    "port",
    type=click.IntRange(1, 65535),
    default=None,
    metavar="PORT",
    help="Serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio.",
)
def mcp_command(root: Path, port: int | None) -> None:
    """An MCP server: assistants and IDEs set up, train, steer and read runs.

    Configure a client with the command `jaxnitro` and the arguments `mcp --root DIR`.
    """
    server = build_server(Workspace(root))
    if port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
