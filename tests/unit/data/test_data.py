"""Tests for data.loader, data.batches and data.prefetch: DataLoader, batch checks, padding,
and the prefetch thread."""

import threading
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, make_data, nitro

import jaxnitro as jn
from jaxnitro._src.data.batches import check_batch, pad_batch
from jaxnitro._src.data.loader import DataLoader, skip
from jaxnitro._src.data.prefetch import Prefetcher


def data(n=10, d=3):
    return {
        "x": np.arange(n * d, dtype=np.float32).reshape(n, d),
        "y": np.arange(n, dtype=np.int32),
    }


def ys(loader_or_batches):
    return np.concatenate([b["y"] for b in loader_or_batches])


def call_with_timeout(fn, seconds=5.0):
    """Run fn in a thread; fail (rather than hang the suite) if it does not return in time."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---------------------------------------------------------------- batching


def test_batches_in_order_with_sizes():
    loader = DataLoader(data(10), batch_size=4)
    batches = list(loader)
    assert [b["y"].shape[0] for b in batches] == [4, 4, 2]
    assert [b["x"].shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
    np.testing.assert_array_equal(ys(batches), np.arange(10))
    np.testing.assert_array_equal(batches[1]["x"], data(10)["x"][4:8])
    assert len(loader) == 3 and loader.ragged


def test_drop_last():
    loader = DataLoader(data(10), batch_size=4, drop_last=True)
    assert len(loader) == 2 and not loader.ragged
    batches = list(loader)
    assert [b["y"].shape[0] for b in batches] == [4, 4]
    np.testing.assert_array_equal(ys(batches), np.arange(8))


def test_len_when_batch_size_divides():
    for drop_last in (False, True):
        loader = DataLoader(data(12), batch_size=4, drop_last=drop_last)
        assert len(loader) == 3 == len(list(loader))
        assert not loader.ragged


def test_batch_larger_than_dataset():
    assert len(DataLoader(data(3), batch_size=8)) == 1
    assert len(DataLoader(data(3), batch_size=8, drop_last=True)) == 0
    assert list(DataLoader(data(3), batch_size=8, drop_last=True)) == []


def test_reiterable():
    loader = DataLoader(data(10), batch_size=3)
    first, second = ys(loader), ys(loader)
    np.testing.assert_array_equal(first, second)
    assert len(list(loader)) == len(list(loader)) == 4


def test_accepts_jax_arrays_and_lists():
    loader = DataLoader({"x": jnp.ones((5, 2)), "y": [0, 1, 2, 3, 4]}, batch_size=2)
    b = next(iter(loader))
    assert isinstance(b["x"], np.ndarray) and isinstance(b["y"], np.ndarray)
    np.testing.assert_array_equal(b["y"], [0, 1])


# ---------------------------------------------------------------- shuffle


def test_shuffle_is_a_permutation_per_epoch():
    loader = DataLoader(data(50), batch_size=7, shuffle=True, seed=1)
    got = ys(loader)
    assert sorted(got.tolist()) == list(range(50))
    assert not np.array_equal(got, np.arange(50))


def test_shuffle_keeps_fields_aligned():
    loader = DataLoader(data(20), batch_size=6, shuffle=True, seed=3)
    for b in loader:
        np.testing.assert_array_equal(b["x"][:, 0], b["y"] * 3)


def test_shuffle_differs_between_epochs():
    loader = DataLoader(data(50), batch_size=10, shuffle=True, seed=0)
    loader.set_epoch(0)
    e0 = ys(loader)
    loader.set_epoch(1)
    e1 = ys(loader)
    assert sorted(e1.tolist()) == list(range(50))
    assert not np.array_equal(e0, e1)


def test_shuffle_is_reproducible_for_same_seed_and_epoch():
    a = DataLoader(data(50), batch_size=10, shuffle=True, seed=5)
    b = DataLoader(data(50), batch_size=10, shuffle=True, seed=5)
    a.set_epoch(3)
    b.set_epoch(3)
    np.testing.assert_array_equal(ys(a), ys(b))
    np.testing.assert_array_equal(ys(a), ys(a))  # and iterating again repeats it
    b.set_epoch(2)
    b.set_epoch(3)
    np.testing.assert_array_equal(ys(a), ys(b))


def test_different_seeds_differ():
    a = DataLoader(data(50), batch_size=10, shuffle=True, seed=1)
    b = DataLoader(data(50), batch_size=10, shuffle=True, seed=2)
    assert not np.array_equal(ys(a), ys(b))


def test_shuffle_with_drop_last_drops_different_samples_but_fixed_count():
    loader = DataLoader(data(10), batch_size=4, shuffle=True, drop_last=True, seed=0)
    got = ys(loader)
    assert got.shape == (8,) and len(set(got.tolist())) == 8


@pytest.mark.parametrize("shuffle", [False, True])
def test_iter_from_equals_tail_of_full_iteration(shuffle):
    loader = DataLoader(data(23), batch_size=4, shuffle=shuffle, seed=7)
    loader.set_epoch(2)
    full = list(loader)
    for k in (0, 1, 3, len(full)):
        tail = list(loader.iter_from(k))
        assert len(tail) == len(full) - k
        for a, b in zip(tail, full[k:], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    tail = list(skip(loader, 2))
    np.testing.assert_array_equal(ys(tail), ys(full[2:]))


def test_skip_on_a_plain_iterable():
    batches = [{"y": np.array([i])} for i in range(5)]
    assert [b["y"][0] for b in skip(batches, 3)] == [3, 4]


# ---------------------------------------------------------------- loader errors


@pytest.mark.parametrize("bad", [[np.zeros(3)], np.zeros((3, 2)), (np.zeros(3),), {}])
def test_non_dict_input_is_a_data_error(bad):
    with pytest.raises(jn.DataError, match="dict"):
        DataLoader(bad, batch_size=2)


def test_mismatched_leading_dims():
    with pytest.raises(jn.DataError, match="leading") as ei:
        DataLoader({"x": np.zeros((10, 2)), "y": np.zeros(9)}, batch_size=2)
    msg = str(ei.value)
    assert "'x': 10" in msg and "'y': 9" in msg


def test_scalar_field_is_refused():
    with pytest.raises(jn.DataError, match="leading"):
        DataLoader({"x": np.zeros((10, 2)), "s": np.array(1.0)}, batch_size=2)
    with pytest.raises(jn.DataError, match="'s'"):
        DataLoader({"x": np.zeros((10, 2)), "s": np.float32(1.0)}, batch_size=2)


@pytest.mark.parametrize(
    "arr",
    [
        np.array(["a", "b", "c"]),
        np.array([b"a", b"b", b"c"]),
        np.array([{}, {}, {}], dtype=object),
    ],
)
def test_object_or_string_dtype_is_refused(arr):
    with pytest.raises(jn.DataError, match="'names'") as ei:
        DataLoader({"x": np.zeros((3, 2)), "names": arr}, batch_size=2)
    assert "dtype" in str(ei.value)


@pytest.mark.parametrize("value", [5, "abc", None, object()])
def test_non_array_field_is_refused(value):
    with pytest.raises(jn.DataError, match="'meta'") as ei:
        DataLoader({"x": np.zeros((3, 2)), "meta": value}, batch_size=2)
    assert "np.asarray" in str(ei.value)


@pytest.mark.parametrize("bs", [0, -1, 2.0, True, None])
def test_bad_batch_size(bs):
    with pytest.raises(jn.DataError, match="batch_size"):
        DataLoader(data(4), batch_size=bs)


def test_numpy_int_batch_size_is_fine():
    assert DataLoader(data(4), batch_size=np.int64(2)).batch_size == 2


# ---------------------------------------------------------------- check_batch / pad_batch


def test_check_batch_returns_batch_size():
    assert check_batch({"x": np.zeros((4, 3)), "y": np.zeros(4)}, "train") == 4


def test_check_batch_fields_with_different_batch_sizes():
    with pytest.raises(jn.DataError, match="'train'") as ei:
        check_batch({"x": np.zeros((4, 3)), "y": np.zeros(5)}, "train")
    msg = str(ei.value)
    assert "'x': 4" in msg and "'y': 5" in msg


def test_check_batch_key_set_changing():
    expect = frozenset({"x", "y"})
    check_batch({"x": np.zeros(2), "y": np.zeros(2)}, "val", expect_fields=expect)
    with pytest.raises(jn.DataError, match="changed") as ei:
        check_batch({"x": np.zeros(2), "z": np.zeros(2)}, "val", expect_fields=expect)
    msg = str(ei.value)
    assert "['x', 'y']" in msg and "['x', 'z']" in msg and "'val'" in msg


def test_check_batch_non_dict_and_scalar_fields():
    with pytest.raises(jn.DataError, match="tuple"):
        check_batch((np.zeros(2), np.zeros(2)), "train")
    with pytest.raises(jn.DataError, match="'s'.*scalar"):
        check_batch({"x": np.zeros(2), "s": np.array(1.0)}, "train")
    with pytest.raises(jn.DataError, match="'name'"):
        check_batch({"x": np.zeros(2), "name": np.array(["a", "b"])}, "train")


def test_check_batch_empty_dict_is_a_data_error():
    with pytest.raises(jn.DataError, match="'train'"):
        check_batch({}, "train")


def test_pad_batch_repeats_last_row():
    batch = {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "y": np.array([7, 8, 9])}
    out = pad_batch(batch, 5)
    assert out["x"].shape == (5, 2) and out["y"].shape == (5,)
    np.testing.assert_array_equal(out["x"][:3], batch["x"])
    np.testing.assert_array_equal(out["x"][3:], [[4, 5], [4, 5]])
    np.testing.assert_array_equal(out["y"], [7, 8, 9, 9, 9])
    assert out["x"].dtype == np.float32 and out["y"].dtype == batch["y"].dtype


def test_pad_batch_full_batch_unchanged():
    batch = {"y": np.array([1, 2])}
    assert pad_batch(batch, 2)["y"] is batch["y"]


# ---------------------------------------------------------------- Prefetcher


def identity_prepare(host):
    return host, host["y"].shape[0]


def test_prefetcher_yields_in_order():
    source = [{"y": np.arange(i, i + 3)} for i in range(50)]
    p = Prefetcher(source, identity_prepare, depth=2)
    got = call_with_timeout(lambda: list(p), 20)
    assert len(got) == 50
    for (dev, n, host), src in zip(got, source, strict=True):
        assert n == 3
        assert host is src
        np.testing.assert_array_equal(dev["y"], src["y"])


def test_prefetcher_with_loader_and_prepare():
    loader = DataLoader(data(23), batch_size=4)
    p = Prefetcher(loader, lambda h: ({k: v * 2 for k, v in h.items()}, len(h["y"])), depth=3)
    got = call_with_timeout(lambda: list(p))
    assert [n for _, n, _ in got] == [4, 4, 4, 4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([d["y"] for d, _, _ in got]), np.arange(23) * 2)


def test_prefetcher_propagates_source_exception():
    def source():
        for i in range(3):
            yield {"y": np.array([i])}
        raise ValueError("bad shard 3")

    p = Prefetcher(source(), identity_prepare)
    got = [call_with_timeout(lambda: next(p)) for _ in range(3)]
    assert [int(h["y"][0]) for _, _, h in got] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad shard 3"):
        call_with_timeout(lambda: next(p))


def test_prefetcher_propagates_prepare_exception():
    def prepare(host):
        raise RuntimeError("device full")

    p = Prefetcher([{"y": np.zeros(1)}], prepare)
    with pytest.raises(RuntimeError, match="device full"):
        call_with_timeout(lambda: next(p))


def test_prefetcher_close_stops_early_without_hanging():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield {"y": np.array([i])}
            i += 1

    p = Prefetcher(endless(), identity_prepare, depth=2)
    first = call_with_timeout(lambda: next(p))
    assert int(first[2]["y"][0]) == 0
    t0 = time.perf_counter()
    call_with_timeout(p.close)
    assert time.perf_counter() - t0 < 2.0
    assert not p._thread.is_alive()
    n = len(produced)
    time.sleep(0.2)
    assert len(produced) == n  # nothing more is read from the source
    assert n < 10  # bounded look-ahead


def test_prefetcher_close_with_a_blocked_consumer_queue():
    p = Prefetcher(({"y": np.array([i])} for i in range(1000)), identity_prepare, depth=1)
    time.sleep(0.1)  # the producer is now blocked on a full queue
    call_with_timeout(p.close)
    assert not p._thread.is_alive()


def test_prefetcher_next_after_close_does_not_hang():
    p = Prefetcher(({"y": np.array([i])} for i in range(1000)), identity_prepare, depth=2)
    call_with_timeout(lambda: next(p))
    call_with_timeout(p.close)
    with pytest.raises(StopIteration):
        call_with_timeout(lambda: next(p))


def test_prefetcher_next_after_exhaustion_keeps_raising_stop_iteration():
    p = Prefetcher([{"y": np.zeros(1)}], identity_prepare)
    assert len(call_with_timeout(lambda: list(p))) == 1
    with pytest.raises(StopIteration):
        call_with_timeout(lambda: next(p))


def test_prefetcher_records_wait_time():
    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield {"y": np.array([i])}

    p = Prefetcher(slow(), identity_prepare)
    call_with_timeout(lambda: list(p))
    assert p.wait_seconds > 0.05


def test_a_float64_split_warns_once(run_dir):
    x, y = make_data(256)
    data = {"train": jn.DataLoader({"x": x.astype(np.float64), "y": y}, 32, drop_last=True)}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir, data=data)
        jn.train(n)
    msgs = [str(m.message) for m in w if "float64" in str(m.message)]
    assert len(msgs) == 1 and "'x'" in msgs[0] and "astype(np.float32)" in msgs[0]


def test_a_val_split_with_other_features_is_named_at_setup(run_dir):
    x, y = make_data(356)

    @jn.experiment
    class Narrow(Tiny):
        def build_data(self, dist):
            return {
                "train": jn.DataLoader({"x": x[:256], "y": y[:256]}, 32, drop_last=True),
                "val": jn.DataLoader({"x": x[256:, :7], "y": y[256:]}, 20),
            }

    with pytest.raises(
        jn.DataError,
        match=r"split 'val': field 'x' has per-sample shape \(7,\).*"
        r"'train' split has \(8,\)",
    ):
        nitro(Narrow(), run_dir=run_dir)
