"""The `jaxnitro` command, run as a user runs it: `python -m jaxnitro ...` in a subprocess, with
real exit codes and output, on a small experiment file written for the test."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

import jaxnitro as jn
from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.observe.runs import list_runs

PNG = b"\x89PNG\r\n\x1a\n"

EXPERIMENT = """
import jax
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


class TinyMLP(nnx.Module):
    def __init__(self, width, *, rngs):
        self.hidden = nnx.Linear(8, width, rngs=rngs)
        self.out = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


@jn.experiment
class Tiny:
    width: jn.GraphConst[int] = 16  # hidden units
    smoothing: jn.Device[float] = 0.0  # label smoothing
    max_epochs: int = 2
    n_train: int = 128
    shuffle: bool = True
    poison: bool = False  # NaN inputs: the loss is not finite

    @classmethod
    def presets(cls):
        return {"wide": {"width": 64}}

    def build_model(self, rng):
        return jn.split_model(TinyMLP(self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.n_train + 64, 8)).astype(np.float32)
        if self.poison:
            x[:] = np.nan
        y = (x @ rng.normal(size=(8, 4))).argmax(-1).astype(np.int32)
        n = self.n_train
        return {
            "train": jn.DataLoader(
                {"x": x[:n], "y": y[:n]}, batch_size=32, shuffle=self.shuffle, drop_last=True
            ),
            "val": jn.DataLoader({"x": x[n:], "y": y[n:]}, batch_size=32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        targets = optax.smooth_labels(jax.nn.one_hot(y, 4), self.smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}
"""


def jaxnitro(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return cli.jaxnitro(*args, cwd=cwd, timeout=timeout, plot=True)  # runs draw curves.png


def last_json(out: str):
    """The JSON document a `--json` command printed (the display may print lines before)."""
    start = min(i for i in (out.find("{"), out.find("[")) if i >= 0)
    return json.loads(out[start:])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "exp.py").write_text(textwrap.dedent(EXPERIMENT))
    return d


@pytest.fixture(scope="module")
def trained(work) -> dict:
    """One real run from the shell, shared by the tests that need a trained run."""
    p = jaxnitro(
        "--compilation-cache", "0",  # not the suite's: the tests count what this run compiles
        "train", "exp.py:Tiny", "--width", "24", "--smoothing", "0.05", "--max_epochs", "2",
        "--no-shuffle", "--run-dir", "runs/good", "--json", cwd=work,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return last_json(p.stdout)


# -- usage errors and help (nothing compiles) --------------------------------------------------
@pytest.mark.slow
def test_help_lists_fields_by_marker_with_docs_defaults_and_presets(work):
    p = jaxnitro("train", "exp.py:Tiny", "--help", cwd=work)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    graph, device, host = (out.index(f"Tiny: {m} fields") for m in ("GraphConst", "Device", "Host"))
    assert graph < out.index("--width ", graph) < device < out.index("--smoothing", graph) < host
    assert "hidden units" in out and "[default: 16]" in out  # the doc comment and default
    assert "--shuffle / --no-shuffle" in out and out.index("--n-train") > host
    assert "presets" in out and "wide" in out and "width=64" in out
    assert "--max-epochs" in out and "also jn.Nitro(max_epochs=...)" in out  # field = option


@pytest.mark.slow  # four interpreters: more than 5 s
def test_bad_targets_exit_2_naming_what_is_missing_and_the_two_forms(work):
    cases = {
        "Tiny": "names no class",
        "missing.py:Tiny": "no file 'missing.py'",
        "exp.py:Tinny": "has no class 'Tinny' (TARGET 'exp.py:Tinny'); experiments in it: "
        "['Tiny']. Did you mean 'Tiny'?",
        "no_such_pkg.models:Tiny": "no module 'no_such_pkg.models'",
    }
    for target, missing in cases.items():
        p = jaxnitro("train", target, cwd=work)
        assert p.returncode == 2, (target, p.stderr)
        assert missing in p.stderr and "Traceback" not in p.stderr
        assert "path/to/file.py:Class or pkg.module:Class" in p.stderr


@pytest.mark.slow
def test_bad_value_and_unknown_option_exit_2(work):
    p = jaxnitro("train", "exp.py:Tiny", "--width", "abc", cwd=work)
    assert p.returncode == 2
    assert "'abc'" in p.stderr and "'width'" in p.stderr and "int" in p.stderr
    assert "Traceback" not in p.stderr
    p = jaxnitro("train", "--widht", "8", "exp.py:Tiny", cwd=work)
    assert p.returncode == 2
    assert "No such option '--widht'" in p.stderr
    assert "Did you mean --width (GraphConst field 'width' of Tiny)?" in p.stderr


@pytest.mark.slow
def test_a_run_setting_the_settings_refuse_exits_2_with_the_message(work):
    """--max-epochs is the experiment's field here (no option range): the Nitro setting's
    check refuses 0, and the shell says so as a usage error, not a failed run."""
    p = jaxnitro("train", "exp.py:Tiny", "--max-epochs", "0", "--run-dir", "runs/zero", cwd=work)
    assert p.returncode == 2, p.stderr
    assert "max_epochs must be an int >= 1, got 0" in p.stderr and "Traceback" not in p.stderr
    assert not (work / "runs" / "zero").exists()  # refused before anything is written


@pytest.mark.slow
def test_steps_per_call_takes_a_number_or_auto(work):
    p = jaxnitro("train", "exp.py:Tiny", "--steps-per-call", "fast", cwd=work)
    assert p.returncode == 2 and "'fast' is not a number of steps >= 1 or 'auto'" in p.stderr
    args = ["--steps-per-call", "auto", "--max-epochs", "1", "--run-dir", "runs/auto", "--json"]
    p = jaxnitro("train", "exp.py:Tiny", *args, cwd=work)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(s) for s in (work / "runs/auto/metrics.jsonl").read_text().splitlines()]
    assert any("steps_per_call_auto" in r for r in lines)


def _log(run: Path, *lines: dict) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_run_table_statuses_without_taking_the_lock(tmp_path):
    params = {"type": "params", "experiment": "Tiny", "run_id": "r1"}
    step = {"type": "metrics", "context": "train", "epoch": 1, "step": 4, "loss": 1.0}
    val = {"type": "metrics", "context": "validate", "epoch": 1, "step": 4, "val_loss": 0.5}
    done = {"type": "finish", "status": "completed", "step": 4, "epoch": 1}
    _log(tmp_path / "a" / "done", params, step, val, {**val, "step": 8, "val_loss": 0.25}, done)
    _log(tmp_path / "killed", params, step)  # no finish, a dead holder's lock
    (tmp_path / "killed" / ".jaxnitro.lock").write_text(
        json.dumps({"pid": 2**31 - 2, "host": socket.gethostname(), "released": False})
    )
    _log(tmp_path / "live", params, step)
    # A resume after a finish line starts a new session: it is not finished.
    _log(tmp_path / "resumed", params, step, done, {"type": "other", "key": "resumed"}, step)
    for age, name in enumerate(["resumed", "live", "killed", "a/done"]):  # newest first
        os.utime(tmp_path / name / "metrics.jsonl", (1e9 - age, 1e9 - age))
    lock = RunLock(tmp_path / "live")
    lock.acquire("train", what="the test's run")
    try:
        rows = {r.run_dir.name: r for r in list_runs(tmp_path)}
    finally:
        lock.release()
    assert {k: r.status for k, r in rows.items()} == {
        "done": "completed",
        "killed": "killed",
        "live": "running",
        "resumed": "killed",
    }
    assert rows["done"].best == 0.25 and rows["done"].metric == "val_loss"
    assert rows["done"].epoch == 1 and rows["done"].step == 4
    assert [r.run_dir.name for r in list_runs(tmp_path)] == ["resumed", "live", "killed", "done"]
    assert not lock.held and rows["live"].to_dict()["status"] == "running"


@pytest.mark.slow
def test_plot_api_draws_one_panel_per_metric(tmp_path):
    import matplotlib.image

    train = {"type": "metrics", "context": "train"}
    steps = [{**train, "epoch": 1 + i // 4, "step": i + 1, "loss": 1 / (i + 1)} for i in range(8)]
    vals = [
        {"type": "metrics", "context": "validate", "epoch": e, "step": 4 * e, "val_loss": 1 / e,
         "acc": 0.5 + e / 10, "train_loss": 1.0}
        for e in (1, 2)
    ]  # fmt: skip
    _log(tmp_path / "run", {"type": "params", "run_id": "x"}, *steps, *vals)
    out = jn.plot(tmp_path / "run", x="epoch")
    assert out == tmp_path / "run" / "curves.png" and out.read_bytes()[:8] == PNG
    assert matplotlib.image.imread(out).shape[:2] == (330, 920)  # loss and acc: two panels
    out = jn.plot([tmp_path / "run"], metrics="acc", out=tmp_path / "acc.png")
    assert matplotlib.image.imread(out).shape[:2] == (330, 460)
    with pytest.raises(jn.ConfigError, match="Did you mean 'acc'"):
        jn.plot(tmp_path / "run", metrics=["acc", "accc"])


# -- slow: real runs from the shell ---------------------------------------------------------
@pytest.mark.slow
def test_train_with_overrides_logs_them_and_draws_curves(work, trained):
    run = work / "runs" / "good"
    params = next(r for r in jn.read_jsonl(run / "metrics.jsonl") if r["type"] == "params")
    assert params["config"]["width"] == 24 and params["config"]["smoothing"] == 0.05
    assert params["config"]["shuffle"] is False and params["max_epochs"] == 2
    assert trained["stop_reason"] == "completed" and trained["epoch"] == 2
    assert trained["programs_compiled"] == 2 and trained["metric"] == "val_loss"
    assert isinstance(trained["best_metric"], float) and trained["best_checkpoint"]
    assert (run / "curves.png").read_bytes()[:8] == PNG  # written at the end of jn.train
    assert trained["curves"] == str(Path("runs/good/curves.png"))


@pytest.mark.slow
def test_validate_a_checkpoint_reads_its_config(work, trained):
    # --checkpoint may name the run directory: its best checkpoint. GraphConst values (width=24)
    # and Device values (smoothing=0.05, which the loss reads) come from the checkpoint unless
    # given: the loss reported is the run's.
    p = jaxnitro("validate", "exp.py:Tiny", "--checkpoint", "runs/good", "--json", cwd=work)
    assert p.returncode == 0, p.stderr
    metrics = last_json(p.stdout)
    assert set(metrics) == {"acc", "val_loss"}
    assert metrics["val_loss"] == pytest.approx(trained["best_metric"], rel=1e-5)
    assert "width=24" in p.stderr and "smoothing=0.05" in p.stderr
    # a Device value given on the command line wins over the checkpoint's
    args = ["--checkpoint", "runs/good", "--smoothing", "0.3", "--json"]
    p = jaxnitro("validate", "exp.py:Tiny", *args, cwd=work)
    assert p.returncode == 0, p.stderr
    assert last_json(p.stdout)["val_loss"] != pytest.approx(trained["best_metric"], rel=1e-5)
    assert "smoothing" not in p.stderr.split("from the checkpoint's config:")[-1]


@pytest.mark.slow
def test_export_a_checkpoint_from_the_shell_then_load_the_bundle(work, trained):
    import jaxnitro as jn

    p = jaxnitro(
        "export", "exp.py:Tiny", "bundles/tiny", "--checkpoint", "runs/good",
        "--platforms", "cpu", "--json", cwd=work,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    summary = last_json(p.stdout)
    assert summary["name"] == "tiny" and summary["platforms"] == ["cpu"]
    bundle = jn.load_bundle(work / "bundles" / "tiny")
    out = bundle(x=np.zeros((3, 8), np.float32))
    assert out.shape == (3, 4)


@pytest.mark.slow
def test_inspect_prints_the_report_without_training(work):
    p = jaxnitro("inspect", "exp.py:Tiny", "--width", "8", cwd=work)
    assert p.returncode == 0, p.stderr
    assert "binding" in p.stdout and "parameter groups" in p.stdout
    assert "width" in p.stdout and "GraphConst" in p.stdout and "programs" in p.stdout


@pytest.mark.slow
def test_a_failed_run_exits_1_and_runs_lists_both(work, trained):
    p = jaxnitro("train", "exp.py:Tiny", "--poison", "--run-dir", "runs/bad", cwd=work)
    assert p.returncode == 1
    assert "NonFiniteLossError" in p.stderr and "Traceback" not in p.stderr
    p = jaxnitro("runs", "--json", cwd=work)
    assert p.returncode == 0, p.stderr
    rows = {Path(r["run_dir"]).name: r for r in json.loads(p.stdout)}
    assert rows["good"]["status"] == "completed" and rows["bad"]["status"] == "error"
    assert rows["good"]["best"] == pytest.approx(trained["best_metric"])
    assert rows["good"]["epoch"] == 2 and rows["bad"]["best"] is None
    assert [Path(r["run_dir"]).name for r in json.loads(p.stdout)][0] == "bad"  # newest first
    p = jaxnitro("runs", "runs", cwd=work)
    assert p.returncode == 0 and "completed" in p.stdout and "error" in p.stdout


@pytest.mark.slow
def test_sweep_over_a_device_field_compiles_once_and_plots(work):
    import matplotlib.image

    p = jaxnitro(
        "--compilation-cache", "0",  # counted below: compiled here, not loaded from the suite's
        "sweep", "exp.py:Tiny", "--smoothing", "0.0,0.05,0.1", "--max-epochs", "1",
        "--run-dir", "sweeps/s[1]", "--json", cwd=work,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = last_json(p.stdout)
    by_point = sorted(rows, key=lambda r: r["point"])
    assert [r["programs_compiled"] for r in by_point] == [2, 0, 0]
    # the points done / total, and from the second point on the best so far
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("sweep point ")]
    assert [ln.split(":")[0] for ln in lines] == [f"sweep point {k}/3" for k in (1, 2, 3)]
    assert "best so far" not in lines[0]
    assert all(re.search(r"best so far: val_loss [\d.]+ \(point \d\)$", ln) for ln in lines[1:])
    assert [r["values"]["smoothing"] for r in by_point] == [0.0, 0.05, 0.1]
    losses = [r["best_metric"] for r in rows]
    assert losses == sorted(losses)  # ranked by the checkpointer's metric, val_loss min
    names = sorted(p.name for p in (work / "sweeps" / "s[1]").iterdir())
    assert names == ["sweep-0-smoothing=0.0", "sweep-1-smoothing=0.05", "sweep-2-smoothing=0.1"]
    assert all(any((work / r["run_dir"] / "checkpoints").iterdir()) for r in rows)
    # The points' curves overlaid: one panel per metric.
    runs = [r["run_dir"] for r in by_point]
    p = jaxnitro("plot", *runs, "--metrics", "loss,acc", "--x", "epoch", "-o", "cmp.png", cwd=work)
    assert p.returncode == 0, p.stderr
    out = work / "cmp.png"
    assert out.read_bytes()[:8] == PNG
    assert matplotlib.image.imread(out).shape[:2] == (330, 920)
