"""Restoring a checkpoint under a progress bar: the arrays are read in parts, the bar counts
them with the bytes read, and what comes back is bitwise what one Orbax call reads."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny

import jaxnitro as jn
from jaxnitro._src.checkpoint import orbax_io
from jaxnitro._src.checkpoint.store import TopKCheckpointer, load_checkpoint


class _Bars:
    """A display's `bar` that records each bar: (label, total, lines, [(k, note), ...])."""

    def __init__(self):
        self.bars: list[tuple[str, int, bool, list]] = []

    @contextlib.contextmanager
    def __call__(self, label, total, *, lines=False):
        steps: list = []
        self.bars.append((label, total, lines, steps))
        yield lambda k=1, note="": steps.append((k, note))


def _trees():
    params = {f"layer{i}": {"w": jnp.full((16, 8), i, jnp.float32)} for i in range(6)}
    opt = optax.adam(1e-3)
    opt_state = opt.update(params, opt.init(params), params)[1]  # moments and a count
    misc = {"bf16": jnp.asarray([1.5, -2.0], jnp.bfloat16), "key": jax.random.key(3)}
    return {"params": params, "opt_state": opt_state, "misc": misc}


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.slow
def test_a_restore_under_a_bar_reads_in_parts_bitwise_like_one_call(tmp_path, monkeypatch):
    ck = TopKCheckpointer(dir=tmp_path / "ck")
    path = ck.save(epoch=1, step=10, metrics={}, trees=_trees(), meta={})
    whole, _ = load_checkpoint(path)
    monkeypatch.setattr(orbax_io, "_PART_BYTES", 1024)  # a few parts of a small checkpoint
    bars = _Bars()
    parts, meta = load_checkpoint(path, bar=bars)
    assert meta["step"] == 10
    for name in ("params", "opt_state"):
        assert _same(parts[name], whole[name]), name
    assert np.array_equal(
        jax.random.key_data(parts["misc"]["key"]), jax.random.key_data(whole["misc"]["key"])
    )
    [(label, total, lines, steps)] = bars.bars
    assert label == f"restoring {path.name}" and total > 2 and lines
    assert sum(k for k, _ in steps) == total  # the bar ends at its true count
    sizes = [re.fullmatch(r"([\d.]+) (KiB|B) of ([\d.]+) (KiB|B)", note) for _, note in steps]
    assert all(sizes), steps
    assert steps[-1][1].split(" of ")[0] == steps[-1][1].split(" of ")[1]  # all bytes read


def test_parts_are_bounded_in_number_and_keep_every_array_once(monkeypatch):
    target = {
        f"t{t}": {f"l{j}": jax.ShapeDtypeStruct((1000,), jnp.float32) for j in range(50)}
        for t in range(3)
    }  # 150 arrays of 4,000 bytes
    monkeypatch.setattr(orbax_io, "_PART_BYTES", 1)
    parts = orbax_io._parts(target)
    assert len(parts) <= orbax_io._MAX_PARTS
    seen = [(t, k) for part in parts for t, tree in part.items() for k in tree]
    assert sorted(seen) == sorted((t, k) for t in target for k in target[t])
    monkeypatch.setattr(orbax_io, "_PART_BYTES", 64 << 20)
    assert len(orbax_io._parts(target)) == 1  # a small checkpoint is read in one call


def test_a_damaged_part_is_reported_like_a_damaged_checkpoint(tmp_path, monkeypatch):
    ck = TopKCheckpointer(dir=tmp_path / "ck")
    path = ck.save(epoch=1, step=10, metrics={}, trees=_trees(), meta={})
    for f in (path / "arrays").rglob("*"):
        if f.is_file() and f.stat().st_size > 200 and "d" in f.parent.name:
            f.write_bytes(b"\0" * f.stat().st_size)  # the data files, not the metadata
    monkeypatch.setattr(orbax_io, "_PART_BYTES", 1024)
    with pytest.raises(jn.CheckpointError, match="corrupted|checksum"):
        load_checkpoint(path, bar=_Bars())


def test_a_resume_and_a_weights_load_show_the_restore_bar(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    jn.train(jn.Nitro(Tiny(max_epochs=1), run_dir=run, progress="plain"))
    capsys.readouterr()
    monkeypatch.setattr(orbax_io, "_PART_BYTES", 512)  # Tiny's ~2 KiB of state: a few parts
    n = jn.Nitro(Tiny(max_epochs=2), run_dir=run, resume="auto", progress="plain")
    shown = capsys.readouterr().out
    lines = re.findall(r"^restoring (epoch-\S+): (\d+)/(\d+) · (.+)$", shown, re.M)
    assert lines, shown
    name, done, total, note = lines[-1]
    assert done == total and int(total) > 1 and note.endswith(note.split(" of ")[0]), lines
    assert shown.index("restoring") < shown.index("resumed from")  # while setup restores
    assert n.progress.epoch == 1
    jn.Nitro(Tiny(), run_dir=tmp_path / "w", checkpoint=run, progress="plain")
    assert re.search(r"^restoring epoch-\S+: (\d+)/\1 · ", capsys.readouterr().out, re.M)


def test_a_small_checkpoint_adds_no_line_to_a_log(tmp_path, capsys):
    run = tmp_path / "run"
    jn.train(jn.Nitro(Tiny(max_epochs=1), run_dir=run, progress="plain"))
    capsys.readouterr()
    jn.Nitro(Tiny(max_epochs=2), run_dir=run, resume="auto", progress="plain")
    shown = capsys.readouterr().out
    assert "resumed from" in shown and "restoring" not in shown, shown
