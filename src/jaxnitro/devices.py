"""Device selection and the 1-D `data` mesh every program is built for."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import ConfigError, check_int, warn_user

_pinned: dict = {}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What `setup_devices` chose: the backend, the devices it shows, the pinned count."""

    backend: str
    visible: int
    n_devices: int | None


def setup_devices(
    backend: str | None = None,
    n_devices: int | None = None,
    *,
    compilation_cache: str | os.PathLike | None = None,
) -> DeviceInfo:
    """Pick the backend (before the first `Nitro`) and pin how many devices runs use.

    Args:
        backend: "cpu", "gpu", "tpu"...; None keeps JAX's choice. Only before JAX has run.
        n_devices: how many devices each run's `data` mesh spans; None: 1.
        compilation_cache: a directory for JAX's persistent compilation cache (also from
            ``$JAXNITRO_COMPILATION_CACHE``), so a second process skips compiling.

    Example:
        >>> info = jn.setup_devices(backend="cpu", n_devices=1)
        >>> info.backend, info.n_devices
        ('cpu', 1)
    """
    if backend is not None:
        try:
            jax.config.update("jax_platforms", backend)
        except Exception as e:  # noqa: BLE001 - jax refuses once a backend is initialized
            raise ConfigError(
                f"cannot switch to backend {backend!r}: {e}. Call jn.setup_devices() before "
                f"anything touches JAX arrays (first thing in the script)."
            ) from e
    compilation_cache = compilation_cache or os.environ.get("JAXNITRO_COMPILATION_CACHE")
    if compilation_cache:
        _use_cache_dir(os.fspath(compilation_cache))
    visible = len(jax.devices())
    if n_devices is not None:
        _pinned["n_devices"] = _check_count(n_devices, visible)
    return DeviceInfo(jax.default_backend(), visible, _pinned.get("n_devices"))


def apply_env() -> None:
    """Turn on the persistent cache from $JAXNITRO_COMPILATION_CACHE if nothing else did."""
    path = os.environ.get("JAXNITRO_COMPILATION_CACHE")
    if path and not getattr(jax.config, "jax_compilation_cache_dir", None):
        _use_cache_dir(path)


def _use_cache_dir(path: str) -> None:
    """Turn on JAX's persistent cache in `path`, after checking who can write to it."""
    path = os.path.expanduser(path)
    check_cache_trust(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


_trust_warned: set = set()


def check_cache_trust(path: str) -> list[str]:
    """Warn (once per directory) when others could plant programs in the compilation cache.

    Entries are executables loaded byte for byte: whoever can write to the directory can make
    this process compute something else. Returns the problems found (empty when trusted).
    """
    import stat

    problems: list[str] = []
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:  # created later: check the parent
        p = os.path.dirname(p)
    try:
        st = os.stat(p)
    except OSError:
        return problems
    exists = p == os.path.abspath(path)  # else `p` is the parent it will be created in
    if exists and hasattr(os, "getuid") and st.st_uid != os.getuid():
        problems.append(f"it is owned by another user (uid {st.st_uid})")
    # A missing cache inside a sticky shared dir (/tmp) is created private to this user.
    shared_parent_ok = not exists and bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not shared_parent_ok:
        problems.append("it is world-writable")
    elif st.st_mode & stat.S_IWGRP and not shared_parent_ok:
        problems.append("it is group-writable")
    if problems and path not in _trust_warned:
        _trust_warned.add(path)
        warn_user(
            f"the compilation cache {path} is not private: {' and '.join(problems)}. Its "
            f"entries are executables loaded as they are, so anyone who can write there can "
            f"change what this process computes. Use a directory only you can write to "
            f"(chmod 700 {p}).",
        )
    return problems


def _check_count(n: int, visible: int) -> int:
    n = check_int("n_devices", n, fix="pass how many devices to train on, e.g. n_devices=1")
    if n > visible:
        raise ConfigError(
            f"n_devices={n} but only {visible} device(s) are visible on backend "
            f"{jax.default_backend()!r}. Use n_devices<={visible}, or on CPU start the process "
            f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}."
        )
    return n


def make_mesh(n_devices: int | None = None) -> Mesh:
    """A 1-D mesh named `data` over the first n devices (default: the pinned count, else 1)."""
    devices = jax.devices()
    # Several processes: every device of every process, unless told otherwise.
    default = 1 if jax.process_count() == 1 else len(devices)
    n = n_devices if n_devices is not None else _pinned.get("n_devices", default)
    n = _check_count(n, len(devices))
    check_spans_processes(devices[:n])
    return Mesh(np.asarray(devices[:n]), ("data",))


def check_spans_processes(devices) -> None:
    """Every process must own a device of the mesh (one without would have no part in the
    run's programs and wait forever for the others)."""
    count = jax.process_count()
    if count == 1:
        return
    have = {d.process_index for d in devices}
    missing = sorted(set(range(count)) - have)
    if missing:
        raise ConfigError(
            f"the mesh of {len(devices)} device(s) has none of process(es) {missing} (of "
            f"{count} processes, {len(jax.devices())} devices in all). Leave n_devices out "
            f"(every device of every process) or give a multiple of {jax.local_device_count()}."
        )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def mesh_id(mesh: Mesh) -> tuple:
    """Hashable identity of a mesh for compile keys."""
    return (mesh.axis_names, tuple(d.id for d in mesh.devices.flat), jax.default_backend())
