"""Checkpointing: bitwise round trips, top-k retention, naming, integrity and error messages."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, nitro
from flax import nnx

import jaxnitro as jn
from jaxnitro._src.checkpoint.store import TopKCheckpointer, load_checkpoint, read_manifest
from jaxnitro._src.core.errors import CheckpointError, ConfigError


def _bits(x) -> bytes:
    a = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()


def _trees():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    opt = optax.inject_hyperparams(optax.radam)(learning_rate=1e-3)
    opt_state = opt.init(params)
    _, opt_state = opt.update(params, opt_state, params)  # non-trivial moments and count
    misc = {
        "bf16": jnp.asarray([1.0, -2.5, 3.1415, 1e-3], dtype=jnp.bfloat16),
        "ints": [
            jnp.asarray([1, -7, 2**31 - 1], jnp.int32),
            jnp.asarray([0, 2**32 - 1], jnp.uint32),
        ],
        "nested": {
            "f32": jnp.asarray(np.random.default_rng(0).standard_normal((4, 5)), jnp.float32)
        },
        "key": jax.random.key(42),
        "none": None,
    }
    return {"model": state, "opt": opt_state, "misc": misc}


def _save(ck: TopKCheckpointer, step: int, **metrics) -> Path:
    return ck.save(
        epoch=step,
        step=step * 10,
        metrics=metrics,
        trees={"p": {"w": jnp.full((2,), step, jnp.float32)}},
        meta={"note": f"s{step}"},
    )


@pytest.mark.slow
def test_round_trip_bitwise_into_template_structure(tmp_path):
    trees = _trees()
    ck = TopKCheckpointer(k=1)
    ck.bind(tmp_path)
    path = ck.save(epoch=1, step=5, metrics={"val_loss": 0.5}, trees=trees, meta={"data_pos": 17})
    # Abstract templates (ShapeDtypeStruct) for two trees, concrete arrays for the third.
    templates = {
        "model": jax.eval_shape(lambda: trees["model"]),
        "opt": jax.eval_shape(lambda: trees["opt"]),
        "misc": trees["misc"],
    }
    restored, meta = load_checkpoint(path, templates)

    assert meta["data_pos"] == 17 and meta["step"] == 5 and meta["epoch"] == 1
    for name in trees:
        assert jax.tree.structure(restored[name]) == jax.tree.structure(trees[name]), name
        got, want = jax.tree.leaves(restored[name]), jax.tree.leaves(trees[name])
        assert [_bits(g) for g in got] == [_bits(w) for w in want], name
    assert type(restored["model"]) is nnx.State
    assert type(restored["opt"]) is type(trees["opt"])
    assert jnp.issubdtype(restored["misc"]["key"].dtype, jax.dtypes.prng_key)
    assert restored["misc"]["bf16"].dtype == jnp.bfloat16
    model = nnx.merge(nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(1)))[0], restored["model"])
    assert np.array_equal(model.kernel[...], trees["model"]["kernel"][...])

    # Without templates: plain nested dicts/lists of numpy arrays.
    plain, _ = load_checkpoint(path)
    assert isinstance(plain["misc"]["ints"], list)
    assert isinstance(plain["misc"]["nested"]["f32"], np.ndarray)
    assert plain["misc"]["bf16"].dtype == jnp.bfloat16
    assert set(plain["model"]) == {"kernel", "bias"}


@pytest.mark.parametrize(
    ("mode", "scores", "best_i"),
    [
        ("max", [0.1, 0.9, 0.3, 0.8, 0.2, 0.05], 1),
        ("min", [0.9, 0.1, 0.7, 0.3, 0.8, 0.95], 1),
    ],
)
def test_top_k_keeps_k_best_plus_newest(tmp_path, mode, scores, best_i):
    ck = TopKCheckpointer(k=2, metric="acc", mode=mode)
    ck.bind(tmp_path)
    paths = [_save(ck, i, acc=s) for i, s in enumerate(scores)]
    expected = {paths[1].name, paths[3].name, paths[5].name}  # two best + newest (worst of all)
    on_disk = {p.name for p in ck.dir.iterdir() if p.is_dir()}
    assert on_disk == expected
    assert {r["name"] for r in read_manifest(ck.dir)} == expected
    assert ck.best() == paths[best_i] and ck.latest() == paths[5]
    assert [r["step"] for r in ck.records()] == [10, 30, 50]  # oldest first


def test_a_requested_checkpoint_outlives_retention_until_deleted(tmp_path):
    ck = TopKCheckpointer(k=1, metric="acc", mode="max", dir=tmp_path / "ck")
    asked = ck.save(epoch=0, step=5, metrics={}, trees={"p": {"w": jnp.zeros(2)}},
                    meta={"requested": True})  # fmt: skip
    paths = [_save(ck, i, acc=0.1 * i) for i in range(1, 4)]
    assert asked.exists() and not paths[0].exists()  # the scored ones still rotate
    assert [r["requested"] for r in ck.records()] == [True, False]
    shutil.rmtree(asked)  # the user removes it: forgotten, nothing else disturbed
    _save(ck, 4, acc=0.0)
    assert [r["step"] for r in ck.records()] == [30, 40]


def test_without_metric_only_newest_is_kept(tmp_path):
    ck = TopKCheckpointer(k=3, metric="val_loss", dir=tmp_path / "ck")
    paths = [_save(ck, i, train_loss=1.0 / (i + 1)) for i in range(4)]
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.is_dir()] == [paths[-1].name]
    assert ck.best() is None and ck.latest() == paths[-1]
    assert "val_loss" not in paths[-1].name


def test_names_are_descriptive_sanitised_and_unique(tmp_path):
    ck = TopKCheckpointer(k=5, metric="val/acc (top-1)" + "x" * 50, mode="max")
    ck.bind(tmp_path)
    metric = ck.metric
    a = ck.save(epoch=3, step=420, metrics={metric: 0.95123456}, trees={}, meta={})
    b = ck.save(epoch=3, step=420, metrics={metric: 0.95123456}, trees={}, meta={})
    safe = "val_acc__top_1_" + "x" * 25
    assert a.name == f"epoch-0003-step-000420-{safe}=0.951235"
    assert b.name == a.name + "-1" and a.is_dir() and b.is_dir()
    rows = read_manifest(tmp_path / "checkpoints")
    assert rows[0]["path"] == a.name and rows[0]["score"] == pytest.approx(0.95123456)
    assert rows[0]["metric"] == metric and set(rows[0]) >= {
        "name",
        "epoch",
        "step",
        "metrics",
        "time",
    }
    c = ck.save(epoch=4, step=500, metrics={metric: float("nan")}, trees={}, meta={})
    assert c.name.endswith("=nan")
    row = read_manifest(ck.dir)[-1]
    assert row["score"] is None and row["metrics"][metric] is None  # JSON has no NaN
    json.loads((ck.dir / "manifest.json").read_text())  # strict JSON


def _data_files(ckpt: Path) -> list[Path]:
    return [p for p in (ckpt / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]


def test_flipped_bytes_in_array_data_are_detected(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    path = ck.save(
        epoch=0,
        step=1,
        metrics={},
        trees={
            "params": {"w": jnp.asarray(np.random.default_rng(1).random((64, 64)), jnp.float32)}
        },
        meta={},
    )
    biggest = max(_data_files(path), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(path)


def test_edited_checksum_is_detected(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    path = _save(ck, 1, val_loss=0.2)
    meta = json.loads((path / "meta.json").read_text())
    meta["trees"]["p"]["sha256"] = "0" * 64
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"corrupted \(checksum mismatch in tree 'p'\)"):
        load_checkpoint(path)


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    done = _save(ck, 1, val_loss=0.2)
    stale = tmp_path / "epoch-0009-step-000090-val_loss=0.1.tmp-12345"
    stale.mkdir()
    (stale / "meta.json").write_text("{}")
    assert ck.latest() == done and len(ck.records()) == 1
    TopKCheckpointer(dir=tmp_path).bind(tmp_path)
    assert not stale.exists()


def test_bind_adopts_complete_checkpoint_missing_from_manifest(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    first, second = _save(ck, 1, val_loss=0.5), _save(ck, 2, val_loss=0.1)
    (tmp_path / "manifest.json").unlink()  # as if killed between rename and manifest write
    ck2 = TopKCheckpointer(dir=tmp_path)
    ck2.bind(tmp_path)
    assert [r["name"] for r in ck2.records()] == [first.name, second.name]
    assert ck2.best() == second


def test_template_mismatch_lists_differing_paths(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    path = ck.save(
        epoch=0,
        step=0,
        metrics={},
        meta={},
        trees={"params": {"a": jnp.zeros((2, 3)), "b": jnp.zeros(4, jnp.int32)}},
    )
    bad = {"params": {"a": jax.ShapeDtypeStruct((3, 2), jnp.float32), "c": jnp.zeros(4, jnp.int32)}}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, bad)
    msg = str(info.value)
    assert (
        "['a']" in msg
        and "(3, 2)" in msg
        and "['b']" in msg
        and "['c']" in msg
        and "'params'" in msg
    )


def test_bind_on_a_file_names_the_path(tmp_path):
    target = tmp_path / "checkpoints"
    target.write_text("not a directory")
    with pytest.raises(CheckpointError, match=str(target)):
        TopKCheckpointer().bind(tmp_path)


def test_bad_config_is_rejected_with_suggestion():
    with pytest.raises(ConfigError, match=r"'maximum'.*'min', 'max'.*Did you mean 'max'\?"):
        TopKCheckpointer(mode="maximum")
    with pytest.raises(ConfigError, match=r"k must be an int >= 1, got 0"):
        TopKCheckpointer(k=0)


def test_saving_is_quiet(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    ck = TopKCheckpointer(dir=tmp_path)
    load_checkpoint(_save(ck, 1, val_loss=0.3))
    assert not [r for r in caplog.records if "orbax" in r.pathname]
    logging.getLogger("absl").info("user message")  # other absl logging still gets through
    assert any(r.getMessage() == "user message" for r in caplog.records)


def test_a_relative_checkpoint_path_loads(run_dir, monkeypatch):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    latest = jn.TopKCheckpointer(dir=run_dir / "checkpoints").latest()
    monkeypatch.chdir(run_dir.parent)
    relative = os.path.relpath(latest, run_dir.parent)
    n = nitro(Tiny(), run_dir="other", checkpoint=relative)
    assert 0 <= jn.validate(n)["acc"] <= 1
    resumed = nitro(Tiny(max_epochs=2), run_dir="other2", resume=relative)
    assert resumed.step == 8


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


def test_the_checkpointer_passed_is_not_changed_and_configures_several_runs(tmp_path):
    ck = TopKCheckpointer(k=2, metric="val_loss")
    a = nitro(Tiny(), run_dir=tmp_path / "a", checkpointer=ck)
    b = nitro(Tiny(), run_dir=tmp_path / "b", checkpointer=ck)
    assert (ck.dir, ck.run_id, ck.metric) == (None, None, "val_loss")
    assert a.checkpointer.dir == tmp_path / "a" / "checkpoints"
    assert b.checkpointer.dir == tmp_path / "b" / "checkpoints"  # not run a's directory
    assert a.checkpointer.k == b.checkpointer.k == 2
