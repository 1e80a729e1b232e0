"""The train arrays kept on the device: batches gathered in the program, bitwise the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro

import jaxnitro as jn


def test_on_by_default_when_the_arrays_fit(run_dir):
    n = nitro(Tiny(), run_dir=run_dir)
    assert n.spec.resident is not None and sorted(n.spec.resident) == ["x", "y"]
    assert "each batch gathered in the train program" in str(jn.inspect(n, show=False))
    off = nitro(Tiny(), run_dir=run_dir / "off", data_on_device=False)
    assert off.spec.resident is None


@pytest.mark.parametrize(
    "options",
    [{}, {"accum": 2}, {"steps_per_call": 3}, {"steps_per_call": 2, "accum": 2}],
    ids=["plain", "accum", "fused-with-tail", "fused-accum"],
)
def test_gathered_batches_train_bitwise_like_sent_ones(tmp_path, options):
    on = nitro(Tiny(), run_dir=tmp_path / "on", **options)
    off = nitro(Tiny(), run_dir=tmp_path / "off", data_on_device=False, **options)
    assert on.spec.resident is not None and off.spec.resident is None
    jn.train(on)
    jn.train(off)
    assert leaves_equal(on.state_leaves, off.state_leaves)
    lines = [
        [json.loads(s) for s in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (tmp_path / "on", tmp_path / "off")
    ]
    losses = [[r["loss"] for r in rows if r.get("context") == "train"] for rows in lines]
    assert losses[0] == losses[1] and len(losses[0]) == on.step


def test_a_resume_mid_epoch_gathers_the_same_rows(tmp_path):
    straight = nitro(Tiny(), run_dir=tmp_path / "a", data_on_device=False)
    jn.train(straight)
    first = nitro(Tiny(), run_dir=tmp_path / "b", checkpoint_every=3)
    jn.every(5, lambda r: jn.request_stop(first), nitro=first)
    jn.train(first)
    assert 0 < first.step < straight.step
    resumed = nitro(Tiny(), run_dir=tmp_path / "b", resume="auto")
    assert resumed.spec.resident is not None
    jn.train(resumed)
    assert leaves_equal(resumed.state_leaves, straight.state_leaves)


@jn.experiment
class Mapped(Tiny):
    path: str = ""

    def build_data(self, dist):
        x, y = make_data(self.n_train)
        np.save(self.path, x)
        return {
            "train": jn.DataLoader(
                {"x": np.load(self.path, mmap_mode="r"), "y": y}, batch_size=32, drop_last=True
            )
        }


def test_sources_that_cannot_stay_on_the_device_send_batches(tmp_path):
    mapped = Mapped(n_val=0, path=str(tmp_path / "x.npy"))
    assert nitro(mapped, run_dir=tmp_path / "a").spec.resident is None  # a memory map
    with pytest.raises(jn.ConfigError, match=r"data_on_device=True, but the train split is not"):
        nitro(mapped, run_dir=tmp_path / "b", data_on_device=True)
    with pytest.raises(jn.ConfigError, match=r"data_on_device='yes'"):
        nitro(Tiny(), run_dir=tmp_path / "c", data_on_device="yes")
    small = nitro(Tiny(), run_dir=tmp_path / "d", memory_budget=1000)  # 25% is 250 bytes
    assert small.spec.resident is None


def test_another_dataset_size_is_explained_as_the_arrays_on_the_device(tmp_path):
    jn.cache_reset()
    jn.compile(nitro(Tiny(), run_dir=tmp_path / "a"))
    bigger = nitro(Tiny(n_train=512), run_dir=tmp_path / "b")
    jn.compile(bigger)
    why = " | ".join(r for row in jn.explain(bigger) for r in row["reasons"])
    assert "the train arrays on the device changed: `x` (256, 8) → (512, 8)" in why, why
    assert "data_on_device=False" in why
    off = [
        nitro(Tiny(n_train=n), run_dir=tmp_path / f"off{n}", data_on_device=False)
        for n in (256, 512)
    ]
    before = jn.cache_stats()["misses"]
    for n in off:
        jn.compile(n)
    # one train program for both sizes (batches sent); the eval program is already cached
    assert jn.cache_stats()["misses"] - before == 1
