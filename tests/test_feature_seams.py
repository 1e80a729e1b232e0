"""Where features meet: the reported best across mid-epoch validations, preemption and resume
lines, warnings that point at the caller, the inspection report, the non-scalar-loss error,
the range test's documented result, and a population's rows."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import optax
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro.checkpoint.runlock import LOCK_NAME as RUN_LOCK

SRC = Path(__file__).resolve().parents[1] / "src"


# -- 1. the reported best covers every validation ------------------------------------------
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


# -- 4. jn.inspect prints once -------------------------------------------------------------
def test_printing_what_inspect_returns_shows_the_report_once(run_dir, capsys):
    n = nitro(Tiny(), run_dir=run_dir)
    print(jn.inspect(n))
    out = capsys.readouterr().out
    assert out.count("forward() receives: x") == 1 and out.count("capacity") == 1
    report = jn.inspect(n, show=False)
    assert capsys.readouterr().out == ""
    assert "forward() receives: x" in str(report) and str(report) == report.text()


# -- 5. the non-scalar loss error names the split, the hook and the shape ------------------
@pytest.mark.parametrize(("n_val", "split", "rows"), [(100, "val", 20), (0, "train", 32)])
def test_a_per_example_loss_names_its_split_hook_and_shape(run_dir, n_val, split, rows):
    @jn.experiment
    class PerExample(Tiny):
        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    with pytest.raises(jn.HookError) as e:
        jn.train(nitro(PerExample(n_val=n_val), run_dir=run_dir))
    assert (
        f"PerExample.loss() returned an array of shape ({rows},) on a batch of the {split!r} "
        f"split ({rows} rows); it must return a scalar" in str(e.value)
    )


# -- 6. the range test's result is documented ------------------------------------------------
def test_lr_find_documents_every_result_field_and_its_example_uses_its_classs_fields():
    names = [f.name for f in dataclasses.fields(jn.LRFindResult)]
    for doc in (jn.lr_find.__doc__, jn.LRFindResult.__doc__):
        assert all(f"`{name}`" in doc or f"{name}:" in doc for name in names), doc
    # every keyword the example passes to its experiment is a field the example declares
    example = jn.lr_find.__doc__.split("Example:")[1]
    declared = set(re.findall(r"^\s*(?:\.\.\.|>>>)\s+(\w+): \w+ =", example, re.M))
    passed = set(re.findall(r"Tuned\((\w+)=", example))
    assert passed and passed <= declared


# -- 7. a population's rows and the documented example -----------------------------------------
def test_population_members_report_the_keys_the_user_gave(run_dir):
    n = nitro(
        Tiny(max_epochs=1, n_train=64),
        run_dir=run_dir,
        population={"smoothing": [0.0, 0.1], "learning_rate": [1e-3, 1e-2]},
        checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"),
    )
    members = jn.train(n).members
    assert sorted(m["member"] for m in members) == [0, 1]
    for m in members:
        assert m["learning_rate"] == [1e-3, 1e-2][m["member"]]
        assert not any(k.startswith("opt.") for k in m), m


def test_the_documented_population_example_ranks_by_a_metric_it_does_not_change():
    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "beyond.md").read_text()
    example = docs.split("## Population training")[1].split("```")[1]
    assert '"smoothing"' in example  # the loss reads smoothing: val_loss cannot rank fairly
    assert 'TopKCheckpointer(metric="acc", mode="max")' in example
    assert "'learning_rate': " in example and "opt.default" not in example
    # The advice the README's bullet gave lives on the page now, after the example.
    advice = docs.split("## Population training")[1].split("```")[2].split("\n\n")[1]
    assert advice.startswith("Rank the members by a metric the population does not change")
    assert "`val_loss`" in advice and "Accuracy compares them fairly" in advice


def dead_pid() -> int:
    """The pid of a process that has exited (it printed its pid, then ended)."""
    code = "import os; print(os.getpid())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout)


# -- 3. warnings point at the caller's line --------------------------------------------------
def test_warnings_under_public_calls_point_at_the_callers_line(tmp_path):
    here = str(Path(__file__).resolve())
    x = np.random.default_rng(0).normal(size=(64, 8))  # float64
    y = np.zeros(64, np.int32)
    float64 = {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32, drop_last=True)}
    table = {"opt.learning_rate": lambda total: lambda s: 1 - s / total}

    def boom(phase, step, epoch, info):
        raise RuntimeError("a broken monitor")

    caught = {}

    def record(name, call):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            result = call()
        assert got, f"{name}: no warning"
        caught[name] = {w.filename for w in got}
        return result

    # jn.Nitro called here (conftest's nitro() would be the caller's line)
    kw = dict(run_dir=tmp_path / "a", progress=False)
    n = record(
        "float64 data",
        lambda: jn.Nitro(Tiny(max_epochs=1), **kw, data=float64, schedules=table),
    )
    jn.on_phase(boom, nitro=n)
    record("a failing phase monitor", lambda: jn.train(n))
    n.max_epochs = 2
    record("schedules past their horizon", lambda: jn.train(n))
    record("trained already", lambda: jn.train(n))
    record(
        "a resume with another seed",
        lambda: jn.Nitro(Tiny(max_epochs=1), **kw, resume="auto", seed=7),
    )
    # through contextlib: jn.train's writing session takes over a dead writer's lock
    stale = tmp_path / "b"
    stale.mkdir()
    (stale / RUN_LOCK).write_text(json.dumps({"pid": dead_pid(), "host": "here"}))
    b = jn.Nitro(Tiny(max_epochs=1), run_dir=stale, progress=False)
    record("a dead writer's lock", lambda: jn.train(b))
    assert len(caught) == 6
    assert all(files == {here} for files in caught.values()), caught


# -- 2. preemption in a plain script, and the resume line --------------------------------------
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
    tests = str(Path(__file__).resolve().parent)
    script.write_text(SCRIPT.format(tests=tests, run_dir=str(run_dir)))
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
