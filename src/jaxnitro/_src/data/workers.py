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
- **failure.** Each worker notes in a second shared mapping the sample it is on and a count
  that moves at every sample. Waiting for a reply also watches the worker's process and that
  count: a worker that dies (a signal, the out-of-memory killer, SIGBUS on a file that shrank)
  or stays on one sample longer than `worker_timeout` fails the pass with a DataError naming
  the worker, its pid, the signal and the sample. The pool is then stopped whole (a stuck
  worker terminated, no process left behind) and the loader's next pass forks a new one.

Platforms without `fork` (Windows) cannot use workers; `workers=0` works everywhere.
"""

from __future__ import annotations

import atexit
import collections
import json
import mmap
import multiprocessing
import signal
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from jaxnitro._src.core import background_imports
from jaxnitro._src.core.errors import DataError
from jaxnitro._src.data import waits

_IN_FLIGHT = 2  # tasks per worker: one computing, one queued
# A worker's row in the progress table: the batch and epoch of its task (-1: none), the
# sample it is on (-1: none yet), and a count that moves at every step.
_BATCH, _EPOCH, _HELD, _BEATS = range(4)
_REAP_S = 5.0  # how long a dead worker's exit status may take to arrive

#: What a signal that ended a worker usually means, and what to check.
_SIGNAL_HINTS = {
    "SIGKILL": "the usual sender is the kernel's out-of-memory killer (see `dmesg` or the "
    "system log; lower workers= or the transform's memory use), else a kill from outside "
    "(a job scheduler, a user)",
    "SIGBUS": "a memory-mapped file shrank while in use: a data file (.npy) was truncated "
    "or rewritten after it was loaded. Write it again in full, load it again, and do not "
    "rewrite a data file while a run reads it",
    "SIGSEGV": "a crash in native code the transform calls (a C extension, an image or "
    "audio library); run the transform on that sample with workers=0 to see where",
    "SIGABRT": "native code the transform calls aborted (a failed assertion in a C "
    "library); run the transform on that sample with workers=0 to see its message",
    "SIGTERM": "it was stopped from outside (a job scheduler, a user)",
}


class TransformPool:
    """N forked workers transforming batches of `loader` into shared-memory slots.

    `timeout`: seconds a worker may stay on one sample (None: no limit)."""

    def __init__(self, loader, workers: int, *, timeout: float | None = None):
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
        self.timeout = timeout
        # Shared with the workers, who write it: what each is on (see _BATCH...).
        self._progress_map = mmap.mmap(-1, workers * 4 * 8)
        self.progress = np.frombuffer(self._progress_map, np.int64).reshape(workers, 4)
        self.progress[:, :_BEATS] = -1
        self._tag = 0  # one per pass: replies of an abandoned pass are told apart
        ctx = multiprocessing.get_context("fork")
        background_imports.wait()  # a fork amid a thread's imports could inherit their locks
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
                    args=(self, w, there, [here, *self.conns]),
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

    @property
    def alive(self) -> bool:
        """False once closed, or stopped after a worker died or hung."""
        return self._finalizer.alive

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
                self._await(worker)
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # the worker's end closed: it died
                raise self._died(worker) from None
            reply = json.loads(data)
            if reply["tag"] == tag:
                return reply

    def _await(self, worker: int) -> None:
        """Wait until the worker's pipe has something to read; raise a DataError if the
        worker dies first, or stays on one sample longer than the timeout."""
        conn, proc = self.conns[worker], self.procs[worker]
        if self.timeout is None:
            ready = wait([conn, proc.sentinel])
        else:
            # The deadline moves with the worker's beats: a long batch of quick samples
            # is fine; a sample that never ends is not.
            tick = min(1.0, self.timeout / 4)
            beat, since = int(self.progress[worker, _BEATS]), time.monotonic()
            while True:
                left = since + self.timeout - time.monotonic()
                ready = wait([conn, proc.sentinel], timeout=max(0.0, min(tick, left)))
                if ready:
                    break
                now = int(self.progress[worker, _BEATS])
                if now != beat:
                    beat, since = now, time.monotonic()
                elif left <= 0:
                    raise self._timed_out(worker)
        if conn not in ready:  # the process ended with nothing left to read
            raise self._died(worker)

    def _where(self, worker: int) -> str:
        """'on sample 13 (batch 3 of epoch 1)': what the worker was on, from its own note."""
        batch, epoch, held = (int(v) for v in self.progress[worker, :_BEATS])
        if batch < 0:
            return "while idle (between tasks)"
        at = f"batch {batch} of epoch {epoch + 1}"
        if held < 0:
            return f"on {at}, reading its rows (before its first sample)"
        return f"on sample {held} ({at})"

    def _died(self, worker: int) -> DataError:
        """The error for a worker that ended (its pipe closed, or its process is gone);
        the pool is stopped."""
        proc = self.procs[worker]
        proc.join(timeout=_REAP_S)
        code = proc.exitcode
        where = self._where(worker)
        self.close()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name} {where}"
            hint = _SIGNAL_HINTS.get(
                name, "a signal from outside, or a crash in native code the transform calls"
            )
        elif code is not None:
            how = f"exited with code {code} {where}"
            hint = (
                "something in the transform ended the process (os._exit, or a native "
                "library's exit); run the transform on that sample with workers=0 to see it"
            )
        else:
            how = f"closed its pipe {where} and did not exit within {_REAP_S:g} s"
            hint = "check the system log for what happened to that process"
        return DataError(
            f"DataLoader transform worker {worker} (pid {proc.pid}) {how}: {hint}. The "
            f"workers were stopped; the loader's next pass starts new ones."
        )

    def _timed_out(self, worker: int) -> DataError:
        """The error for a worker that stayed on one sample past the timeout; the stuck
        worker is terminated and the pool stopped (no process is left behind)."""
        proc = self.procs[worker]
        where = self._where(worker)
        _end(proc)
        self.close()
        return DataError(
            f"DataLoader transform worker {worker} (pid {proc.pid}) spent more than "
            f"worker_timeout={self.timeout:g} s {where} and was stopped (with the other "
            f"workers; the loader's next pass starts new ones). Find out why the transform "
            f"stalls there: call it on that sample in this process (workers=0), e.g. for a "
            f"lock, a network read or an endless loop; or, if it is merely slow, raise "
            f"DataLoader(..., worker_timeout=...) (None waits forever)."
        )

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
            "batch": i,
            "slot": slot,
            "epoch": epoch,
            "seed": seed,
            "rows": index,
            "fields": fields,
        }
        try:
            self.conns[worker].send_bytes(json.dumps(task).encode())
        except OSError:  # BrokenPipeError and kin: the worker is gone
            raise self._died(worker) from None
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


def _serve(pool: TransformPool, worker: int, conn, inherited) -> None:
    """A worker: read a task, write its batch into the slot, reply; until the pipe closes.
    It notes in `pool.progress` the sample it is on, and beats at every step."""
    # The training process's handlers are not this one's: SIGTERM ends a worker (how
    # multiprocessing stops it), and Ctrl-C is the training process's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for other in inherited:
        other.close()
    loader = pool.loader
    progress = pool.progress[worker]

    def on_sample(index: int) -> None:
        progress[_HELD] = index
        progress[_BEATS] += 1

    while True:
        try:
            task = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if task is None:
            return
        progress[_BATCH], progress[_EPOCH], progress[_HELD] = task["batch"], task["epoch"], -1
        progress[_BEATS] += 1
        try:
            rows = np.asarray(task["rows"], dtype=np.int64)
            out = loader.transform_rows(
                rows, task["epoch"], task["seed"], task["fields"], on_sample=on_sample
            )
            views = pool.views(task["slot"], len(rows))
            for f in task["fields"]:
                views[f][...] = out[f]
            reply: dict[str, Any] = {"tag": task["tag"], "rows": len(rows)}
        except BaseException:  # noqa: BLE001 - reported to the consumer with the traceback
            reply = {"tag": task["tag"], "error": traceback.format_exc()}
        progress[_BATCH] = progress[_HELD] = -1
        conn.send_bytes(json.dumps(reply).encode())


def _end(proc) -> None:
    """Terminate a worker (SIGTERM ends it: its handler is the default), then kill it."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=2)


def _stop(conns, procs) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"null")
        except OSError:
            pass
        conn.close()
    # One deadline for all: the idle ones read their null at once; a busy one may finish.
    deadline = time.monotonic() + 2
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _end(proc)
