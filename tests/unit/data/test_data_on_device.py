"""The train arrays kept on the device: batches gathered in the program, bitwise the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro

import jaxnitro as jn
from jaxnitro._src.data import feed


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
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- an in-order split: its batches cut once on the device ------------------------------------
@pytest.fixture
def cut_any_batch(monkeypatch):
    """Tiny's batches (1 KiB) are far below the size from which an in-order split is cut."""
    from jaxnitro._src.run.setup import resident

    monkeypatch.setattr(resident, "CUT_MIN_CALL_BYTES", 0)


def _train_losses(run_dir) -> list:
    rows = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("context") == "train"]


@pytest.mark.parametrize(
    "options",
    [{}, {"accum": 2}, {"steps_per_call": 3}, {"steps_per_call": 2, "accum": 2}],
    ids=["plain", "accum", "fused-with-tail", "fused-accum"],
)
@pytest.mark.slow
def test_an_in_order_split_is_cut_once_and_trains_bitwise_like_sent_batches(
    tmp_path, cut_any_batch, options
):
    on = nitro(Tiny(shuffle=False), run_dir=tmp_path / "on", **options)
    off = nitro(Tiny(shuffle=False), run_dir=tmp_path / "off", data_on_device=False, **options)
    kept = on.spec.device_batches
    assert kept is not None and on.spec.resident is None and off.spec.device_batches is None
    jn.train(on)
    jn.train(off)
    assert on.step == 16 // options.get("accum", 1)  # two epochs
    assert leaves_equal(on.state_leaves, off.state_leaves)
    assert _train_losses(tmp_path / "on") == _train_losses(tmp_path / "off")
    assert kept.kept_bytes == kept.nbytes  # every row once, no copy left over
    if not options:  # 8 batches, put once: the second epoch transfers nothing
        assert kept.puts == 8


@pytest.mark.slow
def test_the_second_epoch_transfers_nothing(tmp_path, cut_any_batch):
    n = nitro(Tiny(shuffle=False, max_epochs=1), run_dir=tmp_path, steps_per_call=4)
    jn.train(n)
    puts = n.spec.device_batches.puts
    n.max_epochs = 3
    jn.train(n)
    assert n.step == 24 and n.spec.device_batches.puts == puts


@pytest.mark.slow
def test_a_resume_mid_call_cuts_other_pieces_and_trains_bitwise(tmp_path, cut_any_batch):
    """Stopped after 5 batches with 2 steps per call: the resumed epoch's calls start at
    rows the next epoch's do not, so its pieces are replaced, never kept twice."""
    straight = nitro(Tiny(shuffle=False), run_dir=tmp_path / "a", data_on_device=False)
    jn.train(straight)
    first = nitro(Tiny(shuffle=False), run_dir=tmp_path / "b", checkpoint_every=5)
    jn.every(5, lambda r: jn.request_stop(first), nitro=first)
    jn.train(first)
    assert first.step == 5
    resumed = nitro(Tiny(shuffle=False), run_dir=tmp_path / "b", resume="auto", steps_per_call=2)
    jn.train(resumed)
    kept = resumed.spec.device_batches
    assert kept is not None and kept.kept_bytes <= kept.nbytes
    assert kept.puts > 4  # the resumed epoch's pieces, then the next epoch's
    assert leaves_equal(resumed.state_leaves, straight.state_leaves)


def test_pieces_that_overlap_a_new_one_are_dropped():
    from jaxnitro._src.data.device_batches import DeviceBatches

    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    kept = DeviceBatches({"x": x}, 2, None)
    assert np.array_equal(kept.get(0, (3,))["x"], x[:6].reshape(3, 2, 2))  # rows 0..5
    assert np.array_equal(kept.get(6, ())["x"], x[6:8])
    assert kept.get(0, (3,)) is kept.get(0, (3,)) and kept.puts == 2
    assert np.array_equal(kept.get(4, (2,))["x"], x[4:8].reshape(2, 2, 2))  # overlaps both
    assert kept.kept_bytes == x[4:8].nbytes and kept.puts == 3
    assert kept.put([(0, ()), (2, ()), (4, (2,)), (8, (6,))]) == 3  # rows 4..7 are kept
    assert kept.kept_bytes == x[:20].nbytes


@jn.experiment
class OneBigBatch(Tiny):
    """One in-order batch of 8192 rows (288 KiB): above the size from which it is cut."""

    shuffled: bool = False

    def build_data(self, dist):
        x, y = make_data(8192)
        loader = jn.DataLoader({"x": x, "y": y}, batch_size=8192, shuffle=self.shuffled)
        return {"train": loader}


def test_large_in_order_batches_are_cut_small_or_shuffled_ones_gathered(tmp_path):
    small = nitro(Tiny(shuffle=False), run_dir=tmp_path / "small")  # 1 KiB batches
    assert small.spec.resident is not None and small.spec.device_batches is None
    big = nitro(OneBigBatch(), run_dir=tmp_path / "big")
    assert big.spec.device_batches is not None and big.spec.resident is None
    shuffled = nitro(OneBigBatch(shuffled=True), run_dir=tmp_path / "shuffled")
    assert shuffled.spec.resident is not None and shuffled.spec.device_batches is None
    off = nitro(OneBigBatch(), run_dir=tmp_path / "off", data_on_device=False)
    assert off.spec.resident is None and off.spec.device_batches is None


@pytest.mark.slow
def test_cut_batches_are_described_and_planned(tmp_path, cut_any_batch):
    n = nitro(Tiny(shuffle=False), run_dir=tmp_path)
    assert "in order: each batch put there once, taken as it is" in str(jn.inspect(n, show=False))
    plan = jn.memory_plan(n)
    assert plan.kept_batches_bytes == n.spec.device_batches.nbytes - 32 * 9 * 4
    assert "train batches kept on the device" in plan.table()
    assert plan.batches_in_flight == 0  # the batches a call takes are the kept ones


@pytest.mark.slow
def test_gathered_batches_plan_only_their_row_indices_in_flight(tmp_path):
    n = nitro(Tiny(), run_dir=tmp_path, steps_per_call=4)
    plan = jn.memory_plan(n)
    # 4 steps of 32 int32 row indices per call, a unit's calls in blocks on one CPU (at
    # most ROWS_BYTES of them)
    assert n.spec.direct_feed
    assert plan.batch_bytes == feed.rows_calls(n.spec) * 4 * 32 * 4 <= feed.ROWS_BYTES
    assert plan.kept_batches_bytes == 0 and "kept on the device" not in plan.table()


def test_another_dataset_size_in_order_compiles_no_new_train_program(tmp_path, cut_any_batch):
    jn.compile(nitro(Tiny(shuffle=False), run_dir=tmp_path / "a"))
    before = jn.cache_stats()["misses"]
    jn.compile(nitro(Tiny(shuffle=False, n_train=512), run_dir=tmp_path / "b"))
    assert jn.cache_stats()["misses"] == before  # the batches, not the arrays, are inputs
