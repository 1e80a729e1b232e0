"""The loggers users live in: TensorBoard, MLflow, W&B (offline) and CSV, read back with the
libraries' own readers; the fan-out that drops a failing logger; resume reattaching each to
its run; the ConfigError naming the extra when a library is missing."""

from __future__ import annotations

import csv
import json
import math
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import Recorder, Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.observe.loggers import (
    FanoutLogger,
    LogWarning,
    NullLogger,
    make_logger,
    read_jsonl,
)
from jaxnitro._src.run.setup import read_meta

TRAIN_STEPS = 8  # Tiny: 256 samples, batch 32, drop_last


def metric_lines(run_dir: Path, context: str) -> list[dict]:
    return [
        r
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if r["type"] == "metrics" and r["context"] == context
    ]


def newest_checkpoint_meta(run_dir: Path) -> dict:
    rows = jn.read_manifest(run_dir / "checkpoints")
    newest = max(rows, key=lambda r: r["step"])
    return read_meta(run_dir / "checkpoints" / newest["path"])


class Broken(Recorder):
    """Raises from log_metrics, as a logger whose server went away would."""

    def log_metrics(self, metrics, *, context, epoch, step):
        super().log_metrics(metrics, context=context, epoch=epoch, step=step)
        raise ConnectionError("tracking server gone")


# ---------------------------------------------------------------- fan-out and failures


def test_a_failing_logger_is_warned_about_once_and_dropped(run_dir):
    broken, ok = Broken(), Recorder()
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), broken, ok])
    with pytest.warns(LogWarning) as record:
        result = jn.train(n)
    msgs = [str(w.message) for w in record if issubclass(w.category, LogWarning)]
    assert len(msgs) == 1
    assert "Broken failed in log_metrics()" in msgs[0] and "tracking server gone" in msgs[0]
    assert result.stop_reason == "completed"
    assert broken.calls[:2] == ["open", "params"] and broken.calls.count("train") == 1
    assert broken.calls[-2:] == ["train", "close"]  # closed when dropped, then never called
    assert ok.calls.count("train") == 2 * TRAIN_STEPS and ok.calls[-2:] == [
        "finish completed",
        "close",
    ]
    assert len(metric_lines(run_dir, "train")) == 2 * TRAIN_STEPS  # JSONL got every line
    assert len(metric_lines(run_dir, "validate")) == 2
    assert n.logger.loggers[1:] == [ok] and n.logger.dropped[0][0] is broken


def test_a_failing_logger_given_alone_is_dropped_too(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, logger=Broken())
    assert isinstance(n.logger, FanoutLogger)
    with pytest.warns(LogWarning, match="Broken failed in log_metrics"):
        assert jn.train(n).stop_reason == "completed"


def test_make_logger_wraps_all_but_the_json_logger():
    js = jn.JSONLogger()
    assert make_logger(js, jn.JSONLogger) is js
    assert isinstance(make_logger(None, jn.JSONLogger), jn.JSONLogger)
    assert isinstance(make_logger(False, jn.JSONLogger), NullLogger)
    rec = Recorder()
    wrapped = make_logger(rec, jn.JSONLogger)
    assert isinstance(wrapped, FanoutLogger) and wrapped.loggers == [rec]


def test_the_json_logger_still_raises_what_it_refuses_and_others_are_closed(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("not a jaxnitro log\n")
    rec = Recorder()
    fan = FanoutLogger([rec, jn.JSONLogger()])
    with pytest.raises(jn.ConfigError, match="not a jaxnitro metrics log"):
        fan.open(tmp_path, resume=False)
    assert rec.calls == ["open", "close"]


def test_a_logger_failing_to_open_or_close_is_dropped(tmp_path):
    class BadOpen(Recorder):
        def open(self, run_dir, *, resume):
            raise OSError("disk full")

    class BadClose(Recorder):
        def close(self):
            raise OSError("disk full")

    good = Recorder()
    fan = FanoutLogger([BadOpen(), BadClose(), good])
    with pytest.warns(LogWarning) as record:
        fan.open(tmp_path, resume=False)
        fan.log_metrics({"loss": 1.0}, context="train", epoch=1, step=1)
        fan.finish("completed")
        fan.close()  # does not raise
    names = [str(w.message).split()[1] for w in record]
    assert names == ["BadOpen", "BadClose"] and fan.loggers == [good]
    assert good.calls == ["open", "train", "finish completed", "close"]


def test_fanout_state_is_keyed_by_class_name():
    class Stateful(Recorder):
        def __init__(self, tag):
            super().__init__()
            self.tag, self.loaded = tag, None

        def state_dict(self):
            return {"tag": self.tag}

        def load_state_dict(self, d):
            self.loaded = d

    a, b = Stateful("a"), Stateful("b")
    fan = FanoutLogger([jn.JSONLogger(), a, Recorder(), b])
    state = fan.state_dict()
    assert state == {"Stateful": {"tag": "a"}, "Stateful#2": {"tag": "b"}}
    fresh = [Stateful("x"), Stateful("y")]
    FanoutLogger(fresh).load_state_dict(state)
    assert [s.loaded for s in fresh] == [{"tag": "a"}, {"tag": "b"}]


def test_checkpoints_save_the_logger_state(run_dir):
    class Stateful(Recorder):
        def state_dict(self):
            return {"remote_run": "r-1", "n": np.int32(3)}

    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir, logger=[jn.JSONLogger(), Stateful()]))
    assert newest_checkpoint_meta(run_dir)["loggers"] == {"Stateful": {"remote_run": "r-1", "n": 3}}


# ---------------------------------------------------------------- missing libraries


@pytest.mark.parametrize(
    "cls, module, extra",
    [
        ("TensorBoardLogger", "tensorboardX", "tensorboard"),
        ("MLflowLogger", "mlflow", "mlflow"),
        ("WandbLogger", "wandb", "wandb"),
    ],
)
def test_a_missing_library_names_the_extra(monkeypatch, cls, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(jn.ConfigError) as ei:
        getattr(jn, cls)()
    assert str(ei.value).startswith(f"jn.{cls} needs {module}: pip install 'jaxnitro[{extra}]'")


# ---------------------------------------------------------------- CSV


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_csv_has_a_row_per_metrics_call(run_dir):
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), jn.CSVLogger()]))
    rows = read_csv(run_dir / "metrics.csv")
    train = [r for r in rows if r["context"] == "train"]
    val = [r for r in rows if r["context"] == "validate"]
    assert [int(r["step"]) for r in train] == list(range(1, 2 * TRAIN_STEPS + 1))
    assert [(int(r["epoch"]), int(r["step"])) for r in val] == [(1, 8), (2, 16)]
    jsonl = metric_lines(run_dir, "train")
    assert [float(r["loss"]) for r in train] == [r["loss"] for r in jsonl]
    assert float(val[-1]["val_loss"]) == metric_lines(run_dir, "validate")[-1]["val_loss"]
    assert train[0]["val_loss"] == "" and val[0]["loss"] == ""  # the header grew safely
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == sum(r["type"] == "metrics" for r in lines)


def test_csv_cells_new_columns_and_resume(tmp_path):
    log = jn.CSVLogger()
    log.open(tmp_path, resume=False)
    log.log_metrics({"loss": 0.5, "gone": None}, context="train", epoch=1, step=1)
    log.log_metrics({"loss": float("nan")}, context="train", epoch=1, step=2)
    cm = np.array([[3, 1], [0, 4]])
    log.log_metrics({"acc": np.float32(0.75), "cm": cm}, context="validate", epoch=1, step=2)
    log.log_metrics({"loss": 0.25}, context="train", epoch=2, step=3)
    log.close()
    rows = read_csv(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["context", "epoch", "step", "loss", "gone", "acc", "cm"]
    assert [r["loss"] for r in rows] == ["0.5", "", "", "0.25"]
    assert rows[2]["acc"] == "0.75" and json.loads(rows[2]["cm"]) == cm.tolist()
    # a resume from step 2 drops the rows the killed run wrote after it, then appends
    log.open(tmp_path, resume=True)
    log.log_other({"key": "resumed", "from_step": 2, "from_checkpoint": "x"})
    log.log_metrics({"loss": 0.3, "lr": 0.1}, context="train", epoch=2, step=3)
    log.close()
    rows = read_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2", "2", "3"] and rows[-1]["lr"] == "0.1"
    assert not list(tmp_path.glob("*.tmp"))


def test_csv_refuses_a_foreign_file(tmp_path):
    (tmp_path / "metrics.csv").write_text("a,b\n1,2\n")
    with pytest.raises(jn.ConfigError, match="not a jaxnitro CSV log"):
        jn.CSVLogger().open(tmp_path, resume=True)
    assert (tmp_path / "metrics.csv").read_text() == "a,b\n1,2\n"


# ---------------------------------------------------------------- TensorBoard


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_scalars_at_their_steps(run_dir):
    pytest.importorskip("tensorboardX")
    tb = jn.TensorBoardLogger()
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), tb]))
    assert tb.log_dir == (run_dir / "tensorboard").absolute()
    got = tb_scalars(tb.log_dir)
    loss = got["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 2 * TRAIN_STEPS + 1))
    assert [v for _, v in loss] == pytest.approx(
        [r["loss"] for r in metric_lines(run_dir, "train")]
    )
    assert [s for s, _ in got["train/lr"]] == [s for s, _ in loss]
    val = metric_lines(run_dir, "validate")
    assert got["validate/val_loss"] == [
        (8, pytest.approx(val[0]["val_loss"])),
        (16, pytest.approx(val[1]["val_loss"])),
    ]
    assert [s for s, _ in got["validate/acc"]] == [8, 16]
    assert [s for s, _ in got["data/steps_per_s"]] == [8, 16]
    assert not any("peak_bytes" in t for t in got)  # None on CPU: skipped


def test_tensorboard_skips_non_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    tb = jn.TensorBoardLogger()
    tb.open(tmp_path, resume=False)
    metrics = {"acc": 0.5, "cm": np.eye(3), "none": None, "nan": float("nan"), "n": np.int64(2)}
    tb.log_metrics(metrics, context="validate", epoch=1, step=4)
    tb.log_metrics({"split": "test", "test_loss": 0.1}, context="validate", epoch=1, step=4)
    tb.finish("completed")
    tb.close()
    got = tb_scalars(tmp_path / "tensorboard")
    assert sorted(got) == ["evaluate/test/test_loss", "validate/acc", "validate/n"]


def test_tensorboard_resume_reuses_the_dir_and_drops_the_lost_timeline(run_dir):
    pytest.importorskip("tensorboardX")
    ck = jn.TopKCheckpointer(k=5)
    jn.train(
        nitro(
            Tiny(max_epochs=2),
            run_dir=run_dir,
            logger=[jn.JSONLogger(), jn.TensorBoardLogger()],
            checkpointer=ck,
        )
    )
    first = next(r for r in jn.read_manifest(run_dir / "checkpoints") if r["step"] == 8)
    # as if the run was killed after step 16 and resumed from its step-8 checkpoint
    n = nitro(
        Tiny(max_epochs=3),
        run_dir=run_dir,
        resume=str(run_dir / "checkpoints" / first["path"]),
        logger=[jn.JSONLogger(), jn.TensorBoardLogger()],
    )
    jn.train(n)
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2  # one directory, a file per writing session
    got = tb_scalars(run_dir / "tensorboard")
    steps = [s for s, _ in got["train/loss"]]
    assert steps == list(range(1, 3 * TRAIN_STEPS + 1))  # 9..16 once: the resumed ones
    resumed = metric_lines(run_dir, "train")[-2 * TRAIN_STEPS :]
    assert [v for _, v in got["train/loss"][8:]] == pytest.approx([r["loss"] for r in resumed])
    assert [s for s, _ in got["validate/val_loss"]] == [8, 16, 24]


# ---------------------------------------------------------------- MLflow


def mlflow_client(logger):
    mlflow = pytest.importorskip("mlflow")
    return mlflow.MlflowClient(logger.tracking_uri)


@pytest.mark.slow
def test_mlflow_params_metrics_tags_and_manifest(run_dir):
    pytest.importorskip("mlflow")
    ml = jn.MLflowLogger()
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), ml])
    jn.train(n)
    assert ml.tracking_uri == (run_dir / "mlruns").absolute().as_uri()
    client = mlflow_client(ml)
    run = client.get_run(ml.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "Tiny"
    loss = client.get_metric_history(ml.run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(1, 2 * TRAIN_STEPS + 1))
    by_step = {m.step: m.value for m in loss}
    assert [by_step[r["step"]] for r in metric_lines(run_dir, "train")] == pytest.approx(
        [r["loss"] for r in metric_lines(run_dir, "train")]
    )
    assert sorted(m.step for m in client.get_metric_history(ml.run_id, "val_loss")) == [8, 16]
    assert sorted(m.step for m in client.get_metric_history(ml.run_id, "acc")) == [8, 16]
    params = run.data.params
    assert params["width"] == "16" and params["smoothing"] == "0.0"
    assert params["max_epochs"] == "2" and params["shuffle"] == "true"
    tags = run.data.tags
    assert tags["experiment"] == "Tiny" and tags["run_id"] == n.spec.run_id
    assert tags["stop_reason"] == "completed"
    assert [a.path for a in client.list_artifacts(ml.run_id, "checkpoints")] == [
        "checkpoints/manifest.json"
    ]
    assert newest_checkpoint_meta(run_dir)["loggers"]["MLflowLogger"]["mlflow_run_id"] == ml.run_id


@pytest.mark.slow
def test_mlflow_resume_continues_the_same_run(run_dir):
    pytest.importorskip("mlflow")
    ml = jn.MLflowLogger()
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), ml]))
    ml2 = jn.MLflowLogger()
    n = nitro(Tiny(max_epochs=3), run_dir=run_dir, resume="auto", logger=[jn.JSONLogger(), ml2])
    jn.train(n)
    assert ml2.run_id == ml.run_id
    client = mlflow_client(ml2)
    assert len(client.search_runs([client.get_run(ml.run_id).info.experiment_id])) == 1
    steps = sorted(m.step for m in client.get_metric_history(ml.run_id, "loss"))
    assert steps == list(range(1, 3 * TRAIN_STEPS + 1))
    run = client.get_run(ml.run_id)
    assert run.data.tags["resumed_from_step"] == "16" and run.info.status == "FINISHED"
    assert run.data.params["max_epochs"] == "2"  # MLflow params cannot change:
    assert run.data.tags["resumed/max_epochs"] == "3"  # the new value is a tag


@pytest.mark.slow
def test_mlflow_failing_mid_run_is_dropped_and_training_goes_on(run_dir, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    real = mlflow.MlflowClient.log_batch

    def server_gone(self, run_id, metrics=(), *args, **kwargs):
        if metrics:
            raise ConnectionError("MLflow server gone")
        return real(self, run_id, metrics, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", server_gone)
    ml = jn.MLflowLogger()
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), ml])
    with pytest.warns(LogWarning) as record:
        assert jn.train(n).stop_reason == "completed"
    (warned,) = [str(w.message) for w in record if issubclass(w.category, LogWarning)]
    assert re.search(r"MLflowLogger failed in \w+\(\).*MLflow server gone", warned)
    assert [type(lg) for lg in n.logger.loggers] == [jn.JSONLogger] and n.logger.dropped[0][0] is ml
    assert len(metric_lines(run_dir, "train")) == 2 * TRAIN_STEPS


def test_mlflow_skips_non_scalars_and_names_evaluate_splits(tmp_path):
    pytest.importorskip("mlflow")
    ml = jn.MLflowLogger(experiment="unit")
    ml.open(tmp_path, resume=False)
    ml.log_params({"experiment": "X", "run_id": "abc", "config": {"w": 3}})
    ml.log_metrics({"acc": 0.9, "loss": 0.5}, context="train", epoch=1, step=1)
    cm = np.eye(3)
    ml.log_metrics(
        {"acc": 0.8, "cm": cm, "bad": math.nan, "val_loss": None},
        context="validate",
        epoch=1,
        step=1,
    )
    ml.log_metrics(
        {"split": "test", "acc": 0.7, "test_loss": 0.2}, context="validate", epoch=1, step=1
    )
    ml.finish("error")
    ml.close()
    client = mlflow_client(ml)
    run = client.get_run(ml.run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics == {
        "acc": 0.9,
        "loss": 0.5,
        "val_acc": 0.8,
        "test_acc": 0.7,
        "test_loss": 0.2,
    }


# ---------------------------------------------------------------- W&B (offline)


def wandb_records(run_dir: Path) -> list:
    """Every record of a W&B offline run's `.wandb` file (a LevelDB-style log: 32 KiB blocks
    of chunks with a 7-byte header crc32 | length | type, after a 7-byte file header)."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunk)
            records.append(rec)
            chunk = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for rec in wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def settled_history(run_dir: Path, train_rows: int, timeout: float = 30.0) -> list[dict]:
    """The offline run's history once its train rows are all there: W&B's service process
    writes the .wandb file after `finish` returns, later on a loaded machine."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        history = wandb_history(run_dir)
        if sum("train/loss" in r for r in history) >= train_rows or time.monotonic() > deadline:
            return history
        time.sleep(0.2)


@pytest.mark.slow
def test_wandb_offline_run_history_config_and_resume(run_dir):
    pytest.importorskip("wandb")
    wb = jn.WandbLogger(mode="offline")
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), wb])
    jn.train(n)
    assert wb.run_id == n.spec.run_id and wb.run_dir.parent == run_dir.absolute() / "wandb"
    history = settled_history(wb.run_dir, 2 * TRAIN_STEPS)
    loss = [(r["_step"], r["train/loss"]) for r in history if "train/loss" in r]
    assert [s for s, _ in loss] == list(range(1, 2 * TRAIN_STEPS + 1))
    assert [v for _, v in loss] == pytest.approx(
        [r["loss"] for r in metric_lines(run_dir, "train")]
    )
    val = [(r["_step"], r["epoch"]) for r in history if "validate/val_loss" in r]
    assert val == [(8, 1), (16, 2)]
    run = next(r.run for r in wandb_records(wb.run_dir) if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.project == "Tiny" and config["width"] == 16 and config["jaxnitro"]["seed"] == 42

    wb2 = jn.WandbLogger(mode="offline")
    n2 = nitro(Tiny(max_epochs=3), run_dir=run_dir, resume="auto", logger=[jn.JSONLogger(), wb2])
    jn.train(n2)
    assert wb2.run_id == wb.run_id and wb2.run_dir != wb.run_dir  # W&B's offline run per session
    steps = [r["_step"] for r in settled_history(wb2.run_dir, TRAIN_STEPS) if "train/loss" in r]
    assert steps == list(range(2 * TRAIN_STEPS + 1, 3 * TRAIN_STEPS + 1))


# ---------------------------------------------------------------- all at once


@pytest.mark.slow
def test_all_loggers_at_once_resume_with_the_same_runs(run_dir):
    for lib in ("tensorboardX", "tensorboard", "mlflow"):
        pytest.importorskip(lib)

    def loggers():
        return [jn.JSONLogger(), jn.TensorBoardLogger(), jn.MLflowLogger(), jn.CSVLogger()]

    first = loggers()
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=first))
    again = loggers()
    n = nitro(Tiny(max_epochs=3), run_dir=run_dir, resume="auto", logger=again)
    assert again[2].run_id == first[2].run_id  # reattached at setup, before any logging
    jn.train(n)
    assert again[1].log_dir == first[1].log_dir
    assert [s for s, _ in tb_scalars(again[1].log_dir)["train/loss"]] == list(range(1, 25))
    rows = read_csv(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["context"] == "train"] == list(range(1, 25))
    assert not n.logger.dropped


class Flushing(Recorder):
    """Records `flush` too; raises from it when `fail`."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail

    def flush(self):
        self.calls.append("flush")
        if self.fail:
            raise ConnectionError("tracking server gone")


def test_loggers_are_flushed_before_each_checkpoint_is_written(run_dir):
    rec = Flushing()
    jn.train(nitro(Tiny(max_epochs=3), run_dir=run_dir, logger=[jn.JSONLogger(), rec]))
    assert len(jn.read_manifest(run_dir / "checkpoints")) == 3  # (k=3 keeps them all)
    # one flush per checkpoint, after the epoch's metrics, before the next epoch's steps
    epochs = "".join(
        "T" if c == "train" else "V" if c == "validate" else "F" if c == "flush" else ""
        for c in rec.calls
    )
    assert epochs == ("T" * TRAIN_STEPS + "VF") * 3


def test_a_logger_failing_to_flush_is_dropped_and_training_goes_on(run_dir):
    rec = Flushing(fail=True)
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, logger=[jn.JSONLogger(), rec])
    with pytest.warns(LogWarning, match="Flushing failed in flush.*tracking server gone"):
        assert jn.train(n).stop_reason == "completed"
    assert rec.calls.count("flush") == 1 and rec.calls[-1] == "close"
    assert len(metric_lines(run_dir, "train")) == 2 * TRAIN_STEPS
