"""What another thread asks of a running `jn.train`, done by the training thread at the next
step boundary: new Device values, new learning rates, a checkpoint (a stop is the run's
`StopControl`).

`jn.start` registers a `Commands` queue for its run; the epoch calls `at_boundary` once per
dispatch (with `steps_per_call=k` the boundary is the dispatch, every k optimizer steps) and
gets back what was asked (`Asked`), or None. A run no handle drives has no queue, and the call
is one dict lookup.

The training thread alone touches the handle's state: the caller only queues (after checking
the values at once, so a bad value is the caller's error, not the run's).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from jaxnitro._src.experiment.markers import replace
from jaxnitro._src.run.live import checked_device, with_values
from jaxnitro._src.run.rates import checked_rates, with_rates

if TYPE_CHECKING:
    from pathlib import Path

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


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a `jn.start` handle asked since the last dispatch that the epoch still has to do,
    once its new Device values and learning rates are in the handle (the epoch sees those
    there, as a new `n.device`): the checkpoints it waits for (the epoch writes one, then
    `written` or `failed`)."""

    checkpoints: tuple[Future, ...]

    def written(self, path: Path | None) -> None:
        for future in self.checkpoints:
            future.set_result(path)

    def failed(self, error: BaseException) -> None:
        for future in self.checkpoints:
            future.set_exception(error)


def at_boundary(n: Nitro, step: int) -> Asked | None:
    """What was asked of `n`'s run since the last dispatch, on the training thread, before
    the next one (`step`: the steps taken); None when nothing was (one dict lookup).

    New Device values go into the handle here (no recompile: same shapes, checked when
    queued) and are logged as an `other` line with the step they apply from. Scalar float
    Device fields also travel in the packed hyperparameters, which the prefetch thread
    packed ahead with the old values: the epoch, seeing a new `n.device`, packs its next
    calls' again from the new ones. A checkpoint asked is the epoch's to write, with every step
    dispatched read back first.
    """
    queue = _queues.get(id(n.services))
    if queue is None or not queue.pending:
        return None
    values, futures = queue.take()
    rates = queue.take_rates()  # (after `take`: a rate queued in between is not lost)
    if rates:
        n.take(device=with_rates(n.device, rates))
        n.services.log_other({"key": "set_lr", "from_step": step + 1, "rates": rates})
    if values:
        arrays = {k: arr for k, (arr, _) in values.items()}
        experiment = replace(n.experiment, **{k: v for k, (_, v) in values.items()})
        n.take(device=with_values(n, arrays, experiment), experiment=experiment)
        n.services.log_other(
            {
                "key": "set_device",
                "from_step": step + 1,
                "values": {k: _plain(v) for k, (_, v) in values.items()},
            }
        )
    return Asked(checkpoints=tuple(futures))


def _plain(value: Any) -> Any:
    """A value as a log line can hold it (an array as a list)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value
