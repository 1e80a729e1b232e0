"""The display as people watch it: a real pseudo-terminal read back as a screen (pyte), a
narrow and a resized console, TERM=dumb, and the notebook display's in-place updates."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pyte
import pytest
from conftest import Tiny
from helpers.notebook import DisplayRecorder
from helpers.paths import SRC, TESTS
from rich.console import Console

import jaxnitro as jn
from jaxnitro._src.observe.display import Display, in_notebook

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")

# 40 train batches of 32 and 5 val batches of 20 per epoch, two epochs.
TRAIN = """
import sys
sys.path.insert(0, {tests!r})
from conftest import Tiny
import jaxnitro as jn
n = jn.Nitro(
    Tiny(n_train=1280, max_epochs=2), run_dir={run_dir!r}, progress={progress!r}, {options}
)
jn.train(n)
print("DONE")
"""


def _run_on_pty(tmp_path, *, columns: int, term: str, progress=None, options="") -> bytes:
    """Run a short training with its stdout on a real pseudo-terminal `columns` wide; the
    bytes the terminal received. `options`: more keywords of `jn.Nitro`, as code."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env.update(PYTHONPATH=str(SRC), JAX_PLATFORMS="cpu", TERM=term, JAXNITRO_NO_PLOT="1")
    script = TRAIN.format(
        tests=str(TESTS), run_dir=str(tmp_path / "run"), progress=progress, options=options
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    return bytes(out)


def _frames(raw: bytes) -> list[str]:
    """Every line state the terminal was sent (escape codes removed; each carriage return,
    newline or cursor move starts a new one)."""
    text = raw.decode(errors="replace")
    parts = re.split(r"\r|\n|\x1b\[[0-9;?]*[ABCDGHJK]", text)
    return [ANSI.sub("", p) for p in parts if ANSI.sub("", p).strip()]


def _screen(raw: bytes, columns: int) -> list[str]:
    screen = pyte.Screen(columns, 200)
    stream = pyte.ByteStream(screen)
    stream.feed(raw.replace(b"\n", b"\r\n"))  # the pty's output post-processing (onlcr)
    return [line.rstrip() for line in screen.display if line.strip()]


@pytest.mark.slow
def test_a_real_terminal_shows_true_counts_transient_bars_and_summary_lines(tmp_path):
    raw = _run_on_pty(tmp_path, columns=60, term="xterm-256color", progress=True)
    frames = _frames(raw)
    for epoch in (1, 2):
        bars = [f for f in frames if re.search(rf"epoch {epoch}/2 .*\d+/\d+", f)]
        assert bars, frames
        # the epoch's last bar state is the true count, labelled as the train bar
        assert re.search(r"\b40/40\b", bars[-1]), bars[-1]
        assert all("validating" not in f for f in bars), bars
    # validation had its own bar, over the split's 5 batches
    val = [f for f in frames if f.lstrip("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏ ").startswith("validating")]
    assert any(re.search(r"\b5/5\b", f) for f in val), frames
    assert all(len(f.rstrip()) <= 60 for f in frames), [f for f in frames if len(f) > 60]
    screen = _screen(raw, 60)
    assert not [line for line in screen if "━" in line or "/40" in line], screen  # none frozen
    summaries = [line for line in screen if re.match(r"epoch \d/2: ", line)]
    assert [s[:10] for s in summaries] == ["epoch 1/2:", "epoch 2/2:"], screen


@pytest.mark.slow
def test_a_population_on_a_real_terminal_shows_one_bar_and_readable_lines(tmp_path):
    options = 'population={"smoothing": [0.0, 0.1, 0.2]}'
    raw = _run_on_pty(tmp_path, columns=120, term="xterm-256color", options=options)
    bars = [f for f in _frames(raw) if re.search(r"epoch \d/2 .*/40", f)]
    assert bars and all("· 3 members" in f and "mean loss" in f for f in bars), bars
    assert all(len(f.rstrip()) <= 120 for f in bars), bars
    screen = _screen(raw, 120)
    assert not [line for line in screen if "━" in line or "/40" in line], screen  # none frozen
    text = "\n".join(screen)
    summaries = re.findall(r"^epoch \d/2: .*$", text, re.M)
    assert len(summaries) == 2 and all("best member" in s for s in summaries), screen
    assert not re.search(r"(acc|val_loss)/\d", text), screen  # no member's name/i
    assert text.count("members, best first by val_loss:") == 1, screen


@pytest.mark.slow
def test_term_dumb_gets_plain_lines_without_escape_codes(tmp_path):
    raw = _run_on_pty(tmp_path, columns=60, term="dumb")
    text = raw.decode(errors="replace")
    assert "\x1b[" not in text, text[:2000]
    assert "━" not in text
    assert re.search(r"^epoch 1/2: .*\r?$", text, re.M), text
    assert re.search(r"^epoch 2/2: .*\r?$", text, re.M), text


def test_the_bar_fits_a_narrow_and_a_resized_console():
    buf = io.StringIO()
    d = Display("rich", file=buf)
    d.console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    d.start_epoch(0, 10, 1400)
    d.update(1280, 0.5472, 1868.0)

    def lines() -> list[str]:
        out = io.StringIO()
        c = Console(file=out, force_terminal=True, width=d.console.width, color_system=None)
        assert d._progress is not None
        c.print(next(iter(d._progress.get_renderables())))
        return [ln for ln in out.getvalue().splitlines() if ln.strip()]

    wide = lines()
    assert "1280/1400" in wide[0] and "steps/s" in wide[0] and "…" not in wide[0], wide
    d.console.width = 60  # the terminal narrowed mid-epoch: the next redraw fits
    narrow = lines()
    assert all(len(ln) <= 60 for ln in narrow), narrow
    assert "1280/1400" in narrow[0] and "loss 0.5472" in narrow[0] and "…" not in narrow[0]
    with d.bar("validating", 7) as advance:  # a mid-epoch validation: a row of its own
        advance(3)
        assert any("validating" in ln and "3/7" in ln for ln in lines())
    assert not any("validating" in ln for ln in lines())
    d.end_train(1400)
    assert d._progress is None
    d.end_epoch("train_loss 0.5")
    assert "epoch 1/10: train_loss 0.5" in buf.getvalue()


def test_the_notebook_display_is_one_display_updated_in_place():
    rec = DisplayRecorder()
    d = Display("notebook", file=io.StringIO(), show=rec)
    for epoch in range(2):
        d.start_epoch(epoch, 2, 4)
        for k in range(1, 5):
            d.update(k, 0.5, 10.0)
        d.end_train(4)
        with d.bar("validating", 2) as advance:
            advance(1)
            advance(1)
        d.end_epoch(f"train_loss 0.{epoch}", {"epoch": epoch + 1})
    assert len(rec.shown) == 1  # one display for the run
    assert len(rec.updates) >= 6
    assert any("validating" in u for u in rec.updates)
    last = rec.updates[-1]
    assert "<table>" in last and "epoch 1/2" in last and "epoch 2/2" in last
    assert "<progress" not in last  # the finished display keeps the summary table only


def test_a_later_cell_gets_a_display_of_its_own(monkeypatch):
    """`jn.train(n)` in one cell, `jn.validate(n)` in the next: the validation's bar is an
    output of the second cell, and the first cell keeps its finished table."""
    import types

    shell = types.SimpleNamespace(execution_count=1)
    ipython = types.SimpleNamespace(get_ipython=lambda: shell)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    rec = DisplayRecorder()
    d = Display("notebook", file=io.StringIO(), show=rec)
    d.start_epoch(0, 1, 2)
    d.update(2, 0.5, 10.0)
    d.end_train(2)
    d.end_epoch("train_loss 0.5", {"epoch": 1})
    updates_of_first = len(rec.updates)
    shell.execution_count = 2  # the next cell
    with d.bar("validating", 3) as advance:
        advance(3)
    assert len(rec.shown) == 2, rec.shown  # a second output, in the second cell
    assert "validating" in rec.shown[1] and "epoch 1/1" not in rec.shown[1]
    assert all("epoch 1/1" not in u for u in rec.updates[updates_of_first:])
    assert "epoch 1/1" in (rec.updates[:updates_of_first] or rec.shown)[-1]


@pytest.mark.slow
def test_validation_prediction_and_lr_find_show_a_bar_over_their_batches(tmp_path):
    n = jn.Nitro(Tiny(), run_dir=tmp_path / "r", progress=False)
    rec = DisplayRecorder()
    n.services.display = Display("notebook", file=io.StringIO(), show=rec)
    jn.validate(n)
    list(jn.predict(n, n.spec.splits["val"]))
    jn.lr_find(n, steps=10)
    seen = "".join(rec.updates)
    for label, count in (("validating", "5/5"), ("predicting", "5/5"), ("lr_find", "10/10")):
        assert re.search(rf"{label} <progress [^>]*></progress> {count}", seen), (label, seen)


@pytest.mark.slow
def test_outside_a_kernel_nothing_imports_ipython(tmp_path):
    """The notebook's code as a script: train, inspect, the tables and the curves; no
    import of IPython comes from jaxnitro (flax.nnx imports it where it is installed)."""
    code = textwrap.dedent(
        f"""
        import builtins, sys
        ours = []  # IPython imports made by jaxnitro's code (flax may import it itself)
        plain_import = builtins.__import__

        def watch(name, globals=None, *args, **kwargs):
            if name.split(".")[0] in ("IPython", "ipykernel"):
                caller = (globals or {{}}).get("__file__") or ""
                if "/src/jaxnitro/" in caller:
                    ours.append(name)
            return plain_import(name, globals, *args, **kwargs)

        builtins.__import__ = watch
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import Tiny
        import jaxnitro as jn
        from jaxnitro._src.observe.display import in_notebook
        assert not in_notebook()
        n = jn.Nitro(Tiny(max_epochs=1), run_dir={str(tmp_path / "run")!r})
        jn.train(n)
        jn.inspect(n, show=False)._repr_html_()
        jn.compile_report(n)._repr_html_()
        jn.history(n)._repr_html_()
        assert jn.plot(n)._repr_png_()
        print(sorted(set(ours)))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    env.pop("JAXNITRO_NO_PLOT", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_in_notebook_is_false_in_a_plain_process():
    assert not in_notebook()


@pytest.mark.parametrize("value", ["yes", 1])
def test_show_curves_takes_a_bool(value, tmp_path):
    with pytest.raises(jn.ConfigError, match="show_curves="):
        jn.Nitro(Tiny(), run_dir=tmp_path / "r", progress=False, show_curves=value)


# ---------------------------------------------------------------- other long work
def test_a_bar_over_other_work_prints_a_few_lines_only_in_plain_mode():
    out = io.StringIO()
    with Display("plain", file=out).bar("warming up", 25, lines=True) as advance:
        for i in range(25):
            advance(1, f"batch {i}")
    lines = out.getvalue().splitlines()
    assert 5 <= len(lines) <= 13 and lines[-1] == "warming up: 25/25 · batch 24", lines
    quiet = io.StringIO()
    for mode, lines_ in (("plain", False), ("off", True)):
        with Display(mode, file=quiet).bar("validating", 5, lines=lines_) as advance:
            advance(5)
    assert quiet.getvalue() == ""  # a split's bar stays out of logs; progress="off": nothing


@pytest.mark.slow
def test_export_shows_its_steps(tmp_path):
    n = jn.Nitro(Tiny(max_epochs=1), run_dir=tmp_path / "r", progress=False)
    jn.train(n)
    out = io.StringIO()
    n.services.display = Display("plain", file=out)
    jn.export_model(n, tmp_path / "bundle", platforms=("cpu",))
    text = out.getvalue()
    assert "exporting tiny: 1/3 · lowered for cpu" in text, text
    assert re.search(r"exporting tiny: 2/3 · wrote [\d,]+ bytes", text), text
    assert "exporting tiny: 3/3 · ran once on cpu" in text, text


def _fake_runs(root: Path, count: int) -> None:
    import json

    for i in range(count):
        rows = [
            {"type": "params", "experiment": "Tiny", "run_id": f"r{i}"},
            {"type": "metrics", "context": "train", "epoch": 1, "step": 2, "loss": 1.0 / (i + 1)},
            {"type": "finish", "status": "completed", "epoch": 1, "step": 2},
        ]
        (root / f"run{i:02d}").mkdir(parents=True)
        (root / f"run{i:02d}" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )


@pytest.mark.slow
def test_the_cli_runs_and_plot_over_many_runs_show_progress_on_stderr(tmp_path):
    import json

    _fake_runs(tmp_path / "runs", 24)
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    cli = [sys.executable, "-m", "jaxnitro"]
    listed = subprocess.run(
        [*cli, "runs", str(tmp_path / "runs"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 24  # stdout stays the listing alone
    assert "reading runs: 24/24" in listed.stderr.splitlines()[-1], listed.stderr
    dirs = sorted(str(p) for p in (tmp_path / "runs").iterdir())
    drawn = subprocess.run(
        [*cli, "plot", *dirs, "-o", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert drawn.stdout.strip() == f"wrote {tmp_path / 'c.png'}"
    assert "reading runs: 24/24" in drawn.stderr, drawn.stderr
    few = subprocess.run(  # a short listing prints no progress lines
        [*cli, "runs", str(tmp_path / "runs" / "run00")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert few.returncode == 0 and "reading runs" not in few.stderr, few.stderr


def test_the_runs_listing_is_an_html_table_in_a_notebook(tmp_path):
    from jaxnitro._src.observe.runs import list_runs

    _fake_runs(tmp_path, 3)
    rows = list_runs(tmp_path)
    assert isinstance(rows, list) and len(rows) == 3
    table = rows._repr_html_()
    assert "<caption>3 run(s), newest first</caption>" in table
    assert table.count("<tr>") == 4 and "run02" in table and "completed" in table
