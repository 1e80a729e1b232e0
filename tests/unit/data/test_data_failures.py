"""Data under failure: transform workers that hang or die (real processes, real signals) and
memory-mapped files that shrink (real truncated files). Whatever happens, the run gets a
DataError that names what happened and what to do, and no worker is left behind."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import make_data
from helpers.procs import child_env, gone, until

import jaxnitro as jn

ENV = child_env()


def _workers() -> dict[str, int]:
    """{name: pid} of this process's transform workers that are running."""
    return {
        p.name: p.pid
        for p in multiprocessing.active_children()
        if p.name.startswith("jaxnitro-transform-") and p.pid is not None
    }


# -- a hung transform (item 7) -------------------------------------------------------------
_HUNG = """
import os, sys, time
import numpy as np
import jaxnitro as jn

marks = sys.argv[1]

def stall(example, rng):
    open(os.path.join(marks, str(os.getpid())), "w").close()
    if int(example["i"]) == 5:  # sample 5 never ends (bounded, so old code leaves no orphan)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            time.sleep(0.5)
    return example

i = np.arange(64, dtype=np.int32)
loader = jn.DataLoader({"i": i}, 4, transform=stall, workers=2, worker_timeout=1)
t0 = time.monotonic()
try:
    list(loader)
except jn.DataError as e:
    print("ERROR", time.monotonic() - t0, e, flush=True)
print("AGAIN", len(list(loader.iter_from(2))), flush=True)  # sample 5 is in batch 1
"""


@pytest.mark.slow
def test_a_hung_transform_fails_after_worker_timeout_naming_the_sample(tmp_path):
    """Once it hung the run forever, with no message; now the pass fails after the timeout,
    the stuck worker is stopped (and its sibling), and the process exits with none left."""
    script, marks = tmp_path / "hung.py", tmp_path / "marks"
    script.write_text(_HUNG)
    marks.mkdir()
    p = subprocess.run(
        [sys.executable, str(script), str(marks)],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("ERROR"))
    seconds = float(line.split()[1])
    assert 1 <= seconds < 60
    assert "worker 1 (pid " in line and "more than worker_timeout=1 s" in line
    assert "on sample 5 (batch 1 of epoch 1)" in line and "None waits forever" in line
    assert "AGAIN 14" in p.stdout  # the next pass starts new workers
    pids = [int(m.name) for m in marks.iterdir()]
    assert len(pids) >= 3  # the probe (this process) and two workers, then two more
    assert gone(pids), "a transform worker outlived the script"


def test_worker_timeout_bounds_one_sample_not_a_whole_batch():
    """A batch of 16 quick samples takes longer than the timeout; no sample does."""

    def quick(example, rng):
        time.sleep(0.1)
        return example

    i = np.arange(32, dtype=np.int32)
    loader = jn.DataLoader({"i": i}, 16, transform=quick, workers=1, worker_timeout=1)
    try:
        t0 = time.monotonic()
        batches = list(loader)
        assert time.monotonic() - t0 > 2  # each batch ran past the timeout, and passed
        assert np.array_equal(np.concatenate([b["i"] for b in batches]), i)
    finally:
        loader.close()


def test_worker_timeout_is_validated():
    x, y = make_data(8)
    for bad in (0, -1.5, "30", True, float("nan")):
        with pytest.raises(jn.DataError, match=r"worker_timeout=.* number > 0 .*None"):
            jn.DataLoader({"x": x, "y": y}, 4, worker_timeout=bad)
    assert jn.DataLoader({"x": x, "y": y}, 4).worker_timeout == 300
    assert jn.DataLoader({"x": x, "y": y}, 4, worker_timeout=None).worker_timeout is None


# -- a dead worker (item 8) ----------------------------------------------------------------
def test_a_worker_killed_mid_sample_names_itself_its_signal_and_the_sample(tmp_path):
    """SIGKILL from outside while a worker holds sample 5: once a bare EOFError."""
    marker = tmp_path / "holding"

    def hold(example, rng):
        if int(example["i"]) == 5:
            marker.write_text(str(os.getpid()))
            end = time.monotonic() + 120  # killed long before
            while time.monotonic() < end:
                time.sleep(0.05)
        return example

    loader = jn.DataLoader({"i": np.arange(32, dtype=np.int32)}, 4, transform=hold, workers=2)
    killed: list[int] = []

    def kill_the_holder():
        pid = int(until(lambda: marker.exists() and marker.read_text()))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_the_holder, daemon=True)
    killer.start()
    try:
        with pytest.raises(jn.DataError) as err:
            list(loader)
        killer.join(timeout=60)
        msg = str(err.value)
        assert f"worker 1 (pid {killed[0]}) was killed by SIGKILL" in msg
        assert "on sample 5 (batch 1 of epoch 1)" in msg
        assert "out-of-memory killer" in msg and "dmesg" in msg
        assert not _workers(), "the other worker was left running"
    finally:
        loader.close()


def test_a_worker_killed_while_idle_is_named_not_a_broken_pipe():
    """A worker that died between passes: the next pass's send to it once raised a bare
    BrokenPipeError. Now it is named, its sibling stopped, and the pass after runs anew."""
    x, y = make_data(32)
    loader = jn.DataLoader({"x": x, "y": y}, 4, transform=lambda ex, rng: ex, workers=2)
    try:
        first = list(loader)
        victim = next(p for p in multiprocessing.active_children() if p.name.endswith("-1"))
        sibling = _workers()["jaxnitro-transform-0"]
        os.kill(victim.pid, signal.SIGKILL)
        multiprocessing.connection.wait([victim.sentinel], timeout=60)
        with pytest.raises(jn.DataError) as err:
            list(loader)
        msg = str(err.value)
        assert f"worker 1 (pid {victim.pid}) was killed by SIGKILL while idle" in msg
        assert "next pass starts new ones" in msg
        assert gone([sibling])
        again = list(loader)
        assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(first, again, strict=True))
    finally:
        loader.close()


def test_a_worker_killed_by_sigbus_on_a_shrunk_map_says_to_check_the_file(tmp_path):
    """The file shrinks under a running pass (after the pass's own check): the worker that
    reads past its end dies of a real SIGBUS, and the error says what that means."""
    path = tmp_path / "x.npy"
    np.save(path, np.ones((64, 1024), np.float32))  # 4 KiB a row: a page each
    keep = 128 + 8 * 4096  # the header and rows 0-7

    def shrink(example, rng):
        if int(example["i"]) == 8:  # batch 1, read already; batch 2 reads past the end
            faulthandler.disable()  # in the worker: it dies of SIGBUS without a dump
            os.truncate(path, keep)
        return example

    data = {"x": np.load(path, mmap_mode="r"), "i": np.arange(64, dtype=np.int32)}
    loader = jn.DataLoader(data, 8, transform=shrink, workers=1)
    try:
        with pytest.raises(jn.DataError) as err:
            list(loader)
        msg = str(err.value)
        assert "was killed by SIGBUS on batch 2 of epoch 1, reading its rows" in msg
        assert "memory-mapped file shrank" in msg and "Write it again in full" in msg
        with pytest.raises(jn.DataError, match="truncated"):  # the next pass is refused
            list(loader)
    finally:
        loader.close()


# -- a memory map whose file shrank (item 9) -----------------------------------------------
def test_a_memory_map_truncated_before_the_loader_is_refused_naming_file_and_sizes(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.ones((1024, 256), np.float32))  # 1 MiB after a 128-byte header
    mm = np.load(path, mmap_mode="r")
    os.truncate(path, 4096)
    with pytest.raises(jn.DataError) as err:
        jn.DataLoader({"x": mm[100:], "y": np.zeros(924, np.int32)}, 32)  # a view as well
    msg = str(err.value)
    assert f"field 'x' is memory-mapped from {path}, which is 4096 bytes long" in msg
    assert f"need {128 + 1024 * 256 * 4} bytes" in msg and "SIGBUS" in msg
    assert "np.save" in msg
    # A file already short when loaded is refused by numpy itself, before any read.
    with pytest.raises(ValueError, match="mmap length is greater than file size"):
        np.load(path, mmap_mode="r")
    # and an intact map passes
    np.save(tmp_path / "ok.npy", np.ones((16, 4), np.float32))
    jn.DataLoader({"x": np.load(tmp_path / "ok.npy", mmap_mode="r")}, 4)


_SHRINKS = """
import os, sys
import numpy as np, optax
from flax import nnx
import jaxnitro as jn

path, run_dir, when = sys.argv[1], sys.argv[2], sys.argv[3]

class Lin(nnx.Module):
    def __init__(self, rngs): self.l = nnx.Linear(8, 2, rngs=rngs)
    def __call__(self, x): return self.l(x)

@jn.experiment
class E:
    max_epochs: int = 2
    def build_model(self, rng): return jn.split_model(Lin(nnx.Rngs(rng)))
    def build_data(self, dist):
        x = np.load(path, mmap_mode="r")
        y = np.zeros(len(x), np.int32)
        train = jn.DataLoader({"x": x, "y": y}, 512, drop_last=True)
        if when == "setup":  # after the loader was made, before setup reads a batch
            os.truncate(path, 4096)
        val = {"x": np.zeros((16, 8), np.float32), "y": np.zeros(16, np.int32)}
        return {"train": train, "val": jn.DataLoader(val, 16)}
    def forward(self, model, params, state, *, x): return jn.apply(model, params, state, x)
    def loss(self, out, *, y): return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

def shrink(phase, step, epoch, info):
    if when == "epoch" and phase == "Evaluating":  # the end of epoch 1
        os.truncate(path, 4096)

jn.on_phase(shrink)
n = jn.Nitro(E(), run_dir=run_dir, progress=False, checkpointer=False)
print("SET UP", flush=True)
jn.train(n)
print("TRAINED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["setup", "epoch"])
def test_a_memory_map_truncated_during_a_run_is_refused_not_a_sigbus(tmp_path, when):
    """A trainer whose memory-mapped file shrank after the loader was made: it died of
    SIGBUS with no message (rc -7). Now setup, or the next epoch's start, refuses it."""
    path = tmp_path / "x.npy"
    np.save(path, np.ones((4096, 8), np.float32))  # 128 KiB; 4 KiB keeps rows 0-123
    script = tmp_path / "shrinks.py"
    script.write_text(_SHRINKS)
    p = subprocess.run(
        [sys.executable, str(script), str(path), str(tmp_path / "run"), when],
        capture_output=True, text=True, timeout=240, env=ENV,
    )  # fmt: skip
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "DataError" in p.stderr
    assert f"memory-mapped from {path}, which is 4096 bytes long" in p.stderr
    assert f"need {128 + 4096 * 8 * 4} bytes" in p.stderr
    assert ("SET UP" in p.stdout) == (when == "epoch")
    assert "TRAINED" not in p.stdout
