"""The epoch's frozen records: the tally of the steps read, the mid-epoch cadence, what a
`jn.start` handle asked (`run/commands.py`)."""

from __future__ import annotations

import dataclasses
import types
from concurrent.futures import Future

import pytest

from jaxnitro._src.run import commands
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.train.epoch import Cadence, Tally
from jaxnitro._src.train.steplines import Chunk


def test_a_tally_goes_on_from_the_progress_and_adds_chunks_in_step_order():
    start = Tally.of(Progress(epoch_loss=(1.0, 2), skipped_steps=3), 10.0)
    assert (start.loss_sum, start.loss_count, start.skipped, start.read_at) == (1.0, 2, 3, 10.0)
    losses = [0.1, 0.2, 0.3]
    after = start.add(Chunk(losses, 1), 11.0)
    total = 1.0
    for v in losses:  # one addition at a time, as the per-step path sums them
        total += v
    assert after.loss_sum == total and after.loss_count == 5 and after.skipped == 4
    assert after.read_at == 11.0 and after.train_loss == total / 5
    assert start.loss_count == 2  # the old record is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.skipped = 0  # type: ignore[misc]


def test_a_custom_step_without_a_loss_counts_its_steps_but_no_loss():
    tally = Tally.of(Progress(), 0.0).add(Chunk([None, None], 0), 1.0)
    assert tally.loss_count == 0 and tally.train_loss is None


def spec(val=None, ckpt=None, minutes=None):
    return types.SimpleNamespace(
        val_every=val, checkpoint_every=ckpt, checkpoint_every_minutes=minutes
    )


def test_the_cadence_is_due_when_a_call_crosses_a_multiple():
    cadence = Cadence.of(spec(val=4, ckpt=6))
    assert cadence.active
    assert cadence.due(2, 3) == (False, False)
    assert cadence.due(3, 4) == (True, False)
    assert cadence.due(5, 8) == (True, True)  # a fused call crossing both
    assert not Cadence.of(spec()).active


def test_a_checkpoint_by_minutes_restarts_the_cadence_it_returns():
    cadence = dataclasses.replace(Cadence.of(spec(minutes=1)), last=0.0)  # long ago
    assert cadence.due(0, 1) == (False, True)
    assert cadence.saved(False) is cadence
    after = cadence.saved(True)
    assert after.due(1, 2) == (False, False) and cadence.last == 0.0


def test_nothing_is_asked_of_a_run_no_handle_drives():
    n = types.SimpleNamespace(services=object())
    assert commands.at_boundary(n, 0) is None


def test_the_checkpoints_asked_get_the_path_or_the_error(tmp_path):
    futures = (Future(), Future())
    asked = commands.Asked(checkpoints=futures)
    asked.written(tmp_path)
    assert [f.result() for f in futures] == [tmp_path, tmp_path]
    failing = commands.Asked(checkpoints=(Future(),))
    failing.failed(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        failing.checkpoints[0].result()
