"""Two local CPU processes started with only a cluster's own variables (SLURM, Open MPI,
Kubeflow Trainer v2, a training-operator JAXJob), faked on localhost, find each other through
`jn.distributed.initialize()`, train together over gloo, and end with the parameters of the
same run under `jaxnitro launch --nproc 2`."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys

import pytest
from helpers.clusters import PORT_BASE, environ_with, fake
from helpers.paths import TESTS
from helpers.procs import child_env, until

RANK = str(TESTS / "e2e" / "cluster_rank.py")


def _free_port_in_jaxs_range() -> int:
    """A free port where JAX puts a SLURM or Open MPI coordinator (it derives it from the job
    id, which the fake environment chooses)."""
    for port in random.sample(range(PORT_BASE, 65536), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in JAX's coordinator range")


def _ranks(out, nproc: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The reference: the same run under `jaxnitro launch --nproc 2`."""
    out = tmp_path_factory.mktemp("launch")
    got = subprocess.run(
        [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", RANK, out, out / "run"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return _ranks(out)


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("source", ["slurm", "openmpi", "kubeflow", "jaxjob"])
def test_two_processes_of_a_faked_cluster_train_like_jaxnitro_launch(launched, tmp_path, source):
    port = _free_port_in_jaxs_range()
    procs = _start(tmp_path, source, port)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    ranks = _ranks(tmp_path)
    assert [r["source"] for r in ranks] == [source, source]
    assert [r["processes"] for r in ranks] == [2, 2]
    assert [r["step"] for r in ranks] == [r["step"] for r in launched] == [4, 4]
    assert [r["source"] for r in launched] == ["launch", "launch"]
    assert ranks[0]["params"] == ranks[1]["params"] == launched[0]["params"]  # bit for bit


def _start(tmp_path, source: str, port: int, **extra: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, RANK, tmp_path, tmp_path / "run"],
            env=environ_with(fake(source, rank=r, nproc=2, port=port), child_env(**extra)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]


def _step(path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.multi_device
def test_sigusr1_to_a_slurm_jobs_tasks_stops_both_at_one_step_and_the_requeue_resumes(
    launched, tmp_path
):
    port = _free_port_in_jaxs_range()
    procs = _start(tmp_path, "slurm", port, CLUSTER_RANK_STEP_SECONDS="1")
    until(lambda: min(_step(tmp_path / f"progress{r}") for r in range(2)) >= 1, 240)
    for p in procs:  # SLURM signals every task of the job's steps
        p.send_signal(signal.SIGUSR1)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], "\n".join(o[-2000:] for o in outputs)
    cut = _ranks(tmp_path)
    assert [r["ended"] for r in cut] == ["preempted", "preempted"]
    assert cut[0]["step"] == cut[1]["step"] < 4 and cut[0]["checkpoint"] == cut[1]["checkpoint"]
    # The requeued job: the same command, resume="auto".
    procs = _start(tmp_path, "slurm", _free_port_in_jaxs_range())
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    resumed = _ranks(tmp_path)
    assert [r["step"] for r in resumed] == [4, 4]
    assert resumed[0]["params"] == launched[0]["params"]  # bit for bit
