"""`jaxnitro mcp`: the SDK's own client over stdio against a real `python -m jaxnitro mcp`,
and the root confinement of every path (`cli/drive.py`)."""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.cli.drive import PathError, Workspace

pytest.importorskip("mcp")
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

SRC = Path(jn.__file__).resolve().parent.parent

# A tiny experiment in its own file under the root: the server loads it as TARGET. Its
# train_metrics logs the Device value `scale`, so the log shows when set_device took effect.
EXPERIMENT = """
import jax
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


@jn.experiment
class Small:
    width: jn.GraphConst[int] = 8
    scale: jn.Device[float] = 1.0
    n_train: int = 256

    def build_model(self, rng):
        return jn.split_model(nnx.Linear(8, 4, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.n_train + 64, 8)).astype(np.float32)
        y = (x[:, :4]).argmax(-1).astype(np.int32)
        tr, te = slice(0, self.n_train), slice(self.n_train, None)
        return {
            "train": jn.DataLoader({"x": x[tr], "y": y[tr]}, batch_size=32, drop_last=True),
            "val": jn.DataLoader({"x": x[te], "y": y[te]}, batch_size=32),
            "test": jn.DataLoader({"x": x[te], "y": y[te]}, batch_size=32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits * self.scale, y).mean()

    def train_metrics(self, logits, *, y):
        return {"scale_seen": self.scale + 0.0 * logits.sum()}

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}
"""


def _server(root: Path) -> StdioServerParameters:
    env = {
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "JAX_PLATFORMS": "cpu",
        "JAXNITRO_COMPILATION_CACHE": "0",
        "JAXNITRO_NO_PLOT": "1",
    }
    return StdioServerParameters(
        command=sys.executable, args=["-m", "jaxnitro", "mcp", "--root", str(root)], env=env
    )


async def _call(session: ClientSession, tool: str, **arguments) -> dict:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def _error(session: ClientSession, tool: str, **arguments) -> str:
    result = await session.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


async def _until_done(session: ClientSession, run_id: str, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = await _call(session, "status", run_id=run_id)
        if status["stop_reason"] is not None:
            return status
        await anyio.sleep(0.05)
    raise AssertionError(f"run {run_id} did not end in {timeout}s")


@pytest.mark.slow
def test_mcp_drives_runs_over_stdio(tmp_path):
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    (tmp_path / "elsewhere").mkdir()

    async def main():
        async with stdio_client(_server(tmp_path)) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                await _scenario(session, tmp_path)

    anyio.run(main)


async def _scenario(session: ClientSession, root: Path) -> None:
    # [1] the tools and their schemas
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert sorted(tools) == sorted(
        "setup train status stop checkpoint set_device set_lr validate evaluate predict export "
        "runs inspect logs".split()
    )
    options = tools["setup"].input_schema["properties"]["options"]["anyOf"][0]["properties"]
    assert options["max_epochs"]["anyOf"][0] == {"type": "integer"}
    assert "Epochs" in options["max_epochs"]["description"]

    # [2] set up, train, poll until done
    run = await _call(
        session, "setup", target="exp.py:Small", options={"max_epochs": 2}, overrides="width=8"
    )
    assert run["fields"]["scale"]["marker"] == "Device" and run["total_steps"] == 16
    assert Path(run["run_dir"]).is_relative_to(root)
    started = await _call(session, "train", run_id=run["id"])
    assert started["id"] == run["id"] and started["stop_reason"] is None
    done = await _until_done(session, run["id"])
    assert done["stop_reason"] == "completed" and done["step"] == 16
    assert done["best_checkpoint"] and "loss" in done["train"] and "acc" in done["validation"]

    # [3] a second run: set_device mid-run, checkpoint, stop
    second = await _call(session, "setup", target="exp.py:Small", options={"max_epochs": 500})
    sid = second["id"]
    await _call(session, "train", run_id=sid)
    deadline = time.monotonic() + 120
    while (await _call(session, "status", run_id=sid))["step"] < 3:
        assert time.monotonic() < deadline, "the second run took no steps"
        await anyio.sleep(0.05)
    applied = await _call(session, "set_device", run_id=sid, values={"scale": 0.5})
    assert applied["applies"] == "from the next step"
    assert "finite number" in await _error(session, "set_lr", run_id=sid, rate=-1.0)
    applied = await _call(session, "set_lr", run_id=sid, rate=2.5e-3)
    assert applied["applies"] == "from the next step"
    saved = await _call(session, "checkpoint", run_id=sid)
    assert saved["checkpoint"] and Path(saved["checkpoint"]).exists()
    stopped = await _call(session, "stop", run_id=sid, wait=True)
    assert stopped["stop_reason"] == "requested" and stopped["best_checkpoint"]
    lines = (await _call(session, "logs", run_id=sid, lines=100_000))["lines"]
    marker = next(r for r in lines if r.get("key") == "set_device")
    seen = {r["step"]: r["scale_seen"] for r in lines if r.get("context") == "train"}
    assert {v for s, v in seen.items() if s < marker["from_step"]} == {1.0}
    assert {v for s, v in seen.items() if s >= marker["from_step"]} == {0.5}
    marker = next(r for r in lines if r.get("key") == "set_lr")  # the rate, the same way
    lr = {r["step"]: r["lr"] for r in lines if r.get("context") == "train"}
    first = marker["from_step"]
    assert [v for s, v in lr.items() if s < first] == pytest.approx([1e-2] * (first - 1))
    after = [v for s, v in lr.items() if s >= first]
    assert after and after == pytest.approx([2.5e-3] * len(after))
    finish = [r for r in lines if r.get("type") == "finish"][-1]
    assert finish["stop_reason"] == "requested"
    # the first run compiled the same programs: this one, set_device included, compiled none
    assert finish["programs_compiled"] == 0
    train_logs = (await _call(session, "logs", run_id=sid, lines=3, context="train"))["lines"]
    assert len(train_logs) == 3 and all(r["context"] == "train" for r in train_logs)

    # [4] predict, evaluate, export (and load the bundle), inspect, runs, resources
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    out = await _call(session, "predict", run_id=run["id"], inputs={"x": x.tolist()})
    assert np.asarray(out["outputs"]).shape == (3, 4)
    metrics = await _call(session, "evaluate", run_id=run["id"])
    assert metrics["split"] == "test" and 0.0 <= metrics["metrics"]["acc"] <= 1.0
    bundle = await _call(session, "export", run_id=run["id"], directory="bundles/small")
    loaded = jn.load_bundle(bundle["bundle"])
    np.testing.assert_allclose(np.asarray(loaded(x)), out["outputs"], rtol=1e-4, atol=1e-5)
    report = await _call(session, "inspect", run_id=run["id"])
    assert report["programs"] and report["memory"]["fits"] is True
    listed = (await _call(session, "runs"))["runs"]
    assert {r["id"] for r in listed} >= {run["id"], sid}
    text = await session.read_resource(f"jaxnitro://runs/{run['id']}/metrics")
    assert '"type": "finish"' in text.contents[0].text
    png = await session.read_resource(f"jaxnitro://runs/{run['id']}/curves.png")
    assert png.contents[0].mime_type == "image/png"
    assert base64.b64decode(png.contents[0].blob).startswith(b"\x89PNG")

    # [5] bad arguments and paths that leave the root: tool errors, the server lives on
    message = await _error(session, "setup", target="exp.py:Small", fields={"widht": 4})
    assert "unknown field 'widht'" in message and "width" in message
    message = await _error(session, "setup", target="exp.py:Small", overrides="width=4, width=5")
    assert "given twice" in message
    message = await _error(
        session, "setup", target="exp.py:Small", overrides="max_epoch=3", options={}
    )
    assert "max_epochs" in message  # did-you-mean
    message = await _error(session, "setup", target="exp.py:Small", options={"max_epoch": 1})
    assert "max_epochs" in message
    message = await _error(session, "status", run_id="nope")
    assert "no run 'nope'" in message
    for escape in ("../out", str(root.parent / "out")):
        message = await _error(session, "export", run_id=run["id"], directory=escape)
        assert "PathError" in message and "root" in message
    (root / "link").symlink_to(root.parent)
    message = await _error(session, "export", run_id=run["id"], directory="link/out")
    assert "symlink" in message
    assert not (root.parent / "out").exists()
    assert (await _call(session, "status", run_id=run["id"]))["stop_reason"] == "completed"


def test_paths_stay_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "runs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "out_link").symlink_to(tmp_path / "outside")
    (root / "in_link").symlink_to(root / "runs")
    ws = Workspace(root)
    assert ws.path("runs/a", what="run_dir") == root.resolve() / "runs" / "a"
    assert ws.path(root / "runs", what="run_dir") == (root / "runs").resolve()
    assert ws.path("in_link/b", what="run_dir") == (root / "runs" / "b").resolve()
    with pytest.raises(PathError, match=r"contains '\.\.'"):
        ws.path("runs/../../outside", what="run_dir")
    with pytest.raises(PathError, match="absolute and outside"):
        ws.path(tmp_path / "outside", what="run_dir")
    with pytest.raises(PathError, match="symlink"):
        ws.path("out_link/x", what="export directory")


@pytest.mark.slow
def test_overrides_refuse_unknown_and_repeated_keys(tmp_path):
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    ws = Workspace(tmp_path)
    with pytest.raises(jn.ConfigError, match="unknown key 'widht'.*Did you mean .width."):
        ws.setup("exp.py:Small", overrides="widht=4")
    with pytest.raises(jn.ConfigError, match="'width' is given twice"):
        ws.setup("exp.py:Small", overrides="width=4, width=8")
    with pytest.raises(jn.ConfigError, match="also as a typed argument"):
        ws.setup("exp.py:Small", fields={"width": 4}, overrides="width=8")
    with pytest.raises(jn.ConfigError, match="takes a Python object"):
        ws.setup("exp.py:Small", options={"checkpointer": None})
    with pytest.raises(PathError):
        ws.setup("../exp.py:Small")
    run = ws.setup("exp.py:Small", overrides="width=16, max_epochs=3, scale=0.5")
    assert run["fields"]["width"]["value"] == 16 and run["max_epochs"] == 3
    assert run["fields"]["scale"]["value"] == 0.5


@pytest.mark.slow
def test_a_missing_sdk_names_the_extra(tmp_path):
    import subprocess

    code = (
        "import sys; sys.modules['mcp'] = None\n"  # an import of it fails, as when absent
        "from jaxnitro._src.cli import main; main(['mcp', '--root', '.'])"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "pip install 'jaxnitro[mcp]'" in done.stderr


@pytest.mark.slow
def test_mcp_over_streamable_http(tmp_path):
    import socket
    import subprocess

    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as sock:  # a free port (released just before the server binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    import httpx2

    params = _server(tmp_path)
    token = "a-token-the-client-sends"
    proc = subprocess.Popen(
        [params.command, *params.args, "--http", str(port)],
        env={**os.environ, **(params.env or {}), "JAXNITRO_MCP_TOKEN": token},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    async def main():
        deadline = time.monotonic() + 120
        while True:
            try:
                client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
                url = f"http://127.0.0.1:{port}/mcp"
                async with client, streamable_http_client(url, http_client=client) as streams:
                    async with ClientSession(*streams[:2]) as session:
                        await session.initialize()
                        tools = (await session.list_tools()).tools
                        assert "train" in {t.name for t in tools}
                        return await _call(session, "runs")
            except Exception:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.2)

    try:
        assert anyio.run(main) == {"runs": []}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_set_device_of_a_graphconst_field_and_setup_say_what_the_python_api_says(tmp_path):
    epochs = "\n\n@jn.experiment\nclass Epochs(Small):\n    max_epochs: int = 2\n"
    (tmp_path / "exp.py").write_text(EXPERIMENT + epochs)
    ws = Workspace(tmp_path)
    run = ws.setup("exp.py:Epochs", options={"max_epochs": 3})
    assert run["max_epochs"] == 3
    field = run["fields"]["max_epochs"]  # the field's own value, and the one the run uses
    assert field["run_uses"] == 3 and field["value"] == 2
    with pytest.raises(jn.ConfigError, match=r"GraphConst field 'width': it is baked into"):
        ws.set_device(run["id"], {"width": 4})
