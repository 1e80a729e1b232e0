"""`Nitro(profile=(start, end))`: a `jax.profiler` trace of those optimizer steps.

The trace starts before the call that runs step `start + 1` is dispatched and stops once the
call that reaches step `end` has finished on the device; it is written under
`run_dir/profile/` (`plugins/profile/<time>/`: an `.xplane.pb` for XProf / TensorBoard's
profile plugin, and a `.trace.json.gz` that Perfetto opens). A window the run does not reach
(it stops first) is closed at the end of the epoch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax


class ProfileWindow:
    """Starts and stops the trace at dispatch boundaries: one comparison per dispatch."""

    def __init__(self, window: tuple[int, int] | None, run_dir: Path):
        self.window = window
        self.dir = Path(run_dir) / "profile"
        self.active = False
        self.done = window is None

    def before_dispatch(self, step: int) -> bool:
        """Before a call that starts at optimizer step count `step`; True: tracing began."""
        if self.done or self.active or self.window is None or step < self.window[0]:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
        self.active = True
        return True

    def after_dispatch(self, step: int, outputs: Any) -> bool:
        """After a call that reached step count `step`; True: the trace was written."""
        if not self.active or self.window is None or step < self.window[1]:
            return False
        return self.close(outputs)

    def close(self, outputs: Any = None) -> bool:
        """Stop an active trace (its last step finished first); True: one was written."""
        if not self.active:
            return False
        # the traced steps' execution is in the trace; a failed step (the error on its way
        # out of the epoch) still stops the trace, and its error is the one raised
        with contextlib.suppress(Exception):
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        return True
