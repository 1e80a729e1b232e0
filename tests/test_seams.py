"""The run's extension seams: no-op and fan-out services, step events, step-based validation
and checkpoints, preemption as an exception, per-step learning rates and gradient norms."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import Recorder, Tiny, leaves_equal, nitro

import jaxnitro as jn


def lines(path):
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def test_logger_false_and_checkpointer_false_write_nothing(run_dir):
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=False, checkpointer=False)
    result = jn.train(n)
    assert result.stop_reason == "completed" and result.best_checkpoint is None
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert len(result.history) == 2 and result.history.best is not None


def test_checkpointer_false_cannot_resume(run_dir):
    with pytest.raises(
        jn.CheckpointError, match=r"resume='auto' needs checkpoints.*checkpointer=False"
    ):
        nitro(run_dir=run_dir, checkpointer=False, resume="auto")


def test_several_loggers_each_get_every_call(run_dir):
    a, b = Recorder(), Recorder()
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir, logger=[jn.JSONLogger(), a, b]))
    assert a.calls == b.calls and a.calls[:2] == ["open", "params"]
    assert a.calls[-2:] == ["finish completed", "close"] and a.calls.count("train") == 8
    assert [ln["type"] for ln in lines(run_dir / "metrics.jsonl")].count("metrics") > 8


def test_learning_rates_and_gradient_norm_are_logged_per_step(run_dir):
    table = {"opt.learning_rate": jn.schedules.linear(1.0, 0.0)}
    jn.train(
        nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, schedules=table, log_grad_norm=True)
    )
    train = [ln for ln in lines(run_dir / "metrics.jsonl") if ln.get("context") == "train"]
    rates = [ln["lr"] for ln in train]
    assert rates[0] == pytest.approx(1e-2) and rates == sorted(rates, reverse=True)
    assert all(ln["grad_norm"] > 0 for ln in train)


def test_every_calls_back_with_a_frozen_step_record(run_dir):
    n = nitro(Tiny(max_epochs=2, n_val=0), run_dir=run_dir, log_grad_norm=True)
    seen = []
    jn.every(3, seen.append, nitro=n)
    jn.train(n)
    assert [r.step for r in seen] == [3, 6, 9, 12, 15]
    r = seen[0]
    assert r.epoch == 1 and np.isfinite(r.loss) and r.grad_norm > 0
    assert r.learning_rates == {"default": pytest.approx(1e-2)} and r.step_seconds > 0
    with pytest.raises(AttributeError):
        r.step = 4  # frozen
    with pytest.raises(jn.ConfigError, match="n_steps must be an int >= 1"):
        jn.every(0, print)


def test_validation_and_checkpoints_every_n_steps_resume_exactly(run_dir):
    kw = dict(val_every=3, checkpoint_every=5)
    n = nitro(
        Tiny(max_epochs=2), run_dir=run_dir / "a", **kw, checkpointer=jn.TopKCheckpointer(k=20)
    )
    saves = []
    jn.on_phase(
        lambda phase, step, epoch, info: saves.append(step) if phase == "Checkpointing" else None,
        nitro=n,
    )
    jn.train(n)
    assert saves == [5, 8, 10, 15, 16]
    val_steps = [
        ln["step"]
        for ln in lines(run_dir / "a" / "metrics.jsonl")
        if ln.get("context") == "validate"
    ]
    assert val_steps == [3, 6, 8, 9, 12, 15, 16]  # every 3 steps, plus each epoch's end
    # Top-K keeps the validated ones (8, 15, 16) plus the newest; the unvalidated step-5 and
    # step-10 checkpoints were the newest only until the next save.
    ckpt_steps = sorted(r["step"] for r in jn.read_manifest(run_dir / "a" / "checkpoints"))
    assert ckpt_steps == [8, 15, 16]
    # resume from the mid-epoch checkpoint at step 15 equals the straight run, bit for bit
    mid = next(r for r in jn.read_manifest(run_dir / "a" / "checkpoints") if r["step"] == 15)
    resumed = nitro(
        Tiny(max_epochs=2),
        run_dir=run_dir / "b",
        resume=str(run_dir / "a" / "checkpoints" / mid["path"]),
    )
    assert resumed.step == 15 and resumed.progress.batch_in_epoch == 7
    jn.train(resumed)
    assert resumed.step == 16 and leaves_equal(resumed.params, n.params)


def test_bad_cadence_options(run_dir):
    with pytest.raises(jn.ConfigError, match="val_every must be an int >= 1"):
        nitro(run_dir=run_dir, val_every=0)
    with pytest.raises(jn.ConfigError, match="checkpoint_every_minutes must be a number > 0"):
        nitro(run_dir=run_dir, checkpoint_every_minutes=-1)


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
    assert e.value.step == n.step and e.value.checkpoint == n.checkpointer.latest()
    assert "resume='auto'" in str(e.value)


def test_grad_norm_is_logged_with_clipping_and_off_by_default(run_dir):
    @jn.experiment
    class Clipped(Tiny):
        def gradient_clip_norm(self):
            return 1.0

    jn.train(nitro(Clipped(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "b"))
    a = [ln for ln in lines(run_dir / "a" / "metrics.jsonl") if ln.get("context") == "train"]
    b = [ln for ln in lines(run_dir / "b" / "metrics.jsonl") if ln.get("context") == "train"]
    assert all("grad_norm" in ln for ln in a) and not any("grad_norm" in ln for ln in b)
    assert all("lr" in ln for ln in b)
