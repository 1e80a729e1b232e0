"""dist/ in one process, no devices: the launcher's stopping and outcome, the peer watch
against a fake coordination service, and the exchanges' single-process path and timeout.
(Found by the sampled mutation run of dist/: tests/README.md, "Scores".)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.dist import distributed, peer_watch
from jaxnitro._src.dist.launcher import Launch

# A rank that takes SIGTERM as a signal to save: it says it is ready, then exits 3 0.3 s
# after the signal.
SAVING = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda s, f: (time.sleep(0.3), sys.exit(3)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _rank(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_stop_all_lets_a_rank_finish_its_save_within_kill_timeout():
    launch = Launch(["unused"], 1, kill_timeout=10.0)
    launch.procs = [_rank(SAVING)]
    launch.stop_all()
    assert launch.procs[0].returncode == 3  # its own exit, not SIGKILL


def test_stop_all_kills_a_rank_that_outlives_kill_timeout():
    hung = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    launch = Launch(["unused"], 1, kill_timeout=0.3)
    launch.procs = [_rank(hung + "print('ready', flush=True)\ntime.sleep(60)\n")]
    t0 = time.monotonic()
    launch.stop_all()
    assert launch.procs[0].returncode == -9 and time.monotonic() - t0 < 5


def test_a_failure_of_the_launcher_itself_stops_the_ranks(monkeypatch):
    launch = Launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, kill_timeout=2.0)

    def interrupted(poll=0.05):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.run()
    assert len(launch.procs) == 2 and all(p.poll() is not None for p in launch.procs)


def test_the_outcome_of_ranks_that_all_exited_zero():
    outcome = Launch(["unused"], 3)._outcome(None)
    assert outcome.status == 0 and outcome.rank is None
    assert outcome.message == "all 3 ranks exited with status 0"


def test_one_device_per_process_is_accepted_none_refused():
    assert Launch(["unused"], 2, devices_per_process=1).devices == 1
    with pytest.raises(ConfigError, match="--devices-per-process 0; give at least 1"):
        Launch(["unused"], 2, devices_per_process=0)


class _Service:
    """The coordination service's key-value store, as the peer watch uses it."""

    def __init__(self, failed: str | None = None):
        self.store: dict[str, str] = {} if failed is None else {peer_watch.FAILED: failed}
        self.lock = threading.Lock()

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.store:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.store[key]

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            self.store[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def _watch(monkeypatch, service, *, me=0, count=2, heartbeat_s=0.2, seconds=0.5):
    calls = []
    watch = peer_watch.PeerWatch(service, me=me, count=count, heartbeat_s=heartbeat_s)
    monkeypatch.setattr(watch, "_silent", lambda p, quiet: calls.append(("silent", p, quiet)))
    monkeypatch.setattr(watch, "_peer_failed", lambda failed: calls.append(("failed", failed)))
    thread = threading.Thread(target=watch._run, daemon=True)
    thread.start()
    thread.join(seconds)
    watch.stop()
    thread.join(5)
    return calls


def test_the_peer_watch_names_a_silent_peer_with_how_long_it_was_silent(monkeypatch):
    calls = _watch(monkeypatch, _Service())  # process 1 never posts its counter
    assert [c[:2] for c in calls] == [("silent", 1)]  # once
    assert 0.1 <= calls[0][2] < 0.5  # half the heartbeat timeout, give or take a beat


def test_the_peer_watch_reacts_to_another_process_failing_not_to_its_own(monkeypatch):
    other = '{"process": 1, "error": "ValueError: x"}'
    calls = _watch(monkeypatch, _Service(failed=other), seconds=0.2)
    assert calls == [("failed", {"process": 1, "error": "ValueError: x"})]
    mine = '{"process": 0, "error": "ValueError: x"}'
    calls = _watch(monkeypatch, _Service(failed=mine), count=1, seconds=0.2)
    assert calls == []  # its own failure is its own path out


def test_single_process_exchanges_need_no_coordination_service():
    assert distributed._client() is None  # none here: a call to it would fail
    assert distributed.gather("test-gather", {"a": 1}) == [{"a": 1}]


def test_the_barrier_timeout_is_ten_minutes_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("JAXNITRO_BARRIER_TIMEOUT", raising=False)
    assert distributed.timeout_ms() == 600_000
    monkeypatch.setenv("JAXNITRO_BARRIER_TIMEOUT", "7")
    assert distributed.timeout_ms() == 7_000
