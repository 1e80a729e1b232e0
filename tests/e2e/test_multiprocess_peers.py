"""Dead and failing peers in a multi-process run: a rank that raises stops every rank at once
(the launcher names its exception), ranks die with their launcher, and a rank whose peer is
gone says which one before JAX aborts it, with no C++ stack trace under the launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.paths import SRC
from helpers.procs import alive

from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.dist import launcher

STACK_TRACE = "Check failure stack trace"

# Rank 0 cannot take the run directory's lock (the test holds it) while rank 1 already waits
# for rank 0 in an exchange: the setup failure of the audit, without a model to build.
LOCKED = """
    import sys
    import jaxnitro as jn
    from jaxnitro._src.checkpoint.runlock import RunLock
    jn.distributed.initialize()
    if jn.distributed.process_index() == 0:
        RunLock(sys.argv[1]).acquire("train", what=f"run directory {sys.argv[1]}")
    jn.distributed.broadcast("run settings")  # rank 1 waits here for rank 0
    print("unreachable")
"""

# Both ranks say "ready" once both are up; then rank KILLED (argv[1]) SIGKILLs itself and the
# other waits for it at a barrier.
KILLED = """
    import os, signal, sys
    import jaxnitro as jn
    jn.distributed.initialize()
    jn.distributed.barrier("up")
    print("ready", flush=True)
    if jn.distributed.process_index() == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    jn.distributed.barrier("end")
"""


def _script(tmp_path, body: str, name: str = "rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXNITRO_")}
    env.update(PYTHONPATH=SRC, JAX_PLATFORMS="cpu", JAXNITRO_HEARTBEAT_TIMEOUT="6", **extra)
    return env


def _launch(script: str, *args: str, timeout: float = 150) -> tuple[int, str, str, float]:
    cmd = [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", script, *args]
    t0 = time.monotonic()
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    return got.returncode, got.stdout, got.stderr, time.monotonic() - t0


def _two_ranks(script: str, *args: str) -> list[subprocess.Popen]:
    """Two ranks started by the test itself (no launcher)."""
    port = str(launcher.free_port())
    return [
        subprocess.Popen(
            [sys.executable, script, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                JAXNITRO_COORDINATOR=f"127.0.0.1:{port}",
                JAXNITRO_NUM_PROCESSES="2",
                JAXNITRO_PROCESS_ID=str(rank),
            ),
        )
        for rank in range(2)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each rank's (status, stderr), all within `timeout` seconds (killed otherwise)."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.fixture
def locked_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = RunLock(run_dir)
    lock.acquire("train", what="the test's run directory")
    yield str(run_dir)
    lock.release()


# ---------------------------------------------------------------- a rank that raises
@pytest.mark.slow
@pytest.mark.multi_device
def test_a_rank_that_raises_stops_the_launch_at_once_naming_its_exception(tmp_path, locked_dir):
    rc, _, err, seconds = _launch(_script(tmp_path, LOCKED), locked_dir)
    assert rc == 1, err[-3000:]
    assert seconds < 60  # (it was 300 s of silence, then an abort)
    assert "rank 0 failed first: RunLockedError: run directory" in err
    assert "is in use by" in err and "(it exited with status 1)" in err
    assert "[rank 1] jaxnitro: process 0 failed (RunLockedError: run directory" in err
    assert STACK_TRACE not in err and "Shutdown barrier" not in err


@pytest.mark.slow
@pytest.mark.multi_device
def test_without_the_launcher_a_raising_rank_stops_the_other_which_names_it(tmp_path, locked_dir):
    t0 = time.monotonic()
    (rc0, err0), (rc1, err1) = _finish(_two_ranks(_script(tmp_path, LOCKED), locked_dir), 100)
    assert time.monotonic() - t0 < 60
    assert rc0 == 1 and "RunLockedError: run directory" in err0  # its own traceback
    assert rc1 == 1, err1[-3000:]
    assert "jaxnitro: process 0 failed (RunLockedError: run directory" in err1
    assert STACK_TRACE not in err0 + err1


@pytest.mark.slow
@pytest.mark.multi_device
def test_a_jaxnitro_command_that_fails_on_one_rank_stops_the_launch_at_once(tmp_path):
    # The command line's error exit (status 1, no traceback) ends the run like an exception.
    script = _script(
        tmp_path,
        """
        import sys
        import jaxnitro as jn
        from jaxnitro._src.cli import main
        jn.distributed.initialize()
        if jn.distributed.process_index() == 0:
            main(["plot", sys.argv[1], "-o", sys.argv[1] + "/curves.png"])
        jn.distributed.broadcast("run settings")
        """,
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err, seconds = _launch(script, str(empty), timeout=120)
    assert rc == 1 and seconds < 60, err[-3000:]
    assert "rank 0 failed first: ConfigError: " in err and "holds no metrics.jsonl" in err
    assert "[rank 1] jaxnitro: process 0 failed (ConfigError: " in err


# ---------------------------------------------------------------- a rank that dies
@pytest.mark.slow
@pytest.mark.multi_device
def test_without_the_launcher_the_survivor_names_the_silent_rank_before_jax_aborts(tmp_path):
    procs = _two_ranks(_script(tmp_path, KILLED), "1")
    (rc0, err0), (rc1, _) = _finish(procs, 120)
    assert rc1 == -signal.SIGKILL
    said = re.search(r"jaxnitro: process 1 has not answered for (\d+)s: it died or hangs", err0)
    assert said and int(said.group(1)) >= 3, err0[-3000:]  # half the 6 s heartbeat timeout
    assert "$JAXNITRO_HEARTBEAT_TIMEOUT" in err0 and "jaxnitro launch" in err0
    # Said before JAX's own report (which follows, after the 6 s heartbeat timeout).
    jax_said = err0.find("Terminating process")
    assert jax_said == -1 or said.start() < jax_said
    assert rc0 != 0


@pytest.mark.slow
@pytest.mark.multi_device
def test_under_the_launcher_a_dead_coordinator_leaves_no_cxx_stack_trace(tmp_path):
    rc, _, err, seconds = _launch(_script(tmp_path, KILLED), "0")
    assert seconds < 60, err[-3000:]
    # Which failure the launcher sees first is a race: rank 0's SIGKILL (137), or rank 1
    # failing to reach the dead coordination service (JAX's abort, 134, or its error, 1).
    assert (rc == 137 and "rank 0 failed first: it was killed by SIGKILL" in err) or (
        rc in (1, 134) and "rank 1 failed first: DistributedError" in err
    ), err[-3000:]
    assert STACK_TRACE not in err and "    @ " not in err
    # Rank 1 said why it stopped: its own watch, or the launcher for JAX's abort.
    assert (
        "[rank 1] jaxnitro: process 0 (it hosts the run's coordination service) stopped" in err
        or "[rank 1] jaxnitro launch: JAX aborted rank 1 because another process" in err
    ), err[-3000:]


# ---------------------------------------------------------------- the launcher dies
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(120)  # training, as far as the launcher knows
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        while len(pids) < 2:  # both ranks started (readline ends at EOF if the launcher dies)
            line = proc.stdout.readline()
            assert line, "the launcher ended before both ranks started"
            pids.append(int(line.split()[-1]))
        proc.send_signal(signal.SIGKILL)  # what the OOM killer does
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids), "a rank outlived its launcher by 10 s"
    finally:
        proc.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_the_launcher_says_jaxs_abort_report_in_one_line(tmp_path):
    # The report JAX's runtime prints before aborting a rank whose peer stopped sending
    # heartbeats (as jax 0.10.2 prints it), from a rank that needs no JAX to print it.
    script = _script(
        tmp_path,
        r"""
        import os, sys
        if os.environ["JAXNITRO_PROCESS_ID"] == "1":
            sys.exit(0)
        print("training", file=sys.stderr, flush=True)
        sys.stderr.write(
            "F1202 03:41:54.091227    4829 client.h:80] Terminating process because the JAX "
            "distributed service detected fatal errors. absl::Status: UNAVAILABLE: The "
            "following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have "
            "crashed.\n*** Check failure stack trace: ***\n"
            "    @     0x7fc275440634  absl::log_internal::LogMessage::SendToLog()\n"
        )
        sys.stderr.flush()
        os.abort()
        """,
    )
    rc, _, err, _ = _launch(script, timeout=60)
    assert rc == 134
    assert "[rank 0] training" in err
    assert (
        "[rank 0] jaxnitro launch: JAX aborted rank 0 because process 1 of the run died or "
        "stopped answering" in err
    )
    assert STACK_TRACE not in err and "absl::" not in err and "Terminating" not in err
    assert "rank 0 failed first: it was killed by SIGABRT" in err
