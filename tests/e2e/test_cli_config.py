"""Config files read by `jaxnitro train --config` (issue 41, item 15): a binary file is a
usage error, and `run_dir/config.toml` repeats its run from any working directory."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from helpers.cli import jaxnitro

EXPERIMENT = """
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


@jn.experiment
class Tiny:
    width: jn.GraphConst[int] = 4

    def build_model(self, rng):
        return jn.split_model(nnx.Linear(8, self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(96, 8)).astype(np.float32)
        y = x[:, :4].argmax(-1).astype(np.int32)
        return {
            "train": jn.DataLoader({"x": x[:64], "y": y[:64]}, batch_size=32, drop_last=True),
            "val": jn.DataLoader({"x": x[64:], "y": y[64:]}, batch_size=32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", [("train",), ("train", "--print-config"), ("sweep",)])
def test_a_binary_config_file_is_a_usage_error(tmp_path, command):
    bad = tmp_path / "weights.toml"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary")
    p = jaxnitro(*command, "--config", bad, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "UnicodeDecodeError" not in p.stderr
    assert f"config file {bad} is not text" in p.stderr, p.stderr


@pytest.mark.slow
def test_a_run_config_repeats_from_another_directory(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "exp.py").write_text(EXPERIMENT)
    first = jaxnitro("train", "exp.py:Tiny", "--width", "6", "--run-dir", "runs/a", cwd=project)
    assert first.returncode == 0, first.stderr
    written = project / "runs" / "a" / "config.toml"
    target = tomllib.loads(written.read_text())["target"]
    assert target == "../../exp.py:Tiny"  # relative to the config file: the tree can move

    again = jaxnitro("train", "--config", written, "--run-dir", "b", cwd=elsewhere)
    assert again.returncode == 0, again.stderr
    repeated = tomllib.loads((elsewhere / "b" / "config.toml").read_text())
    assert repeated["fields"]["width"] == 6
    assert (elsewhere / "b" / Path(repeated["target"].rpartition(":")[0])).resolve() == (
        project / "exp.py"
    ).resolve()


@pytest.mark.slow
def test_a_config_target_beside_the_working_directory_still_loads(tmp_path):
    """A hand-written config in a subfolder naming the file from the project's root (as
    before): not beside the config, so taken from the working directory."""
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "small.toml"
    config.write_text('target = "exp.py:Tiny"\n[fields]\nwidth = 5\n')
    p = jaxnitro("train", "--config", config, "--print-config", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    printed = tomllib.loads(p.stdout.split("\n", 2)[-1])
    assert printed["fields"]["width"] == 5 and printed["target"] == "exp.py:Tiny"
