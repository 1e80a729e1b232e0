"""JSONLogger / read_jsonl hardening: links and foreign files, write failures, partial lines,
dedupe across resumes, close/open lifecycle; History never picks a NaN row; no logger loses
a step that a checkpoint covers when the run is killed with SIGKILL and resumed."""

import csv
import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, nitro
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.core.errors import ConfigError, JaxnitroError
from jaxnitro._src.observe.loggers import JSONLogger, LogWarning, LogWriteError, read_jsonl
from jaxnitro._src.run.history import History


def _log_warnings(record):
    return [w for w in record if issubclass(w.category, LogWarning)]


def _jaxnitro_log(path: Path, text: str = '{"type": "params", "seed": 1}\n') -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- 1. links and foreign files


def test_symlinked_metrics_log_is_refused_and_target_untouched(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_bytes(b"my notes\nlast line without newline")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    log = JSONLogger()
    with pytest.raises(ConfigError, match="symbolic link") as ei:
        log.open(run, resume=True)
    msg = str(ei.value)
    assert str(run / "metrics.jsonl") in msg
    assert "Remove the link" in msg and "JSONLogger(path=)" in msg
    assert target.read_bytes() == b"my notes\nlast line without newline"
    log.log_metrics({"loss": 1.0}, context="train", epoch=1, step=1)  # not open: dropped
    log.close()


def test_symlink_to_a_jaxnitro_log_is_refused_too(tmp_path):
    real = _jaxnitro_log(tmp_path / "real.jsonl")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symbolic link"):
        JSONLogger(link).open(tmp_path, resume=True)
    assert real.read_text() == '{"type": "params", "seed": 1}\n'


def test_dangling_symlink_is_refused_and_nothing_is_created(tmp_path):
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(ConfigError, match="symbolic link"):
        JSONLogger().open(tmp_path, resume=False)
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_a_link_appearing_after_the_check_is_refused(tmp_path, monkeypatch):
    # The race O_NOFOLLOW closes: lstat saw nothing, open() meets a link.
    path = tmp_path / "metrics.jsonl"
    target = tmp_path / "target.txt"
    target.write_text("foreign\n")
    real_lstat, done = os.lstat, []

    def lstat_then_link(p, *a, **k):
        if Path(p) == path and not done:  # report "no file", then put a link there
            done.append(True)
            path.symlink_to(target)
            raise FileNotFoundError(errno.ENOENT, "No such file", str(p))
        return real_lstat(p, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat_then_link)
    with pytest.raises(ConfigError, match="symbolic link"):
        JSONLogger(path).open(tmp_path, resume=True)
    assert target.read_text() == "foreign\n"


@pytest.mark.parametrize(
    "content",
    [
        b"id,loss\n1,0.5\n2,0.4",  # a CSV, last line without newline
        b'{"event": "start"}\n{"event": "stop", "t": 1',  # JSONL, but not jaxnitro's
        b"\x00\x01binary",
    ],
)
def test_foreign_file_is_refused_and_left_byte_for_byte(tmp_path, content):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as ei:
        JSONLogger(path).open(tmp_path, resume=True)
    assert f"{path} exists and is not a jaxnitro metrics log; pass another path" in str(ei.value)
    assert path.read_bytes() == content


def test_directory_at_the_log_path_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        JSONLogger().open(tmp_path, resume=False)


def test_empty_existing_file_is_fine(tmp_path):
    path = tmp_path / "m.jsonl"
    path.touch()
    log = JSONLogger(path)
    log.open(tmp_path, resume=False)
    log.log_params({"a": 1})
    log.close()
    assert [r["type"] for r in read_jsonl(path)] == ["params"]


@pytest.mark.parametrize(
    "first",
    [
        '{"type": "params", "seed": 1}\n',
        '{"type":"metrics","context":"train","step":1}\n',  # compact JSON: still a jaxnitro line
        '{"type": "params", "config": {"wid',  # a kill cut the first line itself
    ],
)
def test_jaxnitro_logs_are_appended_to(tmp_path, first):
    path = _jaxnitro_log(tmp_path / "m.jsonl", first)
    log = JSONLogger(path)
    log.open(tmp_path, resume=True)
    log.log_metrics({"loss": 0.5}, context="train", epoch=1, step=2)
    log.close()
    text = path.read_text()
    assert text.startswith(first)  # nothing before the new line was changed
    assert json.loads(text.splitlines()[-1])["loss"] == 0.5


def test_partial_last_line_is_kept_not_truncated(tmp_path):
    before = '{"type": "params", "seed": 1}\n{"type": "metrics", "context": "train", "loss": 0.'
    path = _jaxnitro_log(tmp_path / "metrics.jsonl", before)
    log = JSONLogger()
    log.open(tmp_path, resume=True)
    log.log_metrics({"loss": 0.5}, context="train", epoch=1, step=1)
    log.close()
    text = path.read_text()
    assert text.startswith(before + "\n")  # every byte kept; the fragment is its own line
    with pytest.warns(LogWarning, match="line 2"):
        rows = read_jsonl(path)
    assert [r["type"] for r in rows] == ["params", "metrics"] and rows[1]["loss"] == 0.5


def test_a_complete_log_gets_no_extra_newline(tmp_path):
    path = _jaxnitro_log(tmp_path / "m.jsonl")
    log = JSONLogger(path)
    log.open(tmp_path, resume=True)
    log.close()
    assert path.read_text() == '{"type": "params", "seed": 1}\n'


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_refusing_leaks_no_descriptor(tmp_path):
    path = tmp_path / "foreign.txt"
    path.write_text("hello\n")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(ConfigError):
            JSONLogger(path).open(tmp_path, resume=True)
    assert len(os.listdir("/proc/self/fd")) == before


def test_unwritable_location_raises_log_write_error(tmp_path, monkeypatch):
    real_open = os.open

    def read_only_fs(path, flags, *a, **k):
        if flags & os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only_fs)
    log = JSONLogger()
    with pytest.raises(LogWriteError, match="cannot open the metrics log") as ei:
        log.open(tmp_path, resume=False)
    assert str(tmp_path / "metrics.jsonl") in str(ei.value) and "free on" in str(ei.value)
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.EROFS
    assert isinstance(ei.value.__cause__, OSError)


# ---------------------------------------------------------------- 2. write failures


class _Full:
    """Stands in for a file handle's write: fails with ENOSPC after `ok` writes."""

    def __init__(self, real, ok=0, err=errno.ENOSPC):
        self.real, self.ok, self.err, self.calls = real, ok, err, 0

    def __call__(self, data):
        self.calls += 1
        if self.calls > self.ok:
            raise OSError(self.err, os.strerror(self.err))
        return self.real(data)


def test_disk_full_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = JSONLogger()
    log.open(tmp_path, resume=False)
    log.log_params({"seed": 0})
    full = _Full(log._fh.write, ok=1)
    monkeypatch.setattr(log._fh, "write", full)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        log.log_metrics({"loss": 0.5}, context="train", epoch=1, step=1)  # fast path: ok
        log.log_metrics({"loss": 0.4}, context="train", epoch=1, step=2)  # fails
        for step in range(3, 50):
            log.log_metrics({"loss": 0.3}, context="train", epoch=1, step=step)
        log.log_metrics({"acc": np.float32(0.9)}, context="validate", epoch=1, step=49)
        log.log_other({"note": "x"})
        log.finish("error", error="boom")
        log.finish("error", error="again")
        log.close()
        log.close()
    ws = _log_warnings(rec)
    assert len(ws) == 1, [str(w.message) for w in rec]
    msg = str(ws[0].message)
    assert str(path) in msg and "free on" in msg and "No space left on device" in msg
    assert full.calls == 2  # a broken logger stops trying
    assert isinstance(log.error, LogWriteError) and isinstance(log.error, JaxnitroError)
    assert isinstance(log.error, OSError) and log.error.errno == errno.ENOSPC
    assert str(log.error) == msg and log.error.path == path
    assert [r.get("step") for r in read_jsonl(path)] == [None, 1]


def test_first_failure_in_finish_does_not_raise(tmp_path, monkeypatch):
    # The driver calls finish() inside its error handler: it must not raise a second error.
    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    monkeypatch.setattr(log._fh, "write", _Full(log._fh.write, err=errno.EIO))
    with pytest.warns(LogWarning, match="m.jsonl"):
        log.finish("error", error="RuntimeError('x')")
    assert log.error.errno == errno.EIO
    log.close()


def test_finish_never_raises_even_on_a_bad_value(tmp_path):
    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    with pytest.warns(LogWarning, match="finish line"):
        log.finish("error", thing=BadRepr())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # even a warning turned into an error stays inside
        log.finish("error", thing=BadRepr())
    log.close()


def test_short_writes_are_completed(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.open(tmp_path, resume=False)
    fd = log._fh.fileno()
    monkeypatch.setattr(log._fh, "write", lambda data: os.write(fd, bytes(data[:7])))
    log.log_params({"config": {"width": 128, "name": "a" * 100}})
    log.log_metrics({"loss": 0.25}, context="train", epoch=1, step=1)
    log.close()
    rows = read_jsonl(path)
    assert rows[0]["config"]["name"] == "a" * 100 and rows[1]["loss"] == 0.25


def test_failed_close_does_not_raise(tmp_path, monkeypatch):
    log = JSONLogger(tmp_path / "m.jsonl")
    log.open(tmp_path, resume=False)
    fh = log._fh
    real_close = fh.close

    def failing_close():
        real_close()
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fh, "close", failing_close)
    with pytest.warns(LogWarning):
        log.close()
    log.close()
    assert fh.closed


def test_open_again_after_a_failure_logs_again(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.open(tmp_path, resume=False)
    monkeypatch.setattr(log._fh, "write", _Full(log._fh.write))
    with pytest.warns(LogWarning):
        log.log_metrics({"loss": 1.0}, context="train", epoch=1, step=1)
    log.open(tmp_path, resume=True)  # space was freed
    assert log.error is None
    log.log_metrics({"loss": 2.0}, context="train", epoch=1, step=2)
    log.close()
    assert [r["loss"] for r in read_jsonl(path)] == [2.0]


def test_log_write_error_str_is_its_message():
    e = LogWriteError("the message", path=Path("/x"), cause=OSError(errno.ENOSPC, "full"))
    assert str(e) == "the message" and e.errno == errno.ENOSPC and e.path == Path("/x")


_FSIZE_CHILD = textwrap.dedent("""
    import json, resource, signal, sys, warnings
    from jaxnitro._src.observe.loggers import JSONLogger, LogWarning
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    run_dir = sys.argv[1]
    log = JSONLogger()
    log.open(run_dir, resume=False)
    log.log_params({"seed": 0})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, hard))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in range(1, 500):
            log.log_metrics({"loss": 1.0 / step, "lr": 0.001}, context="train", epoch=1,
                            step=step)
        log.log_metrics({"acc": 0.5, "n": 3}, context="validate", epoch=1, step=499)
        log.finish("completed", step=499)
        log.close()
    ws = [str(w.message) for w in rec if issubclass(w.category, LogWarning)]
    print(json.dumps({"warnings": ws, "errno": log.error and log.error.errno}))
""")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE/SIGXFSZ semantics")
def test_file_size_limit_in_a_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    path = tmp_path / "metrics.jsonl"
    if path.stat().st_size < 4000:
        pytest.skip("RLIMIT_FSIZE did not limit writes here")
    assert out["errno"] == errno.EFBIG
    assert len(out["warnings"]) == 1 and str(path) in out["warnings"][0]
    assert path.stat().st_size == 4000  # the limit cut a line short
    # Resume: the cut line is kept as its own line and skipped on reading.
    log = JSONLogger()
    log.open(tmp_path, resume=True)
    log.log_metrics({"loss": 9.0}, context="train", epoch=2, step=1000)
    log.close()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rows = read_jsonl(path)
    assert len(_log_warnings(rec)) == 1
    steps = [r["step"] for r in rows if r["type"] == "metrics"]
    assert steps[-1] == 1000 and steps[:-1] == list(range(1, len(steps)))


# ---------------------------------------------------------------- 3. read_jsonl


def test_read_jsonl_skips_unreadable_lines_with_one_warning(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        b'{"type": "params"}\n{"type": "metr\n\n[1, 2]\n'
        b'{"type": "metrics", "step": 1}\n\xff\xfe garbage\n{"type": "finish"'
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rows = read_jsonl(path)
    assert rows == [{"type": "params"}, {"type": "metrics", "step": 1}]
    ws = _log_warnings(rec)
    assert len(ws) == 1
    assert "skipped 4" in str(ws[0].message) and "line 2, 4, 6, 7" in str(ws[0].message)


def test_read_jsonl_clean_file_warns_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"type": "params"}\n{"type": "finish"}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_jsonl(path)) == 2


def _m(step, context="train", **kw):
    return {"type": "metrics", "context": context, "epoch": 1, "step": step, **kw}


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dedupe_keeps_the_last_line_per_context_and_step(tmp_path):
    rows = [
        {"type": "params", "seed": 0},
        _m(1, loss=1.0),
        _m(2, loss=2.0),
        _m(2, "validate", acc=0.1),
        {"type": "other", "note": "a"},
        _m(1, loss=1.5),
        {"type": "other", "note": "a"},
        _m(3, loss=3.0),
        _m(2, "validate", acc=0.2),
    ]
    path = _write_rows(tmp_path / "m.jsonl", rows)
    assert read_jsonl(path) == rows  # dedupe is off by default
    got = read_jsonl(path, dedupe=True)
    # Survivors keep the position of their last occurrence; non-metrics lines all stay.
    assert got == [
        {"type": "params", "seed": 0},
        _m(2, loss=2.0),
        {"type": "other", "note": "a"},
        _m(1, loss=1.5),
        {"type": "other", "note": "a"},
        _m(3, loss=3.0),
        _m(2, "validate", acc=0.2),
    ]


def test_dedupe_keeps_lines_of_different_splits(tmp_path):
    rows = [_m(4, "validate", acc=0.8), _m(4, "validate", acc=0.7, split="test")]
    path = _write_rows(tmp_path / "m.jsonl", rows)
    assert read_jsonl(path, dedupe=True) == rows


def test_dedupe_drops_the_timeline_a_kill_lost(tmp_path):
    marker = {
        "type": "other",
        "key": "resumed",
        "from_step": 4,
        "from_checkpoint": "ck/epoch-0001",
        "time": 1.0,
    }
    rows = (
        [{"type": "params"}]
        + [_m(s, loss=float(s)) for s in range(1, 7)]
        + [_m(4, "validate", acc=0.5), _m(4, "data", n=1), _m(6, "data", n=2)]
        + [_m(9, "validate", acc=0.1)]  # a step the resumed run never re-logs
        + [{"type": "params"}, marker]
        + [_m(s, loss=s + 0.5) for s in range(5, 9)]
        + [_m(8, "validate", acc=0.6)]
        + [{"type": "finish", "status": "completed"}]
    )
    path = _write_rows(tmp_path / "m.jsonl", rows)
    got = read_jsonl(path, dedupe=True)
    train = [(r["step"], r["loss"]) for r in got if r.get("context") == "train"]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.5), (6, 6.5), (7, 7.5), (8, 8.5)]
    assert [(r["step"], r["acc"]) for r in got if r.get("context") == "validate"] == [
        (4, 0.5),
        (8, 0.6),
    ]
    assert [r["step"] for r in got if r.get("context") == "data"] == [4]
    assert [r["type"] for r in got if r["type"] != "metrics"] == [
        "params",
        "params",
        "other",
        "finish",
    ]


def test_dedupe_with_two_resumes(tmp_path):
    def marker(n):
        return {"type": "other", "key": "resumed", "from_step": n, "from_checkpoint": "c"}

    rows = (
        [_m(s, loss=0.0) for s in (1, 2, 3, 4, 5)]
        + [marker(2)]
        + [_m(s, loss=1.0) for s in (3, 4, 5, 6)]
        + [marker(4)]
        + [_m(s, loss=2.0) for s in (5, 6)]
    )
    path = _write_rows(tmp_path / "m.jsonl", rows)
    got = [(r["step"], r["loss"]) for r in read_jsonl(path, dedupe=True) if r["type"] == "metrics"]
    assert got == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0)]


def test_log_resumed_writes_the_marker(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.open(tmp_path, resume=True)
    log.log_resumed(np.int64(40), tmp_path / "ck" / "epoch-0002")
    log.close()
    line = json.loads(path.read_text())
    assert list(line) == ["type", "key", "from_step", "from_checkpoint", "time"]
    assert line["type"] == "other" and line["key"] == "resumed" and line["from_step"] == 40
    assert line["from_checkpoint"] == str(tmp_path / "ck" / "epoch-0002")
    assert isinstance(line["time"], float)


def test_kill_and_resume_end_to_end(tmp_path):
    log = JSONLogger()
    log.open(tmp_path, resume=False)
    log.log_params({"seed": 0})
    for s in range(1, 7):
        log.log_metrics({"loss": float(s)}, context="train", epoch=1 + (s > 4), step=s)
        if s == 4:
            log.log_metrics({"acc": 0.5}, context="validate", epoch=1, step=4)
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:  # killed mid-line at step 7
        fh.write('{"type": "metrics", "context": "train", "epoch": 2, "step": 7, "lo')
    log = JSONLogger()
    log.open(tmp_path, resume=True)
    log.log_params({"seed": 0})
    log.log_resumed(4, "ck/epoch-0001")
    for s in range(5, 9):
        log.log_metrics({"loss": s + 0.5}, context="train", epoch=2, step=s)
    log.finish("completed")
    log.close()
    with pytest.warns(LogWarning, match="line 9"):
        rows = read_jsonl(tmp_path / "metrics.jsonl", dedupe=True)
    assert [(r["step"], r["loss"]) for r in rows if r.get("context") == "train"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 5.5),
        (6, 6.5),
        (7, 7.5),
        (8, 8.5),
    ]
    assert rows[-1]["type"] == "finish"


# ---------------------------------------------------------------- 4. lifecycle


def test_finish_does_not_close(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.open(tmp_path, resume=False)
    log.finish("completed")
    log.log_metrics({"loss": 1.0}, context="train", epoch=2, step=9)  # a second jn.train
    log.finish("completed")
    log.close()
    assert [r["type"] for r in read_jsonl(path)] == ["finish", "metrics", "finish"]


def test_close_is_idempotent_and_open_twice_is_a_no_op(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.close()  # before open: fine
    log.open(tmp_path, resume=False)
    fh = log._fh
    log.open(tmp_path, resume=False)
    assert log._fh is fh
    log.log_params({"a": 1})
    log.close()
    log.close()
    log.open(tmp_path, resume=True)  # re-open after close appends
    log.log_params({"a": 2})
    log.close()
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
    assert path.read_text().count("\n") == 2


def test_context_manager_closes(tmp_path):
    path = tmp_path / "m.jsonl"
    with JSONLogger(path) as log:  # given a path: opened on entry
        log.log_params({"a": 1})
    assert log._fh is None
    with pytest.raises(RuntimeError), JSONLogger() as log2:
        log2.open(tmp_path / "run", resume=False)
        log2.log_params({"b": 2})
        raise RuntimeError("boom")
    assert log2._fh is None
    assert read_jsonl(path)[0]["a"] == 1
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["b"] == 2


def test_no_resource_warning_when_closed(tmp_path):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        log = JSONLogger()
        log.open(tmp_path, resume=False)
        log.log_params({"a": 1})
        log.finish("completed")
        log.close()
        del log
        foreign = tmp_path / "foreign.txt"
        foreign.write_text("x\n")
        with pytest.raises(ConfigError):
            JSONLogger(foreign).open(tmp_path, resume=False)
        gc.collect()
    assert not [w for w in rec if issubclass(w.category, ResourceWarning)]


def test_fast_path_accepts_numpy_step_and_epoch(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JSONLogger(path)
    log.open(tmp_path, resume=False)
    log.log_metrics({"loss": float("nan")}, context="train", epoch=np.int32(1), step=np.int64(3))
    log.close()
    assert read_jsonl(path) == [_m(3, loss=None)]


# ---------------------------------------------------------------- 5. History and NaN


@pytest.mark.parametrize(
    "nan",
    [float("nan"), np.float32("nan"), np.float64("nan"), jnp.float32(jnp.nan), np.array(np.nan)],
)
@pytest.mark.parametrize("mode", ["min", "max"])
def test_history_best_never_picks_nan(nan, mode):
    rows = [
        {"epoch": 1, "m": nan},
        {"epoch": 2, "m": 0.5},
        {"epoch": 3, "m": nan},
        {"epoch": 4, "m": 0.7},
        {"epoch": 5, "m": nan},
    ]
    best = History(rows, metric="m", mode=mode).best
    assert best["epoch"] == (2 if mode == "min" else 4)


def test_history_best_skips_infinities_and_all_nan():
    rows = [{"epoch": 1, "m": -np.inf}, {"epoch": 2, "m": 0.3}, {"epoch": 3, "m": np.inf}]
    assert History(rows, metric="m", mode="min").best["epoch"] == 2
    assert History(rows, metric="m", mode="max").best["epoch"] == 2
    nans = [{"epoch": 1, "m": float("nan")}, {"epoch": 2, "m": np.float32("nan")}]
    h = History(nans, metric="m", mode="min")
    assert h.best is None and h.best_index is None
    assert "None" in repr(h)


def test_history_best_ignores_an_int_beyond_float_range():
    rows = [{"epoch": 1, "m": 10**400}, {"epoch": 2, "m": 3}]
    assert History(rows, metric="m", mode="max").best["epoch"] == 2


# ---------------------------------------------------------------- 4. kill -9 after a checkpoint

_KILL_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[3])
    import jaxnitro as jn
    from conftest import Tiny, nitro

    run_dir, kill_at = sys.argv[1], int(sys.argv[2])
    # flush_secs far beyond the run: only what the driver asks for reaches the disk/store
    tb = jn.TensorBoardLogger(flush_secs=3600)
    ml = jn.MLflowLogger(flush_secs=3600)
    loggers = [jn.JSONLogger(), jn.CSVLogger(), tb, ml]
    # 50 steps in one epoch, no validation split: nothing but a checkpoint flushes mid-epoch
    n = nitro(Tiny(n_train=1600, n_val=0, max_epochs=1), run_dir=run_dir, resume="auto",
              checkpoint_every=10, logger=loggers)

    def die(record):
        if record.step == kill_at:
            n.checkpointer.wait()  # the step-30 checkpoint is complete: it is resumed from
            os.kill(os.getpid(), signal.SIGKILL)

    jn.every(1, die, nitro=n)
    print(json.dumps({"start": n.step}), flush=True)
    jn.train(n)
    print(json.dumps({"done": n.step, "mlflow": ml.run_id, "uri": ml.tracking_uri,
                      "tensorboard": str(tb.log_dir)}), flush=True)
""")


def _train_child(run_dir: Path, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _KILL_CHILD, str(run_dir), str(kill_at), str(TESTS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "MLFLOW_ALLOW_FILE_STORE": "true"},
    )


@pytest.mark.slow
def test_a_kill_after_a_checkpoint_loses_no_metric_of_any_logger(tmp_path, monkeypatch):
    """kill -9 at step 36, resume from the step-30 checkpoint, run to step 50: every logger
    has every step once (MLflow lost steps 1-30 for good when it flushed only on a timer)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    killed = _train_child(run_dir, kill_at=36)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _train_child(run_dir, kill_at=-1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [json.loads(x) for x in resumed.stdout.splitlines() if x.startswith("{")]
    assert lines[0] == {"start": 30}
    done = lines[-1]
    assert done["done"] == 50
    everything = list(range(1, 51))
    steps: dict[str, list[int]] = {}

    rows = read_jsonl(run_dir / "metrics.jsonl", dedupe=True)
    steps["jsonl"] = [r["step"] for r in rows if r.get("context") == "train"]

    with open(run_dir / "metrics.csv", newline="") as fh:
        steps["csv"] = [int(r["step"]) for r in csv.DictReader(fh) if r["context"] == "train"]

    acc = EventAccumulator(done["tensorboard"])
    acc.Reload()
    steps["tensorboard"] = [e.step for e in acc.Scalars("train/loss")]

    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the logger's local default store
    history = mlflow.MlflowClient(done["uri"]).get_metric_history(done["mlflow"], "loss")
    steps["mlflow"] = sorted({m.step for m in history})  # 31-36 may come twice: once each

    wrong = {k: sorted(set(everything) - set(v)) for k, v in steps.items() if v != everything}
    assert not wrong, f"steps missing after kill + resume: {wrong}"


def test_a_resume_writes_a_marker_and_dedupe_keeps_the_last_record(run_dir):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    log = run_dir / "metrics.jsonl"
    with open(log, "a") as fh:  # what a kill after step 11 leaves: 3 steps never checkpointed
        for step in (9, 10, 11):
            fh.write(
                json.dumps(
                    {"type": "metrics", "context": "train", "epoch": 2, "step": step, "loss": 9.0}
                )
                + "\n"
            )
    jn.train(nitro(Tiny(max_epochs=2), run_dir=run_dir, resume="auto"))
    raw = jn.read_jsonl(log)
    marker = [ln for ln in raw if ln.get("key") == "resumed"]
    assert len(marker) == 1 and marker[0]["from_step"] == 8
    train = [ln for ln in jn.read_jsonl(log, dedupe=True) if ln.get("context") == "train"]
    assert [ln["step"] for ln in train] == list(range(1, 17))
    assert all(ln["loss"] != 9.0 for ln in train)


def test_the_log_file_is_closed_when_train_ends(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        jn.train(n)
        jn.validate(n)
        gc.collect()
    assert not [m for m in w if issubclass(m.category, ResourceWarning)]
    assert getattr(n.logger, "_fh", None) is None and not n.services.lock.held
