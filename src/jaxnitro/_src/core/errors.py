"""Errors are part of the interface: each says what went wrong, why, and the fix."""

from __future__ import annotations

import difflib
import numbers
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any


class JaxnitroError(Exception):
    """Base class of every error jaxnitro raises on purpose."""


class ConfigError(JaxnitroError, ValueError):
    """An experiment definition or a `Nitro(...)` argument is invalid."""


class RunLockedError(ConfigError):
    """Another writer (a process or a handle) is using this run directory."""


class ConfigArgumentError(ConfigError, TypeError):
    """An experiment or a jaxnitro function got unknown, missing, positional or mistyped
    arguments (a TypeError as well, so ``except TypeError`` keeps working)."""


class HookError(JaxnitroError, TypeError):
    """A hook is missing, misspelled, has the wrong signature, or returned the wrong thing."""


class RoutingError(JaxnitroError, KeyError):
    """A hook names a batch field the batch does not have."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DataError(JaxnitroError, ValueError):
    """A batch or a data split is malformed."""


class MetricsError(JaxnitroError, ValueError):
    """A metrics hook returned something other than name -> (sum, count)."""


class CheckpointError(JaxnitroError, RuntimeError):
    """A checkpoint cannot be written, found, or loaded."""


class HostFieldError(JaxnitroError, AttributeError):
    """A Host field was read inside traced code."""


class ReadOnlyError(JaxnitroError, AttributeError):
    """Traced code assigned to an attribute of the experiment (read-only while tracing)."""


class NonFiniteLossError(JaxnitroError, FloatingPointError):
    """The training loss became NaN or infinite."""


def closest(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The candidate closest to `name` (a typo or an abbreviation of it), or None."""
    candidates = list(candidates)
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    if not matches and len(name) >= 3:  # 'accuracy' for 'acc': an abbreviation is close too
        matches = [
            c for c in candidates if len(c) >= 3 and (c.startswith(name) or name.startswith(c))
        ][:1]
    return matches[0] if matches else None


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to its first `limit` characters and how long it was, for echoing a value a
    caller sent in an error (an 8 MiB argument must not come back as an 8 MiB message).

    Example:
        >>> clip("x" * 1000, 5)
        'xxxxx…(1000 chars)'
    """
    return text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"


def did_you_mean(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str:
    """Return ' Did you mean 'x'?' for the closest candidate, or '' when none is close."""
    if len(name) > 200:  # a huge argument is no typo (and difflib is quadratic in it)
        return ""
    match = closest(name, candidates, cutoff=cutoff)
    return f" Did you mean {match!r}?" if match is not None else ""


MODES = ("min", "max")


def check_int(
    name: str, value: Any, *, minimum: int = 1, fix: str, error: type[Exception] = ConfigError
) -> int:
    """``value`` as an int >= ``minimum`` (numpy ints too, bools never), else ``error``.

    The message reads ``"<name> must be an int >= <minimum>, got <value>; <fix>."``, so
    ``name`` is the argument as the user spells it and ``fix`` says what to pass.

    Example:
        >>> check_int("TopKCheckpointer k", 3, fix="pass how many checkpoints to keep")
        3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise error(f"{name} must be an int >= {minimum}, got {value!r}; {fix}.")
    return int(value)


def check_mode(name: str, value: Any) -> str:
    """``value`` if it is "min" or "max", else a ConfigError with a did-you-mean.

    Example:
        >>> check_mode("EarlyStopping mode", "max")
        'max'
    """
    if value in MODES:
        return value
    hint = did_you_mean(str(value), MODES, cutoff=0.4)
    if not hint and isinstance(value, str):  # "lower", "decreasing", "higher", "greater"...
        low = value.lower()
        if low.startswith(("min", "low", "dec", "les")):
            hint = " Did you mean 'min'?"
        elif low.startswith(("max", "high", "inc", "gre")):
            hint = " Did you mean 'max'?"
    raise ConfigError(
        f"{name}={value!r} is invalid; valid modes are 'min', 'max' ('min' when lower is "
        f"better, e.g. a loss; 'max' when higher is better, e.g. accuracy).{hint}"
    )


class MemoryPlanError(JaxnitroError, MemoryError):
    """The compiled programs, with their buffers, do not fit the device's memory."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (e.g. corrupted) and an older one is used instead."""


# Where jaxnitro's own frames live (the package root, wherever in it this module sits), and
# the libraries a call may pass through on its way back out (contextlib around a `with`,
# click, pytest's runner, threading).
_PACKAGE = os.path.abspath(__file__)
for _ in __name__.split("."):
    _PACKAGE = os.path.dirname(_PACKAGE)
_PACKAGE = os.path.join(_PACKAGE, __name__.split(".")[0], "")
_LIBRARIES = tuple(
    sorted(
        {
            os.path.abspath(path) + os.sep
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (path := sysconfig.get_paths().get(key))
        }
    )
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` pointed at the user's line: the first frame outside jaxnitro and the
    libraries it calls through (with none, e.g. in a background thread or the CLI, the first
    frame outside jaxnitro), however deep in the package the warning is raised.

    Python 3.12's `skip_file_prefixes` does the first half; this also runs on 3.11.

    Example:
        >>> warn_user("split 'train': field 'x' is float64; ...")  # points at jn.Nitro(...)
    """
    outside = None
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: the frame that called this helper
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_PACKAGE):
            outside = outside or level
            if not (name.startswith(_LIBRARIES) or name.startswith("<frozen ")):
                break
        frame, level = frame.f_back, level + 1
    else:
        level = outside or 2
    warnings.warn(message, category, stacklevel=level)


class ExportError(JaxnitroError, ValueError):
    """`jn.export_model` refused or failed: the program cannot be served without Python
    (a host callback, an unstable custom call), a hook returned the wrong thing, or the
    written bundle did not reproduce `jn.predict` in a fresh process."""


class BundleError(JaxnitroError, ValueError):
    """`jn.load_bundle` cannot use a bundle: a file is missing, tampered with or outside
    the bundle, or the bundle's jaxlib is outside jax.export's compatibility window."""


class BundleInputError(BundleError):
    """A `Bundle` was called with inputs that do not match its manifest (names, dtypes,
    per-example shapes, batch size)."""
