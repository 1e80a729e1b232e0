"""Many processes on JAX's own runtime (`jax.distributed`): start it, and talk through it.

`initialize` starts the runtime the way the launcher or the cluster describes it; the rest are
the few cross-process exchanges a run needs, all through the coordination service with a
timeout (never `sync_global_devices`, which has none): a value decided by process 0 and sent
to the others, a check that every process holds the same thing, and a named barrier.

Where the arguments of `initialize` come from is `jaxnitro._src.dist.layout`'s resolution (first
match wins): the arguments themselves; Kubeflow Trainer v2's variables; a training-operator
JAXJob's; JAX's own cluster detection (Open MPI, SLURM, Cloud TPU, a Kubernetes Indexed Job or
JobSet); the launcher's variables (``jaxnitro launch`` sets ``JAXNITRO_COORDINATOR``,
``JAXNITRO_NUM_PROCESSES``, ``JAXNITRO_PROCESS_ID`` for each rank; any other launcher can too,
and ``JAXNITRO_LOCAL_DEVICE_IDS``); else one process, with no runtime to start. `jaxnitro env`
prints the result without starting anything.

Timeouts (seconds) come from ``JAXNITRO_INIT_TIMEOUT`` (300), ``JAXNITRO_HEARTBEAT_TIMEOUT``
(100: how long a dead process goes unnoticed before the others are stopped) and
``JAXNITRO_BARRIER_TIMEOUT`` (600: the longest one process waits for the others at a barrier
or an exchange, e.g. while process 0 writes a checkpoint).

With several processes, each watches the others (`dist/peer_watch.py`): one that fails ends
the run everywhere at once, and one that falls silent is named before JAX aborts the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import distributed as _jd

from jaxnitro._src.core.errors import ConfigError, JaxnitroError
from jaxnitro._src.dist import layout as _layout
from jaxnitro._src.dist import peer_watch
from jaxnitro._src.dist.layout import ENV_COORDINATOR as ENV_COORDINATOR
from jaxnitro._src.dist.layout import ENV_LOCAL_DEVICE_IDS as ENV_LOCAL_DEVICE_IDS
from jaxnitro._src.dist.layout import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxnitro._src.dist.layout import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxnitro._src.dist.layout import Layout

__all__ = [
    "DistributedError",
    "barrier",
    "broadcast",
    "check_same",
    "initialize",
    "is_initialized",
    "process_count",
    "process_index",
]


class DistributedError(JaxnitroError):
    """The processes of a run could not agree: a peer is gone, late, or holds other data."""


_state: dict[str, Any] = {}  # the arguments `initialize` started the runtime with


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer; set it to e.g. {name}=2.") from None
    if value < 0:
        raise ConfigError(f"${name}={raw!r} is negative; set it to an integer >= 0.")
    return value


def resolve_args(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: int | Sequence[int] | None,
) -> dict[str, Any]:
    """The arguments for `jax.distributed.initialize` that `initialize` would pass: the
    resolved layout's (`jaxnitro._src.dist.layout.resolve`; one process: no coordinator)."""
    return _layout.resolve(
        coordinator_address, num_processes, process_id, local_device_ids
    ).init_args()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
) -> Layout:
    """Start JAX's distributed runtime for this process (first thing in the script).

    With no arguments, the layout is resolved in `jaxnitro._src.dist.layout`'s order: Kubeflow
    Trainer v2, a JAXJob, JAX's cluster detection (SLURM, Open MPI, Cloud TPU, a Kubernetes
    Indexed Job or JobSet), ``jaxnitro launch``'s variables, else one process (nothing is
    started). On CPU the processes talk through gloo. Calling it again with the same arguments
    does nothing; with others, or after JAX has already run a computation, it raises
    `ConfigError`.

    Args:
        coordinator_address: host:port of process 0's coordination service.
        num_processes: how many processes the run has.
        process_id: this process's index, 0 ... num_processes - 1.
        local_device_ids: which local accelerators this process uses (default: all it sees;
            under SLURM or Open MPI, its share of them).

    Returns:
        The `Layout` started, with its source (``slurm``, ``kubeflow``, ``launch``, ...).

    Example:
        >>> import jaxnitro as jn
        >>> jn.distributed.initialize()            # under jaxnitro launch, srun or a k8s Job
        >>> jn.Nitro(MyExp())                       # the mesh spans every process's devices
    """
    if _state:
        return _started_before(coordinator_address, num_processes, process_id, local_device_ids)
    timeout = _env_int("JAXNITRO_INIT_TIMEOUT") or 300
    found = _layout.resolve(
        coordinator_address, num_processes, process_id, local_device_ids, timeout_s=timeout
    )
    if jax.distributed.is_initialized():  # someone called jax.distributed.initialize itself
        _remember(found)
        _watch_peers()
        return found
    if found.coordinator_address is None:  # one process: no runtime to start
        _remember(found)
        return found
    _check_backends_untouched()
    _start_runtime(found, timeout)
    _remember(found)
    _watch_peers()
    return found


def _started_before(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: int | Sequence[int] | None,
) -> Layout:
    """The layout started already, when the arguments given agree with it; else
    `ConfigError` naming each that differs."""
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_ids": [local_device_ids]
        if isinstance(local_device_ids, int)
        else None
        if local_device_ids is None
        else list(local_device_ids),
    }
    clash = {k: (_state[k], v) for k, v in given.items() if v is not None and _state.get(k) != v}
    if clash:
        raise ConfigError(
            f"jn.distributed.initialize was already called with other arguments "
            f"(name: then → now): {clash}. Call it once, first thing in the script."
        )
    return _state["layout"]


def _start_runtime(found: Layout, timeout: int) -> None:
    """`jax.distributed.initialize` with the resolved layout (gloo for CPU collectives)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            **found.init_args(),
            # resolved above: JAX's detection would pin a SLURM task to one device again
            cluster_detection_method="deactivate",
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=_heartbeat_s(),
        )
    except (ValueError, RuntimeError) as e:
        raise ConfigError(
            f"cannot start the distributed runtime as process {found.process_id} of "
            f"{found.num_processes} with coordinator {found.coordinator_address} (from "
            f"{found.source}): {e}. If the coordinator port is in use, pick another (jaxnitro "
            f"launch picks a free one); `jaxnitro env` shows where each value comes from."
        ) from e


def _remember(found: Layout) -> None:
    _state.update(found.init_args())
    _state["layout"] = found


def _watch_peers() -> None:
    """Every process watches the others (`dist/peer_watch.py`): a failing process ends the
    run everywhere at once, and a silent one is named before JAX aborts."""
    peer_watch.start(
        _client(),
        me=jax.process_index(),
        count=jax.process_count(),
        heartbeat_s=_heartbeat_s(),
    )


def _heartbeat_s() -> int:
    return _env_int("JAXNITRO_HEARTBEAT_TIMEOUT") or 100


def _check_backends_untouched() -> None:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "jn.distributed.initialize must run before JAX starts its backends, but something "
            "already used JAX (jax.devices(), an array, jn.setup_devices() or a jn.Nitro). "
            "Call jn.distributed.initialize() first thing in the script, right after the "
            "imports."
        )


def is_initialized() -> bool:
    """Whether this process runs under `jax.distributed` (started here or by the user)."""
    return bool(jax.distributed.is_initialized())


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


# -- exchanges through the coordination service ---------------------------------------------
def _client():
    return _jd.global_state.client


def timeout_ms() -> int:
    return 1000 * (_env_int("JAXNITRO_BARRIER_TIMEOUT") or 600)


_sequence: dict[str, int] = {}


def _key(name: str) -> str:
    """A key unique to this exchange: the processes of a run make the same exchanges in the
    same order, so the n-th exchange of `name` is the same one on every process."""
    n = _sequence[name] = _sequence.get(name, -1) + 1
    return f"jaxnitro/{name}/{n}"


def _waited(what: str, e: Exception) -> DistributedError:
    return DistributedError(
        f"{what}: {str(e).splitlines()[0][:300]}. Another process of this run stopped, failed "
        f"or is stuck (its own output says why); $JAXNITRO_BARRIER_TIMEOUT sets how long to "
        f"wait ({timeout_ms() // 1000}s)."
    )


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (a `DistributedError` after the
    barrier timeout). One process: nothing to wait for."""
    if jax.process_count() == 1:
        return
    key = _key(name)
    try:
        _client().wait_at_barrier(key.replace("/", "_"), timeout_ms())
    except Exception as e:  # noqa: BLE001 - a JaxRuntimeError (DEADLINE_EXCEEDED, ...)
        raise _waited(f"process {jax.process_index()} waited for the others at {name!r}", e) from e


def broadcast(name: str, value: Any = None) -> Any:
    """Process 0's JSON-able `value`, on every process (the others' `value` is ignored)."""
    if jax.process_count() == 1:
        return value
    key, client = _key(name), _client()
    if jax.process_index() == 0:
        client.key_value_set(key, json.dumps(value))
        return value
    try:
        return json.loads(client.blocking_key_value_get(key, timeout_ms()))
    except Exception as e:  # noqa: BLE001
        raise _waited(f"process {jax.process_index()} waited for process 0's {name!r}", e) from e


def decided_by_process_zero(name: str, decide: Callable[[], Any]) -> Any:
    """`decide()` run on process 0 only, its JSON-able result sent to every process. An error
    there is raised on every process (the others' as a `DistributedError` quoting it), so no
    process waits for an answer that never comes."""
    if jax.process_count() == 1:
        return decide()
    if jax.process_index() == 0:
        try:
            value = decide()
        except BaseException as e:
            broadcast(name, {"error": f"{type(e).__name__}: {e}"})
            raise
        broadcast(name, {"value": value})
        return value
    got = broadcast(name)
    if "error" in got:
        raise DistributedError(f"process 0 failed ({name}): {got['error']}")
    return got["value"]


def gather(name: str, value: Any) -> list[Any]:
    """Every process's JSON-able `value`, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    key, client, me = _key(name), _client(), jax.process_index()
    client.key_value_set(f"{key}/{me}", json.dumps(value))
    out = []
    for p in range(jax.process_count()):
        if p == me:
            out.append(value)
            continue
        try:
            out.append(json.loads(client.blocking_key_value_get(f"{key}/{p}", timeout_ms())))
        except Exception as e:  # noqa: BLE001
            raise _waited(f"process {me} waited for process {p}'s {name!r}", e) from e
    return out


def check_same(name: str, value: Any, *, what: str, fix: str) -> None:
    """Raise `DistributedError` on every process unless all hold the same JSON-able `value`;
    the message names this process's value and the first differing one."""
    values = gather(name, value)
    me = jax.process_index()
    mine = json.loads(json.dumps(value))
    for p, other in enumerate(values):
        if other != mine:
            raise DistributedError(
                f"{what} differs between processes: process {me} has {_show(mine)}, process "
                f"{p} has {_show(other)}. {fix}"
            )


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."
