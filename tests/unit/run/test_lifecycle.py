"""Run lifecycle: phases, monitors, signals, non-finite losses, resume with every feature."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro
from helpers.logs import lines
from helpers.paths import SRC, TESTS

import jaxnitro as jn
from jaxnitro._src.optim import schedules
from jaxnitro._src.run.setup import read_meta


def phases_of(n, **kw):
    seen = []
    jn.on_phase(lambda phase, step, epoch, info: seen.append(phase), nitro=n)
    try:
        jn.train(n)
    except Exception:  # noqa: BLE001 - the failure case checks the sequence below
        pass
    return seen


def test_phase_sequence_with_and_without_validation(run_dir):
    jn.cache_reset()
    seen = phases_of(nitro(Tiny(max_epochs=2), run_dir=run_dir / "a"))
    assert seen == [
        "Starting",
        "Compiling",
        "Compiling",
        "Training",
        "Evaluating",
        "Checkpointing",
        "Training",
        "Evaluating",
        "Checkpointing",
        "Done",
    ]
    seen = phases_of(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "b"))
    assert seen == ["Starting", "Training", "Checkpointing", "Done"]  # the program was cached


@pytest.mark.slow
def test_phase_sequence_with_a_failure_and_a_raising_monitor(run_dir):
    @jn.experiment
    class Boom(Tiny):
        def loss(self, logits, *, y):
            return Tiny.loss(self, logits, y=y) / 0.0  # inf

    n = nitro(Boom(max_epochs=1, n_val=0), run_dir=run_dir)
    calls = []

    def bad_monitor(phase, step, epoch, info):
        calls.append(phase)
        raise RuntimeError("monitor bug")

    jn.on_phase(bad_monitor, nitro=n)
    with pytest.warns(UserWarning, match="monitor bug"):
        seen = phases_of(n)
    assert seen[-1] == "Failed" and n.phase == "Failed"
    assert len(calls) == len(seen)  # it kept being called: reported once, never fatal


@pytest.mark.slow
def test_nonfinite_loss_error_names_step_epoch_and_batch(run_dir):
    @jn.experiment
    class NaNAt(Tiny):
        def build_data(self, dist):
            x, y = make_data(256)
            x[5 * 32 + 3] = np.nan  # a NaN in batch 5 (step 6) of epoch 1
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32)}

    with pytest.raises(jn.NonFiniteLossError, match=r"at step 6 \(epoch 1, batch 5\)"):
        jn.train(nitro(NaNAt(max_epochs=1), run_dir=run_dir / "a"))
    n = nitro(NaNAt(max_epochs=2), run_dir=run_dir / "b", on_nonfinite="skip")
    result = jn.train(n)
    assert n.progress.skipped_steps == 2 and n.step == 16
    assert all(np.isfinite(np.asarray(x)).all() for x in jax_leaves(n.params))
    assert np.isfinite(result.history[-1]["train_loss"])
    finish = json.loads((run_dir / "b" / "metrics.jsonl").read_text().splitlines()[-1])
    assert finish["skipped_steps"] == 2


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_resume_is_exact_with_accumulation_schedules_and_dropout(run_dir):
    def make(epochs, where, **kw):
        return nitro(
            Tiny(dropout=0.2, max_epochs=epochs, n_val=0),
            run_dir=run_dir / where,
            accum=2,
            schedules={"opt.learning_rate": schedules.warmup_cosine(2)},
            **kw,
        )

    straight = make(4, "straight")
    jn.train(straight)
    first = make(4, "resumed")
    first.max_epochs = 2  # the same schedule horizon, stopped halfway
    jn.train(first)
    second = make(4, "resumed", resume="auto")
    jn.train(second)
    assert second.step == straight.step == 16
    assert leaves_equal(second.params, straight.params)
    assert leaves_equal(second.opt_state, straight.opt_state)


def test_history_marks_the_best_row(run_dir):
    n = nitro(
        Tiny(max_epochs=3),
        run_dir=run_dir,
        checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"),
    )
    jn.train(n)
    h = jn.history(n)
    accs = h["acc"]
    assert h.best["acc"] == max(accs) and len(h) == 3
    df = h.to_pandas()
    assert list(df["best"]).count(True) == 1 and df.loc[df["best"], "acc"].item() == max(accs)


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    from conftest import Tiny, nitro, make_data

    @jn.experiment
    class Slow(Tiny):
        def build_data(self, dist):
            x, y = make_data(256 * 8)
            return {{"train": jn.DataLoader({{"x": x, "y": y}}, batch_size=32, shuffle=True,
                                            drop_last=True)}}

    n = nitro(Slow(max_epochs={epochs}, n_val=0), run_dir={run!r}, resume="auto", progress="plain")
    print("START", n.step, flush=True)
    jn.on_phase(lambda p, s, e, i: print("PHASE", p, flush=True), nitro=n)
    r = jn.train(n)
    print("END", r.stop_reason, n.step, flush=True)
""")


EPOCHS = 20  # long enough (seconds) that the signal lands mid-run on a fast machine


def _child(tmp_path, run, epochs):
    script = tmp_path / f"child_{epochs}.py"
    script.write_text(CHILD.format(tests=str(TESTS), run=str(run), epochs=epochs))
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _wait_training(proc, timeout=120):
    t0 = time.time()
    for line in proc.stdout:
        if line.startswith("PHASE Training"):
            return
        if time.time() - t0 > timeout:
            break
    raise AssertionError("child never started training: " + proc.stderr.read()[-2000:])


@pytest.mark.slow
def test_sigterm_checkpoints_mid_epoch_and_resume_continues_exactly(tmp_path):
    run = tmp_path / "run"
    proc = _child(tmp_path, run, epochs=EPOCHS)
    _wait_training(proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    rows = jn.read_manifest(run / "checkpoints")
    stopped_at = rows[-1]["step"]
    assert 0 < stopped_at < EPOCHS * 64  # mid-run; mid-epoch unless it landed on a boundary
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["type"] == "finish" and lines[-1]["status"] == "preempted"
    proc = _child(tmp_path, run, epochs=EPOCHS)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert f"START {stopped_at}" in out and f"END completed {EPOCHS * 64}" in out
    straight = tmp_path / "straight"
    proc = _child(tmp_path, straight, epochs=EPOCHS)
    proc.communicate(timeout=300)
    a, _ = jn.load_checkpoint(jn.TopKCheckpointer(dir=run / "checkpoints").latest())
    b, _ = jn.load_checkpoint(jn.TopKCheckpointer(dir=straight / "checkpoints").latest())
    assert leaves_equal(a["params"], b["params"])


@pytest.mark.slow
def test_first_ctrl_c_stops_gracefully(tmp_path):
    run = tmp_path / "run"
    proc = _child(tmp_path, run, epochs=EPOCHS)
    _wait_training(proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "END requested" in out and "Ctrl-C again to abort" in err
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["status"] == "requested"


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_survives_resume(run_dir):
    def es():
        return jn.EarlyStopping(metric="acc", mode="max", patience=2, min_delta=1.0)

    n = nitro(Tiny(max_epochs=10), run_dir=run_dir / "a", early_stop=es())
    result = jn.train(n)
    assert result.stop_reason == "early_stop" and n.epoch == 3  # best at 1, then 2 bad epochs
    finish = json.loads((run_dir / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert finish["status"] == "early_stop"
    # Stopped after 2 epochs, then resumed: the bad-epoch count carries over.
    given = es()
    b = nitro(Tiny(max_epochs=2), run_dir=run_dir / "b", early_stop=given)
    jn.train(b)
    assert b.progress.early_stop.bad_epochs == 1
    # The counters live in the frozen Progress only: the spec keeps the frozen rule, and the
    # EarlyStopping the user passed is left as it was.
    assert b.spec.early_stop == given.config and given.bad_epochs == 0 and given.best is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.progress.early_stop.bad_epochs = 0  # type: ignore[misc]
    c = nitro(Tiny(max_epochs=10), run_dir=run_dir / "b", early_stop=es(), resume="auto")
    assert c.progress.early_stop.bad_epochs == 1 and c.progress.early_stop.best_epoch == 1
    assert jn.train(c).stop_reason == "early_stop" and c.epoch == 3
    with pytest.raises(jn.ConfigError, match=r"'accuracy'.*Did you mean 'acc'"):
        nitro(Tiny(), run_dir=run_dir / "d", early_stop=jn.EarlyStopping(metric="accuracy"))


def test_resume_refuses_changed_param_groups_with_the_reason(run_dir):
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir))

    @jn.experiment
    class Grouped(Tiny):
        def param_group(self, path, leaf):
            return "head" if path.startswith("out") else "body"

    with pytest.raises(jn.CheckpointError, match="optimizer state layout.*param groups"):
        nitro(Grouped(max_epochs=2, n_val=0), run_dir=run_dir, resume="auto")


@pytest.mark.slow
def test_second_ctrl_c_aborts(tmp_path):
    run = tmp_path / "run"
    proc = _child(tmp_path, run, epochs=EPOCHS)
    _wait_training(proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "END" not in out
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["type"] == "finish" and lines[-1]["status"] == "error"


def test_a_different_seed_on_resume_is_replaced_with_a_warning(run_dir):
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, seed=7))
    with pytest.warns(UserWarning, match="resuming with seed 7"):
        n = nitro(Tiny(max_epochs=2, n_val=0), run_dir=run_dir, seed=8, resume="auto")
    assert n.seed == 7


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_unplanned_compiles_are_reported_at_the_end(run_dir, capsys):
    jn.cache_reset()
    x, y = make_data(320)
    batches = [{"x": x[i : i + 32], "y": y[i : i + 32]} for i in range(0, 320, 32)]  # 10, no len()

    class NoLen:
        def __iter__(self):
            return iter(batches)

    n = nitro(
        Tiny(max_epochs=1, n_val=0),
        run_dir=run_dir,
        data={"train": NoLen()},
        steps_per_call=4,
        progress="plain",
    )
    result = jn.train(n)
    assert n.step == 10 and result.programs_compiled == 2  # 2 fused calls, then 2 single steps
    assert "this run compiled 2 programs; its plan expected 1" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["resume", "same handle"])
def test_the_epoch_train_loss_after_a_stop_mid_epoch_covers_the_whole_epoch(tmp_path, how):
    """Stopped after 5 of 8 batches, then continued: the epoch's train_loss is the mean over
    all 8 steps (as the straight run's), not over the 3 after the stop."""
    straight = nitro(Tiny(n_val=0), run_dir=tmp_path / "a", data_on_device=False)
    jn.train(straight)
    first = nitro(Tiny(n_val=0), run_dir=tmp_path / "b", checkpoint_every=5)
    stops = [5]  # once: the same handle trains on past step 10

    def stop_once(result):
        if stops:
            stops.pop()
            jn.request_stop(first)

    jn.every(5, stop_once, nitro=first)
    jn.train(first)
    assert first.step == 5
    if how == "resume":
        later = nitro(Tiny(n_val=0), run_dir=tmp_path / "b", resume="auto")
    else:
        later = first
    jn.train(later)
    want = [row["train_loss"] for row in jn.history(straight).rows]
    assert [row["train_loss"] for row in jn.history(later).rows] == want
    losses = [r["loss"] for r in jn.read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert want[0] == pytest.approx(np.mean(losses[:8]), rel=1e-12)


@pytest.mark.slow
def test_on_nonfinite_skip_end_to_end(run_dir):
    x, y = make_data(256)
    x[40:45] = np.nan  # one poisoned batch per epoch (batch 1)

    @jn.experiment
    class Poisoned(Tiny):
        def build_data(self, dist):
            vx, vy = make_data(60, seed=3)
            vx[0] = np.nan  # and a NaN in the val data: val_loss is NaN
            return {
                "train": jn.DataLoader({"x": x, "y": y}, 32, drop_last=True),
                "val": jn.DataLoader({"x": vx, "y": vy}, 20),
            }

    n = nitro(Poisoned(max_epochs=2), run_dir=run_dir, on_nonfinite="skip")
    result = jn.train(n)
    assert result.stop_reason == "completed" and n.progress.skipped_steps == 2
    assert np.isnan(result.history[-1]["val_loss"])
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(n.params))
    finish = lines(run_dir / "metrics.jsonl")[-1]
    assert finish["status"] == "completed" and finish["skipped_steps"] == 2


def test_nonfinite_loss_before_any_checkpoint_says_so(run_dir):
    x, y = make_data(256)
    x[0] = np.inf

    @jn.experiment
    class Bad(Tiny):
        def build_data(self, dist):
            return {"train": jn.DataLoader({"x": x, "y": y}, 32, drop_last=True)}

    with pytest.raises(jn.NonFiniteLossError, match="no checkpoint yet") as e:
        jn.train(nitro(Bad(max_epochs=1), run_dir=run_dir))
    assert "None" not in str(e.value)


def test_training_a_finished_handle_says_how_to_extend_it(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.warns(
        UserWarning, match=r"already trained to max_epochs=1.*resume='auto', max_epochs=2"
    ):
        result = jn.train(n)
    assert result.stop_reason == "completed" and n.step == 8
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing logged


@pytest.mark.slow
def test_extending_a_scheduled_run_warns_about_the_horizon(run_dir):
    table = (
        {"opt.learning_rate": jn.schedules.warmup_cosine(warmup=2)}
        if hasattr(jn.schedules, "warmup_cosine")
        else {"opt.learning_rate": lambda total: lambda s: 1 - s / total}
    )
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, schedules=table)
    jn.train(n)
    n.max_epochs = 2
    with pytest.warns(
        UserWarning, match=r"resolved at setup for 8 steps.*resume='auto', max_epochs=2"
    ):
        jn.train(n)
    with pytest.warns(UserWarning, match=r"schedules spanned 8 steps into one of 24"):
        nitro(Tiny(max_epochs=3), run_dir=run_dir, schedules=table, resume="auto")


SETUP_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    from conftest import Tiny

    @jn.experiment
    class Slow(Tiny):
        def build_data(self, dist):
            print("BUILDING", flush=True)
            time.sleep(30)
            return Tiny.build_data(self, dist)

    jn.Nitro(Slow(), run_dir={run!r}, progress=False)
    print("NOT REACHED", flush=True)
""")


@pytest.mark.slow
def test_sigterm_during_setup_exits_143_with_a_finish_line(tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(SETUP_CHILD.format(tests=str(TESTS), run=str(run)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.stdout.readline().strip() == "BUILDING"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    finish = lines(run / "metrics.jsonl")[-1]
    assert finish["type"] == "finish" and finish["status"] == "preempted"
    assert finish["phase"] == "setup"


COMPILE_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax
    import jaxnitro as jn
    from conftest import Tiny

    @jn.experiment
    class SlowCompile(Tiny):
        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            for i in range(3000):  # a Python loop: a long compile
                out = out + jax.numpy.sin(out) * 1e-6
            return out, state

    jn.on_phase(lambda phase, step, epoch, info: print("PHASE", phase, flush=True))
    r = jn.train(jn.Nitro(SlowCompile(max_epochs=1), run_dir={run!r}, progress=False))
    print("END", r.stop_reason, flush=True)
""")


@pytest.mark.slow
def test_a_second_ctrl_c_during_compile_aborts(tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(COMPILE_CHILD.format(tests=str(TESTS), run=str(run)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    for line in proc.stdout:
        if line.startswith("PHASE Compiling"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (out, err[-2000:])
    assert "END" not in out
    assert lines(run / "metrics.jsonl")[-1]["status"] == "error"


def test_preempted_is_a_system_exit_with_status_143(run_dir):
    n = nitro(Tiny(max_epochs=3), run_dir=run_dir)

    def preempt(phase, step, epoch, info):
        if phase == "Training" and step == 0:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    jn.on_phase(preempt, nitro=n)
    with pytest.raises(jn.Preempted) as e:
        jn.train(n)
    assert isinstance(e.value, SystemExit) and e.value.code == 143
    # The preemption saved a checkpoint of the step it stopped at (None == None would hold
    # were the save skipped: the first epoch never ended otherwise).
    saved = e.value.checkpoint
    assert saved is not None and saved == n.checkpointer.latest() and saved.is_dir()
    meta = read_meta(saved)
    assert meta["step"] == e.value.step == n.step >= 1 and meta["stop_reason"] == "preempted"
    assert "resume='auto'" in str(e.value)


SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import jaxnitro as jn
from conftest import Tiny

resume = sys.argv[1] if len(sys.argv) > 1 else False
n = jn.Nitro(Tiny(max_epochs=3), run_dir={run_dir!r}, resume=resume, progress="plain")
if not resume:  # a real SIGTERM to this process after step 3 (mid-epoch 1)
    jn.every(3, lambda r: os.kill(os.getpid(), signal.SIGTERM) if r.step == 3 else None, nitro=n)
jn.train(n)
print("finished at step", n.step)
"""


@pytest.mark.slow  # two processes, each importing jax and compiling
def test_a_preempted_script_names_its_checkpoint_and_the_resume_call_then_resumes(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), run_dir=str(run_dir)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    first = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert first.returncode == 143, first.stderr
    last = first.stdout.strip().splitlines()[-1]
    written = jn.TopKCheckpointer(dir=run_dir / "checkpoints").latest()
    assert written is not None and f"wrote checkpoint {written}." in last
    assert "preempted (SIGTERM) at epoch 1 at batch 3, step 3" in last
    assert (
        f"Resume from it with jn.Nitro(Tiny(max_epochs=3), run_dir='{run_dir}', resume='auto')"
        in last
    )
    again = subprocess.run(
        [sys.executable, str(script), "auto"], capture_output=True, text=True, env=env, timeout=300
    )
    assert again.returncode == 0, again.stderr
    out = again.stdout.strip().splitlines()
    assert out[0] == f"resumed from {written} (epoch 1 at batch 3, step 3)"
    assert out[-1] == "finished at step 24"
