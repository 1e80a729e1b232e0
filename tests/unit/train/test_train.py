"""End-to-end runs of the driver: compile counts, routing, exact metrics, Top-K, resume."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro

import jaxnitro as jn


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
    losses = [row["val_loss"] for row in result.history]
    best2 = sorted(range(5), key=lambda i: -losses[i])[:2]
    keep = sorted(set(best2) | {4})
    on_disk = sorted(p.name for p in ck.dir.iterdir() if p.is_dir())
    assert len(on_disk) == len(keep)
    assert [r["epoch"] for r in ck.records()] == [i + 1 for i in keep]
    assert all(f"epoch-{i + 1:04d}" in " ".join(on_disk) for i in keep)
    manifest = jn.read_manifest(ck.dir)
    assert {r["name"] for r in manifest} == set(on_disk)


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


def test_editing_a_hook_never_reuses_the_old_program(run_dir):
    @jn.experiment
    class Editable(Tiny):
        pass

    n = nitro(Editable(max_epochs=1, n_val=0), run_dir=run_dir)
    jn.train(n)
    misses = jn.cache_stats()["misses"]

    def loss(self, logits, *, y):  # a notebook cell re-run with a changed body
        return 2.0 * Tiny.loss(self, logits, y=y)

    Editable.loss = loss
    jn.train(nitro(Editable(max_epochs=1, n_val=0), run_dir=run_dir / "b"))
    assert jn.cache_stats()["misses"] == misses + 1


def test_plain_progress_lines_and_summary(run_dir, capsys):
    jn.cache_reset()
    result = jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, progress="plain"))
    out = capsys.readouterr().out
    assert "compiled the train program" in out and "compiled the eval program" in out
    assert "epoch 1/2:" in out and "epoch 2/2:" in out
    assert "done (completed)" in out and "2 program(s) compiled" in out
    assert str(result.best_checkpoint) in out


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

    from jaxnitro.observe.display import Display

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
