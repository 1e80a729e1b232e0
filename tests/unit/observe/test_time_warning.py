"""SIGUSR1, SLURM's warning that a job's time is nearly up (`#SBATCH --signal=USR1@90`),
stops `jn.train` as a preemption does: the current step is checkpointed, `jn.Preempted`
(exit 143) is raised, and `resume="auto"` continues bit for bit."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import Tiny, leaves_equal, nitro

import jaxnitro as jn


@pytest.mark.slow
def test_sigusr1_checkpoints_the_step_and_resume_continues_exactly(tmp_path):
    n = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "cut")

    def warn(record):
        if record.step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    jn.every(1, warn, nitro=n)
    with pytest.raises(jn.Preempted) as got:
        jn.train(n)
    assert got.value.code == 143 and got.value.step == 3
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # put back after train
    resumed = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "cut", resume="auto")
    assert resumed.step == 3
    jn.train(resumed)
    straight = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "straight")
    jn.train(straight)
    assert resumed.step == straight.step == 16
    assert leaves_equal(resumed.params, straight.params)
