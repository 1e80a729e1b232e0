"""What a resume continues from (`run/setup/rundir.py`): the checkpoint, the run's id and
seed, the loggers' state. Real checkpointers and run locks on tiny trees, no training: these
are the tests `make mutants` runs against the resume code (tests/README.md)."""

from __future__ import annotations

import re
import types
import warnings

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.run.setup.rundir import identity, read_meta, restore_loggers, resume_record


def services(run_dir):
    """The two services a resume reads: the run lock and a checkpointer, both real."""
    return types.SimpleNamespace(lock=RunLock(run_dir), checkpointer=jn.TopKCheckpointer())


def save(run_dir, step, **meta):
    ck = jn.TopKCheckpointer(k=5)
    ck.bind(run_dir)
    trees = {"params": {"w": np.full(3, float(step), np.float32)}}
    # (a val_loss, so Top-K retention keeps the older ones too)
    return ck.save(epoch=step, step=step, metrics={"val_loss": 1.0}, trees=trees, meta=meta)


def test_no_resume_is_a_fresh_run_even_with_checkpoints(tmp_path):
    save(tmp_path, 1)
    for resume in (False, None):
        assert resume_record(services(tmp_path), tmp_path, resume) is None


def test_auto_takes_the_newest_checkpoint_and_none_when_there_is_none(tmp_path):
    assert resume_record(services(tmp_path / "empty"), tmp_path / "empty", "auto") is None
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    assert resume_record(services(tmp_path), tmp_path, "auto") == newest
    assert resume_record(services(tmp_path), tmp_path, True) == newest


def test_auto_skips_a_corrupted_newest_checkpoint(tmp_path):
    older = save(tmp_path, 1)
    newest = save(tmp_path, 2)
    (newest / "meta.json").write_text("{ not json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resume_record(services(tmp_path), tmp_path, "auto") == older
    assert not newest.exists()  # moved aside, never considered again
    assert [p.name for p in newest.parent.glob(f"{newest.name}.corrupt-*")]


def test_resume_true_needs_a_checkpoint(tmp_path):
    with pytest.raises(jn.CheckpointError, match=r"resume=True but .* holds no checkpoint"):
        resume_record(services(tmp_path), tmp_path, True)


def test_the_lock_is_held_while_looking_and_released_after(tmp_path):
    save(tmp_path, 1)
    svc = services(tmp_path)
    resume_record(svc, tmp_path, "auto")
    other = RunLock(tmp_path)  # free again: a second writer can take it now
    assert other.try_acquire("test")
    other.release()
    held = RunLock(tmp_path)
    held.acquire("another run", what="run_dir")
    try:
        with pytest.raises(jn.RunLockedError):
            resume_record(services(tmp_path), tmp_path, "auto")
    finally:
        held.release()


def test_a_path_is_taken_as_given_made_absolute(tmp_path, monkeypatch):
    path = save(tmp_path, 1)
    monkeypatch.chdir(path.parent)
    for given in (str(path), path, path.name):
        got = resume_record(services(tmp_path / "other"), tmp_path / "other", given)
        assert got == path and got.is_absolute()
    with pytest.raises(jn.CheckpointError, match=r"resume='nope': no such checkpoint"):
        resume_record(services(tmp_path), tmp_path, "nope")
    with pytest.raises(jn.ConfigError, match=r"resume=3; use False, 'auto'"):
        resume_record(services(tmp_path), tmp_path, 3)


def test_a_fresh_run_gets_a_new_id_and_keeps_its_seed():
    (a, seed), (b, _) = identity(None, 7), identity(None, 7)
    assert seed == 7 and a != b and re.fullmatch(r"[0-9a-f]{12}", a)


def test_a_resume_keeps_the_checkpoints_id_and_seed(tmp_path):
    path = save(tmp_path, 1, run_id="run-A_1", seed=3)
    for given in (5, 1):  # a larger seed given, and a smaller one
        with pytest.warns(
            UserWarning, match=rf"resuming with seed 3 from the checkpoint instead of {given}"
        ):
            assert identity(path, given) == ("run-A_1", 3)
    big = save(tmp_path / "big", 1, run_id="r", seed=2**40)  # read back: another int object
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same seed: nothing to say
        assert identity(path, 3) == ("run-A_1", 3)
        assert identity(big, 2**40) == ("r", 2**40)


@pytest.mark.parametrize("bad", ["../x", "a" * 65, "", 12])
def test_an_unusable_saved_id_gives_a_new_one(tmp_path, bad):
    path = save(tmp_path, 1, run_id=bad)
    run_id, seed = identity(path, 4)
    assert run_id != bad and re.fullmatch(r"[0-9a-f]{12}", run_id) and seed == 4


def test_an_id_of_64_characters_is_kept(tmp_path):
    path = save(tmp_path, 1, run_id="b" * 64, seed=None)
    assert identity(path, 4) == ("b" * 64, 4)


def test_read_meta_is_the_users_meta(tmp_path):
    path = save(tmp_path, 1, note="warmup")
    assert read_meta(path)["note"] == "warmup"


class Stateful:
    def __init__(self):
        self.loaded = []

    def load_state_dict(self, state):
        self.loaded.append(state)


def test_a_resume_hands_the_loggers_their_saved_state(tmp_path):
    state = {"TensorBoardLogger": {"dir": "tb"}}
    path = save(tmp_path, 1, loggers=state)
    logger = Stateful()
    restore_loggers(types.SimpleNamespace(logger=logger), path)
    assert logger.loaded == [state]
    restore_loggers(types.SimpleNamespace(logger=logger), None)  # a fresh run: nothing
    restore_loggers(types.SimpleNamespace(logger=logger), save(tmp_path / "b", 1, loggers=[1]))
    assert logger.loaded == [state]  # not a dict: ignored
    restore_loggers(types.SimpleNamespace(logger=object()), path)  # no load_state_dict: fine
