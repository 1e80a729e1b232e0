"""Log filters for Orbax: its INFO chatter, and the repeated reports a failed restore leaves
(asyncio futures, TensorStore's wake-ups of a closed event loop). Each drops exactly one kind
of record and passes every other on. Installed on import."""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any


class _QuietOrbax(logging.Filter):
    """Drop Orbax's INFO/WARNING chatter only, leaving every other absl user alone.

    Orbax logs through absl, whose Python logger is "absl" and whose records carry the real
    caller's file, so filtering on the path is precise and changes no global verbosity.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "orbax" not in record.pathname


class _QuietFailedRestore(logging.Filter):
    """A failed Orbax restore (a corrupted checkpoint, already reported as CheckpointError)
    leaves TensorStore futures whose exceptions asyncio logs again, at length, when they are
    collected. Drop exactly those records; every other asyncio message gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Future exception was never retrieved" not in str(record.msg):
            return True
        detail = str(record.msg) + str(record.exc_info[1] if record.exc_info else "")
        return "tensorstore_spec" not in detail


for _name, _filter in (("absl", _QuietOrbax), ("asyncio", _QuietFailedRestore)):
    if not any(isinstance(f, _filter) for f in logging.getLogger(_name).filters):  # reload-safe
        logging.getLogger(_name).addFilter(_filter())


class _DropClosedLoopNoise:
    """``sys.unraisablehook`` wrapper for one known-harmless report, passing all others on.

    When a restore fails, Orbax closes its event loop while TensorStore reads it started are
    still in flight; each, on finishing, wakes the closed loop (``call_soon_threadsafe``) and
    TensorStore reports the RuntimeError as unraisable: a traceback per array, sometimes after
    the restore returned. The failure itself is reported once, as a CheckpointError.
    """

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if (
            isinstance(exc, RuntimeError)
            and str(exc) == "Event loop is closed"
            and any(
                f.f_code.co_name == "call_soon_threadsafe"
                for f, _ in traceback.walk_tb(unraisable.exc_traceback)
            )
        ):
            return
        self.previous(unraisable)


def _quiet_closed_loop() -> None:
    if not isinstance(sys.unraisablehook, _DropClosedLoopNoise):
        sys.unraisablehook = _DropClosedLoopNoise(sys.unraisablehook)
