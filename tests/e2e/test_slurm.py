"""A real SLURM (`tools/slurm_local.sh`: slurmctld, slurmd and munge on this machine) runs
`examples/slurm/train.sbatch` with 2 CPU tasks: SIGUSR1 mid-run makes both tasks checkpoint
one step and exit 143, the script requeues the job, and the requeued job resumes to the
parameters of `jaxnitro launch --nproc 2` of the same run, bit for bit.

Skipped where `sbatch` is missing or no node takes jobs (the reason says how to start one).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers.clusters import LAYOUT_VARIABLES
from helpers.paths import ROOT, TESTS
from helpers.procs import child_env, until

RANK = str(TESTS / "e2e" / "cluster_rank.py")
SBATCH = str(ROOT / "examples" / "slurm" / "train.sbatch")
# The example asks for 2 nodes x 4 GPUs; this machine has one node with 2 CPUs.
ON_THIS_MACHINE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1"]


@functools.cache
def _slurm_here() -> str | None:
    """Why SLURM cannot run a job here (None: it can). Asked once: every collection of the
    suite asks, and a `sinfo` with no controller to reach waits ~9 s before it says so."""
    missing = [c for c in ("sbatch", "srun", "sinfo", "scontrol", "scancel") if not shutil.which(c)]
    if missing:
        return f"no {', '.join(missing)} here (sudo tools/slurm_local.sh install && start)"
    try:  # a controller on this machine answers at once
        got = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=3)
    except subprocess.TimeoutExpired:
        return (
            "SLURM's controller did not answer sinfo in 3 s; start one with sudo "
            "tools/slurm_local.sh start"
        )
    if got.returncode != 0 or not {"idle", "mix"} & set(got.stdout.split()):
        return (
            f"SLURM has no idle node ({(got.stdout + got.stderr).strip()[:200]!r}); start one "
            "with sudo tools/slurm_local.sh start"
        )
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.multi_device,
    pytest.mark.skipif(_slurm_here() is not None, reason=str(_slurm_here())),
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in child_env(**extra).items() if k not in LAYOUT_VARIABLES}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env  # sbatch and srun pass it on to the tasks (--export=ALL)


def _job(job: str) -> dict[str, str]:
    """`scontrol show job` as a dict ({} once the job is gone)."""
    got = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    fields = {}
    for part in got.stdout.split():
        key, _, value = part.partition("=")
        fields[key] = value
    return fields


def _final_state(job: str, seen: list[str]) -> str | None:
    """The job's final state once it has one (None meanwhile); `seen` collects its states.
    (SLURM holds a requeued job back until its old credential expires: 20 s with
    tools/slurm_local.sh, 120 s by default.)"""
    state = _job(job).get("JobState", "GONE")
    if not seen or seen[-1] != state:
        seen.append(state)
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE") else None


def test_srun_tasks_resolve_their_layout_from_slurm():
    got = subprocess.run(
        [
            "srun",
            "--ntasks=2",
            "--cpus-per-task=1",
            sys.executable,
            "-m",
            "jaxnitro",
            "env",
            "--json",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    decoder, text, layouts = json.JSONDecoder(), got.stdout.strip(), []
    while text:
        layout, end = decoder.raw_decode(text)
        layouts.append(layout)
        text = text[end:].strip()
    assert sorted(x["process_id"] for x in layouts) == [0, 1]
    assert {x["source"] for x in layouts} == {"slurm"} and {
        x["num_processes"] for x in layouts
    } == {2}
    assert len({x["coordinator_address"] for x in layouts}) == 1


def test_sbatch_example_requeues_on_sigusr1_and_resumes_like_jaxnitro_launch(tmp_path):
    ref = tmp_path / "launch"
    ref.mkdir()
    got = subprocess.run(
        [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", RANK, ref, ref / "run"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    straight = json.loads((ref / "rank0.json").read_text())

    out = tmp_path / "slurm"
    out.mkdir()
    log = out / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", *ON_THIS_MACHINE, f"--output={log}", f"--chdir={tmp_path}"]
        + [SBATCH, RANK, str(out), str(out / "run")],
        env=_env(CLUSTER_RANK_STEP_SECONDS="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    seen: list[str] = []  # the job's states, in order
    try:
        # Mid-run, SIGUSR1 to every task: what --signal=USR1@90 does before the time limit.
        until(lambda: (out / "progress0").exists() and (out / "progress1").exists(), 300)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        until(lambda: _job(job).get("Restarts") == "1", 120)  # the script requeued it
        cut = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert [r["ended"] for r in cut] == ["preempted", "preempted"]
        assert cut[0]["step"] == cut[1]["step"] < 4 and cut[0]["source"] == "slurm"
        states = until(lambda: _final_state(job, seen), 400)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    text = log.read_text()
    assert states == "COMPLETED", (seen, text[-3000:])
    assert "start 1 on" in text and "start 2 on" in text, text[-3000:]
    assert 'preempted (exit 143): requeued; resume="auto" continues' in text
    resumed = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["ended"] for r in resumed] == ["completed", "completed"], text[-3000:]
    assert [r["step"] for r in resumed] == [4, 4] and resumed[0]["source"] == "slurm"
    assert resumed[0]["params"] == resumed[1]["params"] == straight["params"]  # bit for bit
