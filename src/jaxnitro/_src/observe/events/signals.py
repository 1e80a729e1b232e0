"""Ctrl-C and SIGTERM during `jn.train`: stop after the current step, never mid-write.

The first Ctrl-C asks for a stop (the step finishes, validation and a checkpoint follow); a
second one aborts at once. SIGTERM (preemption) checkpoints the current step without
validating and ends the process, so that `resume="auto"` continues exactly where it stopped.

With several processes (`jax.distributed`), SIGTERM is left to JAX: its preemption notifier
tells every process, and `PreemptionSync` finds the step all of them stop at
(`multihost_utils.reached_preemption_sync_point`), so all checkpoint that same step and exit
143. A Python SIGTERM handler would hide the notice from the other processes, which would then
wait for the stopped one in their next collective. A Ctrl-C or `jn.request_stop` on any one
process becomes such a notice too (the run then ends as preempted, exit 143): a stop that only
one process knows of would leave the others waiting.

SIGUSR1 is SLURM's warning before the end of a job's time (``#SBATCH --signal=USR1@90``):
it stops the run exactly as SIGTERM does (one process: checkpoint and exit 143; several: the
process sends itself SIGTERM, so JAX's notifier makes every process stop at one step), and
the batch script requeues the job (``scontrol requeue``), whose ``resume="auto"`` continues.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading


class StopControl:
    """A run's stop request: set by Ctrl-C, SIGTERM or `jn.request_stop`, read by the loop
    after each dispatch."""

    def __init__(self) -> None:
        self.requested = False
        self.preempted = False

    def request(self, *, preempted: bool = False) -> None:
        if not preempted and _jax_preemption():
            # Several processes: a stop only this one knows of would leave the others
            # waiting for it; JAX's notifier makes it a stop all of them agree on.
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True
        self.preempted = self.preempted or preempted

    def clear(self) -> None:
        self.requested = self.preempted = False

    def begin(self) -> None:
        """A new `train` call: a stop asked for before it still counts, a preemption not."""
        self.preempted = False


def _jax_preemption() -> bool:
    """Whether JAX's preemption service runs here (several processes under jax.distributed),
    with its own SIGTERM handler installed."""
    from jax._src import distributed

    state = distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


class PreemptionSync:
    """The stop that every process of a multi-process run agrees on (inactive otherwise).

    `poll()` runs once per dispatch on every process (so the n-th call is the same step
    everywhere); when JAX's sync protocol says this is the step, the stop is requested as a
    preemption. (A stop asked for locally, `StopControl.request`, is a notice for all.)
    """

    _calls = 0  # per process, over the process's life: JAX's sync ids only increase

    def __init__(self, control: StopControl):
        self.control, self.active = control, _jax_preemption()

    def poll(self) -> None:
        if not self.active:
            return
        control = self.control
        from jax.experimental import multihost_utils

        PreemptionSync._calls += 1
        if multihost_utils.reached_preemption_sync_point(PreemptionSync._calls):
            control.request(preempted=True)


@contextlib.contextmanager
def graceful_stop(control: StopControl):
    """Install the handlers for the duration of a `train` call (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    shared = _jax_preemption()  # SIGTERM stays JAX's; Ctrl-C becomes a notice for all
    presses = [0]
    counter = _SignalCounter()

    def on_interrupt(signum, frame):
        # Two Ctrl-C during one long C call (an XLA compile) reach Python as one handler
        # call; the wakeup fd saw both, so count from it.
        presses[0] += max(1, counter.take(signal.SIGINT))
        if presses[0] > 1:
            signal.signal(signal.SIGINT, previous_int)
            raise KeyboardInterrupt
        if shared:
            control.request()  # (a notice to every process)
            print(
                "\nstopping all processes at a step they agree on (checkpoint, exit 143); "
                "Ctrl-C again to abort",
                file=sys.stderr,
                flush=True,
            )
            return
        control.request()
        print(
            "\nstopping after this step (validate, checkpoint); Ctrl-C again to abort",
            file=sys.stderr,
            flush=True,
        )

    def on_terminate(signum, frame):
        control.request(preempted=True)

    def on_time_warning(signum, frame):  # SIGUSR1: the scheduler's time is nearly up
        if shared:  # JAX's notifier tells every process: all stop at one step
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            control.request(preempted=True)

    previous_int = signal.signal(signal.SIGINT, on_interrupt)
    previous_usr1 = signal.signal(signal.SIGUSR1, on_time_warning)
    # (Python sees JAX's C handler as SIG_DFL: "restoring" it would remove it.)
    previous_term = None if shared else signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield
    finally:
        counter.close()
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGUSR1, previous_usr1)
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


class _SignalCounter:
    """Counts signals at the C level through `signal.set_wakeup_fd` (one byte per signal,
    even when Python runs the handler once for several). Inactive if a wakeup fd is in use
    (an event loop owns it): then each handler call counts one."""

    def __init__(self):
        self._r: socket.socket | None = None
        self._w: socket.socket | None = None
        self._pending: list[int] = []
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread after all
            r.close()
            w.close()
            return
        if old != -1:  # somebody else's: put it back
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self._r, self._w = r, w

    def take(self, signum: int) -> int:
        if self._r is None:
            return 0
        with contextlib.suppress(BlockingIOError, OSError):
            while True:
                data = self._r.recv(4096)
                if not data:
                    break
                self._pending.extend(data)
        count = self._pending.count(int(signum))
        self._pending = [s for s in self._pending if s != int(signum)]
        return count

    def close(self) -> None:
        if self._r is None:
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        self._r.close()
        if self._w is not None:
            self._w.close()
        self._r = self._w = None


class Preempted(SystemExit):
    """Raised by `jn.train` after SIGTERM: the run checkpointed its current step and stopped.

    A `SystemExit` with code 143 (the conventional SIGTERM status), so a script that does not
    catch it exits as terminated, while a notebook or a launcher can catch it and resume with
    ``resume="auto"``. `step` is the last step taken, `checkpoint` the checkpoint written,
    `resume` the call that continues from it; `str()` says all three (`jn.train` prints it
    as its last line).

    Example:
        >>> try:
        ...     jn.train(n)
        ... except jn.Preempted as p:
        ...     print("preempted at step", p.step, "saved to", p.checkpoint)
    """

    def __init__(self, step: int, checkpoint=None, *, where: str = "", resume: str = ""):
        super().__init__(143)
        self.step, self.checkpoint = step, checkpoint
        self.where = where or f"step {step}"
        self.resume = resume or "jn.Nitro(exp, run_dir=..., resume='auto')"

    def __str__(self) -> str:
        return (
            f"preempted (SIGTERM) at {self.where}; wrote checkpoint {self.checkpoint}. "
            f"Resume from it with {self.resume}."
        )


class SetupTerminated(BaseException):
    """SIGTERM arrived while `Nitro(...)` was setting up (a BaseException: nothing catches it
    by accident)."""


@contextlib.contextmanager
def terminate_during_setup():
    """During `Nitro(...)` setup, SIGTERM raises `SetupTerminated` so setup can log a finish
    line and exit 143, instead of the process dying with no trace. A handler someone else
    installed (a launcher, jax.distributed) is left alone."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        or _jax_preemption()  # JAX's own handler, which Python reports as SIG_DFL
    ):
        yield
        return

    def on_terminate(signum, frame):
        raise SetupTerminated

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
