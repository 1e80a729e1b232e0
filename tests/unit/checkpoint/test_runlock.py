"""The run-dir lock: one writer per run directory, readers beside it, stale locks taken over."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from conftest import Tiny, nitro
from helpers.logs import lines
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.checkpoint.runlock import RunLock, RunLockedError


def test_two_handles_in_one_process_cannot_both_write(run_dir):
    a = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    b = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    seen = []

    def try_second(phase, step, epoch, info):
        if phase == "Training" and not seen:
            with pytest.raises(RunLockedError) as e:
                jn.train(b)
            seen.append(str(e.value))

    jn.on_phase(try_second, nitro=a)
    assert jn.train(a).stop_reason == "completed"
    assert seen and "another handle in this process" in seen[0] and "run_dir" in seen[0]
    # Finished: the lock is released, so the other handle (a notebook re-run) just works.
    assert jn.train(b).stop_reason == "completed"


@pytest.mark.slow
def test_setup_writes_nothing_and_a_fresh_handle_after_a_run_just_works(run_dir):
    nitro(Tiny(max_epochs=1), run_dir=run_dir)
    assert not (run_dir / "metrics.jsonl").exists()  # setup never writes the run's files
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    again = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    assert jn.train(again).stop_reason == "completed"
    assert [ln["type"] for ln in lines(run_dir / "metrics.jsonl")].count("params") == 2


@pytest.mark.slow
def test_stale_lock_of_a_killed_process_is_taken_over(run_dir):
    run_dir.mkdir(parents=True)
    code = (
        f"import sys, time; sys.path.insert(0, {os.path.dirname(jn.__file__)!r}+'/..');"
        f"from jaxnitro._src.checkpoint.runlock import RunLock; l = RunLock({str(run_dir)!r}); "
        f"assert l.try_acquire('train'); print('HELD', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with pytest.raises(RunLockedError, match=rf"process {proc.pid}.*another run_dir"):
        jn.train(n)
    proc.kill()
    proc.wait()
    with pytest.warns(UserWarning, match=rf"taking over the run lock .* {proc.pid}"):
        assert jn.train(n).stop_reason == "completed"


TRAINER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    from conftest import Tiny
    def hold(phase, step, epoch, info):
        print("PHASE", phase, flush=True)
        # From the third epoch on, train on only once the reader says it is done: the run
        # (and its lock) outlives the reader's checks however slow the machine is.
        deadline = time.time() + 300
        while phase == "Training" and epoch >= 2 and not os.path.exists({release!r}):
            if time.time() > deadline:
                break
            time.sleep(0.02)
    jn.on_phase(hold)
    # Keep every checkpoint: a reader then never races the trainer's retention (a checkpoint
    # deleted while a reader loads it is a separate, reported failure).
    n = jn.Nitro(
        Tiny(max_epochs={epochs}, n_train=2048),
        run_dir={run!r},
        progress=False,
        checkpointer=jn.TopKCheckpointer(k=1000),
    )
    r = jn.train(n)
    print("END", r.stop_reason, n.step, flush=True)
""")


@pytest.mark.slow
def test_a_reader_evaluates_while_a_trainer_runs_and_never_disturbs_it(tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "trainer.py"
    release = tmp_path / "release"
    script.write_text(
        TRAINER.format(tests=str(TESTS), run=str(run), epochs=4, release=str(release))
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        for line in proc.stdout:
            if line.startswith("PHASE Checkpointing"):
                break
        else:
            raise AssertionError("the trainer never checkpointed: " + proc.stderr.read()[-3000:])
        ckpts = run / "checkpoints"
        done = 0
        deadline = time.time() + 60
        while done < 5 and time.time() < deadline:  # evaluate repeatedly while it trains
            latest = jn.TopKCheckpointer(dir=ckpts).latest()
            if latest is None:
                time.sleep(0.05)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reader = nitro(Tiny(n_train=2048), run_dir=run, checkpoint=latest)
                values = jn.validate(reader)
            assert 0 <= values["acc"] <= 1
            done += 1
            with pytest.raises(RunLockedError, match=f"process {proc.pid}"):
                jn.train(reader)
        release.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert done == 5 and "END completed" in out
    log = lines(run / "metrics.jsonl")
    assert [ln["type"] for ln in log].count("params") == 1  # the readers logged nothing
    assert log[-1]["type"] == "finish" and log[-1]["status"] == "completed"


def test_run_lock_is_reentrant_and_released(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.try_acquire("train") and lock.try_acquire("evaluate")
    other = RunLock(tmp_path)
    assert not other.try_acquire("train")
    lock.release()
    assert not other.try_acquire("train")  # still held once
    lock.release()
    assert other.try_acquire("train")
    other.release()


@pytest.mark.slow
def test_a_fresh_run_into_a_used_run_dir_keeps_the_earlier_runs_checkpoints(run_dir):
    def ck():
        return jn.TopKCheckpointer(k=1, metric="acc", mode="max")

    first = jn.train(nitro(Tiny(max_epochs=3), run_dir=run_dir, checkpointer=ck()))
    kept = {p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()}
    assert first.best_checkpoint.name in kept
    second_n = nitro(Tiny(max_epochs=3, width=24), run_dir=run_dir, checkpointer=ck())
    second = jn.train(second_n)
    now = {p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()}
    assert kept <= now  # nothing of the first run was deleted
    assert second.best_checkpoint.name in now and second.best_checkpoint.name not in kept
    _, meta = jn.load_checkpoint(second.best_checkpoint)
    assert meta["run_id"] == second_n.spec.run_id
    rows = jn.read_manifest(run_dir / "checkpoints")
    assert len({r["run_id"] for r in rows}) == 2
    # resume="auto" continues the run that wrote last
    again = nitro(Tiny(max_epochs=4, width=24), run_dir=run_dir, resume="auto", checkpointer=ck())
    assert again.spec.run_id == second_n.spec.run_id and again.step == 24


@pytest.mark.parametrize("name", ["sweep[lr=0.1]", "a**b", "back\\slash"])
def test_a_run_dir_with_glob_characters_trains_and_resumes(tmp_path, name):
    run = tmp_path / name
    first = jn.train(nitro(Tiny(max_epochs=1), run_dir=run))
    assert first.best_checkpoint is not None
    jn.load_checkpoint(first.best_checkpoint)  # loads: the array store was finalised
    resumed = nitro(Tiny(max_epochs=2), run_dir=run, resume="auto")
    assert resumed.step == 8
    assert jn.train(resumed).stop_reason == "completed" and resumed.step == 16
