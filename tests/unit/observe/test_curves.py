"""The end-of-train curves.png: matplotlib imported while the first program compiles, the
figure drawn before `jn.train` returns."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import Tiny, nitro
from helpers.paths import SRC, TESTS

import jaxnitro as jn

plot = importlib.import_module("jaxnitro._src.observe.plot")  # the module, not jn.plot

PNG = b"\x89PNG\r\n\x1a\n"


def _fresh_process(script: str, *, draw: bool) -> dict:
    """Run `script` in a new interpreter (matplotlib not imported yet); its last stdout
    line is JSON."""
    head = textwrap.dedent(
        f"""
        import json, os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import Tiny, nitro
        import jaxnitro as jn
        plot = sys.modules["jaxnitro._src.observe.plot"]
        """
    )
    if draw:
        head += 'os.environ.pop("JAXNITRO_NO_PLOT")  # conftest turns drawing off\n'
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    env.pop("JAXNITRO_NO_PLOT", None)
    done = subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_matplotlib_is_imported_while_compiling_and_the_curves_are_there_on_return(tmp_path):
    got = _fresh_process(
        f"""
        n = nitro(Tiny(max_epochs=1), run_dir={str(tmp_path / "run")!r})
        before = "matplotlib.figure" in sys.modules
        jn.compile(n)  # the first compile starts the import in the background
        plot.wait_preload()
        after = "matplotlib.figure" in sys.modules
        jn.train(n)
        png = open({str(tmp_path / "run" / "curves.png")!r}, "rb").read(8)
        print(json.dumps({{"before": before, "after": after, "png": png.hex()}}))
        """,
        draw=True,
    )
    assert got == {"before": False, "after": True, "png": PNG.hex()}


@pytest.mark.slow
def test_no_import_when_drawing_is_off(tmp_path):
    got = _fresh_process(
        f"""
        jn.train(nitro(Tiny(max_epochs=1), run_dir={str(tmp_path / "run")!r}))
        plot.wait_preload()
        print(json.dumps({{"imported": "matplotlib.figure" in sys.modules}}))
        """,
        draw=False,
    )
    assert got == {"imported": False}
    assert not (tmp_path / "run" / "curves.png").exists()


def test_a_failing_drawing_only_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXNITRO_NO_PLOT", raising=False)

    def broken(*args):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plot, "_draw", broken)
    with pytest.warns(plot.PlotWarning, match="no fonts"):
        result = jn.train(nitro(Tiny(max_epochs=1), run_dir=tmp_path))
    assert result.stop_reason == "completed" and not (tmp_path / "curves.png").exists()


def test_a_temporary_run_dir_is_removed_whole_right_after_train(monkeypatch):
    """Nothing writes into the run dir after `jn.train` returns: `TemporaryDirectory`'s
    cleanup neither fails nor leaves the figure behind."""
    monkeypatch.delenv("JAXNITRO_NO_PLOT", raising=False)
    with tempfile.TemporaryDirectory() as d:
        jn.train(nitro(Tiny(max_epochs=1), run_dir=d))
        assert (Path(d) / "curves.png").read_bytes()[:8] == PNG
    assert not Path(d).exists()


def test_the_curves_are_drawn_while_the_last_checkpoint_is_written(tmp_path, monkeypatch):
    """The drawing waits on neither the checkpoint's writes nor they on it: curves.png is
    there when train starts waiting for the last background write, and that write is still
    complete, and the run's best checkpoint, when train returns."""
    monkeypatch.delenv("JAXNITRO_NO_PLOT", raising=False)
    driver = importlib.import_module("jaxnitro._src.train.driver")
    seen: list[bool] = []
    wait = driver._wait_for_checkpoint

    def spy(n):
        seen.append((tmp_path / "curves.png").is_file())
        wait(n)

    monkeypatch.setattr(driver, "_wait_for_checkpoint", spy)
    n = nitro(Tiny(max_epochs=2), run_dir=tmp_path)
    result = jn.train(n)
    assert seen == [True]
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    assert result.best_checkpoint is not None and result.best_checkpoint == n.checkpointer.latest()
    assert n.checkpointer.latest_valid() == n.checkpointer.latest()
