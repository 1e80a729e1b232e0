"""Errors are part of the interface: each says what went wrong, why, and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class JaxnitroError(Exception):
    """Base class of every error jaxnitro raises on purpose."""


class ConfigError(JaxnitroError, ValueError):
    """An experiment definition or a `Nitro(...)` argument is invalid."""


class RunLockedError(ConfigError):
    """Another writer (a process or a handle) is using this run directory."""


class ConfigArgumentError(ConfigError, TypeError):
    """An experiment was constructed with unknown, missing or positional arguments."""


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


class NonFiniteLossError(JaxnitroError, FloatingPointError):
    """The training loss became NaN or infinite."""


def did_you_mean(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str:
    """Return ' Did you mean 'x'?' for the closest candidate, or '' when none is close."""
    candidates = list(candidates)
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    if not matches and len(name) >= 3:  # 'accuracy' for 'acc': an abbreviation is close too
        matches = [
            c for c in candidates if len(c) >= 3 and (c.startswith(name) or name.startswith(c))
        ][:1]
    return f" Did you mean {matches[0]!r}?" if matches else ""


class MemoryPlanError(JaxnitroError, MemoryError):
    """The compiled programs, with their buffers, do not fit the device's memory."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (e.g. corrupted) and an older one is used instead."""
