"""Background runs: `jn.start`, `jn.RunHandle`, `jn.runs` (commands applied at step boundaries)."""

from __future__ import annotations

import threading
import time

import jax
import pytest
from conftest import Tiny

import jaxnitro as jn
from jaxnitro._src.train.background import tail_rows


@jn.experiment
class Shown(Tiny):
    """Tiny that logs its Device value `smoothing` with every train step."""

    def train_metrics(self, logits, *, y):
        return {"smoothing_seen": self.smoothing + 0.0 * logits.sum()}


def _until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_background_runs_at_once_with_their_own_run_dirs(tmp_path):
    a = jn.start(jn.Nitro(Tiny(max_epochs=1), run_dir=tmp_path / "a", progress=False))
    b = jn.start(jn.Nitro(Tiny(max_epochs=1), run_dir=tmp_path / "b", progress=False))
    assert a.id != b.id
    ra, rb = a.wait(timeout=120), b.wait(timeout=120)
    assert ra.stop_reason == rb.stop_reason == "completed"
    assert a.status()["stop_reason"] == "completed" and a.status()["step"] == 8
    for h, d in ((a, "a"), (b, "b")):
        assert h.nitro.run_dir == tmp_path / d
        assert ra.best_checkpoint != rb.best_checkpoint
        assert (tmp_path / d / "metrics.jsonl").is_file()
    with pytest.raises(jn.ConfigError, match="ended before a step boundary"):
        a.checkpoint(wait=True, timeout=5)  # no boundary is left: said at once, no hang
    assert [h.id for h in jn.runs()][-2:] == [a.id, b.id]
    table = jn.runs()
    assert a.id in repr(table) and "<table>" in table._repr_html_()


@pytest.mark.slow
def test_wait_reraises_the_run_error(tmp_path):
    @jn.experiment
    class Broken(Tiny):
        def loss(self, logits, *, y):
            return logits.mean() * float("nan")

    h = jn.start(jn.Nitro(Broken(), run_dir=tmp_path / "r", progress=False))
    with pytest.raises(jn.NonFiniteLossError, match="loss is nan"):
        h.wait(timeout=120)
    assert h.status()["stop_reason"] == "error"
    assert "NonFiniteLossError" in h.status()["error"]


def test_stop_before_the_first_step(tmp_path):
    n = jn.Nitro(Tiny(max_epochs=3), run_dir=tmp_path / "r", progress=False)
    gate = threading.Event()
    jn.on_phase(lambda phase, *_: phase == "Starting" and gate.wait(60), nitro=n)
    h = jn.start(n)
    h.stop()  # while the run is still starting: before any step
    gate.set()
    result = h.wait(timeout=120)
    assert result.stop_reason == "requested"
    assert n.step <= 1 and n.epoch == 0
    assert result.best_checkpoint is not None  # the stop validated and checkpointed


@pytest.mark.slow
def test_set_device_checkpoint_and_stop_mid_run(tmp_path):
    n = jn.Nitro(Shown(max_epochs=50), run_dir=tmp_path / "r", progress=False)
    h = jn.start(n)
    _until(lambda: n.step >= 3, "three steps")
    compiled = jn.cache_stats()["misses"]
    with pytest.raises(jn.ConfigError, match="GraphConst field 'width'"):
        h.set_device(width=4)  # checked at once: the caller's error, not the run's
    h.set_device(smoothing=0.25)
    path = h.checkpoint(wait=True, timeout=60)
    assert path is not None and path.exists()
    h.stop()
    result = h.wait(timeout=120)
    assert result.stop_reason == "requested" and n.epoch < 50
    # one epoch count: the status's is the last train line's (mid-epoch: the current one)
    # and the requested checkpoint's name has the epoch of its step; phase apart from reason
    rows = tail_rows(n.run_dir / "metrics.jsonl", 100_000)
    train = [r for r in rows if r.get("context") == "train"]
    assert h.status()["epoch"] == train[-1]["epoch"]
    at = next(r for r in train if r["step"] == int(path.name.split("-")[3]))
    assert path.name.startswith(f"epoch-{at['epoch']:04d}-")
    row = next(r for r in jn.runs().rows() if r[0] == h.id)
    assert row[1:3] == ("Done", "requested"), row
    assert path.exists()  # retention spared the checkpoint asked for, and says so
    assert [r["requested"] for r in n.checkpointer.records() if r["name"] == path.name] == [True]
    assert jn.cache_stats()["misses"] == compiled  # nothing recompiled
    rows = tail_rows(n.run_dir / "metrics.jsonl", 100_000)
    marker = next(r for r in rows if r.get("key") == "set_device")
    seen = {r["step"]: r["smoothing_seen"] for r in rows if r.get("context") == "train"}
    first = marker["from_step"]
    assert all(v == 0.0 for s, v in seen.items() if s < first)
    assert all(v == 0.25 for s, v in seen.items() if s >= first) and max(seen) >= first
    assert jax.device_get(n.device.values["smoothing"]) == 0.25


def test_a_background_run_installs_no_signal_handlers_and_draws_no_bar(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    n = jn.Nitro(Tiny(max_epochs=1), run_dir=tmp_path / "r", progress="rich")
    seen = []
    jn.on_phase(
        lambda phase, *_: seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(15))),
        nitro=n,
    )
    h = jn.start(n)
    assert n.display.mode == "plain"  # a live bar redrawn from a thread: plain lines instead
    h.wait(timeout=120)
    assert seen and all(s == before for s in seen)


EXIT_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import Tiny, nitro
import jaxnitro as jn
n = nitro(Tiny(max_epochs=500, n_train=4096), run_dir={run_dir!r})
h = jn.start(n)
while n.step < 40:
    time.sleep(0.01)
print("leaving", flush=True)
"""


@pytest.mark.slow
def test_a_script_that_ends_mid_run_stops_it_with_a_checkpoint_and_says_so(tmp_path):
    """The script ends while its background run trains: the run stops at its next step with
    a checkpoint, a line says where and how to continue, and nothing is cut or raised."""
    import os
    import subprocess
    import sys

    from helpers.paths import SRC, TESTS

    from jaxnitro._src.run.setup import read_meta

    run_dir = tmp_path / "run"
    script = EXIT_SCRIPT.format(tests=str(TESTS), run_dir=str(run_dir))
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "leaving" in done.stdout
    said = [ln for ln in done.stderr.splitlines() if "the script ended while run" in ln]
    assert len(said) == 1 and "resume='auto'" in said[0], done.stderr[-2000:]
    step = int(said[0].split("it stopped at step ")[1].split()[0])
    latest = max((run_dir / "checkpoints").glob("epoch-*"), key=lambda p: read_meta(p)["step"])
    assert step >= 40 and read_meta(latest)["step"] == step and str(latest) in said[0]
    resumed = jn.Nitro(Tiny(max_epochs=500, n_train=4096), run_dir=run_dir, resume="auto")
    assert resumed.step == step
