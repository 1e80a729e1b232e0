"""Crash safety: SIGKILL at random times (many during a checkpoint write), restart, finish.

The slow test trains a tiny experiment in a child process with `resume="auto"`, kills it
with SIGKILL again and again (in start-up, at random seeded times, and right after a
checkpoint's `*.tmp-*` directory appears), restarts it each time, and finally lets it finish.
Every restart must resume from the newest complete checkpoint, and the final parameters must
equal, bit for bit, those of an uninterrupted run. The other tests cover the pieces:
verification of a checkpoint, `latest_valid()` skipping a corrupted newest one, and the JSONL
log after a kill.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, nitro
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.checkpoint.store import TopKCheckpointer, verify_checkpoint
from jaxnitro._src.core.errors import CheckpointError, CheckpointWarning
from jaxnitro._src.observe.loggers import JSONLogger, read_jsonl

CHILD = r"""
import os, sys
sys.path.insert(0, {tests!r})
import jax
import numpy as np
import jaxnitro as jn
from conftest import Tiny, nitro

run_dir, out, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = nitro(Tiny(), run_dir=run_dir, resume="auto", max_epochs=epochs)
print(f"START {{n.step}} {{n.epoch}}", flush=True)
result = jn.train(n)
leaves = [np.asarray(x) for x in jax.tree.leaves(n.params)]
np.savez(out + ".part.npz", *leaves)
os.replace(out + ".part.npz", out)
print(f"DONE {{n.step}} {{result.stop_reason}}", flush=True)
"""

EPOCHS = 60  # x 8 steps; an epoch (steps, validation, checkpoint) takes ~50 ms here
KILLS = 10  # SIGKILLs before the run is allowed to finish
# Where they land, in a seeded random order: in start-up (imports, setup, restore), at a random
# time in training, right after a checkpoint write begins. Each kind of point at least twice;
# test_checkpoint_files.py and the tests below cover the pieces (temp entries, a truncated
# newest checkpoint) one by one.
MODES = ["startup"] * 2 + ["random"] * 3 + ["save"] * 5
STEPS_PER_EPOCH = 8  # Tiny: 256 samples / 32


def _complete_steps(ckdir: Path) -> list[int]:
    """Steps of the complete checkpoints on disk (a finished directory has meta.json)."""
    if not ckdir.is_dir():
        return []
    steps = []
    for p in ckdir.iterdir():
        if (
            p.is_dir()
            and ".tmp-" not in p.name
            and ".corrupt-" not in p.name
            and (p / "meta.json").is_file()
        ):
            steps.append(json.loads((p / "meta.json").read_text())["step"])
    return steps


def _tmp_entries(ckdir: Path) -> list[str]:
    try:
        return [name for name in os.listdir(ckdir) if ".tmp-" in name]
    except FileNotFoundError:
        return []


class _Child:
    """One training process; its stdout lines are collected by a reader thread."""

    def __init__(self, script: Path, run_dir: Path, out: Path, err: Path, env: dict):
        self.err_path = err
        self._err = open(err, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(out), str(EPOCHS)],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.start: tuple[int, int] | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_start(self, timeout: float) -> bool:
        """Wait for the START line; False if the process ended or the time ran out."""
        deadline = time.monotonic() + timeout
        while self.start is None:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                return False
            if line.startswith("START"):
                _, step, epoch = line.split()
                self.start = (int(step), int(epoch))
        return True

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.finish(30)

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._err.close()
        return rc

    def stderr(self) -> str:
        return self.err_path.read_text()[-3000:]


def _run_to_end(script, run_dir, out, err, env, timeout=300) -> tuple[int, tuple | None, str]:
    child = _Child(script, run_dir, out, err, env)
    child.wait_start(timeout)
    rc = child.finish(timeout)
    return rc, child.start, child.stderr()


@pytest.mark.slow
@pytest.mark.timeout(600)  # generous: a loaded machine; ~12 child processes
def test_sigkill_at_random_times_then_resume_matches_an_uninterrupted_run(tmp_path):
    t_begin = time.monotonic()
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS)))
    # Every child imports conftest, so uses the suite's compilation cache: the restarts load
    # the programs the reference run (or an earlier test) compiled.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)

    # 1. The uninterrupted reference run (it also fills the compilation cache).
    ref_out = tmp_path / "reference.npz"
    rc, start, err = _run_to_end(script, tmp_path / "reference", ref_out, tmp_path / "ref.err", env)
    assert rc == 0, err
    assert start == (0, 0)

    # 2. Kill, restart, kill, ... at seeded random times.
    rng = random.Random(20240611)
    schedule = rng.sample(MODES, len(MODES))
    run_dir, out = tmp_path / "killed", tmp_path / "killed.npz"
    ckdir = run_dir / "checkpoints"
    kills, mid_write, resumed_from, log = 0, 0, set(), []
    cycle = 0
    while kills < KILLS:
        cycle += 1
        assert cycle <= 3 * KILLS, f"the child keeps finishing on its own: {log}"
        steps = _complete_steps(ckdir)
        expected = max(steps, default=0)  # newest complete checkpoint; 0 = a fresh start
        near_end = expected >= (EPOCHS - 8) * STEPS_PER_EPOCH
        mode = schedule[kills]
        if near_end:
            mode = "save"  # kill at the first write: no progress, so kills remain to be done
        child = _Child(script, run_dir, out, tmp_path / f"child-{cycle}.err", env)
        if mode == "startup":  # anywhere in imports, setup, restore, or the first epochs
            time.sleep(rng.uniform(0.05, 2.0))
        else:
            assert child.wait_start(120), f"cycle {cycle}: no START line\n{child.stderr()}"
            if mode == "random":
                time.sleep(rng.uniform(0.0, 0.8))
            else:  # right after the n-th temporary checkpoint entry appears
                nth = 1 if near_end else rng.randint(1, 3)
                extra = rng.choice([0.0, 0.0, rng.uniform(0.0, 0.03)])
                seen: set[str] = set()
                deadline = time.monotonic() + 120  # generous: a loaded machine
                while child.proc.poll() is None and time.monotonic() < deadline:
                    new = set(_tmp_entries(ckdir)) - seen
                    if new:
                        seen |= new
                        if len(seen) >= nth:
                            break
                    time.sleep(0.0005)
                if extra:
                    time.sleep(extra)
        if child.proc.poll() is not None:  # finished (or failed) before the kill
            rc = child.finish(30)
            assert rc == 0, f"cycle {cycle} ({mode}): the child failed, rc={rc}\n{child.stderr()}"
            log.append((cycle, mode, "finished"))
            break
        rc = child.kill()
        assert rc == -signal.SIGKILL, f"cycle {cycle} ({mode}): rc={rc}\n{child.stderr()}"
        kills += 1
        interrupted = bool(_tmp_entries(ckdir))  # a write or a retention delete was cut short
        mid_write += interrupted
        # Drain the lines the child printed before it died.
        child.wait_start(0.5)
        if child.start is not None:
            step, epoch = child.start
            assert step == expected, (
                f"cycle {cycle}: resumed at step {step}, but the newest complete checkpoint "
                f"is at step {expected} (complete: {sorted(steps)})\n{child.stderr()}"
            )
            assert step == epoch * STEPS_PER_EPOCH, (step, epoch)
            resumed_from.add(step)
        log.append((cycle, mode, child.start, interrupted))

    # 3. Let it finish.
    expected = max(_complete_steps(ckdir), default=0)
    rc, start, err = _run_to_end(script, run_dir, out, tmp_path / "final.err", env)
    assert rc == 0, err
    assert start is not None and start[0] == expected, (start, expected)

    print(
        f"{kills} kills ({mid_write} mid-write), resumed from {len(resumed_from)} "
        f"checkpoints, {time.monotonic() - t_begin:.0f}s; {log}"
    )
    assert kills >= KILLS - 1, log
    assert mid_write >= 3, f"only {mid_write} kills hit a checkpoint write: {log}"
    assert len(resumed_from) >= 3, f"restarts resumed from too few checkpoints: {log}"
    ref, got = np.load(ref_out), np.load(out)
    assert len(ref.files) == len(got.files) > 0
    for k in ref.files:
        assert ref[k].dtype == got[k].dtype and np.array_equal(ref[k], got[k]), k
    # Nothing half-written is left, the manifest lists what is on disk, and the log reads back.
    assert not _tmp_entries(ckdir)
    ck = TopKCheckpointer(dir=ckdir)
    assert ck.latest_valid() == ck.latest() and ck.latest().name.startswith(f"epoch-{EPOCHS:04d}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["type"] == "finish" and rows[-1]["status"] == "completed"


# -- the pieces ------------------------------------------------------------------------
def _save(ck: TopKCheckpointer, step: int) -> Path:
    rand = np.random.default_rng(step).standard_normal((64, 64))  # incompressible, not inlined
    trees = {
        "params": {"w": jnp.asarray(rand, jnp.float32), "b": jnp.arange(8, dtype=jnp.int32) + step}
    }
    return ck.save(
        epoch=step,
        step=step * 10,
        metrics={"val_loss": 1.0 / step},
        trees=trees,
        meta={"note": step},
    )


def _data_files(ckpt: Path) -> list[Path]:
    return [p for p in (ckpt / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]


def _truncate_biggest_data_file(ckpt: Path) -> Path:
    biggest = max(_data_files(ckpt), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as fh:
        fh.truncate(biggest.stat().st_size // 2)
    return biggest


def _truncate_all_data_files(ckpt: Path) -> None:
    # OCDBT keeps superseded nodes in some files; cutting all of them hits the live ones.
    for path in _data_files(ckpt):
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)


def test_latest_valid_skips_a_truncated_newest_checkpoint_and_warns(tmp_path):
    ck = TopKCheckpointer(k=5, dir=tmp_path / "ck")
    first, second, third = _save(ck, 1), _save(ck, 2), _save(ck, 3)
    assert ck.latest_valid() == third
    _truncate_biggest_data_file(third)
    with pytest.raises(CheckpointError, match="corrupted"):
        verify_checkpoint(third)
    assert ck.latest() == third  # cheap: looks at meta.json only
    with pytest.warns(CheckpointWarning) as rec:
        assert ck.latest_valid() == second
    [w] = rec
    msg = str(w.message)
    assert third.name in msg and "corrupted" in msg and f"using {second.name} instead" in msg
    assert ".corrupt-0" in msg
    # Moved aside: no longer newest nor listed; bind() does not adopt it back.
    assert not third.exists() and (ck.dir / f"{third.name}.corrupt-0").is_dir()
    assert ck.latest() == second and [r["name"] for r in ck.records()] == [first.name, second.name]
    ck2 = TopKCheckpointer(k=5, dir=ck.dir)
    ck2.bind(ck.dir)
    assert ck2.latest() == second
    # The next save is newest again.
    fourth = _save(ck, 4)
    assert ck.latest_valid() == fourth


def test_latest_valid_skips_several_and_can_leave_them_in_place(tmp_path):
    ck = TopKCheckpointer(k=5, dir=tmp_path)
    first, second, third = _save(ck, 1), _save(ck, 2), _save(ck, 3)
    _truncate_biggest_data_file(third)
    (second / "meta.json").write_text('{"format_version": 1, "epo')  # truncated JSON
    with pytest.warns(CheckpointWarning) as rec:
        assert ck.latest_valid(quarantine=False) == first
    names = [str(w.message) for w in rec]
    assert len(names) == 2 and third.name in names[0] and second.name in names[1]
    assert "unreadable meta.json" in names[1]
    assert third.exists() and second.exists()  # quarantine=False: nothing moved


def test_latest_valid_with_nothing_valid_returns_none(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    assert ck.latest_valid() is None
    only = _save(ck, 1)
    _truncate_biggest_data_file(only)
    with pytest.warns(CheckpointWarning, match="no valid checkpoint remains"):
        assert ck.latest_valid() is None


def test_verify_checkpoint_returns_meta(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    meta = verify_checkpoint(_save(ck, 2))
    assert meta["step"] == 20 and meta["note"] == 2


def test_resume_auto_falls_back_when_the_newest_checkpoint_is_corrupted(run_dir):
    jn.train(nitro(Tiny(), run_dir=run_dir, max_epochs=2))
    newest = TopKCheckpointer(dir=run_dir / "checkpoints")
    newest.bind(run_dir)
    _truncate_all_data_files(newest.latest())
    with pytest.warns(CheckpointWarning, match="epoch-0002"):
        n = nitro(Tiny(), run_dir=run_dir, max_epochs=2, resume="auto")
    assert n.step == 8 and n.epoch == 1


def test_jsonl_log_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "params", "seed": 1}\n{"type": "metrics", "loss": 0.')
    log = JSONLogger()
    log.open(tmp_path, resume=True)
    log.log_metrics({"loss": 0.5}, context="train", epoch=1, step=1)
    log.close()
    with pytest.warns(UserWarning, match="line 2"):  # the cut fragment is kept, and skipped
        rows = read_jsonl(path)
    assert [r["type"] for r in rows] == ["params", "metrics"] and rows[1]["loss"] == 0.5
