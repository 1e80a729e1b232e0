"""The per-step train lines: built and written per read-back chunk, the same as per step.

`data/step_lines.json` holds the train lines (their time-based rates left out) that the
per-step code wrote before issue 47, for the run `_run` makes: a scheduled learning rate,
the gradient norm, 42 steps per epoch (chunks of 16 and a tail), one step per call and
four (a fused call's steps and the single-step tail).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import Recorder, Tiny, nitro
from helpers.logs import lines
from helpers.paths import TESTS

import jaxnitro as jn

GOLDEN = TESTS / "unit" / "train" / "data" / "step_lines.json"
RATES = {"samples_per_s", "tokens_per_s", "tflops_per_s", "mfu", "steps_per_s"}


def _run(run_dir, **kw):
    n = nitro(
        Tiny(max_epochs=2, n_train=32 * 42, n_val=0),
        run_dir=run_dir,
        schedules={"opt.learning_rate": jn.schedules.linear(1.0, 0.0)},
        log_grad_norm=True,
        **kw,
    )
    r = jn.train(n)
    return n, r


def _train_lines(run_dir):
    return [ln for ln in lines(run_dir / "metrics.jsonl") if ln.get("context") == "train"]


def _close(a, b) -> bool:
    """Equal, up to the last bits of a float32 step on another CPU."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("spc", [1, 4])
def test_step_lines_match_the_per_step_lines(run_dir, spc):
    golden = json.loads(GOLDEN.read_text())[f"spc{spc}"]
    n, r = _run(run_dir, steps_per_call=spc)
    got = [{k: v for k, v in ln.items() if k not in RATES} for ln in _train_lines(run_dir)]
    assert [ln["step"] for ln in got] == list(range(1, 85))  # every step keeps its line
    assert len(got) == len(golden)
    for mine, theirs in zip(got, golden, strict=True):
        assert list(mine) == list(theirs), mine["step"]  # the same keys, in the same order
        assert mine["lr"] == theirs["lr"]  # the schedule, exactly
        assert all(_close(mine[k], theirs[k]) for k in theirs), (mine, theirs)
    # the rates each line carries, per chunk, as before
    assert all(ln["samples_per_s"] > 0 for ln in _train_lines(run_dir))
    # the epoch's mean loss and the history read the same steps
    epoch2 = [ln["loss"] for ln in got if ln["epoch"] == 2]
    assert jn.history(n).rows[-1]["train_loss"] == pytest.approx(np.mean(epoch2), rel=1e-6)


@pytest.mark.slow
def test_a_plain_logger_gets_the_same_lines_one_call_per_step(run_dir):
    """A jn.Logger without log_step_rows gets one log_metrics call per step, in order, with
    the rows the JSONL log holds."""

    class Keep(Recorder):
        def __init__(self):
            super().__init__()
            self.rows: list[tuple[int, int, dict]] = []

        def log_metrics(self, metrics, *, context, epoch, step):
            super().log_metrics(metrics, context=context, epoch=epoch, step=step)
            if context == "train":
                self.rows.append((epoch, step, dict(metrics)))

    keep = Keep()
    _run(run_dir, logger=[jn.JSONLogger(), keep])
    written = _train_lines(run_dir)
    assert [(e, s) for e, s, _ in keep.rows] == [(ln["epoch"], ln["step"]) for ln in written]
    for (_, _, row), ln in zip(keep.rows, written, strict=True):
        assert row == {k: v for k, v in ln.items() if k not in ("type", "context", "epoch", "step")}


@pytest.mark.parametrize("every", [5, 16, 100])
def test_log_every_n_steps_thins_the_train_lines(run_dir, every):
    n, _ = _run(run_dir, log_every_n_steps=every)
    steps = [ln["step"] for ln in _train_lines(run_dir)]
    assert steps == [s for s in range(1, 85) if s % every == 0]
    golden = {ln["step"]: ln for ln in json.loads(GOLDEN.read_text())["spc1"]}
    for ln in _train_lines(run_dir):  # the lines kept are the per-step lines of those steps
        assert all(_close(ln[k], v) for k, v in golden[ln["step"]].items())
    # the rest of the run sees every step: the epoch's mean loss, the epoch and data lines
    rows = lines(run_dir / "metrics.jsonl")
    assert [ln["step"] for ln in rows if ln.get("context") == "epoch"] == [42, 84]
    epoch2 = [ln["loss"] for ln in golden.values() if ln["epoch"] == 2]
    assert jn.history(n).rows[-1]["train_loss"] == pytest.approx(np.mean(epoch2), rel=1e-5)
    assert n.step == 84


def test_log_every_n_steps_keeps_callbacks_per_step(run_dir):
    seen = []
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, log_every_n_steps=4)
    jn.every(1, lambda rec: seen.append(rec.step), nitro=n)
    jn.train(n)
    assert seen == list(range(1, 9))
    assert [ln["step"] for ln in _train_lines(run_dir)] == [4, 8]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True])
def test_log_every_n_steps_refuses_a_bad_value(bad):
    with pytest.raises(jn.ConfigError, match="log_every_n_steps must be an int >= 1") as ei:
        nitro(Tiny(), log_every_n_steps=bad)
    assert "log_every_n_steps=50" in str(ei.value)  # the fix, as code


def test_log_every_n_steps_from_an_experiment_field(run_dir):
    @jn.experiment
    class Sparse(Tiny):
        log_every_n_steps: int = 3

    n = nitro(Sparse(max_epochs=1, n_val=0), run_dir=run_dir)
    assert n.spec.log_every_n_steps == 3
    jn.train(n)
    assert [ln["step"] for ln in _train_lines(run_dir)] == [3, 6]


def test_a_non_finite_loss_stops_at_its_step_with_the_steps_before_logged(run_dir):
    """Inside a chunk: the steps before the bad one are logged and counted, the error names
    the bad step (as the per-step code did)."""

    x = np.random.default_rng(0).normal(size=(32 * 8, 8)).astype(np.float32)
    x[32 * 5 + 3, 0] = np.nan  # a NaN in the 6th batch: its loss is NaN
    y = np.zeros(32 * 8, np.int32)

    @jn.experiment
    class NaNData(Tiny):
        def build_data(self, dist):
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32)}

    n = nitro(NaNData(max_epochs=1, n_val=0), run_dir=run_dir)
    with pytest.raises(jn.NonFiniteLossError, match="at step 6 "):
        jn.train(n)
    assert [ln["step"] for ln in _train_lines(run_dir)] == [1, 2, 3, 4, 5]


def test_rows_with_fixed_rates_are_the_outputs_then_the_rates_each_row_updated():
    """The rows of a run without a schedule are built in one pass; each is what a row of the
    outputs `update`d with the rates gives (key order, and a rate wins over an output of its
    name)."""
    import types

    from jaxnitro._src.train import steplines

    got = []

    class Taking:
        def log_step_rows(self, rows, *, context, epoch, steps):
            got.append((rows, context, epoch, steps))

    n = types.SimpleNamespace(spec=types.SimpleNamespace(log_every_n_steps=1), logger=Taking())
    fixed = {"lr": 0.5, "lr/head": 0.25}
    lines_ = steplines.Lines(n, 1, lambda t: fixed, fixed, {})
    names = ["loss", "lr", "acc"]
    lists = [[1.0, 2.0], [9.0, 8.0], [0.5, 0.75]]
    steplines._log_chunk(lines_, 11, names, lists, {"samples_per_s": 3.0})
    ((rows, context, epoch, steps),) = got
    want = []
    for values in zip(*lists, strict=True):
        row = dict(zip(names, values, strict=True))
        row.update({**fixed, "samples_per_s": 3.0})
        want.append(row)
    assert rows == want and [list(r) for r in rows] == [list(w) for w in want]
    assert (context, epoch, steps) == ("train", 2, [11, 12]) and rows[0]["lr"] == 0.5


def _chunk_of(columns, *, spec_routes=()):
    """`chunk_lines` over one call per step, logged to a recorder; (chunk, logged steps)."""
    import types

    from jaxnitro._src.train import steplines
    from jaxnitro._src.train.readback import InFlight

    got = []

    class Taking:
        def log_step_columns(self, names, lists, extra, *, context, epoch, steps):
            got.append((names, lists, steps))

    spec = types.SimpleNamespace(log_every_n_steps=1, routes=spec_routes, population=None, accum=1)
    n = types.SimpleNamespace(
        spec=spec, logger=Taking(), checkpointer=types.SimpleNamespace(latest=lambda: None)
    )
    fixed = {"lr": 0.5}
    lines_ = steplines.Lines(n, 0, lambda t: fixed, fixed, {})
    count = len(next(iter(columns.values())))
    items = [InFlight(s, s, 1, {}) for s in range(1, count + 1)]
    chunk = steplines.chunk_lines(lines_, items, columns, {})
    return chunk, [s for _, _, steps in got for s in steps], got


def test_a_chunk_of_huge_finite_losses_is_all_taken():
    # Their sum overflows to inf: the quick check for a non-finite value must not stop here.
    losses = np.full(16, 1e308)
    chunk, steps, _ = _chunk_of({"loss": losses})
    assert chunk.error is None and steps == list(range(1, 17))
    assert chunk.losses == [1e308] * 16


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_chunk_stops_at_its_first_non_finite_loss_even_beside_huge_ones(bad):
    losses = np.full(16, -1e308, np.float64)
    losses[9] = bad
    chunk, steps, got = _chunk_of({"loss": losses, "acc": np.arange(16, dtype=np.float32)})
    assert isinstance(chunk.error, jn.NonFiniteLossError) and "at step 10 " in str(chunk.error)
    assert steps == list(range(1, 10)) and len(chunk.losses) == 9
    ((names, lists, _),) = got
    assert names == ["loss", "acc"] and lists[1] == [float(i) for i in range(9)]


def test_a_chunk_reads_int_and_bool_outputs_as_floats():
    columns = {
        "loss": np.array([0.5, 0.25], np.float32),
        "n": np.array([3, 4], np.int32),
        "ok": np.array([True, False]),
    }
    chunk, _, got = _chunk_of(columns, spec_routes=("train_step",))
    ((_, lists, _),) = got
    assert lists == [[0.5, 0.25], [3.0, 4.0], [1.0, 0.0]]
    assert all(type(v) is float for column in lists for v in column)
    assert chunk.losses == [0.5, 0.25]
