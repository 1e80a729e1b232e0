"""Steering the learning rate mid-run (`jn.set_lr`, `RunHandle.set_lr`) and the plateau rule
(`reduce_lr_on_plateau=`): the step logs' lr column shows the new rate from the step it applies
to, and nothing recompiles."""

from __future__ import annotations

import time

import optax
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.optim import hyper
from jaxnitro._src.run.early_stop import EarlyStopState
from jaxnitro._src.run.plateau import PlateauRule
from jaxnitro._src.train.background import tail_rows


def _train_rows(n):
    rows = tail_rows(n.run_dir / "metrics.jsonl", 100_000)
    return rows, {r["step"]: r["lr"] for r in rows if r.get("context") == "train"}


def _until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_set_lr_between_trains_reaches_the_step_without_a_recompile(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    assert jn.learning_rates(n) == {"default": pytest.approx(1e-2)}
    compiled = jn.cache_stats()["misses"]
    jn.set_lr(n, 3e-4)
    n.max_epochs = 2
    jn.train(n)
    assert jn.cache_stats()["misses"] == compiled  # the rate is an input of the same program
    _, lr = _train_rows(n)
    assert [lr[s] for s in range(1, 17)] == pytest.approx([1e-2] * 8 + [3e-4] * 8)
    stored = float(hyper.read(n.optimizer, n.opt_state)["opt.default.learning_rate"])
    assert stored == pytest.approx(3e-4)  # the optimizer state took it, not only the log
    jn.set_device(n, smoothing=0.1)  # re-reads the rate hooks: set_lr's rate stays
    assert jn.learning_rates(n) == {"default": pytest.approx(3e-4)}


def test_set_lr_refusals_name_the_fix(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with pytest.raises(jn.ConfigError, match="finite number >= 0"):
        jn.set_lr(n, float("nan"))
    with pytest.raises(jn.ConfigError, match="no parameter group 'defualt'.*'default'"):
        jn.set_lr(n, {"defualt": 1e-3})
    scheduled = nitro(
        Tiny(max_epochs=1),
        run_dir=run_dir / "s",
        schedules={"opt.learning_rate": jn.schedules.linear(1.0, 0.1)},
    )
    with pytest.raises(jn.ConfigError, match="a schedule drives the learning rate"):
        jn.set_lr(scheduled, 1e-3)

    @jn.experiment
    class TwoGroups(Tiny):
        def param_group(self, path, leaf):
            return "head" if path.startswith("out") else "body"

    two = nitro(TwoGroups(max_epochs=1), run_dir=run_dir / "g")
    with pytest.raises(jn.ConfigError, match=r"2 parameter groups \['body', 'head'\]"):
        jn.set_lr(two, 1e-3)
    jn.set_lr(two, {"head": 5e-3})
    assert jn.learning_rates(two) == {"body": pytest.approx(1e-2), "head": pytest.approx(5e-3)}


def test_handle_set_lr_applies_from_the_next_boundary(tmp_path):
    n = jn.Nitro(Tiny(max_epochs=50), run_dir=tmp_path / "r", progress=False)
    h = jn.start(n)
    _until(lambda: n.step >= 3, "three steps")
    compiled = jn.cache_stats()["misses"]
    with pytest.raises(jn.ConfigError, match="finite number"):
        h.set_lr(-1.0)  # checked at once: the caller's error, not the run's
    h.set_lr(2.5e-4)
    _until(lambda: jn.learning_rates(n)["default"] == pytest.approx(2.5e-4), "the new rate")
    _until(lambda: n.step >= 40, "steps after the change")
    h.stop()
    assert h.wait(timeout=120).stop_reason == "requested"
    assert jn.cache_stats()["misses"] == compiled  # nothing recompiled
    rows, lr = _train_rows(n)
    first = next(r for r in rows if r.get("key") == "set_lr")["from_step"]
    assert first > 3
    assert all(v == pytest.approx(1e-2) for s, v in lr.items() if s < first)
    after = [v for s, v in lr.items() if s >= first]
    assert after and all(v == pytest.approx(2.5e-4) for v in after)


@jn.experiment
class Stuck(Tiny):
    """A validation loss that never improves after the first epoch (a frozen model's)."""

    def optimizer(self, group):
        return optax.sgd

    def learning_rate(self, group):
        return 1e-2

    def metrics(self, logits, *, y):
        # the epoch-dependent part is constant: only the first validation improves
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0]), "flat": (0.0 * y.sum(), 1)}


@pytest.mark.slow
def test_plateau_rule_lowers_the_rate_after_patience_epochs_without_a_recompile(run_dir):
    n = nitro(Stuck(max_epochs=6), run_dir=run_dir, reduce_lr_on_plateau="flat:2:0.5:min")
    assert n.spec.reduce_lr_on_plateau == PlateauRule("flat", "min", 2, 0.5)
    compiled = jn.cache_stats()["misses"]
    jn.train(n)
    assert jn.cache_stats()["misses"] - compiled == 2  # the train and eval programs, once
    rows, lr = _train_rows(n)
    per_epoch = [lr[e * 8 + 1] for e in range(6)]
    # epoch 1 sets the best; epochs 2, 3 do not improve -> halved from epoch 4; 4, 5 -> epoch 6
    assert per_epoch == pytest.approx([1e-2, 1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3])
    drops = [r for r in rows if r.get("key") == "reduce_lr_on_plateau"]
    assert [(d["epoch"], d["from_step"]) for d in drops] == [(3, 25), (5, 41)]
    assert drops[0]["rates"] == {"default": pytest.approx(5e-3)}


def test_plateau_rule_parse_and_setup_errors(run_dir):
    assert PlateauRule.parse("acc:3:0.1") == PlateauRule("acc", "max", 3, 0.1)
    assert PlateauRule.parse("val_loss:1:0.5:min").mode == "min"
    for bad, match in (
        ("val_loss:3", "METRIC:PATIENCE:FACTOR"),
        ("val_loss:x:0.5", "must be numbers"),
        ("val_loss:3:1.5", r"in \(0, 1\)"),
        ("val_loss:3:0.5:mni", "Did you mean 'min'"),
    ):
        with pytest.raises(jn.ConfigError, match=match):
            nitro(Tiny(), run_dir=run_dir, reduce_lr_on_plateau=bad)
    with pytest.raises(jn.ConfigError, match="never produces.*Did you mean 'val_loss'"):
        nitro(Tiny(), run_dir=run_dir, reduce_lr_on_plateau="val_los:2:0.5")
    with pytest.raises(jn.ConfigError, match="both drive the rate"):
        nitro(
            Tiny(),
            run_dir=run_dir,
            reduce_lr_on_plateau="val_loss:2:0.5",
            schedules={"opt.learning_rate": jn.schedules.linear(1.0, 0.1)},
        )
    rule = PlateauRule.parse("val_loss:1:0.5")
    state, drop = rule.update(EarlyStopState(), 1, {"val_loss": 0.4})
    state, drop = rule.update(state, 2, {"val_loss": 0.4})
    assert drop and state.bad_epochs == 0 and state.best == 0.4  # the count starts again
    assert rule.lowered({"a": 1e-3}) == {"a": 5e-4}


@pytest.mark.slow
def test_a_resume_continues_with_the_rates_and_the_plateau_count(run_dir):
    plateau = {"reduce_lr_on_plateau": "flat:2:0.5:min"}
    n = nitro(Stuck(max_epochs=4), run_dir=run_dir / "p", **plateau)
    jn.train(n)  # a drop after epoch 3; epoch 4 is the first bad one since
    r = nitro(Stuck(max_epochs=6), run_dir=run_dir / "p", resume="auto", **plateau)
    assert jn.learning_rates(r) == {"default": pytest.approx(5e-3)}
    assert r.progress.plateau is not None and r.progress.plateau.bad_epochs == 1
    jn.train(r)
    _, lr = _train_rows(r)  # as the run without a break: 5e-3 in epoch 5, halved for epoch 6
    assert [lr[33], lr[41]] == pytest.approx([5e-3, 2.5e-3])
    s = nitro(Tiny(max_epochs=1), run_dir=run_dir / "s")
    jn.set_lr(s, 3e-4)
    jn.train(s)
    again = nitro(Tiny(max_epochs=2), run_dir=run_dir / "s", resume="auto")
    assert jn.learning_rates(again) == {"default": pytest.approx(3e-4)}


def test_set_lr_and_set_device_from_a_step_callback_apply_from_the_next_step(run_dir):
    """A step callback runs on the training thread, mid-epoch: what it sets reaches the very
    next call (not the next epoch), and the lines say so."""
    straight = nitro(Tiny(max_epochs=1), run_dir=run_dir / "straight")
    jn.train(straight)
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir / "steered")

    def steer(record):
        if record.step == 3:
            jn.set_lr(n, 0.5)
            jn.set_device(n, smoothing=0.2)

    jn.every(1, steer, nitro=n)
    compiled = jn.cache_stats()["misses"]
    jn.train(n)
    assert jn.cache_stats()["misses"] == compiled  # inputs of the same program
    rows, lr = _train_rows(n)
    assert [lr[s] for s in range(1, 9)] == pytest.approx([1e-2] * 3 + [0.5] * 5)
    loss = {r["step"]: r["loss"] for r in rows if r.get("context") == "train"}
    before, _ = _train_rows(straight)
    same = {r["step"]: r["loss"] for r in before if r.get("context") == "train"}
    assert [loss[s] for s in range(1, 4)] == [same[s] for s in range(1, 4)]  # before it
    assert loss[4] != same[4]  # step 4 took the new smoothing (its loss), then the rate
    assert n.experiment.smoothing == 0.2 and jn.learning_rates(n) == {"default": 0.5}
