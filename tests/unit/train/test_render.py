"""Pictures: `visualize` + `jn.render`, and matrix metrics drawn as heatmaps per validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn

pytest.importorskip("matplotlib")


@jn.experiment
class Seen(Tiny):
    def metrics(self, logits, *, y):
        pred = logits.argmax(-1)
        confusion = (y[:, None, None] == np.arange(4)[None, :, None]) & (
            pred[:, None, None] == np.arange(4)[None, None, :]
        )
        return {
            "acc": ((pred == y).sum(), y.shape[0]),
            "confusion": (confusion.sum(0).astype("int32"), None),
        }

    def visualize(self, outputs, *, x, y):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(3, 2))
        ax = fig.add_subplot()
        ax.bar(range(4), outputs)
        ax.set_title(f"label {int(y)}")
        return fig


def test_render_writes_one_png_per_sample_through_the_hook(run_dir):
    from matplotlib.image import imread

    n = nitro(Seen(max_epochs=1), run_dir=run_dir)
    paths = jn.render(n, split="val", batches=1, max_samples=3)
    assert [p.name for p in paths] == [f"val-b0-s{i}-step000000.png" for i in range(3)]
    assert imread(str(paths[0])).shape[:2] == (200, 300)  # 3x2 inches at 100 dpi


@pytest.mark.slow
def test_a_confusion_matrix_is_logged_as_such_and_drawn_per_validation(run_dir):
    from matplotlib.image import imread

    n = nitro(Seen(max_epochs=2), run_dir=run_dir)
    jn.train(n)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [ln for ln in lines if ln.get("context") == "validate"]
    assert len(val) == 2 and np.asarray(val[-1]["confusion"]).shape == (4, 4)
    assert int(np.asarray(val[-1]["confusion"]).sum()) == 100  # every val sample counted once
    pngs = sorted((run_dir / "viz").glob("confusion-step*.png"))
    assert [p.name for p in pngs] == ["confusion-step000008.png", "confusion-step000016.png"]
    assert imread(str(pngs[-1])).ndim == 3


def test_tensorboard_receives_the_heatmaps_as_images(run_dir):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    n = nitro(Seen(max_epochs=1), run_dir=run_dir, logger=[jn.JSONLogger(), jn.TensorBoardLogger()])
    jn.train(n)
    acc = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert "images/confusion" in acc.Tags()["images"]
    assert [e.step for e in acc.Images("images/confusion")] == [8]


def test_render_after_train_still_reaches_tensorboard(run_dir):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    n = nitro(Seen(max_epochs=1), run_dir=run_dir, logger=[jn.JSONLogger(), jn.TensorBoardLogger()])
    jn.train(n)
    paths = jn.render(n, max_samples=2)  # after train: render opens its own writing session
    acc = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert {f"images/{p.stem}" for p in paths} <= set(acc.Tags()["images"])


def test_render_without_the_hook_names_it(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with pytest.raises(jn.HookError, match=r"visualize\(self, outputs, \*\*batch\)"):
        jn.render(n)


@pytest.mark.slow
def test_mlflow_receives_the_heatmaps_as_artifacts(run_dir, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ml = jn.MLflowLogger()
    n = nitro(Seen(max_epochs=1), run_dir=run_dir, logger=[jn.JSONLogger(), ml])
    jn.train(n)
    client = mlflow.MlflowClient(ml.tracking_uri)
    names = [a.path for a in client.list_artifacts(ml.run_id, "viz")]
    assert names == ["viz/confusion-step000008.png"]
