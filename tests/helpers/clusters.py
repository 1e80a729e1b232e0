"""Cluster environments faked with their exact variables: what SLURM (`srun`), Open MPI
(`mpirun`), Kubeflow Trainer v2, a training-operator JAXJob and `jaxnitro launch` set for one
process, on localhost, so that 2 local processes can start a real run together."""

from __future__ import annotations

import os

#: Every variable any source reads: cleared before a fake environment is applied.
LAYOUT_VARIABLES = (
    "JAXNITRO_COORDINATOR",
    "JAXNITRO_NUM_PROCESSES",
    "JAXNITRO_PROCESS_ID",
    "JAXNITRO_LOCAL_DEVICE_IDS",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_LOCAL_DEVICE_IDS",
    "COORDINATOR_ADDRESS",
    "COORDINATOR_PORT",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)

#: JAX derives the SLURM and Open MPI coordinator port from the job id into this range.
PORT_BASE = 65535 - 2**12 + 1


def fake(source: str, *, rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables `source` sets for process `rank` of `nproc` on one node, its coordinator
    on 127.0.0.1:`port` (for slurm and openmpi `port` must lie in [PORT_BASE, 65535]: the job
    id is chosen so that JAX derives it)."""
    if source == "slurm":
        return {
            "SLURM_JOB_ID": str(port - PORT_BASE + 4096 * 7),  # JAX: id % 4096 + PORT_BASE
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": str(nproc),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": str(nproc),
        }
    if source == "openmpi":
        job = (port - PORT_BASE) * 4096  # JAX: (id // 4096) % 4096 + PORT_BASE
        return {
            "OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://127.0.0.1:41000",
            "OMPI_COMM_WORLD_SIZE": str(nproc),
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(nproc),
        }
    if source == "kubeflow":  # Trainer v2's jax plugin: the address carries the port too
        return {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_COORDINATOR_PORT": str(port),
            "JAX_NUM_PROCESSES": str(nproc),
            "JAX_PROCESS_ID": str(rank),
        }
    if source == "jaxjob":  # training-operator v1: the address without the port
        return {
            "COORDINATOR_ADDRESS": "127.0.0.1",
            "COORDINATOR_PORT": str(port),
            "NUM_PROCESSES": str(nproc),
            "PROCESS_ID": str(rank),
        }
    if source == "launch":
        return {
            "JAXNITRO_COORDINATOR": f"127.0.0.1:{port}",
            "JAXNITRO_NUM_PROCESSES": str(nproc),
            "JAXNITRO_PROCESS_ID": str(rank),
        }
    raise ValueError(source)


def environ_with(variables: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) without any layout variable, plus `variables`."""
    base = dict(os.environ) if base is None else base
    env = {k: v for k, v in base.items() if k not in LAYOUT_VARIABLES}
    env.update(variables)
    return env
