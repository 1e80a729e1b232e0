"""Behaviour the leaf-module refactors must keep: helpers split out of long functions."""

from __future__ import annotations

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.compile import fingerprint as fp


def test_check_metric_names_the_fix_and_the_missing_val_split():
    es = jn.EarlyStopping(metric="acc")
    with pytest.raises(jn.ConfigError) as e:
        es.check_metric(["train_loss"], has_val=False)
    msg = str(e.value)
    assert "never produces; it produces ['train_loss']" in msg
    assert "Pass EarlyStopping(metric=...)" in msg
    assert msg.endswith("Add a 'val' split for validation metrics.")


def test_class_bookkeeping_entries_are_skipped():
    # the instance-namespace descriptor of every plain class is machinery, not behaviour
    assert {"__dict__", "__weakref__", "__module__", "__doc__"} <= fp._CLASS_SKIP

    class A:
        x = 1

    class B:
        x = 1

    B.__qualname__ = A.__qualname__
    assert fp.fingerprint_value(A) == fp.fingerprint_value(B)


def test_save_same_step_twice_keeps_both(tmp_path):
    ck = jn.TopKCheckpointer(k=5, metric="acc", mode="max", dir=tmp_path)
    trees = {"params": {"w": np.ones(2)}}
    first = ck.save(epoch=1, step=10, metrics={"acc": 0.5}, trees=trees, meta={})
    second = ck.save(epoch=1, step=10, metrics={"acc": 0.5}, trees=trees, meta={})
    assert second.name == first.name + "-1"
    loaded, meta = jn.load_checkpoint(second, {"params": {"w": np.zeros(2)}})
    np.testing.assert_array_equal(loaded["params"]["w"], np.ones(2))
    assert meta["step"] == 10


@pytest.mark.parametrize(("epoch", "step"), [(-1, 0), ("x", 3), (None, 1)])
def test_save_refuses_bad_counters(tmp_path, epoch, step):
    ck = jn.TopKCheckpointer(dir=tmp_path)
    with pytest.raises(jn.CheckpointError, match="ints >= 0; pass the run's counters"):
        ck.save(epoch=epoch, step=step, metrics={}, trees={}, meta={})
