"""Run one script as N local processes of a `jax.distributed` run (what torchrun does for
PyTorch; JAX has no such tool).

Each rank gets its environment (the coordinator's address on a free port, the process count
and its id, and with `devices_per_process` that many fake CPU devices), its own session (a
Ctrl-C at the terminal reaches the launcher only, which forwards it once to every rank), and
its output prefixed `[rank i] `. The first rank to fail decides the outcome: the others are
stopped (SIGTERM, then SIGKILL after `kill_timeout`) and the launcher exits with that rank's
status, saying which rank failed and how (a rank that raised names its exception: it writes
type and message to `$JAXNITRO_ERROR_FILE`, see `dist/peer_watch.py`). A rank that exits 143
was preempted: the others are given `grace` seconds to checkpoint the same step and exit too.

The ranks die with the launcher: each asks the kernel for SIGKILL when the launcher's thread
that started it ends (`PR_SET_PDEATHSIG`, Linux), so a launcher killed outright (the OOM
killer) leaves no rank training unseen and holding its run's lock. JAX's own C++ abort report
in a rank (a peer died) is said in one line instead of a stack trace.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.dist.layout import (
    CLUSTER_PLACEMENT_VARIABLES,
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jaxnitro._src.dist.peer_watch import ENV_ERROR_FILE

PREEMPTED = 143
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_PR_SET_PDEATHSIG = 1
# The first line of the report JAX's runtime prints (absl LOG(FATAL)) before it aborts a
# process whose peer died; a C++ stack trace follows it.
_JAX_FATAL = re.compile(r"^F\d{4} .*Terminating process because the JAX distributed service")
_UNHEALTHY = "The following tasks are unhealthy"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(
    base: dict[str, str],
    *,
    rank: int,
    nproc: int,
    coordinator: str,
    devices_per_process: int | None,
    error_file: str | None = None,
) -> dict[str, str]:
    """The environment of one rank: `base` plus the distributed variables (and the fake CPU
    device count, replacing any count already in XLA_FLAGS, and where to write its error),
    less a cluster's placement variables (`SLURM_PROCID`, ...): inside a SLURM step or a pod
    they place the launcher's own task, not its ranks."""
    env = {k: v for k, v in base.items() if k not in CLUSTER_PLACEMENT_VARIABLES}
    if error_file is not None:
        env[ENV_ERROR_FILE] = error_file
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(nproc)
    env[ENV_PROCESS_ID] = str(rank)
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, in order per rank
    if devices_per_process is not None:
        flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
        env.setdefault("JAX_PLATFORMS", "cpu")  # fake devices are CPU devices
    return env


def command(script: str, args: Sequence[str], *, module: bool = False) -> list[str]:
    """The command line of every rank: this Python running the script (or `-m module`)."""
    if module:
        if not re.fullmatch(r"[A-Za-z_][\w.]*", script):
            raise ConfigError(f"-m {script!r} is not a module name; give e.g. -m pkg.train.")
        return [sys.executable, "-m", script, *args]
    if not os.path.isfile(script):
        raise ConfigError(
            f"no such script {script!r}; give the path of a Python file (or -m pkg.module)."
        )
    return [sys.executable, script, *args]


def die_with_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` for a rank: the kernel SIGKILLs it when the thread that started it ends
    (the launcher dies). None off Linux, where there is no such request."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    launcher = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the request: die now
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def describe_status(code: int) -> str:
    """A rank's return code in words (negative: killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    if code == PREEMPTED:
        return "exited with status 143 (preempted: SIGTERM)"
    if code == 134:
        return "exited with status 134 (aborted; JAX aborts a process whose peer is gone)"
    return f"exited with status {code}"


def exit_status(code: int) -> int:
    """A shell's exit status for a return code: 128 + signal for a killed process."""
    return 128 - code if code < 0 else code


@dataclasses.dataclass
class Outcome:
    """How a launch ended: the status to exit with, and the rank that decided it."""

    status: int
    rank: int | None
    message: str


class Launch:
    """N ranks of one command, supervised until they all end (see the module doc)."""

    def __init__(
        self,
        cmd: list[str],
        nproc: int,
        *,
        devices_per_process: int | None = None,
        port: int | None = None,
        grace: float = 60.0,
        kill_timeout: float = 5.0,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
    ) -> None:
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc}; give at least 1 process.")
        if devices_per_process is not None and devices_per_process < 1:
            raise ConfigError(f"--devices-per-process {devices_per_process}; give at least 1.")
        self.cmd, self.nproc, self.devices = cmd, nproc, devices_per_process
        self.port = port if port is not None else free_port()
        self.grace, self.kill_timeout = grace, kill_timeout
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.forwarded: int | None = None  # a signal the launcher passed on to the ranks
        self.error_dir: str | None = None  # where the ranks write their errors
        self._locks = {id(self.out): threading.Lock(), id(self.err): threading.Lock()}

    # -- starting and output --------------------------------------------------------------
    def start(self) -> None:
        coordinator = f"127.0.0.1:{self.port}"
        self.error_dir = errors = tempfile.mkdtemp(prefix="jaxnitro-launch-")
        # Every rank is started from this thread, and before any output thread exists
        # (a preexec_fn runs between fork and exec, where another thread's lock can hang it).
        die_with_launcher = die_with_this_thread()
        for rank in range(self.nproc):
            env = rank_env(
                dict(os.environ),
                rank=rank,
                nproc=self.nproc,
                coordinator=coordinator,
                devices_per_process=self.devices,
                error_file=os.path.join(errors, f"rank-{rank}.json"),
            )
            self.procs.append(
                subprocess.Popen(
                    self.cmd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # the terminal's Ctrl-C reaches the launcher only
                    preexec_fn=die_with_launcher,
                )
            )
        for rank, proc in enumerate(self.procs):
            for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
                t = threading.Thread(target=self._pump, args=(rank, pipe, sink), daemon=True)
                t.start()
                self.pumps.append(t)

    def _error(self, rank: int) -> dict | None:
        """What rank `rank` wrote about its failure, if it wrote anything."""
        if self.error_dir is None:
            return None
        try:
            with open(os.path.join(self.error_dir, f"rank-{rank}.json"), encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) and "type" in got else None

    def _pump(self, rank: int, pipe, sink: IO[str]) -> None:
        prefix = f"[rank {rank}] "
        aborting = False  # JAX's abort report began: the rest is its C++ stack trace
        unhealthy, silent = False, []  # whether it named the silent processes, and which
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if aborting:
                if line.strip().isdigit():  # the task ids under "tasks are unhealthy"
                    silent.append(line.strip())
                continue
            if _JAX_FATAL.match(line):
                aborting, unhealthy = True, _UNHEALTHY in line
                continue
            self._write(sink, prefix + line + "\n")
        if aborting:
            who = f"process {', '.join(silent)}" if unhealthy and silent else "another process"
            self._write(
                sink,
                f"{prefix}jaxnitro launch: JAX aborted rank {rank} because {who} of the run "
                f"died or stopped answering (the first failing rank is named below; its C++ "
                f"stack trace is left out)\n",
            )
        pipe.close()

    def _write(self, sink: IO[str], text: str) -> None:
        with self._locks.setdefault(id(sink), threading.Lock()):
            sink.write(text)
            sink.flush()

    def note(self, text: str) -> None:
        self._write(self.err, f"jaxnitro launch: {text}\n")

    # -- signals and stopping -------------------------------------------------------------
    def forward(self, signum: int) -> None:
        """Pass a signal the launcher received on to every rank still running."""
        self.forwarded = signum
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def stop_all(self) -> None:
        """SIGTERM every running rank; SIGKILL those still running after `kill_timeout`."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.kill_timeout
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()

    # -- supervision ----------------------------------------------------------------------
    def wait(self, poll: float = 0.05) -> Outcome:
        """Until every rank has ended; the first failure decides the outcome."""
        first: tuple[int, int] | None = None  # (rank, return code)
        preempted_at: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and first is None:
                    first = (rank, code)
                    if code == PREEMPTED or self.forwarded is not None:
                        preempted_at = time.monotonic()  # the others are saving too
                    else:
                        raised = self._first_raised()
                        if raised is not None:
                            r, error = raised
                            self.note(f"rank {r} raised {error['type']}; stopping the others")
                        else:
                            self.note(f"rank {rank} {describe_status(code)}; stopping the others")
                        self.stop_all()
            if all(c is not None for c in codes):
                break
            if (
                first is not None
                and preempted_at is not None
                and time.monotonic() - preempted_at > self.grace
            ):
                self.note(
                    f"ranks still running {self.grace:.0f}s after rank {first[0]} was "
                    f"preempted; stopping them"
                )
                self.stop_all()
            time.sleep(poll)
        for t in self.pumps:
            t.join(timeout=5)
        return self._outcome(first)

    def _outcome(self, first: tuple[int, int] | None) -> Outcome:
        if first is None:
            return Outcome(0, None, f"all {self.nproc} ranks exited with status 0")
        rank, code = first
        raised = self._first_raised()
        if raised is not None and code != PREEMPTED:
            # A rank that raised makes the others stop at once: one of them may end first.
            rank, error = raised
            code = self.procs[rank].returncode
            said = f"{error['type']}: {error.get('message', '')}".rstrip(": ")
        else:
            said = None
        others = [
            f"rank {r} {describe_status(p.returncode)}"
            for r, p in enumerate(self.procs)
            if r != rank and p.returncode != 0
        ]
        tail = f" (then: {'; '.join(others)})" if others else ""
        first_word = "was preempted first" if code == PREEMPTED else "failed first"
        how = f"{said} (it {describe_status(code)})" if said else f"it {describe_status(code)}"
        return Outcome(exit_status(code), rank, f"rank {rank} {first_word}: {how}{tail}")

    def _first_raised(self) -> tuple[int, dict] | None:
        """The rank that wrote its error first, with what it wrote."""
        written = [(r, e) for r in range(self.nproc) if (e := self._error(r)) is not None]
        if not written:
            return None
        return min(written, key=lambda item: float(item[1].get("time", 0.0)))

    def run(self) -> Outcome:
        """Start the ranks, forward SIGINT/SIGTERM to them while they run, and wait."""
        handlers = {}
        on_main = threading.current_thread() is threading.main_thread()
        try:
            if on_main:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    handlers[signum] = signal.signal(signum, lambda s, f: self.forward(s))
            self.start()
            return self.wait()
        except BaseException:
            self.stop_all()
            raise
        finally:
            for signum, previous in handlers.items():
                signal.signal(signum, previous)
            if self.error_dir is not None:
                shutil.rmtree(self.error_dir, ignore_errors=True)
