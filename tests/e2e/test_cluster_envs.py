"""Two local CPU processes started with only a cluster's own variables (SLURM, Open MPI,
Kubeflow Trainer v2, a training-operator JAXJob), faked on localhost, find each other through
`jn.distributed.initialize()`, train together over gloo, and end with the parameters of the
same run under `jaxnitro launch --nproc 2`."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys

import pytest
from helpers.clusters import PORT_BASE, environ_with, fake
from helpers.paths import TESTS
from helpers.procs import child_env

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
    procs = [
        subprocess.Popen(
            [sys.executable, RANK, tmp_path, tmp_path / "run"],
            env=environ_with(fake(source, rank=r, nproc=2, port=port), child_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    ranks = _ranks(tmp_path)
    assert [r["source"] for r in ranks] == [source, source]
    assert [r["processes"] for r in ranks] == [2, 2]
    assert [r["step"] for r in ranks] == [r["step"] for r in launched] == [4, 4]
    assert [r["source"] for r in launched] == ["launch", "launch"]
    assert ranks[0]["params"] == ranks[1]["params"] == launched[0]["params"]  # bit for bit
