"""A checkpoint commit (`checkpoint/store.py`): written under a temp name, renamed whole, then
listed; a failure at any point is one `CheckpointError` and leaves no temp entry behind."""

from __future__ import annotations

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.checkpoint import store


def save(ck, step=1):
    trees = {"params": {"w": np.arange(3, dtype=np.float32)}}
    return ck.save(epoch=1, step=step, metrics={"val_loss": 0.5}, trees=trees, meta={})


def test_a_failure_after_the_rename_is_one_checkpoint_error(tmp_path, monkeypatch):
    ck = jn.TopKCheckpointer(dir=tmp_path)

    def fsync_fails(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store, "_fsync_dir", fsync_fails)
    # The temp entry is gone (renamed) when the directory's fsync fails: cleaning it up must
    # not replace the error with its own.
    with pytest.raises(jn.CheckpointError, match=r"cannot write checkpoint .*epoch-0001.*OSError"):
        save(ck)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert ck.records() == []  # never listed


def test_a_failure_mid_write_keeps_nothing_and_lists_nothing(tmp_path, monkeypatch):
    ck = jn.TopKCheckpointer(dir=tmp_path)
    first = save(ck, 1)
    real = store._write_checkpoint

    def half_then_full_disk(tmp, trees, record):
        real(tmp, trees, record)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_checkpoint", half_then_full_disk)
    with pytest.raises(jn.CheckpointError, match=r"No space left on device"):
        save(ck, 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [first.name]
    assert [r["step"] for r in ck.records()] == [1]


def test_an_interrupt_mid_write_propagates_unchanged(tmp_path, monkeypatch):
    ck = jn.TopKCheckpointer(dir=tmp_path)

    def interrupted(tmp, trees, record):
        tmp.mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_write_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(ck)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
