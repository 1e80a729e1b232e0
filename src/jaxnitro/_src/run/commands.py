"""What another thread asks of a running `jn.train`, done by the training thread at the next
step boundary: new Device values, new learning rates, a checkpoint (a stop is the run's
`StopControl`).

`jn.start` registers a `Commands` queue for its run; the epoch calls `at_boundary` once per
dispatch (with `steps_per_call=k` the boundary is the dispatch, every k optimizer steps). A
run no handle drives has no queue, and the call is one dict lookup.

The training thread alone touches the handle's state: the caller only queues (after checking
the values at once, so a bad value is the caller's error, not the run's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from jaxnitro._src.data.feed import Call, HyperFeed
from jaxnitro._src.experiment.markers import replace
from jaxnitro._src.run.live import checked_device
from jaxnitro._src.run.rates import checked_rates

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

_queues: dict[int, Commands] = {}  # id(n.services) -> the queue of the run a handle drives
_registry_lock = threading.Lock()


class Commands:
    """Pending Device values and checkpoint requests of one run (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {}  # field -> (checked array, the value as given)
        self._checkpoints: list[Future] = []
        self._rates: dict[str, float] = {}  # group -> learning rate (run/rates.py)
        self.pending = False  # read without the lock by the training thread: a hint only
        self.closed = False  # the run ended (no boundary will take a request)
        self.repack: tuple[Any, HyperFeed] | None = None  # (epoch, its hyperparameters' feed)

    def set_device(self, n: Nitro, values: dict[str, Any]) -> None:
        """Check `values` now (a ConfigError names the problem); apply at the next boundary."""
        arrays = checked_device(n, values)
        with self._lock:
            self._values.update({k: (arrays[k], values[k]) for k in values})
            self.pending = True

    def set_lr(self, n: Nitro, rate: Any) -> None:
        """Check `rate` now (a ConfigError names the problem); apply at the next boundary."""
        rates = checked_rates(n, rate)
        with self._lock:
            self._rates.update(rates)
            self.pending = True

    def take_rates(self) -> dict[str, float]:
        with self._lock:
            rates, self._rates = self._rates, {}
        return rates

    def checkpoint(self) -> Future:
        """A future resolved with the checkpoint's path once it is written (None: the run
        writes no checkpoints); cancelled when the run ends first."""
        future: Future = Future()
        with self._lock:
            if self.closed:  # the run has ended: no boundary will come
                future.cancel()
                return future
            self._checkpoints.append(future)
            self.pending = True
        return future

    def take(self) -> tuple[dict[str, Any], list[Future]]:
        with self._lock:
            values, futures = self._values, self._checkpoints
            self._values, self._checkpoints, self.pending = {}, [], False
        return values, futures

    def cancel(self) -> None:
        """The run ended: checkpoint requests it did not reach resolve as cancelled."""
        with self._lock:
            self.closed = True
        _, futures = self.take()
        for future in futures:
            future.cancel()


def register(n: Nitro) -> Commands:
    """The queue of `n`'s run (one per handle; a second `jn.start` of it reuses it)."""
    with _registry_lock:
        return _queues.setdefault(id(n.services), Commands())


def unregister(n: Nitro) -> None:
    with _registry_lock:
        queue = _queues.pop(id(n.services), None)
    if queue is not None:
        queue.cancel()


def at_boundary(epoch: Any, checkpoint: Callable[..., None], call: Call) -> Any:
    """Run what was asked since the last dispatch, on the training thread, before the next
    one; returns the packed hyperparameters that dispatch takes.

    `epoch` is the epoch's cursor (its handle `n`, `epoch`, `step`, `extras`, pending outputs
    and `drain`); `checkpoint(n, epoch, validate=False, save=True)` writes a mid-epoch
    checkpoint; `call` is the next dispatch. New Device values reach that
    dispatch (no recompile: same shapes, checked when queued) and are logged as an `other`
    line with the step they apply from. Scalar float Device fields also travel in the packed
    hyperparameters, which the prefetch thread packed ahead with the old values: for the rest
    of the epoch they are packed again here from the new ones.
    """
    hyper, steps = call.hyper, call.steps
    queue = _queues.get(id(epoch.n.services))
    if queue is None:
        return hyper
    if queue.pending:
        _apply(queue, epoch, checkpoint)
    repack = queue.repack
    if repack is not None and repack[0] is epoch:
        return repack[1].at(epoch.step, steps)
    return hyper


def _apply(queue: Commands, epoch: Any, checkpoint: Callable[..., None]) -> None:
    n = epoch.n
    values, futures = queue.take()
    rates = queue.take_rates()  # (after `take`: a rate queued in between is not lost)
    if rates:
        n._set_rates(rates)
        queue.repack = (epoch, HyperFeed(n.spec, n.device.hyper_base))
        epoch.rates_changed()  # the steps dispatched so far are logged with their old rates
        n.services.log_other({"key": "set_lr", "from_step": epoch.step + 1, "rates": rates})
    if values:
        n._set_device(
            {k: arr for k, (arr, _) in values.items()},
            replace(n.experiment, **{k: v for k, (_, v) in values.items()}),
        )
        epoch.extras = n.device.extras
        queue.repack = (epoch, HyperFeed(n.spec, n.device.hyper_base))
        epoch.rates_changed()  # a rate hook may read the field
        n.services.log_other(
            {
                "key": "set_device",
                "from_step": epoch.step + 1,
                "values": {k: _plain(v) for k, (_, v) in values.items()},
            }
        )
    if futures:
        epoch.drain(len(epoch.pending))  # the checkpoint holds every step dispatched
        try:
            checkpoint(n, epoch.epoch, validate=False, save=True, requested=True)
        except BaseException as e:
            for future in futures:
                future.set_exception(e)
            raise
        latest = n.checkpointer.latest()
        for future in futures:
            future.set_result(latest)


def _plain(value: Any) -> Any:
    """A value as a log line can hold it (an array as a list)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value
