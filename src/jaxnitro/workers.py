"""Transform workers: `jn.DataLoader(..., transform=fn, workers=N)` in N forked processes.

The design, and why:

- **fork, once.** The workers are forked from this process on the loader's first iteration
  and live until `loader.close()` or the end of the process. A forked worker shares the data
  (arrays, memory maps, arrow tables) and the transform with this process as they are, so
  nothing is pickled or copied to start it, and a transform may be a lambda or a closure.
  The children never touch JAX (JAX's warning about `fork` in a multithreaded process is
  about children that do); they run numpy and the user's transform only.
- **shared memory out.** The workers write their batches into a ring of slots in one
  anonymous shared mapping made before the fork, laid out from the transform's output specs
  (known from sample 0 at construction). This process copies a batch out of its slot when it
  takes it; only the fields asked for are written.
- **JSON in the pipes.** A task (slot, epoch, seed, rows, fields) and a reply (rows written, or
  the worker's traceback) are JSON bytes: no pickle in either direction.
- **order.** Batch i goes to worker i mod N, at most two per worker in flight; batches come
  back in order. Each pass (an epoch, an evaluation) tags its tasks, so the replies of a pass
  abandoned midway are skipped by the next. Each sample's rng comes from (seed, epoch, index),
  so the result is the same for any N (and for workers=0).

Platforms without `fork` (Windows) cannot use workers; `workers=0` works everywhere.
"""

from __future__ import annotations

import atexit
import collections
import json
import mmap
import multiprocessing
import signal
import traceback
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import waits
from .errors import DataError
from .plot import wait_preload

_IN_FLIGHT = 2  # tasks per worker: one computing, one queued


class TransformPool:
    """N forked workers transforming batches of `loader` into shared-memory slots."""

    def __init__(self, loader, workers: int):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise DataError(
                f"DataLoader workers={workers} needs os.fork, which this platform lacks; use "
                f"workers=0 (transforms in this process)."
            )
        self.loader, self.workers = loader, workers
        self.n_slots = workers * _IN_FLIGHT
        self.layout, slot_bytes = _layout(loader.out_specs, loader.batch_size)
        self.slot_bytes = slot_bytes
        self.buffer = mmap.mmap(-1, max(1, slot_bytes * self.n_slots))
        self._tag = 0  # one per pass: replies of an abandoned pass are told apart
        ctx = multiprocessing.get_context("fork")
        wait_preload()  # a fork amid that thread's imports could inherit their locks
        self.conns: list = []
        self.procs: list = []
        with warnings.catch_warnings():
            # JAX warns on any fork; these children run numpy and the transform only.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            for w in range(workers):
                here, there = ctx.Pipe()
                # The child closes the parent's ends it inherits (its own and the earlier
                # workers'): else no worker would see its pipe end when this process dies.
                proc = ctx.Process(
                    target=_serve,
                    args=(self, there, [here, *self.conns]),
                    name=f"jaxnitro-transform-{w}",
                    daemon=True,
                )
                proc.start()
                there.close()
                self.conns.append(here)
                self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        # Exit hooks run last-registered first: this one runs before multiprocessing's, which
        # joins daemonic children, so a pool a user never closed does not hold the exit up.
        atexit.register(self._finalizer)

    def views(self, slot: int, rows: int) -> dict[str, np.ndarray]:
        """{field: the first `rows` rows of `slot`} over the shared buffer."""
        out = {}
        base = slot * self.slot_bytes
        for f, (offset, shape, dtype) in self.layout.items():
            count = rows * int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=base + offset)
            out[f] = arr.reshape((rows,) + shape)
        return out

    def map(self, rows: Sequence, epoch: int, seed: int, fields) -> Iterator[dict]:
        """The transformed batches of `rows` (one entry per batch), in order."""
        self._tag += 1
        tag, fields = self._tag, list(fields)
        pending: collections.deque = collections.deque()
        tasks = iter(enumerate(rows))
        for _ in range(self.n_slots):
            if not self._send(tasks, pending, tag, epoch, seed, fields):
                break
        while pending:
            i, worker, slot, n = pending.popleft()
            reply = self._reply(worker, tag)
            if "error" in reply:
                raise DataError(
                    f"the DataLoader transform failed in worker {worker} on batch {i} "
                    f"(epoch {epoch + 1}):\n{reply['error']}"
                )
            batch = {f: v.copy() for f, v in self.views(slot, n).items() if f in fields}
            self._send(tasks, pending, tag, epoch, seed, fields)
            yield batch

    def _reply(self, worker: int, tag: int) -> dict:
        """The worker's reply to a task of this pass. An abandoned pass (a stop, a break, an
        error) leaves replies in the pipe; they come first (a worker answers in order) and
        are skipped. A slot always belongs to one worker, so a late write never lands in a
        slot another worker fills."""
        conn = self.conns[worker]
        while True:
            if not conn.poll():  # a wait, once the step in flight has ended
                waits.blocking()
            reply = json.loads(conn.recv_bytes())
            if reply["tag"] == tag:
                return reply

    def _send(self, tasks, pending, tag: int, epoch: int, seed: int, fields) -> bool:
        item = next(tasks, None)
        if item is None:
            return False
        i, r = item
        index = (
            list(range(*r.indices(self.loader.num_samples)))
            if isinstance(r, slice)
            else [int(x) for x in r]
        )
        worker, slot = i % self.workers, i % self.n_slots  # n_slots is a multiple of workers
        task = {
            "tag": tag,
            "slot": slot,
            "epoch": epoch,
            "seed": seed,
            "rows": index,
            "fields": fields,
        }
        self.conns[worker].send_bytes(json.dumps(task).encode())
        pending.append((i, worker, slot, len(index)))
        return True

    def close(self) -> None:
        self._finalizer()


def _layout(specs, batch_size: int) -> tuple[dict, int]:
    """{field: (byte offset in a slot, per-sample shape, dtype)} and the slot size."""
    layout, offset = {}, 0
    for f, (shape, dtype) in specs.items():
        dtype = np.dtype(dtype)
        offset = -(-offset // 64) * 64  # aligned rows for numpy
        layout[f] = (offset, tuple(shape), dtype)
        offset += batch_size * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return layout, -(-offset // 64) * 64


def _serve(pool: TransformPool, conn, inherited) -> None:
    """A worker: read a task, write its batch into the slot, reply; until the pipe closes."""
    # The training process's handlers are not this one's: SIGTERM ends a worker (how
    # multiprocessing stops it), and Ctrl-C is the training process's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for other in inherited:
        other.close()
    loader = pool.loader
    while True:
        try:
            task = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            rows = np.asarray(task["rows"], dtype=np.int64)
            out = loader.transform_rows(rows, task["epoch"], task["seed"], task["fields"])
            views = pool.views(task["slot"], len(rows))
            for f in task["fields"]:
                views[f][...] = out[f]
            reply: dict[str, Any] = {"tag": task["tag"], "rows": len(rows)}
        except BaseException:  # noqa: BLE001 - reported to the consumer with the traceback
            reply = {"tag": task["tag"], "error": traceback.format_exc()}
        conn.send_bytes(json.dumps(reply).encode())


def _stop(conns, procs) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"null")
            conn.close()
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=2)
        if proc.is_alive():
            proc.terminate()
