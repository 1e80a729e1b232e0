"""`log_step_rows`: a read-back chunk's train lines in one encode and one write."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Recorder
from helpers.logs import lines

import jaxnitro as jn
from jaxnitro._src.observe.loggers import LogWarning, base, jsonl

ROWS = [
    {"loss": 0.5, "grad_norm": 1.25, "lr": 1e-05, "samples_per_s": 1234.5},
    {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-05, "samples_per_s": 1234.5},
    {"loss": 0.25, "grad_norm": -float("inf"), "lr": 2e16, "samples_per_s": 1234.5},
]
STEPS = [7, 8, 9]


def _per_step(tmp_path, rows=ROWS, steps=STEPS):
    log = jn.JSONLogger(tmp_path / "per_step.jsonl")
    log.open(tmp_path, resume=False)
    for row, step in zip(rows, steps, strict=True):
        log.log_metrics(dict(row), context="train", epoch=2, step=step)
    log.close()
    return lines(tmp_path / "per_step.jsonl")


def _chunk(tmp_path, rows=ROWS, steps=STEPS, name="chunk.jsonl"):
    log = jn.JSONLogger(tmp_path / name)
    log.open(tmp_path, resume=False)
    writes = []
    emit = log._emit
    log._emit = lambda data: (writes.append(data), emit(data))[1]
    log.log_step_rows([dict(r) for r in rows], context="train", epoch=2, steps=steps)
    log.close()
    return lines(tmp_path / name), writes


@pytest.mark.parametrize("encoder", ["orjson", "json"])
def test_step_rows_are_the_per_step_lines_in_one_write(tmp_path, monkeypatch, encoder):
    if encoder == "json":
        monkeypatch.setattr(jsonl, "_orjson", None)
    elif jsonl._orjson is None:
        pytest.skip("orjson is not installed")
    got, writes = _chunk(tmp_path)
    want = _per_step(tmp_path)
    assert got == want  # the same content, key order and nulls for NaN/inf
    assert [list(g) for g in got] == [list(w) for w in want]
    assert len(writes) == 1 and writes[0].count(b"\n") == 3
    assert got[1]["loss"] is None and got[2]["grad_norm"] is None


@pytest.mark.parametrize("encoder", ["orjson", "json"])
def test_step_rows_of_other_values_are_the_per_step_lines(tmp_path, monkeypatch, encoder):
    if encoder == "json":
        monkeypatch.setattr(jsonl, "_orjson", None)
    rows = [{"loss": 0.5, "note": "x", "n": 3}, {"loss": np.float32(0.25), "n": np.int64(4)}]
    got, writes = _chunk(tmp_path, rows, [1, 2])
    assert got == _per_step(tmp_path, rows, [1, 2])
    assert len(writes) == 2  # what only jsonable converts: line by line, as log_metrics


def test_a_closed_logger_writes_no_step_rows(tmp_path):
    log = jn.JSONLogger(tmp_path / "m.jsonl")
    log.log_step_rows(ROWS, context="train", epoch=1, steps=STEPS)  # never opened: nothing
    assert not (tmp_path / "m.jsonl").exists()


def test_a_log_of_compact_lines_is_still_recognised(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"type":"metrics","context":"train","epoch":1,"step":1,"loss":0.')
    log = jn.JSONLogger(path)
    log.open(tmp_path, resume=True)  # a cut first line written by orjson: still ours
    log.close()


def test_fanout_gives_a_plain_logger_one_call_per_row_and_drops_a_failing_one(tmp_path):
    class Keep(Recorder):
        def __init__(self):
            super().__init__()
            self.got = []

        def log_metrics(self, metrics, *, context, epoch, step):
            self.got.append((context, epoch, step, metrics))

    class Broken(Recorder):
        def log_metrics(self, metrics, *, context, epoch, step):
            raise RuntimeError("server gone")

    keep, broken = Keep(), Broken()
    json_log = jn.JSONLogger(tmp_path / "m.jsonl")
    fan = base.FanoutLogger([json_log, keep, broken])
    fan.open(tmp_path, resume=False)
    with pytest.warns(LogWarning, match="Broken failed in log_metrics"):
        fan.log_step_rows(ROWS, context="train", epoch=2, steps=STEPS)
    assert keep.got == [("train", 2, s, r) for r, s in zip(ROWS, STEPS, strict=True)]
    assert broken not in fan.loggers and keep in fan.loggers
    fan.close()
    assert [ln["step"] for ln in lines(tmp_path / "m.jsonl")] == STEPS


def test_log_step_rows_helper_falls_back_to_log_metrics():
    keep = Recorder()
    base.log_step_rows(keep, ROWS, context="train", epoch=1, steps=STEPS)
    assert keep.calls == ["train"] * 3
    base.log_step_rows(base.NullLogger(), ROWS, context="train", epoch=1, steps=STEPS)


def test_step_rows_encoded_from_one_line_head_are_the_lines_byte_for_byte():
    rows = [
        {"loss": 0.5, "lr": 1e-3},
        {"loss": float("nan"), "lr": 1e16, "big": 2**70},
        {},
        {"é": -0.0, 'q"uote': float("inf")},
    ]
    steps = [1, 2, 3, 4]
    lines = [
        {"type": "metrics", "context": "train", "epoch": 2, "step": s, **r}
        for r, s in zip(rows, steps, strict=True)
    ]
    if jsonl._orjson is None:
        assert jsonl._encode_rows("train", 2, steps, rows) is None
        return
    assert jsonl._encode_rows("train", 2, steps, rows) == jsonl._encode_lines(lines, rows)


@pytest.mark.parametrize("key", ["step", "type", "context", "epoch"])
def test_a_row_naming_a_key_of_the_line_head_is_logged_as_log_metrics_logs_it(tmp_path, key):
    rows = [{"loss": 0.5, key: 3.0}, {"loss": 0.25}]
    assert jsonl._encode_rows("train", 2, [1, 2], rows) is None  # the line path then
    got, writes = _chunk(tmp_path, rows, [1, 2])
    assert got == _per_step(tmp_path, rows, [1, 2]) and got[0][key] == 3.0
    assert len(writes) == 1


COLUMN_CASES = [
    (["loss"], [[0.5, float("nan")]], {"lr": 1e-3, "samples_per_s": 1e16}),
    (["loss", "lr"], [[0.5, 0.25], [9.0, 8.0]], {"lr": 0.1, "x%d": 2.0}),  # a rate wins
    (["a%s", "b"], [[1.0, 2.0], [float("inf"), -0.0]], {}),
    (['é"q'], [[1.0, 2.0]], {"m": 3.0}),
]


@pytest.mark.parametrize("names,lists,extra", COLUMN_CASES)
def test_step_columns_are_the_lines_of_their_rows_byte_for_byte(tmp_path, names, lists, extra):
    from jaxnitro._src.observe.loggers.rows import step_rows

    rows = step_rows(names, lists, extra)
    if jsonl._orjson is not None:
        got = jsonl._encode_columns("train", 3, [5, 6], names, lists, extra)
        assert got == jsonl._encode_rows("train", 3, [5, 6], rows)
    log = jn.JSONLogger(tmp_path / "cols.jsonl")
    log.open(tmp_path, resume=False)
    writes = []
    emit = log._emit
    log._emit = lambda data: (writes.append(data), emit(data))[1]
    log.log_step_columns(names, lists, extra, context="train", epoch=3, steps=[5, 6])
    log.close()
    want_log = jn.JSONLogger(tmp_path / "rows.jsonl")
    want_log.open(tmp_path, resume=False)
    want_log.log_step_rows(rows, context="train", epoch=3, steps=[5, 6])
    want_log.close()
    assert (tmp_path / "cols.jsonl").read_bytes() == (tmp_path / "rows.jsonl").read_bytes()
    assert len(writes) == 1


@pytest.mark.skipif(jsonl._orjson is None, reason="the template path needs orjson")
def test_a_long_chunk_of_columns_encodes_each_float_as_its_row_would():
    # The columns are encoded one list at a time and the chunk formatted in one go: every
    # magnitude, sign and non-finite value must come out as a row's own float does.
    from jaxnitro._src.observe.loggers.rows import step_rows

    rng = np.random.default_rng(0)
    size = 300
    col = rng.normal(size=size) * 10.0 ** rng.integers(-30, 30, size=size)
    col[:6] = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 5e-324]
    lists = [col.tolist(), rng.normal(size=size).astype(np.float32).astype(float).tolist()]
    steps = list(range(1000, 1000 + size))
    for names, extra in ((["loss", "g%d"], {"lr": 1e-3}), (["lr"], {"lr": 0.5})):
        rows = step_rows(names, lists[: len(names)], extra)
        got = jsonl._encode_columns("train", 2, steps, names, lists[: len(names)], extra)
        assert got == jsonl._encode_rows("train", 2, steps, rows)
        assert got.count(b"\n") == size


def test_step_columns_of_other_values_take_the_row_path():
    assert jsonl._encode_columns("train", 1, [1], ["loss"], [[np.float32(0.5)]], {}) is None
    assert jsonl._encode_columns("train", 1, [1], ["step"], [[0.5]], {}) is None
    assert jsonl._encode_columns("train", 1, [1], ["loss"], [[0.5]], {"note": "x"}) is None


def test_a_fanout_gives_columns_to_who_takes_them_and_rows_to_the_others(tmp_path):
    got = {}

    class Columns(Recorder):
        def log_step_columns(self, names, lists, extra, *, context, epoch, steps):
            got["columns"] = (list(names), [list(c) for c in lists], dict(extra), steps)

    class Rows(Recorder):
        def log_step_rows(self, rows, *, context, epoch, steps):
            got.setdefault("rows", []).append(rows)

    class Broken(Recorder):
        def log_step_rows(self, rows, *, context, epoch, steps):
            raise RuntimeError("gone")

    class Plain(Recorder):
        def log_metrics(self, metrics, *, context, epoch, step):
            got.setdefault("metrics", []).append((metrics, step))

    plain = Plain()
    fan = base.FanoutLogger([Columns(), Rows(), Rows(), plain, Broken()])
    with pytest.warns(LogWarning, match="gone"):
        fan.log_step_columns(
            ["loss"], [[0.5, 0.25]], {"lr": 0.1}, context="train", epoch=1, steps=[3, 4]
        )
    want = [{"loss": 0.5, "lr": 0.1}, {"loss": 0.25, "lr": 0.1}]
    assert got["columns"] == (["loss"], [[0.5, 0.25]], {"lr": 0.1}, [3, 4])
    assert got["rows"] == [want, want] and got["rows"][0] is got["rows"][1]  # built once
    assert got["metrics"] == [(want[0], 3), (want[1], 4)]  # one log_metrics call per step
    assert len(fan.loggers) == 4  # the broken one dropped


@pytest.mark.parametrize("context", ["train", "a%db", "100%", "%s%%"])
def test_step_columns_of_any_context_are_the_lines_of_their_rows(context):
    from jaxnitro._src.observe.loggers.rows import step_rows

    assert jsonl._orjson is not None  # a core dependency: the template is its path
    names, lists, extra = ["loss"], [[0.5, 0.25]], {"lr": 0.1}
    rows = step_rows(names, lists, extra)
    got = jsonl._encode_columns(context, 2, [7, 8], names, lists, extra)
    assert got == jsonl._encode_rows(context, 2, [7, 8], rows)


@pytest.mark.skipif(jsonl._orjson is None, reason="the template path needs orjson")
def test_line_shapes_past_the_kept_few_are_encoded_anew():
    from jaxnitro._src.observe.loggers.rows import step_rows

    rows = step_rows(["loss"], [[0.5, 0.25]], {"lr": 0.1})
    for epoch in range(1, 41):  # more shapes than are kept: each line still its row's
        got = jsonl._encode_columns("train", epoch, [1, 2], ["loss"], [[0.5, 0.25]], {"lr": 0.1})
        assert got == jsonl._encode_rows("train", epoch, [1, 2], rows)
    assert len(jsonl._shapes) <= 16
