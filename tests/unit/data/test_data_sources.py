"""Data beyond memory: memory maps, Hugging Face datasets, grain splits, transforms in worker
processes, and what a resume reads from each (bitwise against a straight run)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro
from helpers.procs import alive, child_env, gone

import jaxnitro as jn
from jaxnitro._src.data import tables

N_TRAIN, BS, AT = 64, 8, 3  # 8 steps an epoch; the mid-epoch checkpoint is at step 3


def val_split():
    x, y = make_data(40, seed=1)
    return jn.DataLoader({"x": x, "y": y}, batch_size=20)


def straight_and_resumed(tmp_path, make_train, *, max_epochs=2):
    """Train straight with a validated checkpoint every AT steps; resume another run from the
    step-AT checkpoint (mid-epoch 1) and train it to the end: both must end bit for bit equal.
    `make_train()` builds the split afresh for each handle. Returns (straight, resumed)."""
    kw = dict(checkpoint_every=AT, val_every=AT, checkpointer=jn.TopKCheckpointer(k=50))
    a = nitro(
        Tiny(max_epochs=max_epochs),
        data={"train": make_train(), "val": val_split()},
        run_dir=tmp_path / "a",
        **kw,
    )
    jn.train(a)
    ck = tmp_path / "a" / "checkpoints"
    mid = next(r for r in jn.read_manifest(ck) if r["step"] == AT)
    b = nitro(
        Tiny(max_epochs=max_epochs),
        data={"train": make_train(), "val": val_split()},
        run_dir=tmp_path / "b",
        resume=str(ck / mid["path"]),
    )
    assert b.step == AT and b.progress.batch_in_epoch == AT
    jn.train(b)
    assert b.step == a.step == max_epochs * N_TRAIN // BS
    assert leaves_equal(a.params, b.params)
    assert leaves_equal(a.opt_state, b.opt_state)
    return a, b


# -- memory maps ----------------------------------------------------------------------------
def saved_arrays(tmp_path, n=N_TRAIN):
    x, y = make_data(n)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return tmp_path / "x.npy", tmp_path / "y.npy"


@pytest.mark.slow
def test_memmap_resume_mid_epoch_is_bitwise(tmp_path):
    xp, yp = saved_arrays(tmp_path)

    def train():
        x, y = np.load(xp, mmap_mode="r"), np.load(yp, mmap_mode="r")
        return jn.DataLoader({"x": x, "y": y}, batch_size=BS, shuffle=True, drop_last=True)

    a, _ = straight_and_resumed(tmp_path, train)
    assert isinstance(a.spec.splits["train"].table.arrays["x"], np.memmap)  # never loaded


def test_a_memory_map_is_read_by_batch_never_whole(tmp_path):
    rows, width = 4096, 512  # an 8 MiB file; a batch of 16 rows is 32 KiB
    path = tmp_path / "big.npy"
    np.save(path, np.arange(rows * width, dtype=np.float32).reshape(rows, width))
    mm = np.load(path, mmap_mode="r")
    loader = jn.DataLoader({"x": mm}, batch_size=16, shuffle=True, seed=0)
    loader.set_epoch(1)
    tracemalloc.start()
    try:
        total, first = 0, None
        for batch in loader.iter_from(100):  # a resume position: batches 0..99 never read
            total += batch["x"].shape[0]
            first = batch["x"] if first is None else first
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == rows - 100 * 16
    assert peak < mm.nbytes / 20, f"peak {peak} bytes: a full copy of the map happened"
    order = np.random.default_rng([0, 1]).permutation(rows)
    assert np.array_equal(first, np.asarray(mm)[order[1600:1616]])  # rows in shuffle order


# -- Hugging Face datasets ------------------------------------------------------------------
def hf_dataset(n=N_TRAIN, extra=True):
    datasets = pytest.importorskip("datasets")
    x, y = make_data(n)
    cols = {"features": x, "label": y}
    if extra:
        cols["unused"] = np.ones((n, 64), np.float32)
    return datasets.Dataset.from_dict(cols)


@pytest.mark.slow
def test_hf_dataset_resume_mid_epoch_is_bitwise(tmp_path):
    ds = hf_dataset()

    def train():
        cols = {"x": "features", "y": "label"}
        return jn.DataLoader(ds, batch_size=BS, shuffle=True, drop_last=True, columns=cols)

    straight_and_resumed(tmp_path, train)


def test_hf_batches_match_the_arrays_in_shuffle_order():
    ds = hf_dataset(extra=False)
    x, y = make_data(N_TRAIN)
    loader = jn.DataLoader(ds, batch_size=BS, shuffle=True, seed=4, columns=["features", "label"])
    loader.set_epoch(2)
    batch = next(loader.iter_from(1))
    rows = np.random.default_rng([4, 2]).permutation(N_TRAIN)[BS : 2 * BS]
    assert batch["label"].dtype == np.int32  # the column's own dtype, not numpy's int64
    assert np.array_equal(batch["features"], x[rows]) and np.array_equal(batch["label"], y[rows])


@pytest.mark.slow
def test_a_column_no_hook_names_is_never_read_while_training(tmp_path, monkeypatch):
    ds = hf_dataset()
    cols = {"x": "features", "y": "label", "unused": "unused"}
    loader = jn.DataLoader(ds, batch_size=BS, shuffle=True, drop_last=True, columns=cols)
    n = nitro(Tiny(max_epochs=1), data={"train": loader, "val": val_split()}, run_dir=tmp_path)
    read: list = []
    original = tables.ArrowTable.read

    def spy(self, rows, fields, **kw):
        read.append(tuple(fields))
        return original(self, rows, fields, **kw)

    monkeypatch.setattr(tables.ArrowTable, "read", spy)
    jn.train(n)
    assert read and all("unused" not in f for f in read)
    assert "host only ['unused']" in jn.inspect(n, show=False).binding


def test_hf_column_errors_name_the_column_and_the_fix():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(jn.DataError, match="'lable'.*Did you mean 'label'"):
        jn.DataLoader(hf_dataset(), batch_size=4, columns=["features", "lable"])
    ragged = datasets.Dataset.from_dict({"t": [[1, 2], [3], [4, 5]]})
    with pytest.raises(jn.DataError, match="lists of different lengths.*Pad or truncate"):
        list(jn.DataLoader(ragged, batch_size=2))
    later = datasets.Dataset.from_dict({"t": [[1, 2], [3, 4], [5, 6, 7], [8, 9, 0]]})
    with pytest.raises(jn.DataError, match=r"per-sample shape \(3,\).*first row has \(2,\)"):
        list(jn.DataLoader(later, batch_size=2))
    text = datasets.Dataset.from_dict({"s": ["a", "b"]})
    with pytest.raises(jn.DataError, match="not numeric.*Encode it as numbers"):
        jn.DataLoader(text, batch_size=2)


# -- transforms and workers -----------------------------------------------------------------
def jitter(example, rng):
    """A random per-sample transform: noise and a random flip of the features."""
    x = example["x"] + rng.normal(size=example["x"].shape).astype(np.float32) * 0.1
    return {"x": x[::-1].copy() if rng.random() < 0.5 else x, "y": example["y"]}


def test_transforms_are_the_same_for_0_1_and_2_workers():
    x, y = make_data(50)
    runs = {}
    for workers in (0, 1, 2):
        loader = jn.DataLoader(
            {"x": x, "y": y}, batch_size=8, shuffle=True, seed=7, transform=jitter, workers=workers
        )
        batches = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            batches += list(loader)
            batches += [b for b, _ in loader.iter_stacked(2, 2, ["x"])]
        loader.close()
        runs[workers] = batches
    for workers in (1, 2):
        assert len(runs[workers]) == len(runs[0])
        for a, b in zip(runs[0], runs[workers], strict=True):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # the transform ran: not the raw rows, and each epoch draws anew
    assert not np.array_equal(runs[0][0]["x"], x[:8])
    assert not np.array_equal(runs[0][0]["x"], runs[0][len(runs[0]) // 2]["x"])


def test_an_abandoned_pass_does_not_leak_into_the_next():
    x, y = make_data(64)
    kw = dict(batch_size=8, shuffle=True, seed=2, transform=jitter)
    inline = list(jn.DataLoader({"x": x, "y": y}, **kw))
    loader = jn.DataLoader({"x": x, "y": y}, **kw, workers=2)
    try:
        held = loader.iter_from(0)
        next(held)  # a pass stopped after one batch, its generator still alive (not closed)
        again = list(loader)
        assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(inline, again, strict=True))
        del held
    finally:
        loader.close()


def test_a_transform_gets_an_rng_of_seed_epoch_and_index_only():
    from jaxnitro._src.data.loader import sample_rng

    assert sample_rng(1, 2, 3).random() == sample_rng(1, 2, 3).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(1, 2, 4).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(1, 3, 3).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(2, 2, 3).random()
    # a sample's stream does not run into its neighbour's (Philox counters apart)
    assert not np.isin(sample_rng(1, 2, 3).random(64), sample_rng(1, 2, 4).random(64)).any()
    x, y = make_data(16)
    draws = []

    def record(example, rng):
        draws.append(rng.random())
        return example

    loader = jn.DataLoader({"x": x, "y": y}, batch_size=4, seed=1, transform=record)
    assert len(draws) == 1  # probed once at construction: a wrong transform fails there
    loader.set_epoch(2)
    next(loader.iter_from(1))
    assert draws[1:] == [sample_rng(1, 2, i).random() for i in range(4, 8)]


def test_a_failing_transform_in_a_worker_names_the_batch_and_the_traceback():
    x, y = make_data(32)

    def bad(example, rng):
        if example["x"][0] > 10 or rng.random() > 0.9:
            raise ValueError("broken sample")
        return example

    loader = jn.DataLoader({"x": x, "y": y}, batch_size=8, seed=0, transform=bad, workers=2)
    try:
        with pytest.raises(jn.DataError, match="(?s)worker .* on batch .*broken sample"):
            list(loader)
        assert len(list(loader.iter_from(4))) == 0  # the pool still answers afterwards
    finally:
        loader.close()


def test_transform_misuse_is_named():
    x, y = make_data(8)
    with pytest.raises(jn.DataError, match="must return a non-empty dict"):
        jn.DataLoader({"x": x, "y": y}, 4, transform=lambda ex, rng: ex["x"])
    with pytest.raises(jn.DataError, match="workers=2 runs transforms.*no transform="):
        jn.DataLoader({"x": x, "y": y}, 4, workers=2)
    with pytest.raises(jn.DataError, match="workers must be an int >= 0"):
        jn.DataLoader({"x": x, "y": y}, 4, transform=jitter, workers=-1)
    odd = jn.DataLoader(
        {"x": x, "y": y}, 4, transform=lambda ex, rng: {"x": ex["x"][: int(ex["y"]) + 1]}
    )
    with pytest.raises(jn.DataError, match="same shape and dtype"):
        list(odd)


@pytest.mark.slow
def test_training_with_transform_workers_equals_in_process_and_resumes(tmp_path):
    x, y = make_data(N_TRAIN)

    def train(workers):
        return lambda: jn.DataLoader(
            {"x": x, "y": y},
            batch_size=BS,
            shuffle=True,
            drop_last=True,
            transform=jitter,
            workers=workers,
        )

    a, b = straight_and_resumed(tmp_path / "w2", train(2))
    inline = nitro(
        Tiny(max_epochs=2), data={"train": train(0)(), "val": val_split()}, run_dir=tmp_path / "w0"
    )
    jn.train(inline)
    assert leaves_equal(inline.params, a.params)
    assert "transform in 2 worker(s)" in jn.inspect(b, show=False).binding
    for n in (a, b):
        n.spec.splits["train"].close()


# -- grain ----------------------------------------------------------------------------------
class CountingSource:
    """A grain random-access source that records every index read."""

    def __init__(self, n=N_TRAIN):
        self.x, self.y = make_data(n)
        self.read: list[int] = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        i = int(i)
        self.read.append(i)
        return {"x": self.x[i], "y": self.y[i], "i": np.int32(i)}

    def __repr__(self):  # grain checks it on set_state: the same source
        return f"CountingSource({len(self)})"


def grain_map(source):
    grain = pytest.importorskip("grain")
    return (
        grain.MapDataset.source(source)
        .shuffle(seed=5)
        .random_map(lambda ex, rng: {**ex, "x": ex["x"] + np.float32(rng.normal())}, seed=9)
        .batch(BS, drop_remainder=True)
    )


def grain_loader(source, shard=None):
    grain = pytest.importorskip("grain")

    class Jitter(grain.transforms.RandomMap):
        def random_map(self, element, rng):
            return {**element, "x": element["x"] + np.float32(rng.normal())}

    sampler = grain.samplers.IndexSampler(
        len(source),
        shard_options=shard or grain.sharding.NoSharding(),
        shuffle=True,
        num_epochs=1,
        seed=3,
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[Jitter(), grain.transforms.Batch(BS, drop_remainder=True)],
        worker_count=0,
    )


@pytest.mark.slow
def test_grain_map_dataset_resume_is_bitwise_and_epochs_differ(tmp_path):
    a, _ = straight_and_resumed(tmp_path, lambda: grain_map(CountingSource()))
    ds = grain_map(CountingSource())
    from jaxnitro._src.data.grain_source import batches

    e0 = np.concatenate([b["i"] for b, _ in batches(ds, 0, 0, None)])
    e1 = np.concatenate([b["i"] for b, _ in batches(ds, 1, 0, None)])
    assert sorted(e0) == sorted(e1) == list(range(N_TRAIN)) and list(e0) != list(e1)


@pytest.mark.slow
def test_grain_map_dataset_resume_reads_nothing_before_the_position(tmp_path):
    sources: list = []

    def train():
        sources.append(CountingSource())
        return grain_map(sources[-1])

    straight_and_resumed(tmp_path, train, max_epochs=1)
    from jaxnitro._src.data.grain_source import batches

    order = np.concatenate([b["i"] for b, _ in batches(grain_map(CountingSource()), 0, 0, None)])
    before, after = set(order[: AT * BS].tolist()), set(order[AT * BS :].tolist())
    assert not before & set(sources[1].read) and after == set(sources[1].read)
    assert set(sources[0].read) == set(range(N_TRAIN))


@pytest.mark.slow
def test_grain_loader_resume_is_bitwise_and_reads_nothing_before_the_position(tmp_path):
    grain = pytest.importorskip("grain")
    sources: list = []

    def train():
        sources.append(CountingSource())
        return grain_loader(sources[-1])

    straight_and_resumed(tmp_path, train, max_epochs=1)
    sampler = grain.samplers.IndexSampler(
        N_TRAIN, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=3
    )
    order = [sampler[k].record_key for k in range(N_TRAIN)]
    before, after = set(order[: AT * BS]), set(order[AT * BS :])
    resumed_reads = set(sources[1].read)
    assert not before & resumed_reads and after <= resumed_reads
    assert set(sources[0].read) == set(range(N_TRAIN))  # the straight run read every record


def test_grain_shards_follow_dist_and_an_unsharded_loader_is_refused():
    pytest.importorskip("grain")
    from jaxnitro._src.data import grain_source
    from jaxnitro._src.run.setup import Dist

    reads = []
    for p in (0, 1):
        src = CountingSource()
        dist = Dist(process_index=p, process_count=2, n_devices=1, mesh=None)
        for _ in grain_loader(src, shard=jn.shard_options(dist)):
            pass
        reads.append(set(src.read))
    assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(N_TRAIN))
    assert len(reads[0]) == len(reads[1]) == N_TRAIN // 2
    with pytest.raises(jn.DataError, match="sharded 1 way.*2 processes.*jn.shard_options"):
        grain_source.check("train", grain_loader(CountingSource()), dist)


def test_grain_in_the_binding_report(tmp_path):
    n = nitro(
        Tiny(max_epochs=1),
        data={"train": grain_loader(CountingSource()), "val": val_split()},
        run_dir=tmp_path,
    )
    binding = jn.inspect(n, show=False).binding
    assert "grain.DataLoader (0 worker process(es))" in binding
    assert "host only ['i']" in binding


# -- sources that cannot seek ---------------------------------------------------------------
class Batches:
    """A re-iterable of dict batches with no position to report (not a sequence)."""

    def __init__(self):
        x, y = make_data(N_TRAIN)
        self.items = [{"x": x[i : i + BS], "y": y[i : i + BS]} for i in range(0, N_TRAIN, BS)]
        self.reads = 0

    def __iter__(self):
        for item in self.items:
            self.reads += 1
            yield item


def test_a_generic_iterable_on_resume_is_named_at_setup(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        straight_and_resumed(tmp_path, Batches, max_epochs=1)
    said = [str(w.message) for w in caught if "cannot report or seek" in str(w.message)]
    assert len(said) == 1
    assert "type Batches" in said[0] and f"replays its first {AT} batches" in said[0]
    assert "jn.DataLoader" in said[0] and "grain" in said[0]


def test_a_list_of_batches_resumes_at_the_position_without_a_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        straight_and_resumed(tmp_path, lambda: Batches().items, max_epochs=1)
    assert not [w for w in caught if "cannot report or seek" in str(w.message)]


# -- worker processes end with the training process ------------------------------------------
_UNCLOSED = """
import os, sys, time
import numpy as np, optax
from flax import nnx
import jaxnitro as jn

class Lin(nnx.Module):
    def __init__(self, rngs): self.l = nnx.Linear(3, 2, rngs=rngs)
    def __call__(self, x): return self.l(x)

def aug(ex, rng):
    if MODE == "raise" and ex["y"] == 1:
        raise ValueError("boom in worker")
    return {"x": ex["x"] * 2, "y": ex["y"]}

MODE = sys.argv[2]

@jn.experiment
class E:
    max_epochs: int = 2
    def build_model(self, rng): return jn.split_model(Lin(nnx.Rngs(rng)))
    def build_data(self, dist):
        y = np.zeros(64, np.int32); y[40] = 1
        x = np.ones((64, 3), np.float32)
        return {"train": jn.DataLoader({"x": x, "y": y}, 8, transform=aug, workers=2)}
    def forward(self, model, params, state, *, x): return jn.apply(model, params, state, x)
    def loss(self, out, *, y): return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

n = jn.Nitro(E(), run_dir=sys.argv[1], progress=False)
loader = n.spec.splits["train"]
try:
    jn.train(n)
finally:  # the loader is never closed: the user's script just ends
    print("PIDS", *[p.pid for p in loader._pool.procs], flush=True)
    if MODE == "hang":
        time.sleep(600)  # killed with SIGKILL by the test
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "raise"])
def test_a_script_that_never_closes_its_workers_exits_and_leaves_none(tmp_path, mode):
    """The workers inherit the run's SIGTERM handling and the parent's pipe ends: once they
    outlived the script (holding its stdout and run lock) or held its exit up."""
    script = tmp_path / "unclosed.py"
    script.write_text(_UNCLOSED)
    env = child_env()
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run"), mode],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert p.returncode == (0 if mode == "ok" else 1), p.stderr
    if mode == "raise":
        assert "boom in worker" in p.stderr
    pids = [int(x) for x in p.stdout.split("PIDS")[1].split()]
    assert len(pids) == 2 and gone(pids), "transform workers outlived the script"


@pytest.mark.slow
def test_workers_of_a_killed_training_process_end(tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(_UNCLOSED)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), "hang"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        pids = [int(x) for x in line.split("PIDS")[1].split()]
        assert all(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert gone(pids), "transform workers outlived a SIGKILLed training process"


def _batches(n=8, bs=32):
    x, y = make_data(n * bs)
    return [{"x": x[i * bs : (i + 1) * bs], "y": y[i * bs : (i + 1) * bs]} for i in range(n)]


def test_a_source_that_returns_the_same_iterator_is_refused_at_setup(run_dir):
    class SameIterator:
        def __init__(self):
            self._it = iter(_batches())

        def __iter__(self):
            return self._it

    with pytest.raises(jn.DataError, match=r"'train'.*same iterator.*jn.DataLoader"):
        nitro(Tiny(n_val=0), run_dir=run_dir, data={"train": SameIterator()})


def test_setup_iterates_a_source_once_and_a_short_epoch_warns(run_dir):
    shared = iter(_batches(16))

    class Shared:  # a new generator per pass, over one shared iterator: runs dry
        passes = 0

        def __iter__(self):
            Shared.passes += 1
            for _, b in zip(range(8), shared, strict=False):
                yield b

        def __len__(self):
            return 8

    n = nitro(Tiny(max_epochs=3, n_val=0), run_dir=run_dir, data={"train": Shared()})
    assert Shared.passes == 1
    with pytest.warns(
        UserWarning, match=r"epoch 2 yielded 7 train batches, but the split's len\(\) is 8"
    ):
        jn.train(n)


@pytest.mark.slow
def test_a_later_batch_with_other_features_names_split_batch_and_field(run_dir):
    good = _batches(8)
    bad = [dict(b) for b in good]
    bad[5] = {"x": np.zeros((32, 9), np.float32), "y": bad[5]["y"]}
    with pytest.raises(
        jn.DataError,
        match=r"batch 5 of split 'train': field 'x' has per-sample "
        r"shape \(9,\).*first batch had \(8,\)",
    ):
        jn.train(nitro(Tiny(n_val=0), run_dir=run_dir / "a", data={"train": bad}))
    val = [dict(b) for b in good]
    val[2] = {"x": val[2]["x"].astype(np.int32), "y": val[2]["y"]}
    with pytest.raises(jn.DataError, match=r"batch 2 of split 'val': field 'x'.*int32.*float32"):
        jn.train(nitro(Tiny(), run_dir=run_dir / "b", data={"train": good, "val": val}))
