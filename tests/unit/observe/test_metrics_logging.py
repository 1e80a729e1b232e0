"""Tests for steps.metrics, the loggers, jaxnitro._src.run.history and jaxnitro.datasets."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, nitro
from helpers.logs import lines

import jaxnitro as jn
from jaxnitro._src.observe.loggers import JSONLogger, read_jsonl
from jaxnitro._src.run.history import History
from jaxnitro._src.steps import metrics

# ---------------------------------------------------------------- metrics.normalize


@pytest.mark.parametrize("bare", [0.5, 3, jnp.float32(0.5), np.array(1.0)])
def test_normalize_refuses_a_bare_number(bare):
    with pytest.raises(jn.MetricsError, match="'acc'") as ei:
        metrics.normalize({"acc": bare})
    assert "(sum, count)" in str(ei.value)


@pytest.mark.parametrize("bad", [[("acc", (1, 2))], (1, 2), 0.5, None])
def test_normalize_refuses_a_non_dict(bad):
    with pytest.raises(jn.MetricsError, match="dict") as ei:
        metrics.normalize(bad, hook="train_metrics")
    assert "train_metrics()" in str(ei.value)


def test_normalize_refuses_a_three_tuple_and_non_string_name():
    with pytest.raises(jn.MetricsError, match="'acc'"):
        metrics.normalize({"acc": (1, 2, 3)})
    with pytest.raises(jn.MetricsError, match="non-string"):
        metrics.normalize({0: (1, 2)})


def test_normalize_refuses_a_non_scalar_count():
    with pytest.raises(jn.MetricsError, match="'acc'") as ei:
        metrics.normalize({"acc": (jnp.ones(3), jnp.ones(3))})
    assert "(3,)" in str(ei.value) and "scalar" in str(ei.value)


def test_normalize_returns_arrays_and_widens_bools():
    out = metrics.normalize(
        {
            "acc": (jnp.array([True, False, True]).sum(), 3),
            "hits": (jnp.array(True), 1),
            "cm": (jnp.eye(3, dtype=jnp.int32), None),
        }
    )
    total, count = out["acc"]
    assert int(total) == 2 and int(count) == 3
    assert out["hits"][0].dtype == jnp.int32
    assert out["cm"][1] is None and out["cm"][0].shape == (3, 3)


# ---------------------------------------------------------------- add / finalize


def test_sum_then_divide_once_is_exact_not_mean_of_means():
    # Batch 1: 1/1 correct; batch 2: 1/3 correct. Exact: 2/4, mean of means would be 2/3.
    b1 = metrics.normalize({"acc": (jnp.int32(1), jnp.int32(1))})
    b2 = metrics.normalize({"acc": (jnp.int32(1), jnp.int32(3))})
    totals = metrics.add(metrics.add(metrics.zeros_like_totals(b1), b1), b2)
    values = metrics.finalize(totals)
    assert values["acc"] == pytest.approx(0.5)
    assert isinstance(values["acc"], float)


def test_finalize_divides_counted_metrics_once():
    values = metrics.finalize(
        {
            "acc": (np.int32(7), np.int32(10)),
            "loss": (np.float32(5.0), np.float32(2.0)),
        }
    )
    assert values["acc"] == pytest.approx(0.7)
    assert values["loss"] == pytest.approx(2.5)


def test_finalize_count_none_is_returned_raw():
    cm = np.array([[3, 1], [0, 4]], dtype=np.int32)
    values = metrics.finalize({"cm": (cm, None), "n": (np.int32(8), None)})
    assert isinstance(values["cm"], np.ndarray) and values["cm"].shape == (2, 2)
    np.testing.assert_array_equal(values["cm"], cm)  # not divided, not flattened
    assert values["n"] == 8.0


def test_finalize_vector_sum_with_count():
    values = metrics.finalize({"per_class": (np.array([2.0, 4.0]), np.int32(2))})
    np.testing.assert_allclose(values["per_class"], [1.0, 2.0])


def test_finalize_zero_count_is_nan():
    values = metrics.finalize({"acc": (np.int32(0), np.int32(0))})
    assert math.isnan(values["acc"])


def test_add_keeps_confusion_matrix_summing():
    b = metrics.normalize({"cm": (jnp.eye(2, dtype=jnp.int32), None)})
    totals = metrics.add(metrics.add(metrics.zeros_like_totals(b), b), b)
    values = metrics.finalize(totals)
    np.testing.assert_array_equal(values["cm"], [[2, 0], [0, 2]])


# ---------------------------------------------------------------- JSONLogger


def test_json_logger_line_types(tmp_path):
    log = JSONLogger()
    log.open(tmp_path / "run", resume=False)
    assert log.path == tmp_path / "run" / "metrics.jsonl"
    log.log_params({"width": 128, "lr": 1e-3})
    log.log_metrics({"loss": 0.31}, context="train", epoch=1, step=4)
    log.log_metrics({"acc": 0.94}, context="validate", epoch=1, step=4)
    log.log_metrics({"n_train": 100}, context="data", epoch=0, step=0)
    log.log_other({"note": "hello"})
    log.finish("completed", best=0.94)
    log.close()
    rows = lines(log.path)
    assert [r["type"] for r in rows] == [
        "params",
        "metrics",
        "metrics",
        "metrics",
        "other",
        "finish",
    ]
    assert rows[0]["width"] == 128 and rows[0]["lr"] == 1e-3
    assert {k: rows[1][k] for k in ("type", "context", "epoch", "step", "loss")} == {
        "type": "metrics",
        "context": "train",
        "epoch": 1,
        "step": 4,
        "loss": 0.31,
    }
    assert rows[2]["context"] == "validate" and rows[2]["acc"] == 0.94
    assert rows[3]["context"] == "data"
    assert rows[4]["note"] == "hello"
    assert rows[5]["status"] == "completed" and rows[5]["best"] == 0.94
    assert read_jsonl(log.path) == rows


def test_json_logger_appends_on_reopen(tmp_path):
    path = tmp_path / "m.jsonl"
    for epoch in (1, 2):
        log = JSONLogger(path)
        log.open(tmp_path / "ignored", resume=True)
        log.log_metrics({"loss": float(epoch)}, context="train", epoch=epoch, step=epoch)
        log.close()
    rows = lines(path)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert not (tmp_path / "ignored").exists()


def test_json_logger_writes_non_finite_as_null(tmp_path):
    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    log.log_metrics(
        {
            "loss": float("nan"),
            "up": float("inf"),
            "down": -np.inf,
            "f32": np.float32("nan"),
            "arr": np.array([1.0, np.nan]),
            "nested": {"x": [float("inf"), 2.0]},
            "ok": jnp.float32(0.5),
        },
        context="train",
        epoch=1,
        step=1,
    )
    log.close()
    text = (tmp_path / "m.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["loss"] is None and row["up"] is None and row["down"] is None
    assert row["f32"] is None
    assert row["arr"] == [1.0, None]
    assert row["nested"] == {"x": [None, 2.0]}
    assert row["ok"] == 0.5


def test_json_logger_converts_numpy_scalars(tmp_path):
    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    log.log_metrics(
        {"acc": np.float64(0.25), "n": np.int64(3), "flag": np.bool_(True)},
        context="validate",
        epoch=np.int32(2),
        step=np.int64(10),
    )
    log.close()
    row = lines(tmp_path / "m.jsonl")[0]
    assert row == {
        "type": "metrics",
        "context": "validate",
        "epoch": 2,
        "step": 10,
        "acc": 0.25,
        "n": 3,
        "flag": True,
    }


def test_json_logger_flushes_every_line(tmp_path):
    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    log.log_params({"a": 1})
    assert len(lines(tmp_path / "m.jsonl")) == 1  # readable before close
    log.log_metrics({"loss": 1.0}, context="train", epoch=1, step=1)
    assert [r["type"] for r in lines(tmp_path / "m.jsonl")] == ["params", "metrics"]
    log.close()


# ---------------------------------------------------------------- History

ROWS = [
    {"epoch": 1, "step": 10, "loss": 1.0, "acc": 0.5, "val_loss": 0.9},
    {"epoch": 2, "step": 20, "loss": 0.5, "acc": 0.8, "val_loss": 0.6},
    {"epoch": 3, "step": 30, "loss": 0.4, "acc": 0.7, "val_loss": 0.7},
]


def test_history_best_by_min():
    h = History(ROWS, metric="val_loss", mode="min")
    assert h.best_index == 1 and h.best["epoch"] == 2


def test_history_best_by_max():
    h = History(ROWS, metric="acc", mode="max")
    assert h.best_index == 1 and h.best["acc"] == 0.8
    assert repr(h) == "History(3 rows; best by max acc: rows[1], acc=0.8)"  # not "acc=1"
    h = History(ROWS, metric="loss", mode="max")
    assert h.best["epoch"] == 1


def test_history_best_skips_missing_and_non_finite():
    rows = [
        {"epoch": 1, "acc": float("nan")},
        {"epoch": 2},
        {"epoch": 3, "acc": 0.1},
        {"epoch": 4, "acc": None},
    ]
    assert History(rows, metric="acc", mode="max").best["epoch"] == 3
    assert History([{"epoch": 1}], metric="acc").best is None
    assert History([], metric="acc").best is None


def test_history_best_with_numpy_and_jax_scalars():
    # finalize_metrics may return numpy/jax scalars (np.mean of a float32 array is np.float32).
    rows = [
        {"epoch": 1, "recall": np.float32(0.5)},
        {"epoch": 2, "recall": np.float32(0.9)},
        {"epoch": 3, "recall": jnp.float32(0.7)},
        {"epoch": 4, "recall": np.array([1.0])},
    ]
    assert History(rows, metric="recall", mode="max").best["epoch"] == 2
    assert History(rows, metric="recall", mode="min").best["epoch"] == 1


def test_history_columns_rows_and_slices():
    h = History(ROWS, metric="acc", mode="max")
    assert h["acc"] == [0.5, 0.8, 0.7]
    assert h["missing"] == [None, None, None]
    assert h[-1]["epoch"] == 3
    assert len(h) == 3 and [r["epoch"] for r in h] == [1, 2, 3]
    tail = h[2:]
    assert isinstance(tail, History) and len(tail) == 1 and tail.best["epoch"] == 3


def test_history_to_pandas_has_best_column():
    h = History(ROWS, metric="val_loss", mode="min")
    df = h.to_pandas()
    assert list(df["epoch"]) == [1, 2, 3]
    assert list(df["best"]) == [False, True, False]
    assert list(df["acc"]) == [0.5, 0.8, 0.7]


# ---------------------------------------------------------------- datasets


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("JAXNITRO_MNIST", raising=False)


def test_mnist_shipped_subset(no_env):
    x, y = jn.datasets.mnist()
    assert x.shape == (5000, 784) and x.dtype == np.float32
    assert y.shape == (5000,) and y.dtype == np.int32
    assert x.min() >= 0.0 and x.max() <= 1.0 and x.max() > 0.5
    assert set(np.unique(y).tolist()) == set(range(10))
    assert set(np.unique(y[:500]).tolist()) == set(range(10))  # shuffled, not sorted by class
    x2, y2 = jn.datasets.mnist()
    np.testing.assert_array_equal(y, y2)  # a fixed order


def fake_npz(path, n_train=6, n_test=0):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "y_train": (np.arange(n_train) % 10).astype(np.uint8),
    }
    arrays["x_train"][0, 0, 0] = 255
    if n_test:
        arrays["x_test"] = rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8)
        arrays["y_test"] = np.full(n_test, 9, dtype=np.uint8)
    np.savez(path, **arrays)
    return arrays


def test_mnist_from_local_npz(tmp_path, no_env):
    path = tmp_path / "mnist.npz"
    arrays = fake_npz(path)
    x, y = jn.datasets.mnist(path)
    assert x.shape == (6, 784) and x.dtype == np.float32
    assert y.dtype == np.int32 and y.tolist() == [0, 1, 2, 3, 4, 5]
    assert x.max() == 1.0 and x.min() >= 0.0
    np.testing.assert_allclose(x[1], arrays["x_train"][1].reshape(-1) / 255.0, rtol=1e-6)
    x_str, _ = jn.datasets.mnist(str(path))
    np.testing.assert_array_equal(x, x_str)


def test_mnist_npz_appends_test_rows(tmp_path, no_env):
    path = tmp_path / "mnist.npz"
    fake_npz(path, n_train=4, n_test=3)
    x, y = jn.datasets.mnist(path)
    assert x.shape == (7, 784)
    assert y.tolist() == [0, 1, 2, 3, 9, 9, 9]


def test_mnist_path_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "env.npz"
    fake_npz(path, n_train=3)
    monkeypatch.setenv("JAXNITRO_MNIST", str(path))
    x, y = jn.datasets.mnist()
    assert x.shape == (3, 784)


def test_mnist_missing_file_errors_clearly(tmp_path, no_env):
    missing = tmp_path / "nope.npz"
    with pytest.raises(jn.DataError, match="nope.npz") as ei:
        jn.datasets.mnist(missing)
    assert "does not exist" in str(ei.value)


def test_mnist_npz_without_expected_arrays(tmp_path, no_env):
    path = tmp_path / "wrong.npz"
    np.savez(path, images=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(jn.DataError, match="x_train") as ei:
        jn.datasets.mnist(path)
    assert "images" in str(ei.value)


@pytest.mark.slow
def test_learning_rates_and_gradient_norm_are_logged_per_step(run_dir):
    table = {"opt.learning_rate": jn.schedules.linear(1.0, 0.0)}
    jn.train(
        nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, schedules=table, log_grad_norm=True)
    )
    train = [ln for ln in lines(run_dir / "metrics.jsonl") if ln.get("context") == "train"]
    rates = [ln["lr"] for ln in train]
    assert rates[0] == pytest.approx(1e-2) and rates == sorted(rates, reverse=True)
    assert all(ln["grad_norm"] > 0 for ln in train)


@pytest.mark.slow
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
