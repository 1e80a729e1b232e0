"""End-to-end runs of the driver: compile counts, routing, exact metrics, Top-K, resume."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro
from helpers.logs import lines

import jaxnitro as jn


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_train_and_val_compile_two_programs_then_nothing(run_dir):
    jn.cache_reset()
    result = jn.train(
        nitro(run_dir=run_dir, checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"))
    )
    stats = jn.cache_stats()
    assert stats["misses"] == 2 and stats["entries"] == 2
    assert result.programs_compiled == 2
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"]
    # Only Device and Host values change: every program is reused.
    jn.train(nitro(Tiny(smoothing=0.1, max_epochs=1), run_dir=run_dir / "b"))
    assert jn.cache_stats()["misses"] == 2
    # A GraphConst change: one new train program and one new eval program.
    jn.train(nitro(Tiny(width=24, max_epochs=1), run_dir=run_dir / "c"))
    assert jn.cache_stats()["misses"] == 4


@pytest.mark.slow
def test_graphconst_change_is_one_new_program_without_val(run_dir):
    jn.cache_reset()
    jn.train(nitro(Tiny(n_val=0, max_epochs=1), run_dir=run_dir))
    assert jn.cache_stats()["misses"] == 1
    jn.train(nitro(Tiny(n_val=0, max_epochs=1, width=20), run_dir=run_dir / "b"))
    assert jn.cache_stats()["misses"] == 2


def test_device_field_changes_the_result_without_recompiling(run_dir):
    a = nitro(Tiny(max_epochs=1), run_dir=run_dir / "a")
    b = nitro(Tiny(max_epochs=1, smoothing=0.3), run_dir=run_dir / "b")
    jn.train(a)
    misses = jn.cache_stats()["misses"]
    jn.train(b)
    assert jn.cache_stats()["misses"] == misses
    assert not leaves_equal(a.params, b.params)


def test_host_field_read_in_traced_code(run_dir):
    @jn.experiment
    class ReadsHost(Tiny):
        def loss(self, logits, *, y):
            return super().loss(logits, y=y) * self.max_epochs

    with pytest.raises(jn.HostFieldError, match=r"loss\(\) read Host field 'max_epochs'") as e:
        jn.train(nitro(ReadsHost(), run_dir=run_dir))
    assert "jn.GraphConst[int]" in str(e.value) and "jn.Device[int]" in str(e.value)


def test_routing_error_at_setup_names_hook_and_fields(run_dir):
    @jn.experiment
    class Typo(Tiny):
        def loss(self, logits, *, lable):
            return logits.mean()

    with pytest.raises(jn.RoutingError, match="loss") as e:
        nitro(Typo(), run_dir=run_dir)
    assert "'lable'" in str(e.value) and "['x', 'y']" in str(e.value) and "'y'" in str(e.value)


@pytest.mark.slow
def test_fields_no_hook_names_stay_on_host(run_dir):
    @jn.experiment
    class Extra(Tiny):
        def build_data(self, dist):
            x, y = make_data(64)
            ids = np.arange(64)
            return {"train": jn.DataLoader({"x": x, "y": y, "ids": ids}, 32, drop_last=True)}

    n = nitro(Extra(max_epochs=1), run_dir=run_dir)
    assert n.spec.split_specs["train"].fields == ("x", "y")
    jn.train(n)


@pytest.mark.slow
def test_metrics_are_exact_on_a_ragged_split(run_dir):
    # 100 validation samples at batch 30: the last batch has 10 rows, padded to 30 in the program.
    n = nitro(Tiny(max_epochs=1, val_batch=30), run_dir=run_dir)
    jn.train(n)
    values = jn.validate(n)
    x, y = make_data(356)
    logits = jn.predict(n, {"x": x[256:]})
    assert logits.shape == (100, 4)
    correct = int((np.asarray(logits).argmax(-1) == y[256:]).sum())
    assert values["acc"] == pytest.approx(correct / 100, abs=1e-12)
    # val_loss is per sample over the whole split, not a mean of per-batch means.
    per_sample = -jax.nn.log_softmax(logits)[np.arange(100), y[256:]]
    assert values["val_loss"] == pytest.approx(float(per_sample.mean()), rel=1e-5)


def test_topk_keeps_k_best_plus_newest(run_dir):
    ck = jn.TopKCheckpointer(k=2, metric="val_loss", mode="max")  # "max" so newest is not best
    n = nitro(Tiny(max_epochs=5), run_dir=run_dir, checkpointer=ck)
    result = jn.train(n)
    assert ck.dir is None  # the object passed is left as it was; the handle has a copy
    ck = n.checkpointer
    losses = [row["val_loss"] for row in result.history]
    best2 = sorted(range(5), key=lambda i: -losses[i])[:2]
    keep = sorted(set(best2) | {4})
    on_disk = sorted(p.name for p in ck.dir.iterdir() if p.is_dir())
    assert len(on_disk) == len(keep)
    assert [r["epoch"] for r in ck.records()] == [i + 1 for i in keep]
    assert all(f"epoch-{i + 1:04d}" in " ".join(on_disk) for i in keep)
    manifest = jn.read_manifest(ck.dir)
    assert {r["name"] for r in manifest} == set(on_disk)


@pytest.mark.slow
def test_resume_equals_a_straight_run_bitwise(run_dir):
    exp = Tiny(dropout=0.2)
    straight = nitro(exp.__class__(dropout=0.2, max_epochs=4), run_dir=run_dir / "straight")
    jn.train(straight)
    first = nitro(exp.__class__(dropout=0.2, max_epochs=2), run_dir=run_dir / "resumed")
    jn.train(first)
    second = nitro(
        exp.__class__(dropout=0.2, max_epochs=4), run_dir=run_dir / "resumed", resume="auto"
    )
    assert second.epoch == 2 and second.step == first.step
    result = jn.train(second)
    assert second.step == straight.step == 4 * 8
    assert leaves_equal(second.params, straight.params)
    assert leaves_equal(second.opt_state, straight.opt_state)
    assert leaves_equal(second.state, straight.state)
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_refuses_a_changed_graphconst(run_dir):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    with pytest.raises(jn.CheckpointError, match="width"):
        nitro(Tiny(width=24, max_epochs=2), run_dir=run_dir, resume="auto")


def test_checkpoint_loads_weights_only(run_dir):
    a = nitro(Tiny(max_epochs=1), run_dir=run_dir / "a")
    r = jn.train(a)
    b = nitro(Tiny(max_epochs=1), run_dir=run_dir / "b", checkpoint=r.best_checkpoint)
    assert leaves_equal(a.params, b.params)
    assert b.step == 0 and b.epoch == 0


def test_short_train_batch_is_a_setup_error(run_dir):
    @jn.experiment
    class Ragged(Tiny):
        def build_data(self, dist):
            x, y = make_data(100)
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32)}

    with pytest.raises(jn.DataError, match="drop_last=True"):
        nitro(Ragged(), run_dir=run_dir)


def test_checkpointer_metric_never_produced(run_dir):
    with pytest.raises(
        jn.ConfigError, match=r"'accuracy'.*\['acc', 'val_loss'\].*Did you mean 'acc'"
    ):
        nitro(run_dir=run_dir, checkpointer=jn.TopKCheckpointer(metric="accuracy", mode="max"))


def test_jsonl_log_lines(run_dir):
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir))
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [(ln["type"], ln.get("context")) for ln in lines]
    assert kinds[0] == ("params", None)
    train = [ln for ln in lines if ln.get("context") == "train"]
    assert len(train) == 16 and train[0]["step"] == 1 and train[-1]["step"] == 16
    assert all(isinstance(ln["loss"], float) for ln in train)
    val = [ln for ln in lines if ln.get("context") == "validate"]
    assert [v["epoch"] for v in val] == [1, 2] and "acc" in val[0] and "val_loss" in val[0]
    assert any(ln.get("context") == "data" and "data_wait_frac" in ln for ln in lines)
    assert lines[-1]["type"] == "finish" and lines[-1]["status"] == "completed"


def test_evaluate_unknown_split_and_predict_errors(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with pytest.raises(jn.DataError, match="Did you mean 'val'"):
        jn.evaluate(n, split="vall")
    with pytest.raises(jn.DataError, match=r"dict batch.*\['x'\]"):
        jn.predict(n, np.zeros((3, 8), np.float32))
    x, _ = make_data(45)
    outs = list(jn.predict(n, jn.DataLoader({"x": x}, batch_size=20)))
    assert [o.shape for o in outs] == [(20, 4), (20, 4), (5, 4)]


def test_set_device_no_recompile_and_refusals(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    misses = jn.cache_stats()["misses"]
    jn.set_device(n, smoothing=0.2)
    assert jn.device_value(n, "smoothing") == pytest.approx(0.2)
    assert n.experiment.smoothing == pytest.approx(0.2)
    jn.validate(n)
    assert jn.cache_stats()["misses"] == misses
    with pytest.raises(jn.ConfigError, match="GraphConst field 'width'"):
        jn.set_device(n, width=3)
    with pytest.raises(jn.ConfigError, match="Host field 'max_epochs'"):
        jn.set_device(n, max_epochs=3)
    with pytest.raises(jn.ConfigError, match="shape"):
        jn.set_device(n, smoothing=np.zeros(3, np.float32))


def test_seed_controls_init_and_shuffle(run_dir):
    a = nitro(Tiny(max_epochs=1), run_dir=run_dir / "a", seed=1)
    b = nitro(Tiny(max_epochs=1), run_dir=run_dir / "b", seed=1)
    c = nitro(Tiny(max_epochs=1), run_dir=run_dir / "c", seed=2)
    assert leaves_equal(a.params, b.params) and not leaves_equal(a.params, c.params)
    jn.train(a), jn.train(b)
    assert leaves_equal(a.params, b.params)


def test_request_stop_ends_with_requested(run_dir):
    n = nitro(Tiny(max_epochs=3), run_dir=run_dir)
    jn.on_phase(
        lambda phase, step, epoch, info: jn.request_stop(n) if phase == "Training" else None,
        nitro=n,
    )
    result = jn.train(n)
    assert result.stop_reason == "requested"
    assert n.step == 1
    assert n.checkpointer.latest() is not None


@pytest.mark.slow
def test_editing_a_hook_never_reuses_the_old_program(run_dir):
    @jn.experiment
    class Editable(Tiny):
        pass

    n = nitro(Editable(max_epochs=1, n_val=0), run_dir=run_dir / "a", seed=0)
    jn.train(n)
    misses = jn.cache_stats()["misses"]

    def loss(self, logits, *, y):  # a notebook cell re-run with a changed body
        return 2.0 * Tiny.loss(self, logits, y=y)

    Editable.loss = loss
    jn.train(nitro(Editable(max_epochs=1, n_val=0), run_dir=run_dir / "b", seed=0))
    assert jn.cache_stats()["misses"] == misses + 1
    # The edited loss is the one that ran: the same weights and first batch, twice the loss.
    first = [train_losses(run_dir / name)[0] for name in ("a", "b")]
    assert first[1] == pytest.approx(2 * first[0], rel=1e-5)


def train_losses(run_dir):
    return [r["loss"] for r in lines(run_dir / "metrics.jsonl") if r.get("context") == "train"]


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_plain_progress_lines_and_summary(run_dir, capsys):
    jn.cache_reset()
    result = jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, progress="plain"))
    out = capsys.readouterr().out
    assert "compiled the train program" in out and "compiled the eval program" in out
    assert "epoch 1/2:" in out and "epoch 2/2:" in out
    assert "done (completed)" in out and "2 program(s) compiled" in out
    assert str(result.best_checkpoint) in out


@pytest.mark.slow
def test_stop_mid_epoch_then_resume_equals_straight_run(run_dir):
    straight = nitro(Tiny(max_epochs=2), run_dir=run_dir / "straight")
    jn.train(straight)
    first = nitro(Tiny(max_epochs=2), run_dir=run_dir / "stopped")
    # "Training" is entered once the train program is compiled: the run stops after step 1.
    jn.on_phase(
        lambda phase, step, epoch, info: (
            jn.request_stop(first) if phase == "Training" and step == 0 else None
        ),
        nitro=first,
    )
    assert jn.train(first).stop_reason == "requested"
    assert first.step == 1 and first.epoch == 0 and first.progress.batch_in_epoch == 1
    resumed = nitro(Tiny(max_epochs=2), run_dir=run_dir / "stopped", resume="auto")
    assert resumed.step == 1 and resumed.progress.batch_in_epoch == 1
    result = jn.train(resumed)
    assert [r["epoch"] for r in result.history] == [1, 2]
    assert resumed.step == straight.step
    assert leaves_equal(resumed.params, straight.params)
    assert leaves_equal(resumed.opt_state, straight.opt_state)


def test_rich_display_runs_on_a_terminal_like_stream(run_dir):
    import io

    from jaxnitro._src.observe.display import Display

    buf = io.StringIO()
    d = Display("rich", file=buf)
    with d.compiling("train", "Tiny"):
        pass
    d.start_epoch(0, 2, 10)
    d.update(5, 0.5, 100.0)
    d.phase("validating")
    d.end_epoch("train_loss 0.5")
    assert "compiled the train program (Tiny)" in buf.getvalue()
    assert "epoch 1/2: train_loss 0.5" in buf.getvalue()


@jn.experiment
class Rich(Tiny):
    """derive, train_metrics, a count=None metric and finalize_metrics together."""

    class_weight: jn.Device[float] = 1.0

    def derive(self, data):
        labels = np.concatenate([b["y"] for b in data["train"]])
        return {"class_weight": float(len(labels) / (4 * np.bincount(labels, minlength=4).max()))}

    def loss(self, logits, *, y):
        return self.class_weight * super().loss(logits, y=y)

    def train_metrics(self, logits, *, y):
        return {"train_acc": (logits.argmax(-1) == y).mean()}

    def metrics(self, logits, *, y):
        pred = logits.argmax(-1)
        confusion = jax.numpy.zeros((4, 4), jax.numpy.int32).at[y, pred].add(1)
        return {"acc": ((pred == y).sum(), y.shape[0]), "confusion": (confusion, None)}

    def finalize_metrics(self, values, split):
        m = np.asarray(values["confusion"])
        recall = np.diag(m) / np.maximum(m.sum(1), 1)
        return {**values, "macro_recall": float(recall.mean()), "split_seen": split}


@pytest.mark.slow
def test_derive_train_metrics_and_finalize(run_dir):
    n = nitro(Rich(max_epochs=1, val_batch=30), run_dir=run_dir)
    x, y = make_data(356)
    expected = 256 / (4 * np.bincount(y[:256], minlength=4).max())
    assert n.experiment.class_weight == pytest.approx(expected)
    jn.train(n)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [ln for ln in lines if ln.get("context") == "train"]
    assert all(0.0 <= ln["train_acc"] <= 1.0 for ln in train)
    values = jn.validate(n)
    m = np.asarray(values["confusion"])
    assert m.shape == (4, 4) and m.sum() == 100  # summed, never divided; padding not counted
    logits = jn.predict(n, {"x": x[256:]})
    pred = np.asarray(logits).argmax(-1)
    truth = np.zeros((4, 4), int)
    np.add.at(truth, (y[256:], pred), 1)
    assert np.array_equal(m, truth)
    recall = np.diag(truth) / np.maximum(truth.sum(1), 1)
    assert values["macro_recall"] == pytest.approx(recall.mean())
    assert values["split_seen"] == "val"


def test_a_custom_logger_receives_the_protocol_calls(run_dir):
    class Recorder:
        def __init__(self):
            self.calls = []

        def open(self, run_dir, *, resume):
            self.calls.append(("open", resume))

        def log_params(self, params):
            self.calls.append(("params", params["experiment"]))

        def log_metrics(self, metrics, *, context, epoch, step):
            self.calls.append((context, epoch, step))

        def log_other(self, values):
            self.calls.append(("other", sorted(values)))

        def finish(self, status, **info):
            self.calls.append(("finish", status))

        def close(self):
            self.calls.append(("close",))

    rec = Recorder()
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir, logger=rec))
    kinds = [c[0] for c in rec.calls]
    assert kinds[:2] == ["open", "params"] and rec.calls[1] == ("params", "Tiny")
    assert kinds.count("train") == 8 and ("validate", 1, 8) in rec.calls
    assert rec.calls[-2:] == [("finish", "completed"), ("close",)]  # closed when train ends


def test_a_stop_requested_by_a_step_callback_ends_after_that_step(run_dir):
    n = nitro(Tiny(max_epochs=3), run_dir=run_dir)  # 8 steps per epoch
    jn.every(11, lambda r: jn.request_stop(n), nitro=n)
    result = jn.train(n)
    assert result.stop_reason == "requested" and n.step == 11


@jn.experiment
class NoPositives(Tiny):
    """A recall over a class the val split never has: 0/0 every epoch."""

    def metrics(self, logits, *, y):
        hit = ((logits.argmax(-1) == 9) & (y == 9)).sum()
        return {
            "acc": ((logits.argmax(-1) == y).sum(), y.shape[0]),
            "recall9": (hit, (y == 9).sum()),
        }


@pytest.mark.slow
def test_a_nan_validation_metric_is_logged_null_stored_and_never_best(run_dir):
    es = jn.EarlyStopping(metric="recall9", mode="max", patience=5)
    n = nitro(
        NoPositives(max_epochs=3),
        run_dir=run_dir,
        early_stop=es,
        checkpointer=jn.TopKCheckpointer(k=1, metric="recall9", mode="max"),
    )
    result = jn.train(n)
    assert result.stop_reason == "completed" and np.isnan(result.history[-1]["recall9"])
    val = [ln for ln in lines(run_dir / "metrics.jsonl") if ln.get("context") == "validate"]
    assert len(val) == 3 and all(v["recall9"] is None for v in val)
    assert n.checkpointer.best() is None and result.best_checkpoint == n.checkpointer.latest()
    assert n.progress.early_stop.best is None and n.progress.early_stop.bad_epochs == 3
    # and the run resumes from its checkpoint (the meta's NaN is stored as null)
    again = nitro(
        NoPositives(max_epochs=4),
        run_dir=run_dir,
        resume="auto",
        early_stop=es,
        checkpointer=jn.TopKCheckpointer(k=1, metric="recall9", mode="max"),
    )
    assert again.step == 24 and again.progress.history[-1]["recall9"] is None


@jn.experiment
class Weighted(Tiny):
    """A token-weighted loss: samples with label 0 are masked out."""

    def loss(self, logits, *, y):
        per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        mask = (y != 0).astype(jnp.float32)
        return (per * mask).sum(), mask.sum()


@pytest.mark.slow
def test_a_sum_count_loss_is_exact_for_every_val_batch_size(run_dir):
    n = nitro(Weighted(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    x, y = make_data(356)
    xv, yv = x[256:], y[256:]
    logits, _ = jn.apply(n.model, n.params, n.state, jnp.asarray(xv))
    per = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, yv))
    truth = (per * (yv != 0)).sum() / (yv != 0).sum()
    got = []
    for bs in (100, 30, 16, 1):
        data = {
            "train": n.splits["train"],
            "val": jn.DataLoader({"x": xv, "y": yv}, bs),
            "test": jn.DataLoader({"x": xv, "y": yv}, bs),
        }
        m = nitro(
            Weighted(), run_dir=run_dir / f"b{bs}", data=data, checkpoint=n.checkpointer.latest()
        )
        got.append(jn.validate(m)["val_loss"])
        test = jn.evaluate(m, split="test")
        assert "test_loss" in test and "val_loss" not in test
        assert test["test_loss"] == pytest.approx(got[-1], rel=1e-6)
    assert got == pytest.approx([truth] * 4, rel=1e-5)


@jn.experiment
class ValFails(Tiny):
    fail_epoch: int = 2

    def build_data(self, dist):
        splits = Tiny.build_data(self, dist)
        val, fail = splits["val"], self.fail_epoch
        seen = {"n": 0}

        class Flaky:
            batch_size = val.batch_size

            def __iter__(self):
                seen["n"] += 1
                if seen["n"] == fail + 2:  # setup peeks once and plans once
                    raise OSError("val shard unreachable")
                return iter(val)

        splits["val"] = Flaky()
        return splits


def test_a_failing_validation_keeps_the_epochs_training(run_dir):
    n = nitro(ValFails(max_epochs=3), run_dir=run_dir)
    with pytest.raises(OSError, match="val shard unreachable"):
        jn.train(n)
    latest = n.checkpointer.latest()
    _, meta = jn.load_checkpoint(latest)
    assert meta["step"] == 16 and meta["validated"] is False
    resumed = nitro(Tiny(max_epochs=3), run_dir=run_dir, resume="auto")
    assert resumed.epoch == 2 and resumed.step == 16


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_history_best_and_best_metric_cover_mid_epoch_validations(run_dir, capsys):
    # val_loss ranked "max": the first validation (step 3, mid-epoch) is the best one, which
    # an epoch-end-only history (steps 8 and 16) never reports
    ck = jn.TopKCheckpointer(k=1, metric="val_loss", mode="max")
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, val_every=3, checkpoint_every=3, checkpointer=ck)
    n.services.display.mode = "plain"
    result = jn.train(n)
    rows = result.history.rows
    assert [r["step"] for r in rows] == [3, 6, 8, 9, 12, 15, 16]
    assert [r["step"] for r in rows if "train_loss" in r] == [8, 16]  # the epochs' ends
    assert result.history.best["step"] == 3
    meta = json.loads((result.best_checkpoint / "meta.json").read_text())
    assert meta["step"] == 3
    assert result.best_metric == meta["metrics"]["val_loss"] == rows[0]["val_loss"]
    assert jn.history(n).best == result.history.best
    finish = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"best val_loss {result.best_metric:.4f}" in finish
    assert result.best_checkpoint.name in finish and "not checkpointed" not in finish


def test_best_metric_is_the_checkpoints_score_and_the_line_names_a_better_unsaved_one(
    run_dir, capsys
):
    # validations every 3 steps, checkpoints only at epoch ends: the best validation (step 3)
    # has no checkpoint, so best_metric is the best checkpoint's score, and the line says so
    ck = jn.TopKCheckpointer(k=2, metric="val_loss", mode="max")
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, val_every=3, checkpointer=ck)
    n.services.display.mode = "plain"
    result = jn.train(n)
    meta = json.loads((result.best_checkpoint / "meta.json").read_text())
    assert meta["step"] in (8, 16) and result.best_metric == meta["metrics"]["val_loss"]
    assert result.history.best["step"] == 3
    finish = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(step 3 validated" in finish and "not checkpointed" in finish


def test_a_stop_mid_epoch_then_the_rest_gives_the_straight_runs_history(tmp_path):
    straight = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "a", val_every=3)
    jn.train(straight)
    first = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "b", val_every=3)
    jn.every(4, lambda record: jn.request_stop(first) if record.step == 4 else None, nitro=first)
    jn.train(first)
    assert first.step == 4 and [r["step"] for r in jn.history(first)] == [3, 4]
    jn.train(first)
    assert [r["step"] for r in jn.history(first)] == [3, 6, 8]
    assert jn.history(first)["val_loss"] == jn.history(straight)["val_loss"]


def test_one_step_has_one_epoch_in_every_report(run_dir):
    from jaxnitro._src.train.epoch import mid_epoch

    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)  # 8 steps per epoch
    jn.train(n)
    # a checkpoint asked for at the next epoch's start, before any of its steps: same step,
    # same epoch as the end-of-epoch one
    mid_epoch(n, n.epoch, validate=False, save=True, requested=True)
    n.checkpointer.wait()
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert len(names) == 2 and all(s.startswith("epoch-0001-step-000008") for s in names), names
    rows = lines(run_dir / "metrics.jsonl")
    finish = next(r for r in reversed(rows) if r["type"] == "finish")
    last_train = next(r for r in reversed(rows) if r.get("context") == "train")
    assert n.progress.epoch_number == finish["epoch"] == last_train["epoch"] == 1
