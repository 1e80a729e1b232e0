"""`jaxnitro mcp` against a hostile client and a hostile local user (issue 41): the bearer
token of `--http` (checked from a second local user's account where the tests run as root),
module TARGETs confined to the root, every path confined wherever it comes from, reads that
refuse links out of the root, `--max-runs`, and huge arguments cut in errors. Each test runs
a real `python -m jaxnitro mcp` and talks to it with the SDK's client (or curl)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from helpers.procs import child_env, until

pytest.importorskip("mcp")
import httpx2  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

# A tiny experiment: a field named like an option (`checkpoint`) and one typed Path.
EXPERIMENT = """
from pathlib import Path

import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


@jn.experiment
class Small:
    width: jn.GraphConst[int] = 8
    checkpoint: str | None = None
    notes: Path | None = None
    n_train: int = 4096

    def build_model(self, rng):
        return jn.split_model(nnx.Linear(8, 4, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.n_train + 64, 8)).astype(np.float32)
        y = x[:, :4].argmax(-1).astype(np.int32)
        tr, te = slice(0, self.n_train), slice(self.n_train, None)
        return {
            "train": jn.DataLoader({"x": x[tr], "y": y[tr]}, batch_size=8, drop_last=True),
            "val": jn.DataLoader({"x": x[te], "y": y[te]}, batch_size=32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
"""

# A module that must never be imported: it leaves a mark where it was started.
PLANTED = """
from pathlib import Path
Path(__file__).with_suffix(".ran").write_text("imported")
import jaxnitro as jn
@jn.experiment
class Tiny:
    width: int = 1
"""

SECOND_USER = "jnmcp41"  # created by the test when it runs as root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stdio(root: Path, *, cwd: Path, extra: tuple[str, ...] = (), **env: str):
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "jaxnitro", "mcp", "--root", str(root), *extra],
        env=child_env(JAXNITRO_COMPILATION_CACHE="0", **env),
        cwd=str(cwd),
    )
    return stdio_client(params)


async def _call(session: ClientSession, tool: str, **arguments) -> dict:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def _error(session: ClientSession, tool: str, **arguments) -> str:
    result = await session.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


def _serve_http(root: Path, port: int, *args: str, **env: str) -> subprocess.Popen:
    env = child_env(JAXNITRO_COMPILATION_CACHE="0", **env)
    if "JAXNITRO_MCP_TOKEN" not in env or not env["JAXNITRO_MCP_TOKEN"]:
        env.pop("JAXNITRO_MCP_TOKEN", None)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxnitro", "mcp", "--root", str(root), "--http", str(port), *args],
        env=env,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


INITIALIZE = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "probe", "version": "0"},
        },
    }
)
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def _post(port: int, token: str | None) -> int:
    """The HTTP status of an `initialize` POST, with `token` as bearer (or none)."""
    headers = dict(HEADERS)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    r = httpx2.post(f"http://127.0.0.1:{port}/mcp", content=INITIALIZE, headers=headers)
    return r.status_code


def _listening(port: int, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def _runs_with(port: int, token: str) -> dict:
    client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
    url = f"http://127.0.0.1:{port}/mcp"
    async with client, streamable_http_client(url, http_client=client) as streams:
        async with ClientSession(*streams[:2]) as session:
            await session.initialize()
            return await _call(session, "runs")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


# -- item 3: --http needs the bearer token --------------------------------------------------
@pytest.mark.slow
def test_http_generates_a_private_token_and_refuses_requests_without_it(tmp_path):
    port = _free_port()
    proc = _serve_http(tmp_path, port, JAXNITRO_MCP_TOKEN="")
    try:
        until(lambda: _listening(port, proc), 180)
        line = proc.stderr.readline()
        match = re.search(r"the token is in (\S+) \(", line)
        assert match, line
        token_file = Path(match.group(1))
        assert not token_file.is_relative_to(tmp_path)  # not in the (maybe shared) root
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        assert len(token) >= 32

        assert _post(port, None) == 401
        assert _post(port, "wrong") == 401
        assert _post(port, token[:-1]) == 401
        assert _post(port, token + "x") == 401
        assert anyio.run(_runs_with, port, token) == {"runs": []}
    finally:
        _stop(proc)
    assert not token_file.exists()  # the generated token goes with the server


@pytest.mark.slow
def test_http_token_from_the_environment_or_a_private_file(tmp_path):
    loose = tmp_path / "loose.token"
    loose.write_text("s3cret-token-value\n")
    loose.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "jaxnitro", "mcp", "--root", str(tmp_path), "--http", "1"]
        + ["--token-file", str(loose)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and f"chmod 600 {loose}" in done.stderr, done.stderr

    private = tmp_path / "private.token"
    private.write_text("file-token-0123456789\n")
    private.chmod(0o600)
    port = _free_port()
    proc = _serve_http(tmp_path, port, "--token-file", str(private), JAXNITRO_MCP_TOKEN="env")
    try:
        until(lambda: _listening(port, proc), 180)
        assert _post(port, "env") == 401  # the file wins over the variable
        assert anyio.run(_runs_with, port, "file-token-0123456789") == {"runs": []}
    finally:
        _stop(proc)

    port = _free_port()
    proc = _serve_http(tmp_path, port, JAXNITRO_MCP_TOKEN="env-token-abcdefghij")
    try:
        until(lambda: _listening(port, proc), 180)
        assert _post(port, None) == 401
        assert anyio.run(_runs_with, port, "env-token-abcdefghij") == {"runs": []}
    finally:
        err = _stop(proc)
    assert "the token is in" not in err  # none generated when one is given


def _second_user() -> tuple[int, int]:
    """The uid and gid of a second local account (created once; needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create and act as a second local user")
    if not (shutil.which("useradd") and shutil.which("runuser") and shutil.which("curl")):
        pytest.skip("needs useradd, runuser and curl to act as a second local user")
    import pwd

    try:
        entry = pwd.getpwnam(SECOND_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", SECOND_USER],
            check=True,
        )
        entry = pwd.getpwnam(SECOND_USER)
    return entry.pw_uid, entry.pw_gid


def _as_second_user(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", SECOND_USER, "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


@pytest.mark.slow
def test_a_second_local_user_can_neither_call_nor_read_the_token(tmp_path):
    _second_user()
    port = _free_port()
    proc = _serve_http(tmp_path, port, JAXNITRO_MCP_TOKEN="")
    try:
        until(lambda: _listening(port, proc), 180)
        token_file = Path(re.search(r"the token is in (\S+) \(", proc.stderr.readline())[1])
        token = token_file.read_text().strip()

        curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"]
        curl += [a for k, v in HEADERS.items() for a in ("-H", f"{k}: {v}")]
        curl += ["--data", INITIALIZE, f"http://127.0.0.1:{port}/mcp"]
        assert _as_second_user(*curl).stdout == "401"  # reaches the port, gets nothing
        guessed = _as_second_user(*curl, "-H", "Authorization: Bearer guess")
        assert guessed.stdout == "401"
        peek = _as_second_user("cat", str(token_file))
        assert peek.returncode != 0 and token not in peek.stdout
        assert "Permission denied" in peek.stderr
        # the token in the right hands works (the same request as the owner)
        assert _post(port, token) == 200
    finally:
        _stop(proc)


# -- items 3 and 9: module TARGETs come from the root or installed packages -----------------
@pytest.mark.slow
def test_module_targets_are_imported_only_from_the_root_or_trusted_places(tmp_path):
    root, shared, loose = tmp_path / "root", tmp_path / "shared", tmp_path / "loose"
    for d in (root, shared, loose):
        d.mkdir()
    (root / "rootmod.py").write_text(EXPERIMENT)
    (shared / "evilmod.py").write_text(PLANTED)  # where the server was started
    (loose / "loosemod.py").write_text(PLANTED)  # on its path, but anyone may write there
    loose.chmod(0o777)

    async def main():
        path = os.pathsep.join([child_env()["PYTHONPATH"], str(loose)])
        async with _stdio(root, cwd=shared, PYTHONPATH=path) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                message = await _error(session, "setup", target="evilmod:Tiny")
                assert "PathError" in message and "working directory" in message, message
                message = await _error(session, "setup", target="loosemod:Tiny")
                assert "PathError" in message and "other users can write" in message, message
                # under the root, and installed (the standard library): imported
                run = await _call(session, "setup", target="rootmod:Small")
                assert run["experiment"] == "Small"
                message = await _error(session, "setup", target="json:dumps")
                assert "not an experiment" in message, message

    anyio.run(main)
    assert not (shared / "evilmod.ran").exists()
    assert not (loose / "loosemod.ran").exists()


# -- item 10: every path, whatever carries it ------------------------------------------------
@pytest.mark.slow
def test_paths_in_fields_and_presets_stay_under_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside_run"
    root.mkdir()
    outside.mkdir()
    (root / "exp.py").write_text(EXPERIMENT)
    (root / "out").symlink_to(outside)

    async def main():
        async with _stdio(root, cwd=root) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                for value in (str(outside), "../outside_run", "out"):
                    message = await _error(
                        session, "setup", target="exp.py:Small", fields={"checkpoint": value}
                    )
                    assert "PathError" in message and "Small.checkpoint" in message, message
                message = await _error(
                    session, "setup", target="exp.py:Small", overrides=f"checkpoint={outside}"
                )
                assert "PathError" in message, message
                message = await _error(
                    session, "setup", target="exp.py:Small", fields={"notes": "/etc/passwd"}
                )
                assert "PathError" in message and "Small.notes" in message, message
                message = await _error(
                    session, "setup", target="exp.py:Small", options={"resume": str(outside)}
                )
                assert "PathError" in message, message
                run = await _call(session, "setup", target="exp.py:Small", fields={"notes": "n"})
                assert run["fields"]["notes"]["value"] == str(root.resolve() / "n")

    anyio.run(main)


# -- item 11: reads refuse links out of the root ---------------------------------------------
@pytest.mark.slow
def test_logs_and_the_metrics_resource_refuse_links_out_of_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "exp.py").write_text(EXPERIMENT)
    secret = '{"type": "metrics", "context": "train", "secret": "outside-content"}\n'
    (outside / "metrics.jsonl").write_text(secret)
    (outside / "curves.png").write_bytes(b"\x89PNG outside")

    async def main():
        async with _stdio(root, cwd=root) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                first = await _call(session, "setup", target="exp.py:Small")
                run_dir = Path(first["run_dir"])  # setup made it
                # a planted log: a link to a file outside
                (run_dir / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
                (run_dir / "curves.png").symlink_to(outside / "curves.png")
                message = await _error(session, "logs", run_id=first["id"])
                assert "PathError" in message and "outside-content" not in message, message
                for name in ("metrics", "curves.png"):
                    with pytest.raises(Exception) as caught:
                        await session.read_resource(f"jaxnitro://runs/{first['id']}/{name}")
                    assert "outside-content" not in str(caught.value)
                listed = (await _call(session, "runs"))["runs"]
                assert first["id"] not in {r["id"] for r in listed}  # its log is not read
                # the run directory itself swapped for a link out after setup
                second = await _call(session, "setup", target="exp.py:Small")
                shutil.rmtree(second["run_dir"])
                Path(second["run_dir"]).symlink_to(outside)
                message = await _error(session, "logs", run_id=second["id"])
                assert "PathError" in message and "outside-content" not in message, message
                # a real log inside the root reads as before
                third = await _call(session, "setup", target="exp.py:Small")
                (Path(third["run_dir"]) / "metrics.jsonl").write_text(secret.replace("out", "in"))
                lines = (await _call(session, "logs", run_id=third["id"]))["lines"]
                assert lines[0]["secret"] == "inside-content"
                text = await session.read_resource(f"jaxnitro://runs/{third['id']}/metrics")
                assert "inside-content" in text.contents[0].text

    anyio.run(main)


# -- item 14: --max-runs, and huge arguments cut in errors ----------------------------------
@pytest.mark.slow
def test_max_runs_caps_the_runs_training_at_once(tmp_path):
    (tmp_path / "exp.py").write_text(EXPERIMENT)

    async def main():
        async with _stdio(tmp_path, cwd=tmp_path, extra=("--max-runs", "1")) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                options = {"max_epochs": 1000}
                first = await _call(session, "setup", target="exp.py:Small", options=options)
                second = await _call(session, "setup", target="exp.py:Small", options=options)
                await _call(session, "train", run_id=first["id"])
                message = await _error(session, "train", run_id=second["id"])
                assert "--max-runs 1" in message and first["id"] in message, message
                await _call(session, "stop", run_id=first["id"], wait=True)
                started = await _call(session, "train", run_id=second["id"])
                assert started["id"] == second["id"]
                await _call(session, "stop", run_id=second["id"], wait=True)

    anyio.run(main)


@pytest.mark.slow
def test_huge_arguments_are_cut_in_errors(tmp_path):
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    huge = "a" * (1 << 20)

    async def main():
        async with _stdio(tmp_path, cwd=tmp_path) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                cases = [
                    ("setup", {"target": huge + ":Tiny"}),
                    ("setup", {"target": "exp.py:" + huge}),
                    ("setup", {"target": "exp.py:Small", "fields": {huge: 1}}),
                    ("setup", {"target": "exp.py:Small", "overrides": huge + "=1"}),
                    ("setup", {"target": "exp.py:Small", "options": {"resume": "/" + huge}}),
                    ("status", {"run_id": huge}),
                ]
                for tool, arguments in cases:
                    message = await _error(session, tool, **arguments)
                    assert len(message) < 3000, (tool, len(message))
                    assert f"…({len(huge)}" in message or "chars)" in message, message[:300]

    anyio.run(main)


@pytest.mark.slow
def test_the_server_forgets_its_working_directory(tmp_path):
    """`python -m` puts the working directory first on sys.path; the server takes it off
    before it imports anything a client names (in-process: the command's own code)."""
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    code = (
        "import sys, os\n"
        "from jaxnitro._src.cli import mcp_server\n"
        "class Stop(Exception): pass\n"
        "def fake(*a, **k): raise Stop\n"
        "mcp_server.build_server = fake\n"
        "try: mcp_server.mcp_command.main(['--root', '.'], standalone_mode=False)\n"
        "except Stop: pass\n"
        "print(os.getcwd() in sys.path, '' in sys.path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.split() == ["False", "False"], done.stderr
