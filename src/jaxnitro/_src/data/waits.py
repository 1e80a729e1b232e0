"""Waiting for data: the time the device sat idle because the next batch was not ready.

Dispatch is asynchronous: the loop hands a step to the device and asks for the next batch
while that step still runs. The time the loop spends in that ask is a wait for data only
from the moment the device has finished; before that, the batch is prepared in the device's
shadow and costs the run nothing. So a feed asks `in_flight()` for an output of the last
dispatched step (None: nothing in flight, the device is idle) and counts:

- for a source that only blocks (the prefetch queue, a transform worker's reply): a watcher
  thread notes when the step's outputs become ready (`blocking`), and the wait is the
  time after that. Exact, and the loop is not held: a batch that comes before the step ends
  is dispatched at once, behind it.
- for a batch prepared in this thread (slicing arrays, a transform with workers=0, a plain
  iterable), which runs alongside the device: the whole time when the device was idle as it
  began; none when the step is still running after it; and the whole time, an upper bound,
  when the step ended in between (when exactly is not known without a thread watching it).
  Steps end in order, so that is the whole time exactly when the step has ended by the time
  the batch is ready: a source that never blocks (the row indices of arrays kept on the
  device) is asked once, after (`WaitClock.work`).

`data_wait_frac` is that time over the epoch's. Without this, a loop that merely waits out the
device's step in the data source reported the step's time as data wait.
"""

from __future__ import annotations

import atexit
import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_ASK: contextvars.ContextVar[_Ask | None] = contextvars.ContextVar("jaxnitro_ask", default=None)


def blocking() -> None:
    """For a source about to block on work done elsewhere (a worker's reply): from here on
    the ask is a wait, once the device's step has ended (the watcher notes when). Outside
    an ask (another thread, no run) it does nothing."""
    ask = _ASK.get()
    if ask is not None:
        ask.watch()


def _ready(token: Any) -> bool:
    return token is None or not hasattr(token, "is_ready") or token.is_ready()


class _Ask:
    __slots__ = ("token", "device_done", "watched", "over")

    def __init__(self, token):
        self.token = token  # an output of the step in flight; None: the device is idle
        self.device_done: float | None = None  # when the watcher saw the step end
        self.watched = False
        self.over = False  # the ask has returned: the watcher need not wait on it

    def watch(self) -> None:
        if not self.watched and self.token is not None:
            self.watched = True
            _Watcher.get().asks.put(self)


class _Watcher:
    """One daemon thread noting when the steps handed to it end (their outputs ready)."""

    _one: _Watcher | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.asks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="jaxnitro-wait-watch", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """At exit: let the thread finish the wait it is in, then end. A daemon thread still
        inside XLA's wait when Python finalizes is unwound through C++ frames that do not
        rethrow, and the process aborts (SIGABRT) instead of exiting with its status, as a
        run that failed mid-step (its last step in flight) did."""
        self.asks.put(None)
        self.thread.join(timeout=30)

    @classmethod
    def get(cls) -> _Watcher:
        with cls._lock:
            if cls._one is None:
                cls._one = cls()
            return cls._one

    def _run(self) -> None:
        while True:
            ask = self.asks.get()
            if ask is None:  # `stop`
                return
            if ask.over:
                continue
            try:
                ask.token.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step: the loop reports it, not this
                pass
            ask.device_done = time.perf_counter()


class WaitClock:
    """Accumulates the seconds a feed's asks waited for data (`seconds`).

    Args:
        in_flight: returns one output array of the last dispatched step, or None when
            nothing is in flight (all read back). None: the device is taken as idle.
    """

    def __init__(self, in_flight: Callable[[], Any] | None = None):
        self._in_flight = in_flight
        self.seconds = 0.0

    def run(self, fn: Callable[[], Any], *, blocking: bool = False) -> Any:
        """`fn()`, timed as one ask. `blocking`: fn only waits for work done elsewhere;
        otherwise it works in this thread, alongside the device."""
        token = self._in_flight() if self._in_flight is not None else None
        if _ready(token):  # the device is idle: the whole ask is a wait (nothing to watch)
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.seconds += time.perf_counter() - t0
        ask = _Ask(token)
        t0 = time.perf_counter()
        if blocking:
            ask.watch()
        reset = _ASK.set(ask)
        try:
            return fn()
        finally:
            _ASK.reset(reset)
            t1 = time.perf_counter()
            ask.over = True
            done = ask.device_done
            if done is not None:  # it ended while this waited
                self.seconds += max(0.0, t1 - max(t0, done))
            elif not ask.watched and _ready(ask.token):  # it ended during the work: at most
                self.seconds += t1 - t0
            # else: the step was still running when the batch was ready: no wait

    def work(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, an ask that works in this thread and never blocks, timed as `run` times it
        with one question to the device, after: the whole time is a wait when the step in
        flight has ended by then (it was idle as the ask began, or ended during it: the upper
        bound `run` counts), else none (it ran throughout)."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            t1 = time.perf_counter()
            if _ready(self._in_flight() if self._in_flight is not None else None):
                self.seconds += t1 - t0
