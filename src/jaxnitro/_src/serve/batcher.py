"""Dynamic batching: concurrent requests for one model become one bundle call.

Requests wait in a bounded FIFO queue (full: 503). A dispatcher task per model takes the
oldest request, waits at most ``max_delay_s`` for more to arrive (none by default: it takes
whatever is queued now), then merges requests, counting rows, up to ``max_batch_size``
rows; a request that does not fit waits for the next call, one larger than
``max_batch_size`` is split across calls. The merged batch runs in the model's worker
thread (the event loop stays free), or on the event loop itself when calls of its size are
known to be quick (`ServedModel.quick`: the hop to the thread and back would cost the loop
more than the call); the bundle pads it to a bucket size compiled at start-up, and each
request gets its own rows back. With ``max_batch_size=None`` nothing is merged: each
request goes straight to the worker thread's own FIFO (no dispatcher hop between calls),
or, when nothing is ahead of it and its call is quick, runs at once on the loop; either
way requests run alone, in arrival order, and the queue bound holds.

Requests arrive here already validated (`ServedModel.prepare`), so one bad request never
fails the others it would have shared a call with.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxnitro._src.serve.errors import ServeError, Unavailable
from jaxnitro._src.serve.registry import ServedModel

#: The default bound on requests waiting per model.
MAX_QUEUE_SIZE = 1024


@dataclasses.dataclass(eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    rows: int
    future: asyncio.Future
    arrived: float
    taken: int = 0  # rows handed to a call so far
    pieces: list = dataclasses.field(default_factory=list)
    done: int = 0  # rows answered so far


class Batcher:
    """The queue and dispatcher of one model.

    Args:
        model: the model whose `run` executes a batch (in ``model.executor``).
        max_batch_size: most rows per call; None: no merging.
        max_delay_s: how long the oldest request may wait for others to join it.
        max_queue_size: most requests waiting; more are refused with 503.
        on_batch: called with (rows, seconds, waits) after each call, for metrics: waits
            are the queue seconds of each request whose first rows the call ran.
    """

    def __init__(
        self,
        model: ServedModel,
        *,
        max_batch_size: int | None,
        max_delay_s: float,
        max_queue_size: int,
        on_batch: Callable[[int, float, list[float]], None] = lambda rows, seconds, waits: None,
    ):
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s if max_batch_size else 0.0
        self.max_queue_size = max_queue_size
        self.on_batch = on_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._alone = 0  # requests submitted to the worker directly (no batching)
        self._alone_rows = 0
        self._idle: asyncio.Event | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the call in progress)."""
        return len(self._queue) + max(0, self._alone - 1)

    @property
    def queued_rows(self) -> int:
        """Rows waiting (without batching: and the ones in the call in progress)."""
        return sum(p.rows - p.taken for p in self._queue) + self._alone_rows

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        if self.max_batch_size is not None:
            self._task = asyncio.get_running_loop().create_task(
                self._dispatch(), name=f"jaxnitro-batcher-{self.model.name}"
            )

    async def submit(self, inputs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """The model's outputs for these (validated) inputs, once their turn comes."""
        if self._wake is None or self._closing:
            raise Unavailable(f"model {self.model.name!r} is not accepting requests (stopping).")
        if self.depth >= self.max_queue_size:
            raise Unavailable(
                f"model {self.model.name!r} has {self.depth} requests queued (the limit); "
                f"retry shortly, or start the server with a larger max_queue_size."
            )
        if self.max_batch_size is None:
            return await self._alone_call(inputs, rows)
        loop = asyncio.get_running_loop()
        item = _Pending(inputs, rows, loop.create_future(), loop.time())
        self._queue.append(item)
        self._wake.set()
        return await item.future

    async def close(self) -> None:
        """Refuse new requests, answer every queued one, then stop."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
        if self._idle is not None:
            await self._idle.wait()

    # -- no batching: straight to the worker ---------------------------------------------------
    async def _alone_call(self, inputs: dict[str, np.ndarray], rows: int) -> dict:
        assert self._idle is not None
        if not self._alone and self.model.quick(rows):
            return self._inline(inputs, rows)  # nothing ahead of it: its turn is now
        loop = asyncio.get_running_loop()
        self._alone += 1
        self._alone_rows += rows
        self._idle.clear()
        arrived = time.perf_counter()
        try:
            out, seconds, started = await loop.run_in_executor(
                self.model.executor, self._timed, inputs
            )
        except ServeError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to this request alone
            raise _internal(self.model.name, e) from e
        finally:
            self._alone -= 1
            self._alone_rows -= rows
            if not self._alone:
                self._idle.set()
        self.on_batch(rows, seconds, [started - arrived])
        return out

    def _inline(self, inputs: dict[str, np.ndarray], rows: int) -> dict:
        """A quick call run here, on the event loop (see `INLINE_MAX_S`)."""
        try:
            out, seconds, _ = self._timed(inputs)
        except ServeError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to this request alone
            raise _internal(self.model.name, e) from e
        self.on_batch(rows, seconds, [0.0])
        return out

    def _timed(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float, float]:
        started = time.perf_counter()
        out = self.model.run(inputs)
        return out, time.perf_counter() - started, started

    # -- the dispatcher --------------------------------------------------------------------
    async def _dispatch(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._gather(loop)
            batch = self._take()
            if batch and await self._run(loop, batch):
                # the call ran here without yielding: let its requests respond and new
                # ones queue up. (After a call in the worker, the next batch goes to the
                # worker first, so it computes while those requests respond.)
                await asyncio.sleep(0)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until a full batch is queued or the oldest request's delay is up."""
        assert self._wake is not None
        if not self.max_batch_size or self.max_delay_s <= 0:
            return
        deadline = self._queue[0].arrived + self.max_delay_s
        while not self._closing and self.queued_rows < self.max_batch_size:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                return

    def _take(self) -> list[tuple[_Pending, int, int]]:
        """(request, first row, end row) for the next call, oldest first."""
        cap = self.max_batch_size
        assert cap is not None
        batch: list[tuple[_Pending, int, int]] = []
        room = cap
        while self._queue and room:
            item = self._queue[0]
            if item.future.done():
                self._queue.popleft()
                continue
            left = item.rows - item.taken
            if left > room and item.rows <= cap:
                break  # fits a call of its own: wait for the next one, keep the order
            n = min(left, room)
            batch.append((item, item.taken, item.taken + n))
            item.taken += n
            room -= n
            if item.taken == item.rows:
                self._queue.popleft()
        return batch

    async def _run(self, loop: asyncio.AbstractEventLoop, batch) -> bool:
        """Run one call for ``batch`` and answer its requests; True if it ran on the loop."""
        whole = [i for i, start, stop in batch if start == 0 and stop == i.rows]
        if len(batch) == 1 and whole:
            merged = batch[0][0].inputs
        else:
            merged = {
                k: np.concatenate([i.inputs[k][start:stop] for i, start, stop in batch])
                for k in batch[0][0].inputs
            }
        rows = sum(stop - start for _, start, stop in batch)
        inline = self.model.quick(rows)
        now = loop.time()
        waits = [now - i.arrived for i, start, _ in batch if start == 0]
        try:
            if inline:
                out, seconds, _ = self._timed(merged)
            else:
                out, seconds, _ = await loop.run_in_executor(
                    self.model.executor, self._timed, merged
                )
        except Exception as e:  # noqa: BLE001 - every request of the call gets the error
            error = e if isinstance(e, ServeError) else _internal(self.model.name, e)
            for item, _, _ in batch:
                if not item.future.done():
                    item.future.set_exception(error)
                self._discard(item)
            return inline
        self.on_batch(rows, seconds, waits)
        offset = 0
        for item, start, stop in batch:
            n = stop - start
            if not item.future.done():
                item.pieces.append({k: v[offset : offset + n] for k, v in out.items()})
                item.done += n
                if item.done == item.rows:
                    item.future.set_result(_join(item.pieces))
            offset += n
        return inline

    def _discard(self, item: _Pending) -> None:
        try:
            self._queue.remove(item)
        except ValueError:
            pass

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()


def _join(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def _internal(model: str, e: Exception) -> ServeError:
    error = ServeError(f"model {model!r} failed on this batch: {type(e).__name__}: {e}")
    error.__cause__ = e
    return error
