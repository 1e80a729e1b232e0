"""The run's services: logger=False and checkpointer=False, several loggers fanned out."""

from __future__ import annotations

import pytest
from conftest import Recorder, Tiny, nitro
from helpers.logs import lines

import jaxnitro as jn


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
