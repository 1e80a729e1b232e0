"""Device batches prepared ahead of the step: `Prefetcher` in a background thread, a bounded
number ahead; `InlineFeed`, the same interface preparing each batch when asked (one CPU
device, where a second thread would only contend for the GIL). Both time the device's waits
for data (`waits`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

from jaxnitro._src.data import waits


class InlineFeed:
    """The same interface as `Prefetcher`, preparing each batch when it is asked for.

    For a single CPU device, where batches need no transfer: a second Python thread would only
    contend for the GIL with the dispatching one. `wait_seconds` is the time the device sat
    idle while a batch was prepared (`waits`); `in_flight` gives an output of the step last
    dispatched (None: none in flight); `may_block=False`: the source never blocks on work
    done elsewhere, so each batch is timed by `waits.WaitClock.work` (one question).
    """

    def __init__(self, source: Iterable, prepare, *, in_flight=None, may_block: bool = True):
        self._source, self._prepare = iter(source), prepare
        self._clock = waits.WaitClock(in_flight)
        self._ask = self._clock.run if may_block else self._clock.work  # (per batch)

    @property
    def wait_seconds(self) -> float:
        return self._clock.seconds

    def __iter__(self):
        return self

    def __next__(self):
        return self._ask(self._next)

    def _next(self):
        host = next(self._source)
        return (*self._prepare(host), host)

    def close(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


class Prefetcher:
    """Produces device batches in order from a background thread, a bounded number ahead.

    Iterating yields `(device_batch, n_valid, host_batch)`. `wait_seconds` accumulates the
    time the device sat idle for want of the next batch, for `data_wait_frac` (`waits`):
    `in_flight` gives an output of the step last dispatched (None: none in flight).
    """

    _DONE = object()

    def __init__(self, source: Iterable, prepare, *, depth: int = 2, in_flight=None):
        self._source = source
        self._prepare = prepare  # host batch -> (device batch, n_valid)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._clock = waits.WaitClock(in_flight)
        self._finished = False  # set once DONE/an error was consumed, or on close()
        self._thread = threading.Thread(target=self._run, name="jaxnitro-prefetch", daemon=True)
        self._thread.start()

    @property
    def wait_seconds(self) -> float:
        return self._clock.seconds

    def _run(self) -> None:
        try:
            for host in self._source:
                if self._stop.is_set():
                    return
                item = (*self._prepare(host), host)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self._put_final(self._DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer thread
            self._put_final(e)

    def _put_final(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        # After the end, an error, or close() the producer puts nothing more: a blocking get()
        # would wait forever, so an exhausted or closed prefetcher keeps raising StopIteration.
        if self._finished:
            raise StopIteration
        try:
            item = self._queue.get_nowait()
        except queue.Empty:  # not ready: a wait, once the step in flight has ended
            item = self._clock.run(self._queue.get, blocking=True)
        if item is self._DONE:
            self._finished = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            self._thread.join()
            raise item
        return item

    def close(self) -> None:
        self._finished = True
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)
