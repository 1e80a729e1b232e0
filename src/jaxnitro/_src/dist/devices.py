"""Device selection and the 1-D `data` mesh every program is built for."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxnitro._src.core.errors import ConfigError, check_int
from jaxnitro._src.core.units import parse_bytes

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
    compilation_cache: str | os.PathLike | bool | None = None,
    compilation_cache_max_size: int | str | None = None,
) -> DeviceInfo:
    """Pick the backend (before the first `Nitro`) and pin how many devices runs use.

    Args:
        backend: "cpu", "gpu", "tpu"...; None keeps JAX's choice. Only before JAX has run.
        n_devices: how many devices each run's `data` mesh spans; None: 1.
        compilation_cache: JAX's persistent compilation cache, so a second process loads
            its programs instead of compiling them. None (the default): on, in
            ``$JAXNITRO_COMPILATION_CACHE`` if set (``0`` turns it off), else in the user
            cache directory (`default_cache_dir()`); a path: there; False: off.
        compilation_cache_max_size: the cache's size cap (bytes, or "2GiB"); the least
            recently used entries are evicted beyond it. Default 2 GiB (also from
            ``$JAXNITRO_COMPILATION_CACHE_MAX_SIZE``).

    Returns:
        A `DeviceInfo`: the backend, the devices it shows, the pinned count.

    Raises:
        ConfigError: JAX has already chosen another backend, or `n_devices` is not
            between 1 and the devices visible.

    Example:
        >>> info = jn.setup_devices(backend="cpu", n_devices=1, compilation_cache=False)
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
    configure_cache(compilation_cache, max_size=compilation_cache_max_size)
    visible = len(jax.devices())
    if n_devices is not None:
        _pinned["n_devices"] = _check_count(n_devices, visible)
    return DeviceInfo(jax.default_backend(), visible, _pinned.get("n_devices"))


#: The persistent cache's default size cap.
DEFAULT_CACHE_MAX_SIZE = 2 * 2**30
_OFF = ("0", "false", "off", "no")
_cache_state: dict = {}  # "dir": the directory in use (None: off), once decided


def apply_env() -> None:
    """Turn on the persistent cache as `setup_devices` would by default, unless it was
    already decided (by `setup_devices`, or by the user through JAX's own config)."""
    if "dir" not in _cache_state:
        configure_cache(None)


def default_cache_dir() -> str:
    """The platform's user cache directory for compiled programs: ``$XDG_CACHE_HOME`` (or
    ``~/.cache``) ``/jaxnitro/xla`` on Linux, ``~/Library/Caches/jaxnitro/xla`` on macOS,
    ``%LOCALAPPDATA%\\jaxnitro\\xla`` on Windows."""
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    elif os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "jaxnitro", "xla")


def cache_dir_choice(value: str | os.PathLike | bool | None = None) -> str | None:
    """The directory `compilation_cache=value` means (None: off): False is off, a path is
    that path, None (or True) is ``$JAXNITRO_COMPILATION_CACHE`` (``0``: off) or else
    `default_cache_dir()`."""
    if value is False:
        return None
    if value is None or value is True:
        env = os.environ.get("JAXNITRO_COMPILATION_CACHE", "").strip()
        if env.lower() in _OFF:
            return None
        return os.path.expanduser(env) if env else default_cache_dir()
    return os.path.expanduser(os.fspath(value))


def configure_cache(
    value: str | os.PathLike | bool | None, *, max_size: int | str | None = None
) -> str | None:
    """Point JAX's persistent compilation cache at `cache_dir_choice(value)` (or turn it
    off); returns the directory in use. A directory that is not private to this user is not
    used (a warning names it and the fix). A directory the user set through JAX's own
    config (`jax_compilation_cache_dir`) is left as it is when `value` is None."""
    user_set = getattr(jax.config, "jax_compilation_cache_dir", None)
    if value is None and user_set and _cache_state.get("dir") != user_set:
        _cache_state["dir"] = user_set  # the user's own JAX setting wins over our default
        return user_set
    path = cache_dir_choice(value)
    if path is not None and not _prepare_private(path):
        path = None
    size = _max_size(max_size)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_compilation_cache_max_size", size)
    from jaxnitro._src.compile import persistent

    persistent.use(path)  # its loads and compiles are recorded there at exit
    if _cache_state.get("dir", False) != path or _cache_state.get("size") != size:
        _reset_jax_cache()  # JAX decides once per process whether (and where) to cache
    _cache_state.update(dir=path, size=size)
    return path


def cache_in_use() -> str | None:
    """The persistent cache directory this process uses (None: off, or not decided yet)."""
    return _cache_state.get("dir")


def _max_size(value: int | str | None) -> int:
    if value is None:
        value = os.environ.get("JAXNITRO_COMPILATION_CACHE_MAX_SIZE") or DEFAULT_CACHE_MAX_SIZE
    return parse_bytes("compilation_cache_max_size", value, error=ConfigError)


def _reset_jax_cache() -> None:
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - a JAX without it has no cache to reset
        return
    compilation_cache.reset_cache()


def _prepare_private(path: str) -> bool:
    """Create `path` private to this user (0700, and so whatever of its parents is made),
    check every component on the way to it, and have JAX's cache there verify each entry;
    False (with a warning) when it is not safe to load programs from."""
    from jaxnitro._src.compile import cache_guard

    problems = cache_guard.prepare(path)
    if not problems and not cache_guard.guard(path):
        problems = [cache_guard.Problem("this JAX has no hook to verify its entries")]
    if problems:
        cache_guard.warn_not_used(path, problems)
        return False
    return True


def make_private_dir(path: str) -> list[str]:
    """Create the directory `path` (and what is missing above it) 0700 whatever the umask;
    the reasons others could change what it holds (empty: none), as `check_cache_trust`."""
    from jaxnitro._src.compile import cache_guard

    return [p.why for p in cache_guard.make_private(path)]


def check_cache_trust(path: str, *, warn: bool = True) -> list[str]:
    """The reasons others could plant programs in the compilation cache `path` (empty when
    it is private to this user); with `warn`, said once per directory.

    Entries are executables loaded byte for byte: whoever can write to the directory, or
    replace a directory on the way to it, can make this process compute something else.
    Every component of the path is checked (`jaxnitro._src.compile.cache_guard`).
    """
    from jaxnitro._src.compile import cache_guard

    problems = cache_guard.problems(path)
    if problems and warn:
        cache_guard.warn_not_used(path, problems)
    return [p.why for p in problems]


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
