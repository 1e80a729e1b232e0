"""The processes of a multi-process run watch each other, so that none waits for a dead one.

Left to itself, JAX's runtime handles a failing process badly: a process that raises waits up
to 5 minutes at JAX's shutdown barrier for peers that are themselves waiting for it, and a
process whose peer died is aborted with a C++ stack trace that does not say which peer. Here,
through the coordination service's key-value store (JAX's own; nothing else is opened):

* a process that fails (an uncaught exception, or `jaxnitro train` exiting on an error) says
  so under ``jaxnitro/failed``, writes its error for the launcher (``$JAXNITRO_ERROR_FILE``)
  and exits 1 within seconds;
* every process runs a watch thread that reads that key: the others print one line naming the
  failed process and its error, and exit 1 too. All of them, the failed one included, first
  shut JAX's client down together (`jax.distributed.shutdown`, whose barrier every process
  now reaches at once): a process still connected when process 0, the coordination service's
  host, leaves would be aborted by JAX with a C++ stack trace instead;
* the watch thread also posts a counter every second (``jaxnitro/alive/<i>``) and, when a
  peer's counter stops for half the heartbeat timeout, says in one line which process stopped
  answering and what to do, before JAX's own abort (``$JAXNITRO_HEARTBEAT_TIMEOUT`` later).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

ENV_ERROR_FILE = "JAXNITRO_ERROR_FILE"
FAILED = "jaxnitro/failed"
ALIVE = "jaxnitro/alive/"
DONE = "done"  # the last value of a process's counter: it ended normally (at exit)
FAILED_STATUS = 1  # a process that failed, or that stops because another one failed
PEER_LOST_STATUS = 134  # the coordinator is gone: the status JAX's own abort would give
SHUTDOWN_WAIT_S = 10.0  # the longest a failing run waits for every process at JAX's shutdown

_ending = threading.Lock()  # one way out per process: the failing thread or the watch
_stopping = threading.Event()  # the watch is ending this process (another one failed)
_watch: PeerWatch | None = None


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"jaxnitro: {text}\n")
        sys.stderr.flush()


def _exit_now(status: int) -> None:
    """Leave at once, skipping Python's exit (whose JAX shutdown could wait 5 minutes)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _shut_down_then_exit(status: int) -> None:
    """Shut JAX's client down with the other processes (they are doing the same), then leave.
    A process that never comes (hung) is waited for `SHUTDOWN_WAIT_S` at most."""
    import jax

    def shut_down() -> None:
        with contextlib.suppress(Exception):
            jax.distributed.shutdown()

    closing = threading.Thread(target=shut_down, name="jaxnitro-shutdown", daemon=True)
    closing.start()
    closing.join(SHUTDOWN_WAIT_S)
    _exit_now(status)


class PeerWatch:
    """This process's watch over its peers (one per process; see the module doc)."""

    def __init__(self, client: Any, *, me: int, count: int, heartbeat_s: float) -> None:
        self.client, self.me, self.count = client, me, count
        self.heartbeat_s = heartbeat_s
        self.silent_after = heartbeat_s / 2
        self.interval = min(1.0, self.silent_after / 5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxnitro-peer-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # -- the watch thread -----------------------------------------------------------------
    def _run(self) -> None:
        beats = 0
        started = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {
            p: (None, started) for p in range(self.count) if p != self.me
        }
        warned: set[int] = set()
        while not self._stop.is_set():
            try:
                failed = self._failed()
                if failed is not None and failed.get("process") != self.me:
                    self._peer_failed(failed)
                    return
                beats += 1
                self.client.key_value_set(f"{ALIVE}{self.me}", str(beats), allow_overwrite=True)
                posted = dict(self.client.key_value_dir_get(ALIVE))
            except Exception as e:  # noqa: BLE001 - a JaxRuntimeError: the service is gone
                if not self._stop.is_set():
                    self._coordinator_lost(e)
                return
            now = time.monotonic()
            for p, (value, since) in seen.items():
                got = posted.get(f"{ALIVE}{p}")
                if got == DONE:  # it is at JAX's shutdown barrier, waiting for this one
                    continue
                if got != value:
                    seen[p] = (got, now)
                    warned.discard(p)
                elif now - since >= self.silent_after and p not in warned:
                    warned.add(p)
                    self._silent(p, now - since)
            self._stop.wait(self.interval)

    def _failed(self) -> dict | None:
        try:
            raw = self.client.key_value_try_get(FAILED)
        except Exception as e:
            if "NOT_FOUND" in str(e):
                return None
            raise
        try:
            info = json.loads(raw)
        except ValueError:
            info = {"process": None, "error": raw}
        return info if isinstance(info, dict) else {"process": None, "error": str(info)}

    def _peer_failed(self, failed: dict) -> None:
        if not _ending.acquire(blocking=False):
            return  # this process is failing itself: its own path exits
        _stopping.set()
        _say(
            f"process {failed.get('process')} failed ({failed.get('error')}); process "
            f"{self.me} stops too (exit {FAILED_STATUS}). The failed process's own output "
            f"has the traceback."
        )
        _shut_down_then_exit(FAILED_STATUS)

    def _silent(self, p: int, seconds: float) -> None:
        _say(
            f"process {p} has not answered for {seconds:.0f}s: it died or hangs (its own "
            f"output says why). JAX stops this process once process {p} has been silent for "
            f"{self.heartbeat_s:.0f}s ($JAXNITRO_HEARTBEAT_TIMEOUT). Run under `jaxnitro "
            f"launch` to stop every process as soon as one dies."
        )

    def _coordinator_lost(self, e: Exception) -> None:
        if not _ending.acquire(blocking=False):
            return
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        _say(
            f"process 0 (it hosts the run's coordination service) stopped answering ({first}); "
            f"process {self.me} stops too (exit {PEER_LOST_STATUS}). Process 0's own output "
            f"says why; under `jaxnitro launch` the launcher names it."
        )
        _exit_now(PEER_LOST_STATUS)


def start(client: Any, *, me: int, count: int, heartbeat_s: float) -> None:
    """Start this process's watch and make an uncaught exception end the run everywhere."""
    global _watch
    if _watch is not None or count < 2:
        return
    _watch = PeerWatch(client, me=me, count=count, heartbeat_s=heartbeat_s)
    _watch.start()
    atexit.register(_at_exit)  # after JAX's own exit handler, so it runs before it
    previous = sys.excepthook

    def on_uncaught(kind, value, tb):
        if _stopping.is_set():
            # The shutdown cut the main thread's wait short: not an error of its own, and
            # the watch thread ends the process in a moment.
            threading.Event().wait()
        previous(kind, value, tb)  # the traceback first, as always
        fail(value if value is not None else kind())

    sys.excepthook = on_uncaught


def _at_exit() -> None:
    """A normal exit: stop watching, and tell the others this process is not lost."""
    watch = _watch
    if watch is None:
        return
    watch.stop()
    with contextlib.suppress(Exception):
        watch.client.key_value_set(f"{ALIVE}{watch.me}", DONE, allow_overwrite=True)


def fail(error: BaseException) -> None:
    """End this process of a multi-process run because of `error`: tell the launcher and the
    other processes, shut JAX's client down with them (10 s at most, where Python's own exit
    would wait 5 minutes for processes that wait for this one) and exit 1. Does nothing in a
    single-process run (the caller goes on to exit as usual)."""
    watch = _watch
    if watch is None:
        return
    watch.stop()
    if not _ending.acquire(blocking=False):
        # The watch thread is already taking this process out (another process failed).
        threading.Event().wait()
    message = f"{type(error).__name__}: {error}"
    path = os.environ.get(ENV_ERROR_FILE)
    if path:
        record = {"process": watch.me, "type": type(error).__name__, "message": str(error)}
        with contextlib.suppress(OSError):
            with open(path, "w", encoding="utf-8") as f:
                json.dump({**record, "time": time.time()}, f)
    with contextlib.suppress(Exception):  # a second failing process finds the key taken
        watch.client.key_value_set(FAILED, json.dumps({"process": watch.me, "error": message}))
    _shut_down_then_exit(FAILED_STATUS)
