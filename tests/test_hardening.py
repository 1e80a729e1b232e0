"""Hardening of the driver: run-dir locking, exact metrics, one-shot sources, finished
handles, non-finite metrics, batch checks, signals during setup/compile/validation."""

from __future__ import annotations

import gc
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro

import jaxnitro as jn
from jaxnitro.checkpoint.runlock import RunLock, RunLockedError
from jaxnitro.dist.devices import check_cache_trust

TESTS = os.path.dirname(__file__)


def lines(path):
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


# ------------------------------------------------------------------ 3. one writer per run dir
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


def test_setup_writes_nothing_and_a_fresh_handle_after_a_run_just_works(run_dir):
    nitro(Tiny(max_epochs=1), run_dir=run_dir)
    assert not (run_dir / "metrics.jsonl").exists()  # setup never writes the run's files
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    again = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    assert jn.train(again).stop_reason == "completed"
    assert [ln["type"] for ln in lines(run_dir / "metrics.jsonl")].count("params") == 2


def test_stale_lock_of_a_killed_process_is_taken_over(run_dir):
    run_dir.mkdir(parents=True)
    code = (
        f"import sys, time; sys.path.insert(0, {os.path.dirname(jn.__file__)!r}+'/..');"
        f"from jaxnitro.checkpoint.runlock import RunLock; l = RunLock({str(run_dir)!r}); "
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
    import sys
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    from conftest import Tiny
    jn.on_phase(lambda phase, step, epoch, info: print("PHASE", phase, flush=True))
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
    script.write_text(TRAINER.format(tests=TESTS, run=str(run), epochs=40))
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
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert done == 5 and "END completed" in out
    log = lines(run / "metrics.jsonl")
    assert [ln["type"] for ln in log].count("params") == 1  # the readers logged nothing
    assert log[-1]["type"] == "finish" and log[-1]["status"] == "completed"


# --------------------------------------------------------------- 2. non-finite val metrics
@jn.experiment
class NoPositives(Tiny):
    """A recall over a class the val split never has: 0/0 every epoch."""

    def metrics(self, logits, *, y):
        hit = ((logits.argmax(-1) == 9) & (y == 9)).sum()
        return {
            "acc": ((logits.argmax(-1) == y).sum(), y.shape[0]),
            "recall9": (hit, (y == 9).sum()),
        }


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


# --------------------------------------------------------------- 5. exact (sum, count) loss
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


# ---------------------------------------------------------------- 9. one-shot iterables
def _batches(n=8, bs=32):
    x, y = make_data(n * bs)
    return [{"x": x[i * bs : (i + 1) * bs], "y": y[i * bs : (i + 1) * bs]} for i in range(n)]


def test_a_source_that_returns_the_same_iterator_is_refused_at_setup(run_dir):
    class SameIterator:
        def __init__(self):
            self._it = iter(_batches())

        def __iter__(self):
            return self._it

    with pytest.raises(jn.DataError, match=r"'train'.*same iterator.*jn.DataLoader"):
        nitro(Tiny(n_val=0), run_dir=run_dir, data={"train": SameIterator()})


def test_setup_iterates_a_source_once_and_a_short_epoch_warns(run_dir):
    shared = iter(_batches(16))

    class Shared:  # a new generator per pass, over one shared iterator: runs dry
        passes = 0

        def __iter__(self):
            Shared.passes += 1
            for _, b in zip(range(8), shared, strict=False):
                yield b

        def __len__(self):
            return 8

    n = nitro(Tiny(max_epochs=3, n_val=0), run_dir=run_dir, data={"train": Shared()})
    assert Shared.passes == 1
    with pytest.warns(
        UserWarning, match=r"epoch 2 yielded 7 train batches, but the split's len\(\) is 8"
    ):
        jn.train(n)


# ---------------------------------------------------------------- 10. a finished handle
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


# ---------------------------------------------------------------- 11. compilation cache trust
def test_a_shared_compilation_cache_dir_warns(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert check_cache_trust(str(private)) == []
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.warns(UserWarning, match=r"is not used: it is world-writable.*chmod 700"):
        assert check_cache_trust(str(shared)) == ["it is world-writable"]
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, stat.S_IRWXU | stat.S_IRWXG)
    with pytest.warns(UserWarning, match="group-writable"):
        check_cache_trust(str(group))
    assert check_cache_trust(str(tmp_path / "not-yet")) == []  # created private later


# --------------------------------------------------------------- 13. resume marker, dedupe
def test_a_resume_writes_a_marker_and_dedupe_keeps_the_last_record(run_dir):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    log = run_dir / "metrics.jsonl"
    with open(log, "a") as fh:  # what a kill after step 11 leaves: 3 steps never checkpointed
        for step in (9, 10, 11):
            fh.write(
                json.dumps(
                    {"type": "metrics", "context": "train", "epoch": 2, "step": step, "loss": 9.0}
                )
                + "\n"
            )
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, resume="auto"))
    raw = jn.read_jsonl(log)
    marker = [ln for ln in raw if ln.get("key") == "resumed"]
    assert len(marker) == 1 and marker[0]["from_step"] == 8
    train = [ln for ln in jn.read_jsonl(log, dedupe=True) if ln.get("context") == "train"]
    assert [ln["step"] for ln in train] == list(range(1, 17))
    assert all(ln["loss"] != 9.0 for ln in train)


# ----------------------------------------------------------- 14. batch shape / dtype changes
def test_a_later_batch_with_other_features_names_split_batch_and_field(run_dir):
    good = _batches(8)
    bad = [dict(b) for b in good]
    bad[5] = {"x": np.zeros((32, 9), np.float32), "y": bad[5]["y"]}
    with pytest.raises(
        jn.DataError,
        match=r"batch 5 of split 'train': field 'x' has per-sample "
        r"shape \(9,\).*first batch had \(8,\)",
    ):
        jn.train(nitro(Tiny(n_val=0), run_dir=run_dir / "a", data={"train": bad}))
    val = [dict(b) for b in good]
    val[2] = {"x": val[2]["x"].astype(np.int32), "y": val[2]["y"]}
    with pytest.raises(jn.DataError, match=r"batch 2 of split 'val': field 'x'.*int32.*float32"):
        jn.train(nitro(Tiny(), run_dir=run_dir / "b", data={"train": good, "val": val}))


def test_a_float64_split_warns_once(run_dir):
    x, y = make_data(256)
    data = {"train": jn.DataLoader({"x": x.astype(np.float64), "y": y}, 32, drop_last=True)}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, data=data)
        jn.train(n)
    msgs = [str(m.message) for m in w if "float64" in str(m.message)]
    assert len(msgs) == 1 and "'x'" in msgs[0] and "astype(np.float32)" in msgs[0]


# ------------------------------------------------------------- 17. signals and validation
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
    script.write_text(SETUP_CHILD.format(tests=TESTS, run=str(run)))
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
    script.write_text(COMPILE_CHILD.format(tests=TESTS, run=str(run)))
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


# ------------------------------------------------------------------- 18. the log is closed
def test_the_log_file_is_closed_when_train_ends(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        jn.train(n)
        jn.validate(n)
        gc.collect()
    assert not [m for m in w if issubclass(m.category, ResourceWarning)]
    assert getattr(n.logger, "_fh", None) is None and not n.services.lock.held


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


# ------------------------------------------- 3. a fresh run never deletes an earlier run's
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


# ------------------------------------------------------------ found trying it as a new user
def test_a_relative_checkpoint_path_loads(run_dir, monkeypatch):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    latest = jn.TopKCheckpointer(dir=run_dir / "checkpoints").latest()
    monkeypatch.chdir(run_dir.parent)
    relative = os.path.relpath(latest, run_dir.parent)
    n = nitro(Tiny(), run_dir="other", checkpoint=relative)
    assert 0 <= jn.validate(n)["acc"] <= 1
    resumed = nitro(Tiny(max_epochs=2), run_dir="other2", resume=relative)
    assert resumed.step == 8


def test_a_val_split_with_other_features_is_named_at_setup(run_dir):
    x, y = make_data(356)

    @jn.experiment
    class Narrow(Tiny):
        def build_data(self, dist):
            return {
                "train": jn.DataLoader({"x": x[:256], "y": y[:256]}, 32, drop_last=True),
                "val": jn.DataLoader({"x": x[256:, :7], "y": y[256:]}, 20),
            }

    with pytest.raises(
        jn.DataError,
        match=r"split 'val': field 'x' has per-sample shape \(7,\).*"
        r"'train' split has \(8,\)",
    ):
        nitro(Narrow(), run_dir=run_dir)


def test_predict_names_a_misnamed_field_and_a_wrong_width(run_dir):
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir)
    with pytest.raises(
        jn.DataError,
        match=r"needs field\(s\) \['x'\]; the batch has \['xx'\]\. "
        r"Rename 'xx' to 'x'\.",
    ):
        jn.predict(n, {"xx": np.zeros((3, 8), np.float32)})
    with pytest.raises(jn.DataError, match=r"field 'x' has per-sample shape \(5,\)"):
        jn.predict(n, {"x": np.zeros((3, 5), np.float32)})


@pytest.mark.parametrize("name", ["sweep[lr=0.1]", "a**b", "back\\slash"])
def test_a_run_dir_with_glob_characters_trains_and_resumes(tmp_path, name):
    run = tmp_path / name
    first = jn.train(nitro(Tiny(max_epochs=1), run_dir=run))
    assert first.best_checkpoint is not None
    jn.load_checkpoint(first.best_checkpoint)  # loads: the array store was finalised
    resumed = nitro(Tiny(max_epochs=2), run_dir=run, resume="auto")
    assert resumed.step == 8
    assert jn.train(resumed).stop_reason == "completed" and resumed.step == 16


def test_new_user_mistakes_from_the_trial_are_named(run_dir, tmp_path):
    # An uncalled logger class is refused at setup (it used to disable all logging quietly).
    with pytest.raises(jn.ConfigError, match=r"logger=JSONLogger is the class; pass an instance"):
        nitro(Tiny(), run_dir=run_dir / "a", logger=jn.JSONLogger)
    with pytest.raises(jn.ConfigError, match=r"is the class"):
        nitro(Tiny(), run_dir=run_dir / "b", logger=[jn.JSONLogger(), jn.JSONLogger])
    # checkpoint= takes a run directory (its best checkpoint), as the CLI does.
    first = nitro(Tiny(max_epochs=1), run_dir=run_dir / "trained")
    jn.train(first)
    again = nitro(Tiny(max_epochs=1), run_dir=run_dir / "eval", checkpoint=run_dir / "trained")
    assert leaves_equal(again.params, first.params)
    with pytest.raises(jn.CheckpointError, match=r"does not exist; pass a checkpoint directory"):
        nitro(Tiny(), run_dir=run_dir / "c", checkpoint=tmp_path / "nope")
