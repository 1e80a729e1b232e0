"""Run one script as N local processes of a `jax.distributed` run (what torchrun does for
PyTorch; JAX has no such tool).

Each rank gets its environment (the coordinator's address on a free port, the process count
and its id, and with `devices_per_process` that many fake CPU devices), its own session (a
Ctrl-C at the terminal reaches the launcher only, which forwards it once to every rank), and
its output prefixed `[rank i] `. The first rank to fail decides the outcome: the others are
stopped (SIGTERM, then SIGKILL after `kill_timeout`) and the launcher exits with that rank's
status, saying which rank failed and how. A rank that exits 143 was preempted: the others are
given `grace` seconds to checkpoint the same step and exit too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from .distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .errors import ConfigError

PREEMPTED = 143
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


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
) -> dict[str, str]:
    """The environment of one rank: `base` plus the distributed variables (and the fake CPU
    device count, replacing any count already in XLA_FLAGS)."""
    env = dict(base)
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
        self._locks = {id(self.out): threading.Lock(), id(self.err): threading.Lock()}

    # -- starting and output --------------------------------------------------------------
    def start(self) -> None:
        coordinator = f"127.0.0.1:{self.port}"
        for rank in range(self.nproc):
            env = rank_env(
                dict(os.environ),
                rank=rank,
                nproc=self.nproc,
                coordinator=coordinator,
                devices_per_process=self.devices,
            )
            proc = subprocess.Popen(
                self.cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C reaches the launcher only
            )
            self.procs.append(proc)
            for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
                t = threading.Thread(target=self._pump, args=(rank, pipe, sink), daemon=True)
                t.start()
                self.pumps.append(t)

    def _pump(self, rank: int, pipe, sink: IO[str]) -> None:
        prefix = f"[rank {rank}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._write(sink, prefix + line + "\n")
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
        others = [
            f"rank {r} {describe_status(p.returncode)}"
            for r, p in enumerate(self.procs)
            if r != rank and p.returncode != 0
        ]
        tail = f" (then: {'; '.join(others)})" if others else ""
        first_word = "was preempted first" if code == PREEMPTED else "failed first"
        return Outcome(
            exit_status(code), rank, f"rank {rank} {first_word}: it {describe_status(code)}{tail}"
        )

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
