"""Ctrl-C and SIGTERM during `jn.train`: stop after the current step, never mid-write.

The first Ctrl-C asks for a stop (the step finishes, validation and a checkpoint follow); a
second one aborts at once. SIGTERM (preemption) checkpoints the current step without
validating and ends the process, so that `resume="auto"` continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


@contextlib.contextmanager
def graceful_stop(n):
    """Install the handlers for the duration of a `train` call (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = [0]

    def on_interrupt(signum, frame):
        presses[0] += 1
        if presses[0] > 1:
            signal.signal(signal.SIGINT, previous_int)
            raise KeyboardInterrupt
        n.stop_requested = True
        print("\nstopping after this step (validate, checkpoint); Ctrl-C again to abort",
              file=sys.stderr, flush=True)

    def on_terminate(signum, frame):
        n.stop_requested = True
        n.preempted = True

    previous_int = signal.signal(signal.SIGINT, on_interrupt)
    previous_term = signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)
