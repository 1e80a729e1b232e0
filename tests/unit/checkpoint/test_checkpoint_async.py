"""Checkpoints written in the background: the same checkpoint, training waits only to copy."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.checkpoint.store import TopKCheckpointer, load_checkpoint


def test_a_background_save_writes_the_same_checkpoint(tmp_path):
    trees = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "model_state": {}, "opt_state": {}}
    fg = TopKCheckpointer(dir=tmp_path / "fg")
    bg = TopKCheckpointer(dir=tmp_path / "bg")
    a = fg.save(epoch=1, step=4, metrics={"val_loss": 0.5}, trees=trees, meta={})
    b = bg.save(epoch=1, step=4, metrics={"val_loss": 0.5}, trees=trees, meta={}, background=True)
    trees["params"]["w"].delete()  # the arrays were copied before save returned
    bg.wait()
    assert bg.latest() == b and b.name == a.name
    got_a, _ = load_checkpoint(a)
    got_b, _ = load_checkpoint(b)
    np.testing.assert_array_equal(got_a["params"]["w"], got_b["params"]["w"])


def test_training_logs_each_checkpoint_stall(run_dir):
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir)
    jn.train(n)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # one `other` line per checkpoint (the epoch's time split carries the key too)
    stalls = [r for r in lines if r["type"] == "other" and "checkpoint_stall_s" in r]
    assert len(stalls) == 2 and all(r["checkpoint_stall_s"] >= 0 for r in stalls)
    assert n.checkpointer.latest().name == stalls[-1]["checkpoint"]
