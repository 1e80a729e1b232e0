"""The process layout (`jaxnitro._src.dist.layout`) in each cluster environment, faked with its
exact variables, and `jaxnitro env` printing it: nothing is started."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.clusters import LAYOUT_VARIABLES, PORT_BASE, fake

import jaxnitro as jn
from jaxnitro._src.cli import cli
from jaxnitro._src.dist.layout import resolve


@pytest.fixture
def environ(monkeypatch):
    """Apply a fake environment (every layout variable cleared first)."""
    for name in LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def apply(variables: dict[str, str]) -> None:
        for k, v in variables.items():
            monkeypatch.setenv(k, v)

    return apply


def env_output(*args: str) -> str:
    got = CliRunner().invoke(cli, ["env", *args])
    assert got.exit_code == 0, got.output
    return got.output


PORT = PORT_BASE + 123
CASES = {  # source: (process count, id, coordinator) for rank 1 of 2
    "slurm": (2, 1, f"localhost:{PORT}"),
    "openmpi": (2, 1, f"127.0.0.1:{PORT}"),
    "kubeflow": (2, 1, f"127.0.0.1:{PORT}"),
    "jaxjob": (2, 1, f"127.0.0.1:{PORT}"),
    "launch": (2, 1, f"127.0.0.1:{PORT}"),
}


@pytest.mark.parametrize("source", sorted(CASES))
def test_each_cluster_environment_resolves_with_its_source(environ, source):
    environ(fake(source, rank=1, nproc=2, port=PORT))
    n, pid, coordinator = CASES[source]
    layout = resolve()
    assert (layout.source, layout.num_processes, layout.process_id) == (source, n, pid)
    assert layout.coordinator_address == coordinator
    out = env_output()
    assert f"source:        {source}" in out
    assert "processes:     2\n" in out and "process id:    1\n" in out
    assert f"coordinator:   {coordinator}\n" in out
    as_dict = json.loads(env_output("--json"))
    assert as_dict["source"] == source and as_dict["coordinator_address"] == coordinator


def test_one_process_when_nothing_says_otherwise(environ):
    environ({})
    layout = resolve()
    assert (layout.source, layout.num_processes, layout.process_id) == ("single", 1, 0)
    assert layout.coordinator_address is None
    out = env_output()
    assert "source:        single" in out and "processes:     1" in out
    assert "local devices: all visible" in out


def test_explicit_values_win_and_the_rest_come_from_the_environment(environ):
    environ(fake("slurm", rank=1, nproc=2, port=PORT))
    layout = resolve(num_processes=4, process_id=3)
    assert (layout.source, layout.num_processes, layout.process_id) == ("explicit", 4, 3)
    assert layout.coordinator_address == f"localhost:{PORT}"  # from SLURM
    assert "the rest from slurm" in layout.notes
    out = env_output("--coordinator", "10.0.0.1:99", "--num-processes", "3", "--process-id", "2")
    assert "source:        explicit" in out and "coordinator:   10.0.0.1:99" in out
    assert "process id:    2" in out


def test_the_order_trainer_jaxjob_then_jaxs_detection_then_launch(environ):
    slurm = fake("slurm", rank=0, nproc=2, port=PORT)
    environ({**fake("launch", rank=1, nproc=2, port=1), **slurm})
    assert resolve().source == "slurm"  # JAX's detection before the launcher's variables
    environ(fake("jaxjob", rank=1, nproc=2, port=2))
    assert resolve().source == "jaxjob"
    environ(fake("kubeflow", rank=1, nproc=2, port=3))
    assert resolve().source == "kubeflow"


def test_slurm_one_task_per_node_drives_every_visible_gpu(environ):
    # The trap: JAX pins each SLURM task to the device numbered SLURM_LOCALID.
    environ(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_NODELIST": "gpu[003-004]",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        }
    )
    layout = resolve()
    assert layout.local_device_ids == [0, 1, 2, 3]
    assert layout.coordinator_address == f"gpu003:{77 + PORT_BASE}"
    out = env_output()
    assert "local devices: 0,1,2,3 (every device it sees: the only task on its node" in out


def test_slurm_several_tasks_per_node_share_the_visible_gpus(environ, monkeypatch):
    environ(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_NODELIST": "gpu003",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        }
    )
    assert resolve().local_device_ids == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # --gpus-per-task=1: bound per task
    assert resolve().local_device_ids == [0]
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "5")
    assert resolve().local_device_ids == [5]  # the user's word wins
    assert "local devices: 5 ($JAX_LOCAL_DEVICE_IDS)" in env_output()


def test_open_mpi_one_rank_per_node_drives_every_visible_gpu(environ):
    environ(
        {
            **fake("openmpi", rank=1, nproc=2, port=PORT),
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            "CUDA_VISIBLE_DEVICES": "0,1",
        }
    )
    assert resolve().local_device_ids == [0, 1]


def test_half_set_variables_name_what_is_missing(environ, monkeypatch):
    environ({"JAX_NUM_PROCESSES": "2"})
    with pytest.raises(jn.ConfigError, match=r"JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not"):
        resolve()
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    environ({"COORDINATOR_ADDRESS": "h", "NUM_PROCESSES": "2", "PROCESS_ID": "0"})
    with pytest.raises(jn.ConfigError, match=r"has no port and no port variable"):
        resolve()
    got = CliRunner().invoke(cli, ["env"])
    assert got.exit_code == 2 and "has no port" in got.output
    monkeypatch.delenv("COORDINATOR_ADDRESS")
    environ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(jn.ConfigError, match=r"process_id=2 with num_processes=2"):
        resolve()


def test_a_broken_slurm_environment_is_named(environ):
    environ({**fake("slurm", rank=0, nproc=2, port=PORT), "SLURM_NTASKS": "two"})
    with pytest.raises(jn.ConfigError, match=r"JAX detected slurm .* could not read the layout"):
        resolve()


def test_explicit_processes_without_a_coordinator_say_what_to_pass(environ):
    environ({})
    with pytest.raises(jn.ConfigError, match=r"num_processes=2 but no coordinator_address"):
        resolve(num_processes=2)
    with pytest.raises(jn.ConfigError, match=r"num_processes=2 but no process_id"):
        resolve("10.0.0.1:5", num_processes=2)
    assert resolve("10.0.0.1:5", 2, 1).source == "explicit"


def test_launch_removes_the_clusters_placement_from_its_ranks():
    from jaxnitro._src.dist import launcher

    base = {**fake("slurm", rank=3, nproc=4, port=PORT), "OTHER": "kept"}
    env = launcher.rank_env(base, rank=1, nproc=2, coordinator="h:1", devices_per_process=None)
    assert "SLURM_PROCID" not in env and "SLURM_LOCALID" not in env
    assert env["OTHER"] == "kept" and env["SLURM_JOB_ID"] == base["SLURM_JOB_ID"]


def test_a_kubernetes_job_is_read_through_jaxs_own_detection(environ, monkeypatch):
    # JAX's K8sCluster asks the API server (jax[k8s]); here its answers are given.
    from jax._src.clusters import K8sCluster

    environ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"})
    monkeypatch.setattr(K8sCluster, "is_env_present", classmethod(lambda cls: True))
    monkeypatch.setattr(
        K8sCluster,
        "get_coordinator_address",
        classmethod(lambda cls, timeout_secs, override_coordinator_port: "train-0.train:55527"),
    )
    monkeypatch.setattr(K8sCluster, "get_process_count", classmethod(lambda cls: 2))
    layout = resolve()
    assert (layout.source, layout.num_processes, layout.process_id) == ("k8s", 2, 1)
    assert layout.coordinator_address == "train-0.train:55527"
    assert layout.local_device_ids is None  # one pod, every device it sees
    assert "source:        k8s" in env_output()
