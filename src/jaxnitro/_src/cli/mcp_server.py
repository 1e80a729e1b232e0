"""`jaxnitro mcp`: the tools of `cli/drive.py` served over the Model Context Protocol.

Built on the official `mcp` SDK (`MCPServer`: each tool's JSON schema comes from its typed
signature; the run options' schema from `run/options.py`). stdio by default (the SDK points
fd 1 at stderr while it serves, so a print cannot corrupt the protocol); `--http PORT` serves
streamable HTTP on 127.0.0.1, and only to a client that sends the bearer token (`--token-file`,
`$JAXNITRO_MCP_TOKEN`, or one generated into a private file), checked by the SDK's bearer
middleware with our verifier. The SDK is the optional extra `jaxnitro[mcp]` and is imported
here only.
"""

# (No `from __future__ import annotations`: the SDK reads the tools' annotations at runtime.)

import atexit
import functools
import hmac
import os
import secrets
import signal
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import click
from pydantic import Field

from jaxnitro._src.cli.common import CONTEXT
from jaxnitro._src.cli.drive import Workspace, options_schema
from jaxnitro._src.core.errors import clip

#: The variable that may hold the bearer token of `jaxnitro mcp --http` (DESIGN section 15).
TOKEN_ENV = "JAXNITRO_MCP_TOKEN"
#: An error message past this many characters is cut (an argument may be megabytes).
_MESSAGE_LIMIT = 2000

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


def build_server(workspace: Workspace, *, token: str | None = None, port: int = 0) -> Any:
    """An `MCPServer` whose tools drive `workspace`'s runs, and its resources (each run's
    metrics.jsonl and curves.png). With `token`, its HTTP app answers only requests that
    carry `Authorization: Bearer <token>` (401 otherwise)."""
    MCPServer, ToolError = _sdk()
    auth: dict[str, Any] = {}
    if token is not None:
        from mcp.server.auth.settings import AuthSettings
        from pydantic import AnyHttpUrl

        auth = {
            "token_verifier": _TokenVerifier(token),
            "auth": AuthSettings(
                issuer_url=AnyHttpUrl(f"http://127.0.0.1:{port}"), resource_server_url=None
            ),
        }
    server = MCPServer(
        **auth,
        name="jaxnitro",
        instructions=(
            "Drive jaxnitro training runs: setup (a run id, nothing compiled), train "
            "(background; returns at once), status (poll), stop, checkpoint, set_device, set_lr, "
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
                message = _cut(f"{type(e).__name__}: {e}", [*args, *kwargs.values()])
                raise ToolError(message) from e

        server.add_tool(call, name=fn.__name__, description=fn.__doc__, structured_output=True)
        return call

    _run_tools(workspace, tool)
    _control_tools(workspace, tool)
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
    """setup, train, status."""

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


def _control_tools(ws: Workspace, tool: Callable) -> None:
    """stop, checkpoint, set_device, set_lr: a running run, steered between steps."""

    @tool
    def stop(run_id: RunId, wait: bool = False, timeout: float = 300.0) -> dict[str, Any]:
        """Stop gracefully: the step finishes, validation and a checkpoint follow;
        stop_reason 'requested'. wait=true returns once it ended."""
        return ws.stop(run_id, wait, timeout)

    @tool
    def checkpoint(run_id: RunId, timeout: float = 300.0) -> dict[str, Any]:
        """Write a checkpoint at the next step boundary without stopping; returns its path.
        Retention keeps it until the user deletes it."""
        return ws.checkpoint(run_id, timeout)

    @tool
    def set_device(
        run_id: RunId,
        values: Annotated[dict[str, Any], Field(description="Device field values by name")],
    ) -> dict[str, Any]:
        """Change Device fields of a run from its next step on (no recompile)."""
        return ws.set_device(run_id, values)

    @tool
    def set_lr(
        run_id: RunId,
        rate: Annotated[
            float | dict[str, float],
            Field(description="the learning rate, or {group: rate} with several groups"),
        ],
    ) -> dict[str, Any]:
        """Set the learning rate from the next step on (no recompile); the step lines' lr
        column shows it. Refused where a schedule drives the rate."""
        return ws.set_lr(run_id, rate)


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
        return ws.metrics_text(run_id)

    @server.resource(
        "jaxnitro://runs/{run_id}/curves.png",
        name="curves",
        description="A run's training and validation curves",
        mime_type="image/png",
    )
    def curves_resource(run_id: str) -> bytes:
        return ws.curves_png(run_id)


def _cut(message: str, arguments: list[Any]) -> str:
    """`message` with every long string argument it echoes cut (`core.errors.clip`), and no
    longer than `_MESSAGE_LIMIT` whatever it holds."""
    for text in sorted(_strings(arguments), key=len, reverse=True):
        if len(text) > 200 and text in message:
            message = message.replace(text, clip(text))
    return clip(message, _MESSAGE_LIMIT)


def _strings(value: Any) -> list[str]:
    """The strings in a tool's arguments (dict keys and values, list items), each as given
    and as its repr (messages quote values with !r)."""
    if isinstance(value, str):
        return [value, repr(value), repr(value)[1:-1]]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


class _TokenVerifier:
    """The SDK's `TokenVerifier`: one fixed token, compared in constant time."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def verify_token(self, token: str) -> Any:
        from mcp.server.auth.provider import AccessToken

        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._token):
            return None
        return AccessToken(token="", client_id="jaxnitro-mcp", scopes=[])


def _token(token_file: Path | None) -> str:
    """The bearer token: from --token-file, else $JAXNITRO_MCP_TOKEN, else a new one
    written 0600 into a new private directory (its path said once on stderr; the file is
    removed when the server exits)."""
    if token_file is not None:
        return _read_token(token_file)
    from_env = os.environ.get(TOKEN_ENV, "").strip()
    if from_env:
        return from_env
    token = secrets.token_urlsafe(32)
    folder = tempfile.mkdtemp(prefix="jaxnitro-mcp-")  # mode 0700, a fresh name
    path = Path(folder) / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    atexit.register(_remove, path)
    click.echo(
        f"jaxnitro mcp: clients must send 'Authorization: Bearer <token>'; the token is in "
        f"{path} (readable by you only; or pass --token-file PATH or set ${TOKEN_ENV}).",
        err=True,
    )
    return token


def _read_token(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise click.BadParameter(
            f"{path}: cannot read it ({e.strerror}).", param_hint="--token-file"
        ) from None
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise click.BadParameter(
                f"{path} is readable or writable by other users (mode {stat.filemode(mode)}); "
                f"a token must be private: chmod 600 {path}.",
                param_hint="--token-file",
            )
        token = f.read().strip()
    if not token:
        raise click.BadParameter(
            f"{path} is empty; write the token into it.", param_hint="--token-file"
        )
    return token


def _remove(path: Path) -> None:
    for step in (path.unlink, path.parent.rmdir):
        try:
            step()
        except OSError:
            pass


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
    help="Serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio (bearer token required).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"The bearer token --http clients must send (a private file; default "
    f"${TOKEN_ENV}, else one is generated and its file named on stderr).",
)
@click.option(
    "--max-runs",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Runs training at once; train past it is refused until one ends.",
)
def mcp_command(root: Path, port: int | None, token_file: Path | None, max_runs: int) -> None:
    """An MCP server: assistants and IDEs set up, train, steer and read runs.

    Configure a client with the command `jaxnitro` and the arguments `mcp --root DIR`.
    Over --http, clients send the bearer token (--token-file, $JAXNITRO_MCP_TOKEN, or the
    generated one whose file is named on stderr).
    """
    # `python -m` puts the working directory first on sys.path: a module planted there would
    # win over installed ones. Code comes from the root and installed packages only.
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    if token_file is not None and port is None:
        raise click.UsageError("--token-file goes with --http PORT (stdio needs no token).")
    workspace = Workspace(root, max_runs=max_runs)
    if port is None:
        build_server(workspace).run()
    else:
        server = build_server(workspace, token=_token(token_file), port=port)
        # uvicorn re-raises SIGTERM once it shut down; as an exception it lets the exit
        # handlers run (they remove a generated token), exit status 143 all the same.
        signal.signal(signal.SIGTERM, _terminated)
        server.run("streamable-http", host="127.0.0.1", port=port)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
