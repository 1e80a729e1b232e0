"""jax.export's compatibility window, as a bundle loader can check it.

jax.export guarantees that an artifact runs on a jaxlib built up to **6 months after** the
exporting one (backward compatibility) and up to **3 weeks before** it (forward
compatibility); the artifact records its calling-convention version and its flatbuffer
serialization version, and the runtime supports a range of each. A bundle records the
versions of the process that wrote it; `window_problem` compares them with this process's:

- a runtime jaxlib *older* than the exporter's is refused: 3 weeks of forward compatibility
  cannot be checked without build dates, so only the same or a newer jaxlib is accepted;
- a runtime more than one minor release newer (jax ships a minor release about every
  three months, so two minors are about the six-month window) is refused;
- a calling-convention or serialization version this runtime does not support is refused.

Every refusal can be overridden (``load_bundle(dir, allow_incompatible_jaxlib=True)``).
"""

from __future__ import annotations

import re

import jax
from jax import export

#: Minor releases a runtime may be ahead of the exporter (about six months of jax releases).
MINOR_RELEASES_AHEAD = 1


def serialization_version() -> int | None:
    """The flatbuffer schema version this jax writes (None if jax stops exposing it)."""
    try:
        from jax._src.export import serialization
    except ImportError:  # pragma: no cover - a jax that moved its internals
        return None
    version = getattr(serialization, "_SERIALIZATION_VERSION", None)
    return version if isinstance(version, int) else None


def versions() -> dict:
    """The versions a bundle records and a loader compares: jax, jaxlib, the serialization
    version and the supported calling-convention range."""
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "serialization_version": serialization_version(),
        "calling_convention_versions": [
            export.minimum_supported_calling_convention_version,
            export.maximum_supported_calling_convention_version,
        ],
    }


def _release(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version))
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def window_problem(recorded: dict, runtime: dict | None = None) -> str | None:
    """Why the bundle's recorded versions fall outside the runtime's window, or None.

    Example:
        >>> window_problem({"jaxlib": "0.10.2"}, {"jaxlib": "0.10.3"}) is None
        True
    """
    here = versions() if runtime is None else runtime
    made, run = _release(recorded.get("jaxlib", "")), _release(here.get("jaxlib", ""))
    if made is None:
        return f"the manifest records no readable jaxlib version ({recorded.get('jaxlib')!r})"
    if run is not None and run < made:
        return (
            f"this process has jaxlib {here['jaxlib']}, older than the jaxlib "
            f"{recorded['jaxlib']} that exported the bundle (jax.export guarantees only 3 "
            f"weeks of forward compatibility)"
        )
    if run is not None and (run[0] != made[0] or run[1] - made[1] > MINOR_RELEASES_AHEAD):
        return (
            f"this process has jaxlib {here['jaxlib']}, more than "
            f"{MINOR_RELEASES_AHEAD} minor release(s) newer than the jaxlib "
            f"{recorded['jaxlib']} that exported the bundle (beyond jax.export's 6-month "
            f"backward-compatibility window)"
        )
    return _format_problem(recorded, here)


def _format_problem(recorded: dict, here: dict) -> str | None:
    cc, (lo, hi) = recorded.get("calling_convention_version"), here["calling_convention_versions"]
    if isinstance(cc, int) and not lo <= cc <= hi:
        return f"the program uses calling convention {cc}; this jax supports {lo}..{hi}"
    made, run = recorded.get("serialization_version"), here.get("serialization_version")
    if isinstance(made, int) and isinstance(run, int) and made > run:
        return f"the program was serialized with schema version {made}; this jax reads up to {run}"
    return None


def platform() -> str:
    """This process's default platform as jax.export names it: cpu, cuda, rocm or tpu."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"
