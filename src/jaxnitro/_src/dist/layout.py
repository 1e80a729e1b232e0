"""Where a process stands in a run: how many processes, which one this is, where process 0
listens, which local devices it drives, and who said so (the *source*).

Tried in this order, first match wins (`resolve`):

1. ``explicit``: arguments given to `jn.distributed.initialize` (or `jaxnitro env`); fields
   left out are filled from the first environment below that has them.
2. ``kubeflow``: Kubeflow Trainer v2 (runtime ``jax-distributed``) sets
   ``JAX_COORDINATOR_ADDRESS``, ``JAX_COORDINATOR_PORT``, ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID``. JAX itself reads only the address, so a bare
   ``jax.distributed.initialize()`` fails there with "Number of processes must be defined".
3. ``jaxjob``: the training-operator's ``JAXJob`` sets ``COORDINATOR_ADDRESS``,
   ``COORDINATOR_PORT``, ``NUM_PROCESSES`` and ``PROCESS_ID``.
4. JAX's own cluster detection (``jax._src.clusters``, in JAX's order): ``openmpi``
   (``mpirun``), ``slurm`` (``srun``), ``tpu`` (Cloud TPU VMs), ``k8s`` (an Indexed Job or a
   JobSet, with ``pip install 'jax[k8s]'`` and RBAC to read pods and jobs).
   ``JAX_COORDINATOR_ADDRESS`` / ``JAX_COORDINATOR_PORT`` override the address it derives.
5. ``launch``: the variables ``jaxnitro launch`` sets for each rank (``JAXNITRO_COORDINATOR``,
   ``JAXNITRO_NUM_PROCESSES``, ``JAXNITRO_PROCESS_ID``).
6. ``single``: one process, no runtime to start.

Local devices. JAX's SLURM and Open MPI detection pins each process to the one device whose
index is its local rank (``SLURM_LOCALID``): with one task per node and several GPUs, each
process drives one GPU and leaves the others idle (jax#16788, #28194). Here a process drives
every visible device when it is the only task on its node, and an even share of them when
several tasks see the same devices; ``JAX_LOCAL_DEVICE_IDS`` or ``JAXNITRO_LOCAL_DEVICE_IDS``
(comma-separated) override both.

Nothing here starts JAX's backends or the runtime: `jaxnitro env` prints the result.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jaxnitro._src.core.errors import ConfigError

ENV_COORDINATOR = "JAXNITRO_COORDINATOR"
ENV_NUM_PROCESSES = "JAXNITRO_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXNITRO_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXNITRO_LOCAL_DEVICE_IDS"

#: The sources, in the order they are tried.
SOURCES = ("explicit", "kubeflow", "jaxjob", "openmpi", "slurm", "tpu", "k8s", "launch", "single")

#: The variables that place one process of a cluster's job. `jaxnitro launch` removes them
#: from its ranks' environment: inside a SLURM step or a pod they describe the launcher's own
#: task, not the ranks it starts.
CLUSTER_PLACEMENT_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "COORDINATOR_ADDRESS",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "JOB_COMPLETION_INDEX",
)

# JAX's cluster classes by our source names (JAX's own `name` is blank for some).
_JAX_CLUSTERS = {
    "OmpiCluster": "openmpi",
    "SlurmCluster": "slurm",
    "GkeTpuCluster": "tpu",
    "GceTpuCluster": "tpu",
    "K8sCluster": "k8s",
}
_VISIBLE = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The resolved place of this process in its run.

    `local_device_ids` is None when the process uses every device it sees; `devices_from`
    says why those devices (a variable, or the rule that chose them); `variables` names the
    environment variables the layout was read from.
    """

    source: str
    num_processes: int
    process_id: int
    coordinator_address: str | None
    local_device_ids: list[int] | None
    devices_from: str = "every device it sees"
    variables: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def init_args(self) -> dict[str, Any]:
        """The arguments of `jax.distributed.initialize` that start this layout."""
        return {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
            "local_device_ids": self.local_device_ids,
        }

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- reading variables ----------------------------------------------------------------------
def _int(env: Mapping[str, str], name: str, *, lowest: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer; set it to e.g. {name}=2.") from None
    if value < lowest:
        raise ConfigError(f"${name}={raw!r}; it must be an integer >= {lowest}.")
    return value


def _ids(env: Mapping[str, str], name: str) -> list[int] | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return [int(part) for part in raw.split(",")]
    except ValueError:
        raise ConfigError(
            f"${name}={raw!r} is not a comma-separated list of device ids; e.g. {name}=0,1."
        ) from None


def _with_port(address: str, port: str | None, *, what: str) -> str:
    """`address` with `port` appended when it has none (an address with a port keeps it)."""
    if ":" in address and address.rsplit(":", 1)[1].isdigit():
        return address
    if not port:
        raise ConfigError(
            f"{what}={address!r} has no port and no port variable says one; give host:port."
        )
    return f"{address}:{port}"


def check_address(address: str | None) -> None:
    if address is not None and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
        raise ConfigError(
            f"coordinator_address={address!r} has no port; give host:port of process 0, e.g. "
            f"'10.0.0.1:12355'."
        )


def _check_ids(n: int, pid: int, *, named: str) -> None:
    if n < 1:
        raise ConfigError(f"num_processes={n}; a run needs at least 1 process.")
    if not 0 <= pid < n:
        raise ConfigError(
            f"process_id={pid} with num_processes={n}: ids run from 0 to {n - 1}. Give each "
            f"process its own id ({named})."
        )


# -- the sources ----------------------------------------------------------------------------
def _kubeflow(env: Mapping[str, str]) -> Layout | None:
    if "JAX_NUM_PROCESSES" not in env:
        return None
    missing = [v for v in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID") if v not in env]
    if missing:
        raise ConfigError(
            f"$JAX_NUM_PROCESSES is set (Kubeflow Trainer's variables) but {', '.join(missing)} "
            f"not: set all of JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID."
        )
    address = _with_port(
        env["JAX_COORDINATOR_ADDRESS"],
        env.get("JAX_COORDINATOR_PORT"),
        what="$JAX_COORDINATOR_ADDRESS",
    )
    n, pid = _int(env, "JAX_NUM_PROCESSES", lowest=1), _int(env, "JAX_PROCESS_ID")
    _check_ids(n, pid, named="$JAX_PROCESS_ID")
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_PROCESSES")
    return Layout("kubeflow", n, pid, address, None, variables=tuple(v for v in names if v in env))


def _jaxjob(env: Mapping[str, str]) -> Layout | None:
    names = ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID")
    if not all(v in env for v in names):
        return None
    address = _with_port(
        env["COORDINATOR_ADDRESS"], env.get("COORDINATOR_PORT"), what="$COORDINATOR_ADDRESS"
    )
    n, pid = _int(env, "NUM_PROCESSES", lowest=1), _int(env, "PROCESS_ID")
    _check_ids(n, pid, named="$PROCESS_ID")
    used = (*names, "COORDINATOR_PORT") if "COORDINATOR_PORT" in env else names
    return Layout("jaxjob", n, pid, address, None, variables=used)


def _launch(env: Mapping[str, str]) -> Layout | None:
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    if ENV_NUM_PROCESSES not in env:
        return None
    n = _int(env, ENV_NUM_PROCESSES, lowest=1)
    missing = [v for v in names if v not in env]
    if missing:
        raise ConfigError(
            f"${ENV_NUM_PROCESSES} is set but {', '.join(missing)} not: set all of "
            f"{', '.join(names)} (jaxnitro launch sets them for each rank)."
        )
    pid = _int(env, ENV_PROCESS_ID)
    _check_ids(n, pid, named=f"${ENV_PROCESS_ID}")
    address = env[ENV_COORDINATOR]
    check_address(address)
    return Layout("launch", n, pid, address, None, variables=names)


def _jax_cluster(env: Mapping[str, str], timeout_s: int) -> tuple[Layout | None, list[str]]:
    """JAX's own detection, read through its cluster classes (in JAX's order; they read
    `os.environ`, which `env` is)."""
    from jax._src import clusters

    notes: list[str] = []
    for cluster in clusters.ClusterEnv._cluster_types:
        source = _JAX_CLUSTERS.get(cluster.__name__)
        if source is None or cluster.opt_in_only_method:
            continue
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                present = cluster.is_env_present()
            except Exception as e:  # noqa: BLE001 - e.g. k8s: no in-cluster config here
                notes.append(f"JAX's {source} detection failed: {type(e).__name__}: {e}")
                present = False
        notes += [str(w.message).replace("\n", " ") for w in said]
        if not present:
            continue
        try:
            if "JAX_COORDINATOR_ADDRESS" in env:
                address = _with_port(
                    env["JAX_COORDINATOR_ADDRESS"],
                    env.get("JAX_COORDINATOR_PORT"),
                    what="$JAX_COORDINATOR_ADDRESS",
                )
            else:
                address = cluster.get_coordinator_address(
                    timeout_secs=timeout_s,
                    override_coordinator_port=env.get("JAX_COORDINATOR_PORT"),
                )
            n, pid = int(cluster.get_process_count()), int(cluster.get_process_id())
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise ConfigError(
                f"JAX detected {source} ({', '.join(_VARIABLES.get(source, ()))}) but could "
                f"not read the layout from it: {type(e).__name__}: {e}. Fix the job's "
                f"variables, or pass coordinator_address, num_processes and process_id."
            ) from e
        _check_ids(n, pid, named=f"{source}'s process id")
        local = cluster.get_local_process_id() if source in ("slurm", "openmpi") else None
        ids, why = _share_of_devices(env, source, local)
        return (
            Layout(source, n, pid, address, ids, why, _VARIABLES.get(source, ()), tuple(notes)),
            notes,
        )
    return None, notes


_VARIABLES = {
    "slurm": (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    ),
    "openmpi": (
        "OMPI_MCA_orte_hnp_uri",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    "k8s": ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),
}


# -- local devices ----------------------------------------------------------------------------
def tasks_on_this_node(env: Mapping[str, str], source: str) -> int | None:
    """How many processes of the job run on this node (None: the scheduler does not say)."""
    if source == "openmpi":
        raw = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
        return int(raw) if raw.isdigit() else None
    if source != "slurm":
        return None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:  # e.g. "2(x3),1": 2 tasks on each of 3 nodes, then 1
        counts: list[int] = []
        for part in per_node.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m is None:
                return None
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        node = env.get("SLURM_NODEID", "0")
        index = int(node) if node.isdigit() else 0
        return counts[index] if index < len(counts) else None
    raw = env.get("SLURM_NTASKS_PER_NODE", "")
    return int(raw) if raw.isdigit() else None


def visible_devices(env: Mapping[str, str]) -> tuple[int | None, str]:
    """How many accelerators this process sees, and from where (None: unknown, or none)."""
    for name in _VISIBLE:
        raw = env.get(name)
        if raw is not None and raw.strip():
            return len([p for p in raw.split(",") if p.strip()]), f"${name}={raw}"
    found = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    if found:
        return len(found), f"{len(found)} /dev/nvidia* devices"
    return None, ""


def _share_of_devices(
    env: Mapping[str, str], source: str, local_rank: int | None
) -> tuple[list[int] | None, str]:
    """The local device ids of a SLURM or Open MPI task (see the module doc), and why."""
    for name in ("JAX_LOCAL_DEVICE_IDS", ENV_LOCAL_DEVICE_IDS):
        if (ids := _ids(env, name)) is not None:
            return ids, f"${name}"
    if local_rank is None:
        return None, "every device it sees"
    tasks = tasks_on_this_node(env, source)
    seen, where = visible_devices(env)
    every = list(range(seen)) if seen else None  # ordinals, as CUDA numbers what it shows
    if tasks == 1:
        return every, f"every device it sees: the only task on its node{_of(where)}"
    if tasks is not None and seen is not None:
        if seen < tasks:  # each task was given its own devices (e.g. --gpus-per-task)
            return every, f"every device it sees: {where}, bound per task"
        k = seen // tasks
        return (
            list(range(local_rank * k, (local_rank + 1) * k)),
            f"local rank {local_rank}'s {k} of {seen} visible devices: {where}, {tasks} tasks "
            f"on this node",
        )
    return [local_rank], f"local rank {local_rank}'s device: JAX's rule, one device per task"


def _of(where: str) -> str:
    return f", {where}" if where else ""


# -- the resolution -------------------------------------------------------------------------
def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    timeout_s: int = 300,
) -> Layout:
    """This process's `Layout`: the first source of the module doc's order that applies.

    Args:
        coordinator_address, num_processes, process_id, local_device_ids: explicit values
            (source ``explicit``); those left None come from the environment.
        timeout_s: how long JAX's Kubernetes detection waits for pod 0's address.

    Example:
        >>> from jaxnitro.distributed import resolve_layout
        >>> layout = resolve_layout()      # under srun: Layout(source='slurm', ...)
        >>> layout.source in ("single", "launch", "slurm")
        True
    """
    env = os.environ
    ids = [local_device_ids] if isinstance(local_device_ids, int) else local_device_ids
    given_ids = list(ids) if ids is not None else None
    found = _from_environment(env, timeout_s)
    if (coordinator_address, num_processes, process_id, given_ids) == (None, None, None, None):
        return found
    # Explicit: each given value wins; the others come from what the environment says.
    n = num_processes if num_processes is not None else found.num_processes
    pid = process_id if process_id is not None else found.process_id
    address = coordinator_address or found.coordinator_address
    if n > 1 and address is None:
        raise ConfigError(
            f"num_processes={n} but no coordinator_address, and no cluster or launcher says "
            f"it: pass coordinator_address='host:port' of process 0 and process_id=i too (or "
            f"run under `jaxnitro launch --nproc {n}`)."
        )
    if n > 1 and process_id is None and found.source == "single":
        raise ConfigError(
            f"num_processes={n} but no process_id, and no cluster or launcher says it: pass "
            f"process_id=i (0 ... {n - 1}), a different one in each process."
        )
    _check_ids(n, pid, named="process_id=")
    if n > 1:
        check_address(address)
    devices: list[int] | None
    if given_ids is not None:
        devices, devices_from = given_ids, "local_device_ids="
    else:
        devices, devices_from = found.local_device_ids, found.devices_from
    notes = (
        found.notes if found.source == "single" else (*found.notes, f"the rest from {found.source}")
    )
    return Layout("explicit", n, pid, address, devices, devices_from, found.variables, notes)


def _from_environment(env: Mapping[str, str], timeout_s: int) -> Layout:
    for read in (_kubeflow, _jaxjob):
        if (layout := read(env)) is not None:
            return _with_device_override(env, layout)
    layout, notes = _jax_cluster(env, timeout_s)
    if layout is not None:
        return layout
    if (layout := _launch(env)) is not None:
        return _with_device_override(env, dataclasses.replace(layout, notes=tuple(notes)))
    return _with_device_override(env, Layout("single", 1, 0, None, None, notes=tuple(notes)))


def _with_device_override(env: Mapping[str, str], layout: Layout) -> Layout:
    for name in ("JAX_LOCAL_DEVICE_IDS", ENV_LOCAL_DEVICE_IDS):
        if (ids := _ids(env, name)) is not None:
            return dataclasses.replace(layout, local_device_ids=ids, devices_from=f"${name}")
    return layout
