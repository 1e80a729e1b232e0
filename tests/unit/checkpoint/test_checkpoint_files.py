"""Checkpoint hardening: odd paths, non-finite values, shared directories, crafted or damaged
files on disk, bounded restores, full disks, and quiet reports of corrupted checkpoints."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnitro._src.checkpoint import format as ckformat
from jaxnitro._src.checkpoint import orbax_io, store
from jaxnitro._src.checkpoint.store import (
    TopKCheckpointer,
    load_checkpoint,
    read_manifest,
    validate_int,
    verify_checkpoint,
)
from jaxnitro._src.core.errors import CheckpointError, CheckpointWarning

FREE = r"\d+(\.\d)? [KMGTP]?i?B free"  # jaxnitro._src.core.units.format_bytes, then "free"


def _trees(step: int = 1):
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((16, 16)), jnp.float32),
            "bf16": jnp.asarray([1.0, -2.5, 3.25], jnp.bfloat16),
            "key": jax.random.key(step),
        },
        "opt": {"count": jnp.asarray(step, jnp.int32)},
    }


def _save(ck: TopKCheckpointer, step: int, **metrics) -> Path:
    metrics = metrics or {"val_loss": 1.0 / step}  # (retention keeps only the newest without one)
    return ck.save(
        epoch=step, step=step * 10, metrics=metrics, trees=_trees(step), meta={"note": step}
    )


def _bits(x) -> bytes:
    a = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()


def _truncate_data_files(ckpt: Path) -> None:
    for p in (ckpt / "arrays").rglob("*"):
        if p.is_file() and p.parent.name == "d":
            with open(p, "r+b") as fh:
                fh.truncate(p.stat().st_size // 2)


def _edit_meta(ckpt: Path, **changes) -> None:
    info = json.loads((ckpt / "meta.json").read_text())
    info.update(changes)
    (ckpt / "meta.json").write_text(json.dumps(info))


# -- 1. glob characters in the checkpoint path -----------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["sweep[lr=0.1]", "a**b", "back\\slash", "x{1,2}", "q?x"],
    ids=["brackets", "double-star", "backslash", "braces", "question"],
)
def test_glob_characters_in_the_directory_round_trip(tmp_path, monkeypatch, name):
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    ck = TopKCheckpointer(k=1, metric="val_loss", dir=tmp_path / name)
    first = _save(ck, 1, val_loss=0.5)
    second = _save(ck, 2, val_loss=0.1)  # retention removes the first
    assert not first.exists() and ck.best() == second == ck.latest_valid()
    trees, meta = load_checkpoint(second, {"params": _trees(2)["params"]})
    assert [_bits(x) for x in jax.tree.leaves(trees["params"])] == [
        _bits(x) for x in jax.tree.leaves(_trees(2)["params"])
    ]
    assert meta["note"] == 2 and verify_checkpoint(second)["step"] == 20
    assert list(private_tmp.iterdir()) == []  # the symlinks Orbax went through are gone


def test_a_write_that_does_not_read_back_is_refused_at_save(tmp_path, monkeypatch):
    ck = TopKCheckpointer(dir=tmp_path)
    real = orbax_io._orbax_layout
    monkeypatch.setattr(
        orbax_io, "_orbax_layout", lambda handler, where: {t: {} for t in real(handler, where)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"cannot write checkpoint .*epoch-0001-step-000010"
        r".*did not read back as written.*t0/l0",
    ):
        _save(ck, 1)
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp entry, nothing listed


# -- 2. non-finite metrics and meta ---------------------------------------------------------
def test_non_finite_values_in_meta_are_stored_as_null_and_never_best(tmp_path):
    ck = TopKCheckpointer(k=3, metric="acc", mode="max", dir=tmp_path)
    history = [{"epoch": 1, "train_loss": float("nan")}, {"epoch": 2, "train_loss": float("inf")}]
    nan = ck.save(
        epoch=1,
        step=1,
        metrics={"acc": float("nan")},
        trees={},
        meta={"history": history, "nested": {"x": (float("-inf"), 1.5)}},
    )
    assert nan.name.endswith("-acc=nan")
    assert ck.best() is None  # no finite score anywhere
    _, meta = load_checkpoint(nan)
    assert meta["history"][0]["train_loss"] is None and meta["nested"]["x"] == [None, 1.5]
    low = ck.save(epoch=2, step=2, metrics={"acc": 0.1}, trees={}, meta={})
    ck.save(epoch=3, step=3, metrics={"acc": float("inf")}, trees={}, meta={})
    assert ck.best() == low
    ck.mode = "min"  # a non-finite score is ranked after every finite one in both modes
    assert ck.best() == low


def test_a_nan_score_in_the_manifest_is_not_ranked(tmp_path):
    ck = TopKCheckpointer(k=1, metric="acc", mode="max", dir=tmp_path)
    good = ck.save(epoch=1, step=1, metrics={"acc": 0.5}, trees={}, meta={})
    text = (tmp_path / "manifest.json").read_text().replace('"acc": 0.5', '"acc": NaN')
    (tmp_path / "manifest.json").write_text(text)  # Python's json reads NaN
    assert ck.best() is None and ck.latest() == good


@pytest.mark.parametrize(("epoch", "step"), [(float("nan"), 1), (1, -3), ("x", 1)])
def test_counters_that_could_not_be_read_back_are_refused_at_save(tmp_path, epoch, step):
    with pytest.raises(CheckpointError, match=r"epoch and step must be ints >= 0.*epoch="):
        TopKCheckpointer(dir=tmp_path).save(epoch=epoch, step=step, metrics={}, trees={}, meta={})
    assert not [p for p in tmp_path.iterdir() if p.name != "manifest.json"]


# -- 3. temp cleanup: only dead writers' entries --------------------------------------------
def test_bind_removes_only_temp_entries_of_dead_processes(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    _save(ck, 1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f"epoch-0002-step-000020.tmp-{child.pid}"
        live.mkdir()
        (live / "meta.json").write_text("{}")  # a half-written checkpoint of a live writer
        live_json = tmp_path / f"manifest.json.tmp-{child.pid}"
        live_json.write_text("{")
        TopKCheckpointer(dir=tmp_path).bind(tmp_path)
        assert live.is_dir() and live_json.is_file()
    finally:
        child.kill()
        child.wait()
    TopKCheckpointer(dir=tmp_path).bind(tmp_path)
    assert not live.exists() and not live_json.exists()
    assert len(TopKCheckpointer(dir=tmp_path).records()) == 1


def test_a_temp_name_without_a_pid_is_never_deleted(tmp_path):
    TopKCheckpointer(dir=tmp_path).bind(tmp_path)
    notes = tmp_path / "foo.tmp-notes"
    notes.write_text("mine")
    with pytest.raises(CheckpointError, match="foo.tmp-notes"):
        TopKCheckpointer(dir=tmp_path).bind(tmp_path)
    TopKCheckpointer(dir=tmp_path).bind(tmp_path, writer=False)
    assert notes.read_text() == "mine"


def test_own_pid_entries_are_kept_while_written_and_cleaned_after(tmp_path):
    ck = TopKCheckpointer(dir=tmp_path)
    ck.bind(tmp_path)
    mine = tmp_path / f"epoch-0001-step-000010.tmp-{os.getpid()}"
    mine.mkdir()
    with ckformat.writing(mine):  # a write in progress in this process
        TopKCheckpointer(dir=tmp_path).bind(tmp_path)
        assert mine.is_dir()
    TopKCheckpointer(dir=tmp_path).bind(tmp_path)  # left by an earlier process with our pid
    assert not mine.exists()


def test_reader_bind_changes_nothing(tmp_path):
    missing = tmp_path / "not-yet"
    reader = TopKCheckpointer(dir=missing)
    reader.bind(tmp_path, writer=False)
    assert reader.records() == [] and reader.latest() is None and not missing.exists()
    ck = TopKCheckpointer(k=5, dir=tmp_path / "ck")
    first, second = _save(ck, 1), _save(ck, 2)
    (ck.dir / "x.tmp-999999999").mkdir()  # a dead writer's leftover
    _truncate_data_files(second)
    before = sorted(os.listdir(ck.dir))
    reader = TopKCheckpointer(dir=ck.dir)
    reader.bind(ck.dir, writer=False)
    with pytest.warns(CheckpointWarning, match="skipping corrupted"):
        assert reader.latest_valid() == first  # reported, not moved aside
    (ck.dir / "manifest.json").unlink()  # two orphans a writer would adopt
    assert reader.records() == [] and reader.best() is None
    assert sorted(os.listdir(ck.dir)) == sorted(set(before) - {"manifest.json"})
    with pytest.raises(CheckpointError, match="read-only"):
        _save(reader, 3)


# -- 4. foreign content ----------------------------------------------------------------------
def test_a_directory_with_foreign_files_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError) as info:
        TopKCheckpointer(dir=tmp_path).bind(tmp_path)
    msg = str(info.value)
    assert "'data/'" in msg and "'notes.txt'" in msg and "empty or new dir=" in msg
    assert (tmp_path / "notes.txt").exists()
    ck = TopKCheckpointer(dir=tmp_path)
    ck.bind(tmp_path, writer=False)  # reading is fine; a refused writer bind leaves it unbound
    with pytest.raises(CheckpointError, match="did not create"):
        ck.bind(tmp_path)
    with pytest.raises(CheckpointError, match="did not create"):
        _save(ck, 1)
    assert sorted(os.listdir(tmp_path)) == ["data", "notes.txt"]


def test_own_entries_and_empty_directories_are_accepted(tmp_path):
    TopKCheckpointer(dir=tmp_path / "empty").bind(tmp_path)
    (tmp_path / "empty2").mkdir()
    TopKCheckpointer(dir=tmp_path / "empty2").bind(tmp_path)
    ck = TopKCheckpointer(k=5, dir=tmp_path / "ck")
    _save(ck, 1)
    bad = _save(ck, 2)
    _truncate_data_files(bad)
    with pytest.warns(CheckpointWarning):
        ck.latest_valid()  # leaves '<name>.corrupt-0'
    (ck.dir / ".jaxnitro.lock").write_text("")
    (ck.dir / "x.tmp-1234567").mkdir()
    TopKCheckpointer(dir=ck.dir).bind(ck.dir)


# -- 5. crafted or damaged manifest.json ------------------------------------------------------
def test_crafted_manifest_rows_cannot_reach_outside_the_directory(tmp_path):
    root, victim = tmp_path / "ck", tmp_path / "victim"
    victim.mkdir()
    (victim / "sentinel").write_text("keep")
    (victim / "meta.json").write_text("{}")  # looks complete to a check of meta.json only
    ck = TopKCheckpointer(k=1, metric="val_loss", dir=root)
    first = _save(ck, 1, val_loss=0.5)
    [row] = read_manifest(root)
    evil = [
        dict(row, name=n, path=p, metrics={"val_loss": 9.0}, step=s)
        for n, p, s in [
            ("../victim", "../victim", 0),
            (str(victim), str(victim), 1),
            ("..", "../..", 2),
            ("ok-name", "../victim", 3),
            ("a\0b", "a\0b", 4),
            (7, 7, 5),
        ]
    ]
    (root / "manifest.json").write_text(
        json.dumps({"format_version": 1, "checkpoints": evil + [row]})
    )
    with pytest.warns(CheckpointWarning, match=r"ignoring 6 row\(s\).*not a plain entry"):
        assert read_manifest(root) == [row]
    ck2 = TopKCheckpointer(k=1, metric="val_loss", dir=root)
    with pytest.warns(CheckpointWarning, match="ignoring 6 row"):
        ck2.bind(root)  # the writer drops them from the manifest for good
    second, third = _save(ck2, 2, val_loss=0.9), _save(ck2, 3, val_loss=0.8)  # retention
    assert first.exists() and not second.exists()  # the best and the newest are kept
    _truncate_data_files(third)
    with pytest.warns(CheckpointWarning, match="skipping corrupted"):
        assert ck2.latest_valid() == first  # and the newest is quarantined
    assert sorted(os.listdir(victim)) == ["meta.json", "sentinel"]
    assert (victim / "sentinel").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["ck", "victim"]


def test_a_symlinked_row_is_dropped(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "outside"
    ck = TopKCheckpointer(dir=root)
    real = _save(ck, 1)
    outside.mkdir()
    (outside / "meta.json").write_text((real / "meta.json").read_text())
    (root / "link").symlink_to(outside, target_is_directory=True)
    [row] = read_manifest(root)
    manifest = {
        "format_version": 1,
        "checkpoints": [row, dict(row, name="link", path="link", step=99)],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match="'link'"):
        assert read_manifest(root) == [row]


_ROW = {"name": "a", "path": "a", "epoch": 0, "step": 0, "metrics": {}, "time": "t"}


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '{"checkpoints": {}}',
        '{"checkpoints": [1]}',
        json.dumps({"checkpoints": [dict(_ROW, step="x")]}),
        json.dumps({"checkpoints": [dict(_ROW, step=True)]}),
        json.dumps({"checkpoints": [dict(_ROW, metrics=[1])]}),
        json.dumps({"checkpoints": [{k: v for k, v in _ROW.items() if k != "epoch"}]}),
        '{"checkpoints": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"checkpoints": [',
        b"\xff\xfe".decode("latin-1"),
    ],
    ids=[
        "list",
        "rows-dict",
        "row-int",
        "step-str",
        "step-bool",
        "metrics-list",
        "no-epoch",
        "deep",
        "truncated",
        "bytes",
    ],
)
def test_a_damaged_manifest_is_a_checkpoint_error_and_rebuilt_by_the_writer(tmp_path, content):
    ck = TopKCheckpointer(k=5, dir=tmp_path)
    a, b = _save(ck, 1), _save(ck, 2)
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"manifest .*manifest.json is unreadable"):
        read_manifest(tmp_path)
    ck2 = TopKCheckpointer(k=5, dir=tmp_path)
    with pytest.warns(CheckpointWarning, match=r"manifest.json is unreadable.*rebuilt it"):
        ck2.bind(tmp_path)
    assert [r["name"] for r in ck2.records()] == [a.name, b.name]
    assert [r["name"] for r in read_manifest(tmp_path)] == [a.name, b.name]


# -- 6. meta.json validation -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epoch", 1e9),
        ("epoch", -1),
        ("epoch", True),
        ("step", "x"),
        ("metrics", {"acc": "high"}),
        ("metrics", [1]),
        ("meta", []),
        ("trees", {"params": {"index": "0"}}),
        ("time", 3),
    ],
)
def test_bad_meta_fields_are_named(tmp_path, field, value):
    path = _save(TopKCheckpointer(dir=tmp_path), 1, val_loss=0.5)
    _edit_meta(path, **{field: value})
    with pytest.raises(
        CheckpointError,
        match=rf"{path.name} is corrupted \(meta.json field "
        rf"'{field}[.a-z]*' must be",
    ):
        load_checkpoint(path)


def test_edited_meta_fails_its_record_hash(tmp_path):
    path = _save(TopKCheckpointer(dir=tmp_path), 1, val_loss=0.5)
    info = json.loads((path / "meta.json").read_text())
    assert len(info["record_sha256"]) == 64
    info["meta"]["note"] = 2
    (path / "meta.json").write_text(json.dumps(info))
    with pytest.raises(
        CheckpointError, match=r"corrupted \(meta.json does not match its record_sha256"
    ):
        verify_checkpoint(path)
    del info["record_sha256"]  # written before the hash existed: loads
    (path / "meta.json").write_text(json.dumps(info))
    assert verify_checkpoint(path)["note"] == 2


def test_validate_int_helper(tmp_path):
    assert validate_int({"n": 3}, "n", tmp_path) == 3
    assert validate_int({}, "n", tmp_path, default=0) == 0
    with pytest.raises(CheckpointError, match=r"field 'n' must be an int >= 1, got 0"):
        validate_int({"n": 0}, "n", tmp_path, minimum=1)
    with pytest.raises(CheckpointError, match=r"field 'n' must be an int >= 0, got None"):
        validate_int({}, "n", tmp_path)


# -- 7. bounded restore ----------------------------------------------------------------------
def test_a_store_larger_than_meta_says_is_refused_before_reading(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    path = TopKCheckpointer(dir=tmp_path).save(
        epoch=0, step=0, metrics={}, meta={}, trees={"p": {"w": jnp.zeros(2, jnp.float32)}}
    )
    shutil.rmtree(path / "arrays")
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:  # 64 MiB where meta says 8 B
        c.save(
            path / "arrays",
            args=ocp.args.StandardSave({"t0": {"l0": np.ones((4096, 4096), np.float32)}}),
        )

    def no_restore(*args, **kwargs):
        raise AssertionError("an array was read")

    monkeypatch.setattr(ocp.Checkpointer, "restore", no_restore)
    t0 = time.monotonic()
    for load in (load_checkpoint, verify_checkpoint):
        with pytest.raises(
            CheckpointError,
            match=r"corrupted \(its arrays do not match meta.json: "
            r"t0/l0: stored \(\(4096, 4096\), 'float32'\)",
        ):
            load(path)
    assert time.monotonic() - t0 < 5


def test_a_template_mismatch_is_reported_before_any_array_is_read(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    path = _save(TopKCheckpointer(dir=tmp_path), 1)
    calls = []
    monkeypatch.setattr(ocp.Checkpointer, "restore", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(ocp.Checkpointer, "metadata", lambda *a, **k: calls.append(a))
    wrong = {"params": {**_trees()["params"], "w": jnp.zeros((8, 16), jnp.float32)}}
    with pytest.raises(CheckpointError, match=r"(?s)does not match its template.*\(8, 16\)"):
        load_checkpoint(path, wrong)
    assert calls == []


def test_restored_leaves_are_host_numpy_with_their_dtypes(tmp_path):
    path = _save(TopKCheckpointer(dir=tmp_path), 3)
    plain, _ = load_checkpoint(path)
    leaves = plain["params"]
    assert all(isinstance(v, np.ndarray) for v in leaves.values())
    assert leaves["bf16"].dtype == jnp.bfloat16 and leaves["key"].dtype == np.uint32
    restored, _ = load_checkpoint(path, {"params": _trees()["params"]})
    assert jnp.issubdtype(restored["params"]["key"].dtype, jax.dtypes.prng_key)
    assert _bits(restored["params"]["key"]) == _bits(_trees(3)["params"]["key"])


# -- 8. write failures -----------------------------------------------------------------------
def test_a_full_disk_during_save_is_a_checkpoint_error(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    ck = TopKCheckpointer(dir=tmp_path)
    kept = _save(ck, 1)

    def full(*args, **kwargs):
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device")

    monkeypatch.setattr(ocp.Checkpointer, "save", full)
    with pytest.raises(CheckpointError) as info:
        _save(ck, 2)
    msg = str(info.value)
    assert "cannot write checkpoint" in msg and "epoch-0002-step-000020" in msg
    assert "RESOURCE_EXHAUSTED" in msg and re.search(FREE, msg) and "larger disk" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["manifest.json", kept.name])
    assert ck.latest() == kept


def test_interrupt_during_save_propagates_unchanged_and_cleans_up(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    ck = TopKCheckpointer(dir=tmp_path)
    ck.bind(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.Checkpointer, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save(ck, 1)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_the_json_writes_is_a_checkpoint_error(tmp_path, monkeypatch):
    ck = TopKCheckpointer(dir=tmp_path)
    ck.bind(tmp_path)
    real, failing = ckformat.write_json, set()

    def enospc(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def write_json(path, obj):  # the real writer, with fsync failing for the chosen file
        with monkeypatch.context() as m:
            if path.name in failing:
                m.setattr(os, "fsync", enospc)
            real(path, obj)

    for module in (orbax_io, store):  # meta.json is written by one, manifest.json by the other
        monkeypatch.setattr(module, "_write_json", write_json)
    failing.add("meta.json")
    with pytest.raises(
        CheckpointError, match=r"cannot write checkpoint .*epoch-0001.*\(OSError: \[Errno 28\]"
    ):
        _save(ck, 1)
    assert os.listdir(tmp_path) == []
    failing.clear()
    failing.add("manifest.json")  # the checkpoint is complete, its listing fails
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*manifest.json.*" + FREE):
        _save(ck, 2)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    failing.clear()
    ck2 = TopKCheckpointer(dir=tmp_path)
    ck2.bind(tmp_path)  # adopts the unlisted checkpoint
    assert [r["step"] for r in ck2.records()] == [20]


FSIZE_CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import jax.numpy as jnp, numpy as np
from jaxnitro._src.checkpoint.store import TopKCheckpointer
from jaxnitro._src.core.errors import CheckpointError
ck = TopKCheckpointer(dir=sys.argv[1])
ck.bind(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
w = jnp.asarray(np.random.default_rng(0).random(200_000), jnp.float32)
try:
    ck.save(epoch=0, step=1, metrics={}, trees={"p": {"w": w}}, meta={})
except CheckpointError as e:
    print("CHECKPOINT_ERROR", e)
else:
    print("SAVED")
"""


@pytest.mark.slow
def test_a_real_file_size_limit_is_a_checkpoint_error(tmp_path):
    if not hasattr(signal, "SIGXFSZ"):
        pytest.skip("no RLIMIT_FSIZE here")
    out = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    if "SAVED" in out.stdout:
        pytest.skip("the file size limit did not stop the write here")
    assert "CHECKPOINT_ERROR cannot write checkpoint" in out.stdout, out.stdout + out.stderr[-2000:]
    assert re.search(FREE, out.stdout)
    assert os.listdir(tmp_path / "ck") == []


# -- 9. quiet quarantine, lost meta.json --------------------------------------------------------
def test_a_corrupted_checkpoint_gives_one_short_warning_and_no_tracebacks(tmp_path, capfd):
    ck = TopKCheckpointer(k=5, metric="acc", dir=tmp_path)
    rng = np.random.default_rng(0)
    many = {
        "p": {f"w{i}": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for i in range(40)}
    }
    good = ck.save(epoch=1, step=1, metrics={"acc": 0.1}, trees=many, meta={})
    bad = ck.save(epoch=2, step=2, metrics={"acc": 0.2}, trees=many, meta={})
    _truncate_data_files(bad)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert ck.latest_valid() == good
        time.sleep(0.5)  # TensorStore callbacks that outlive the failed restore
        gc.collect()
    [w] = [r for r in rec if issubclass(r.category, CheckpointWarning)]
    msg = str(w.message)
    assert "tensorstore_spec" not in msg and len(msg) < 2 * len(str(bad)) + 400, msg
    assert "\n" not in msg and bad.name in msg and "corrupted" in msg
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err[:2000]


def test_a_listed_checkpoint_without_meta_is_reported_and_moved_aside(tmp_path):
    ck = TopKCheckpointer(k=5, dir=tmp_path)
    first, second = _save(ck, 1), _save(ck, 2)
    (second / "meta.json").unlink()
    reader = TopKCheckpointer(dir=tmp_path)
    reader.bind(tmp_path, writer=False)
    with pytest.warns(CheckpointWarning, match=rf"{second.name} in .* lost their meta.json") as rec:
        assert [r["name"] for r in reader.records()] == [first.name]
    assert len(rec) == 1 and second.is_dir()  # a reader moves nothing
    writer = TopKCheckpointer(dir=tmp_path)
    with pytest.warns(CheckpointWarning, match=r"moved aside to .*\.corrupt-0"):
        writer.bind(tmp_path)
    assert not second.exists() and (tmp_path / f"{second.name}.corrupt-0").is_dir()
    assert [r["name"] for r in read_manifest(tmp_path)] == [first.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert writer.latest() == first
