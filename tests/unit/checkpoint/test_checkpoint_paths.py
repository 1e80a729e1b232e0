"""Checkpoint code the round-trip tests did not reach in one fast process: a tree that is a
single leaf, a template naming no stored tree, the shard write of several processes (here,
one), the run lock's file, a stale writer's process id, and the filter of a failed
restore's asyncio reports. (Found by the sampled mutation run of checkpoint/:
tests/README.md, "Scores".)"""

from __future__ import annotations

import json
import logging
import os
import stat

import jax.numpy as jnp
import numpy as np
import pytest

from jaxnitro._src.checkpoint import directory, quiet
from jaxnitro._src.checkpoint import shards as checkpoint_shards
from jaxnitro._src.checkpoint.format import ARRAYS, META, Unverified
from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.checkpoint.store import TopKCheckpointer, load_checkpoint
from jaxnitro._src.core.errors import CheckpointError


def _saved(tmp_path, trees):
    ck = TopKCheckpointer(k=1)
    ck.bind(tmp_path)
    return ck.save(epoch=1, step=3, metrics={}, trees=trees, meta={})


def test_a_tree_that_is_one_array_loads_as_that_array_without_a_template(tmp_path):
    path = _saved(tmp_path, {"w": jnp.arange(3.0), "p": {"b": jnp.ones(2)}})
    plain, meta = load_checkpoint(path)
    assert np.array_equal(plain["w"], np.arange(3.0)) and meta["step"] == 3
    assert np.array_equal(plain["p"]["b"], np.ones(2))


def test_a_template_for_a_tree_not_stored_is_refused_naming_the_stored_ones(tmp_path):
    path = _saved(tmp_path, {"params": {"w": jnp.ones(2)}})
    with pytest.raises(CheckpointError, match=r"has no tree\(s\) \['param'\]") as e:
        load_checkpoint(path, {"param": {"w": np.zeros(2)}})
    assert "it holds ['params']" in str(e.value) and "Did you mean 'params'?" in str(e.value)


def test_the_shard_write_of_every_process_writes_and_reads_back_in_one(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    trees = {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(2, np.float32)}}
    checkpoint_shards.write(target, trees, {"epoch": 1, "step": 3})
    meta = json.loads((target / META).read_text())
    assert (target / ARRAYS).is_dir() and meta["step"] == 3
    spec = meta["trees"]["params"]
    values = [np.ones(2, np.float32), np.arange(6.0, dtype=np.float32).reshape(2, 3)]  # b, w
    assert [leaf["path"] for leaf in spec["leaves"]] == ["['b']", "['w']"]
    checkpoint_shards.verify(target, "params", spec, values)


def test_a_shard_write_that_reads_back_otherwise_is_unverified(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    target.mkdir()
    monkeypatch.setattr(checkpoint_shards, "orbax_layout", lambda handler, path: {})
    with pytest.raises(Unverified, match="did not read back as written"):
        checkpoint_shards.write(target, {"params": {"w": jnp.ones(2)}}, {"step": 1})
    assert not (target / META).exists()


def test_the_run_lock_file_is_readable_by_others_writable_by_its_owner(tmp_path):
    mask = os.umask(0o022)
    try:
        lock = RunLock(tmp_path / "run")
        assert lock.try_acquire("train")
        mode = stat.S_IMODE(os.stat(lock.path).st_mode)
        lock.release()
    finally:
        os.umask(mask)
    assert mode == 0o644


def test_a_process_id_that_cannot_be_asked_counts_as_alive():
    assert directory._pid_alive(os.getpid())
    assert directory._pid_alive(0) and directory._pid_alive(-5)  # unknown: kept


def _record(msg, error=None):
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_failed_restores_future_reports_are_dropped_and_nothing_else():
    drop = quiet._QuietFailedRestore()
    never = "Future exception was never retrieved"
    assert not drop.filter(_record(never, RuntimeError("... tensorstore_spec: {...}")))
    assert not drop.filter(_record(never + " tensorstore_spec"))
    assert drop.filter(_record(never, RuntimeError("another failure")))
    assert drop.filter(_record("Task was destroyed but it is pending!"))
