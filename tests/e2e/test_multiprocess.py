"""Many processes: `jn.distributed.initialize`, `jaxnitro launch`, and runs of 2 localhost
processes (gloo) that must match one process with as many devices."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.paths import SRC

import jaxnitro as jn
from jaxnitro._src.dist import distributed, launcher
from jaxnitro.distributed import resolve_args

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- arguments, no processes
def test_initialize_reads_the_launchers_variables_and_the_arguments_win(monkeypatch):
    monkeypatch.setenv("JAXNITRO_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JAXNITRO_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXNITRO_PROCESS_ID", "3")
    monkeypatch.setenv("JAXNITRO_LOCAL_DEVICE_IDS", "0,1")
    assert resolve_args(None, None, None, None) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
        "local_device_ids": [0, 1],
    }
    got = resolve_args("host:99", 2, 0, None)
    assert (got["coordinator_address"], got["num_processes"], got["process_id"]) == (
        "host:99",
        2,
        0,
    )


def test_with_nothing_set_initialize_resolves_one_process(monkeypatch):
    from helpers.clusters import LAYOUT_VARIABLES

    for name in LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert resolve_args(None, None, None, None) == {
        "coordinator_address": None,  # nothing to start
        "num_processes": 1,
        "process_id": 0,
        "local_device_ids": None,
    }


def test_initialize_itself_hands_jax_the_resolved_layout(monkeypatch):
    """Through the public entry, not the helper: one process starts nothing; a JAXJob's
    variables reach `jax.distributed.initialize` as resolved, with JAX's own detection off."""
    import jax
    from helpers.clusters import LAYOUT_VARIABLES

    for name in LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    asked = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: asked.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "_check_backends_untouched", lambda: None)  # started here
    monkeypatch.setattr(distributed, "_watch_peers", lambda: None)
    monkeypatch.setattr(distributed, "_state", {})
    one = jn.distributed.initialize()
    assert (one.source, one.num_processes, asked) == ("single", 1, [])

    monkeypatch.setattr(distributed, "_state", {})
    for name, value in {
        "COORDINATOR_ADDRESS": "10.0.0.1",
        "COORDINATOR_PORT": "1234",
        "NUM_PROCESSES": "4",
        "PROCESS_ID": "3",
    }.items():
        monkeypatch.setenv(name, value)
    collectives = jax.config.jax_cpu_collectives_implementation
    try:
        got = jn.distributed.initialize()
    finally:
        jax.config.update("jax_cpu_collectives_implementation", collectives)
    assert (got.source, got.num_processes, got.process_id) == ("jaxjob", 4, 3)
    (kw,) = asked
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"]) == (
        "10.0.0.1:1234",
        4,
        3,
    )
    assert kw["cluster_detection_method"] == "deactivate"


def test_bad_distributed_arguments_name_the_fix(monkeypatch):
    with pytest.raises(jn.ConfigError, match=r"process_id=2 with num_processes=2: ids run from 0"):
        resolve_args("h:1", 2, 2, None)
    with pytest.raises(jn.ConfigError, match=r"has no port; give host:port"):
        resolve_args("localhost", 2, 0, None)
    monkeypatch.setenv("JAXNITRO_NUM_PROCESSES", "two")
    with pytest.raises(jn.ConfigError, match=r"\$JAXNITRO_NUM_PROCESSES='two' is not an integer"):
        resolve_args(None, None, None, None)


def test_initialize_after_jax_started_says_to_call_it_first():
    import jax

    jax.devices()  # this test process has started its backend
    with pytest.raises(jn.ConfigError, match=r"must run before JAX starts its backends"):
        jn.distributed.initialize("localhost:1", 2, 0)
    assert not jn.distributed.is_initialized()


def test_one_process_exchanges_are_local():
    assert jn.distributed.broadcast("x", {"a": 1}) == {"a": 1}
    jn.distributed.barrier("nothing to wait for")
    jn.distributed.check_same("shape", [1, 2], what="the shape", fix="")


# ---------------------------------------------------------------- the launcher's pieces
def test_each_rank_gets_its_environment_and_one_device_count():
    env = launcher.rank_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"},
        rank=1,
        nproc=2,
        coordinator="127.0.0.1:5",
        devices_per_process=2,
    )
    assert env["JAXNITRO_COORDINATOR"] == "127.0.0.1:5"
    assert (env["JAXNITRO_NUM_PROCESSES"], env["JAXNITRO_PROCESS_ID"]) == ("2", "1")
    assert env["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu"
    plain = launcher.rank_env({}, rank=0, nproc=1, coordinator="h:1", devices_per_process=None)
    assert "XLA_FLAGS" not in plain and "JAX_PLATFORMS" not in plain


def test_statuses_are_said_in_words():
    assert launcher.describe_status(-9) == "was killed by SIGKILL"
    assert "preempted" in launcher.describe_status(143)
    assert launcher.describe_status(1) == "exited with status 1"
    assert launcher.exit_status(-9) == 137 and launcher.exit_status(3) == 3


def test_free_ports_are_free():
    import socket

    port = launcher.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_launch_refuses_what_it_cannot_run(tmp_path):
    from click.testing import CliRunner

    from jaxnitro._src.cli import cli

    runner = CliRunner()
    got = runner.invoke(cli, ["launch", "--nproc", "2", str(tmp_path / "nope.py")])
    assert got.exit_code == 2 and "no such script" in got.output
    got = runner.invoke(cli, ["launch", "--nproc", "0", "x.py"])
    assert got.exit_code == 2 and "--nproc" in got.output
    got = runner.invoke(cli, ["launch", "x.py"])
    assert got.exit_code == 2 and "--nproc" in got.output
    with pytest.raises(jn.ConfigError, match="not a module name"):
        launcher.command("a b", [], module=True)
    with pytest.raises(jn.ConfigError, match="at least 1"):
        launcher.Launch(["true"], 0)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_launch_prefixes_output_passes_args_and_exits_with_the_first_failure(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys, time
        rank = int(os.environ["JAXNITRO_PROCESS_ID"])
        print("args", sys.argv[1:], "of", os.environ["JAXNITRO_NUM_PROCESSES"])
        print("warn", file=sys.stderr)
        if rank == 1:
            time.sleep(1.5); sys.exit(3)
        time.sleep(30)   # the launcher must stop this rank, not wait for it
        """,
    )
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    run = launcher.Launch([sys.executable, script, "--x", "1"], 3, kill_timeout=2, out=out, err=err)
    outcome = run.run()
    assert time.monotonic() - t0 < 20
    assert outcome.status == 3 and outcome.rank == 1
    assert "rank 1 failed first: it exited with status 3" in outcome.message
    lines = out.getvalue().splitlines()
    assert sorted(lines) == [f"[rank {r}] args ['--x', '1'] of 3" for r in range(3)]
    assert "[rank 2] warn" in err.getvalue()
    assert "rank 1 exited with status 3; stopping the others" in err.getvalue()


def test_launch_names_a_rank_killed_by_a_signal(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["JAXNITRO_PROCESS_ID"] == "0":
            time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
        """,
    )
    outcome = launcher.Launch([sys.executable, script], 2, kill_timeout=2, err=io.StringIO()).run()
    assert outcome.status == 137 and outcome.rank == 0
    assert "rank 0 failed first: it was killed by SIGKILL" in outcome.message


@pytest.mark.slow
def test_launch_forwards_sigterm_to_every_rank(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda s, f: (print("got TERM"), sys.exit(143)))
        print("ready")
        time.sleep(30)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxnitro", "launch", "--nproc", "2", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    seen = 0
    while seen < 2:  # both ranks installed their handler
        seen += "ready" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert "[rank 0] got TERM" in out and "[rank 1] got TERM" in out


# ---------------------------------------------------------------- 2 processes × 2 devices
RANK = os.path.join(HERE, "multiprocess_rank.py")


def _launch(out, mode: str, *, nproc: int = 2, timeout: float = 120):
    """`jaxnitro launch` of tests/multiprocess_rank.py; (return code, stderr, seconds, ranks)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jaxnitro", "launch", "--nproc", str(nproc)]
    cmd += ["--devices-per-process", "2", RANK, str(out), str(out / "run"), mode]
    t0 = time.monotonic()
    got = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": SRC, "JAXNITRO_NO_PLOT": "1"},
    )
    return got.returncode, got.stderr, time.monotonic() - t0, _ranks(out, nproc)


def _one_process(out, mode: str) -> dict:
    """The rank script as one process with 4 devices (the reference of a 2 × 2 run)."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXNITRO_")}
    env.update(
        PYTHONPATH=SRC,
        JAXNITRO_NO_PLOT="1",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    got = subprocess.run(
        [sys.executable, RANK, str(out), str(out / "run"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return _ranks(out, 1)[0]


def _ranks(out, nproc: int) -> list[dict]:
    import json

    return [
        json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else {}
        for r in range(nproc)
    ]


@pytest.fixture(scope="module")
def straight_pair(tmp_path_factory):
    """An uninterrupted 2 × 2 run (3 epochs of 8 steps)."""
    out = tmp_path_factory.mktemp("pair")
    rc, err, _, ranks = _launch(out, "train")
    assert rc == 0, err[-3000:]
    return out, ranks


def _max_diff(a: list, b: list) -> float:
    import numpy as np

    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.slow
@pytest.mark.multi_device
def test_two_processes_train_like_one_process_with_as_many_devices(straight_pair, tmp_path):
    import json

    out, ranks = straight_pair
    assert [r["devices"] for r in ranks] == [4, 4] and [r["step"] for r in ranks] == [24, 24]
    assert ranks[0]["params"] == ranks[1]["params"]  # one model, on every process
    one = tmp_path / "one"
    single = _one_process(one, "train")
    assert single["devices"] == 4 and single["step"] == 24
    assert _max_diff(ranks[0]["params"], single["params"]) < 1e-5
    # Only process 0 writes the log, and each train step is in it once.
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x.get("context") == "train"]
    assert steps == list(range(1, 25))
    val = [x for x in lines if x.get("context") == "validate"]
    ref = [json.loads(x) for x in (one / "run" / "metrics.jsonl").read_text().splitlines()]
    ref_val = [x for x in ref if x.get("context") == "validate"]
    assert [v["acc"] for v in val] == [v["acc"] for v in ref_val]  # exact: same counts
    assert len(list((out / "run" / "checkpoints").glob("epoch-*"))) == 3


@pytest.mark.slow
@pytest.mark.multi_device
def test_sigterm_to_one_rank_checkpoints_both_at_one_step_and_resume_is_bitwise(
    straight_pair, tmp_path
):
    rc, err, _, ranks = _launch(tmp_path, "sigterm")  # rank 1 gets SIGTERM after step 3
    assert rc == 143, err[-3000:]
    assert "was preempted first" in err  # (both end at once: either may be seen first)
    assert [r["ended"] for r in ranks] == ["preempted", "preempted"]
    assert ranks[0]["step"] == ranks[1]["step"] and 3 < ranks[0]["step"] < 24
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"]
    assert f"step-{ranks[0]['step']:06d}" in ranks[0]["checkpoint"]
    rc, err, _, resumed = _launch(tmp_path, "resume")
    assert rc == 0, err[-3000:]
    assert [r["step"] for r in resumed] == [24, 24]
    straight = straight_pair[1]
    assert resumed[0]["params"] == straight[0]["params"]  # bit for bit
    assert resumed[1]["params"] == straight[1]["params"]


@pytest.mark.slow
@pytest.mark.multi_device
def test_a_killed_rank_ends_the_launch_in_bounded_time_naming_it(tmp_path):
    rc, err, seconds, _ = _launch(tmp_path, "die")  # rank 1 SIGKILLs itself after step 3
    assert rc == 137 and seconds < 60
    assert "rank 1 failed first: it was killed by SIGKILL" in err


@pytest.mark.slow
@pytest.mark.multi_device
def test_processes_with_other_data_shapes_fail_naming_both(tmp_path):
    rc, err, seconds, ranks = _launch(tmp_path, "ragged")  # rank 1 has one batch fewer
    assert rc == 1 and seconds < 60
    for r in ranks:
        assert r["error"].startswith("DataError: the data")
        assert '"batches": 8' in r["error"] and '"batches": 7' in r["error"]


@pytest.mark.slow
@pytest.mark.multi_device
def test_fsdp_over_two_processes_writes_each_processes_shards(straight_pair, tmp_path):
    import json

    import numpy as np

    rc, err, _, ranks = _launch(tmp_path, "fsdp")
    assert rc == 0, err[-3000:]
    assert "P(None, 'data')" in ranks[0]["specs"] and "P('data',)" in ranks[0]["specs"]
    assert _max_diff(ranks[0]["params"], straight_pair[1][0]["params"]) < 1e-5
    latest = sorted((tmp_path / "run" / "checkpoints").glob("epoch-0003-*"))[-1]
    arrays = latest / "arrays"
    assert (arrays / "ocdbt.process_0").is_dir() and (arrays / "ocdbt.process_1").is_dir()
    meta = json.loads((latest / "meta.json").read_text())
    kernel = next(x for x in meta["trees"]["params"]["leaves"] if x["shape"] == [8, 16])
    assert meta["trees"]["params"]["sharded"] and len(kernel["shards"]) == 4
    # One process, one device: the whole arrays, every shard's checksum verified.
    trees, got = jn.load_checkpoint(latest)
    assert got["step"] == 24
    loaded = [np.asarray(a) for a in jax_leaves(trees["params"])]
    assert _max_diff([a.tolist() for a in loaded], ranks[0]["params"]) == 0.0


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
@pytest.mark.multi_device
def test_request_stop_on_one_rank_stops_every_rank_at_one_step(tmp_path):
    rc, err, _, ranks = _launch(tmp_path, "stop")  # rank 0 calls jn.request_stop after step 3
    assert rc == 143, err[-3000:]
    assert [r["ended"] for r in ranks] == ["preempted", "preempted"]
    assert ranks[0]["step"] == ranks[1]["step"] and ranks[0]["checkpoint"] == ranks[1]["checkpoint"]


@pytest.mark.slow
@pytest.mark.multi_device
def test_a_model_axis_across_processes_feeds_them_the_same_rows(tmp_path):
    rc, err, _, ranks = _launch(tmp_path / "pair", "model")  # {"data": 1, "model": 4}
    assert rc == 0, err[-3000:]
    assert ranks[0]["params"] == ranks[1]["params"] and ranks[0]["step"] == 24
    assert any("model" in s for s in ranks[0]["specs"])  # the kernels are split over 4
    single = _one_process(tmp_path / "one", "model")
    assert single["step"] == 24 and _max_diff(ranks[0]["params"], single["params"]) < 1e-5
