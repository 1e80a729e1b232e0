"""The end-of-train curves.png: drawn in the background, whole when the script ends."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
from conftest import Tiny, nitro

import jaxnitro as jn

plot = importlib.import_module("jaxnitro.plot")  # the module (`jaxnitro.plot` is jn.plot)

PNG = b"\x89PNG\r\n\x1a\n"
SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def drawing(monkeypatch):
    monkeypatch.delenv("JAXNITRO_NO_PLOT", raising=False)
    yield
    plot.wait_curves()


def test_train_returns_before_its_curves_are_drawn(tmp_path, drawing, monkeypatch):
    release, started = threading.Event(), threading.Event()
    draw = plot._draw

    def held(*args, **kw):
        started.set()
        assert release.wait(30)
        draw(*args, **kw)

    monkeypatch.setattr(plot, "_draw", held)
    n = nitro(Tiny(max_epochs=1), run_dir=tmp_path)
    jn.train(n)  # returns while the drawing is held
    assert started.wait(30) and not (tmp_path / "curves.png").exists()
    release.set()
    plot.wait_curves()
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG


def test_a_run_dir_removed_before_its_curves_are_drawn_stays_removed(
    tmp_path, drawing, monkeypatch
):
    """`with TemporaryDirectory() as d: jn.train(...)` removes the run dir right away: the
    drawing must neither recreate it nor fail."""
    release = threading.Event()
    draw = plot._draw

    def held(*args, **kw):
        assert release.wait(30)
        draw(*args, **kw)

    monkeypatch.setattr(plot, "_draw", held)
    run = tmp_path / "run"
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run))
    shutil.rmtree(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        release.set()
        plot.wait_curves()
    assert not run.exists()
    assert not [w for w in caught if issubclass(w.category, plot.PlotWarning)]


def test_a_failing_drawing_only_warns(tmp_path, drawing, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plot, "_draw", broken)
    n = nitro(Tiny(max_epochs=1), run_dir=tmp_path)
    with pytest.warns(plot.PlotWarning, match="no fonts"):  # from the drawing thread
        result = jn.train(n)
        plot.wait_curves()
    assert result.stop_reason == "completed" and not (tmp_path / "curves.png").exists()


def test_a_script_that_ends_right_after_train_leaves_its_curves_whole(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import Tiny, nitro
        import jaxnitro as jn
        os.environ.pop("JAXNITRO_NO_PLOT")  # conftest's default: draw in this script
        jn.train(nitro(Tiny(max_epochs=1), run_dir={str(tmp_path / "run")!r}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    env.pop("JAXNITRO_NO_PLOT", None)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes()[:8] == PNG
