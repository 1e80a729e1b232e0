"""Pictures of what a model does: `jn.render` and the heatmaps of matrix metrics.

- `visualize(self, outputs, **batch)` is an optional experiment hook that returns a matplotlib
  `Figure` for **one sample** (its outputs and batch fields, as host numpy arrays, without the
  batch dimension). `jn.render(n, split="val", batches=1)` runs `forward` in inference mode on
  the first batches of a split, calls the hook per sample and writes the PNGs under
  `run_dir/viz`; loggers with a `log_images` method (TensorBoard, MLflow) receive them.
- A metric returned with `count=None` that is a matrix (a confusion matrix) is drawn as a
  heatmap after each validation, `run_dir/viz/<name>-step<step>.png`, and sent to the loggers.

Figures are drawn on matplotlib's Agg canvas (no pyplot), so a notebook's backend is left
alone; matplotlib is needed only when something is drawn (`jaxnitro[plot]`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, HookError, did_you_mean, warn_user

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

_SAMPLES = 16


class RenderWarning(UserWarning):
    """A picture after validation could not be drawn (the run is unaffected)."""


def render(
    n: Nitro,
    split: str = "val",
    batches: int = 1,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    max_samples: int = _SAMPLES,
) -> list[Path]:
    """Write one PNG per sample of the first `batches` batches of `split`, drawn by the
    experiment's `visualize(self, outputs, **batch)` hook.

    Args:
        n: the run (`jn.Nitro`).
        split: the split whose batches are drawn.
        batches: how many of its batches.
        out_dir: where the PNGs go; None: `<run_dir>/viz`.
        max_samples: at most this many samples per batch.

    Returns:
        The paths of the PNGs written, also sent to the run's loggers.

    Raises:
        HookError: the experiment has no `visualize` hook.
        ConfigError: the data has no such split, or `n` is a population.

    Example:
        >>> paths = jn.render(n, split="val", batches=1)
        >>> paths[0].name
        'val-b0-s0-step000120.png'
    """
    from jaxnitro._src.steps.population import refuse
    from jaxnitro._src.train.prediction import predict

    refuse(n, "jn.render")
    spec = n.spec
    hook = getattr(spec.cls, "visualize", None)
    if hook is None:
        raise HookError(
            f"jn.render needs a visualize(self, outputs, **batch) hook on {spec.cls.__name__} "
            f"returning a matplotlib Figure for one sample; add one."
        )
    if split not in spec.splits:
        raise ConfigError(
            f"jn.render: no split {split!r}; the data has {sorted(spec.splits)}."
            + did_you_mean(split, spec.splits)
        )
    out = Path(out_dir) if out_dir is not None else Path(n.run_dir) / "viz"
    paths: list[Path] = []
    for b, batch in enumerate(spec.splits[split]):
        if b >= batches:
            break
        outputs = predict(n, batch)
        rows = len(next(iter(batch.values())))
        for i in range(min(rows, max_samples)):
            fig = hook(n.experiment, _row(outputs, i, rows), **_row(dict(batch), i, rows))
            path = out / f"{split}-b{b}-s{i}-step{n.step:06d}.png"
            paths.append(save(fig, path))
    _send(n, {p.stem: p for p in paths})
    return paths


def _row(tree: Any, i: int, rows: int) -> Any:
    """Sample `i` of every leaf whose first dimension is the batch."""
    return jax.tree.map(
        lambda x: np.asarray(x)[i] if np.ndim(x) and np.shape(x)[0] == rows else x, tree
    )


def save(fig: Any, path: Path) -> Path:
    """A matplotlib Figure to a PNG, written whole then moved into place."""
    if not hasattr(fig, "savefig"):
        raise HookError(
            f"visualize must return a matplotlib Figure, got {type(fig).__name__}; build one "
            f"with matplotlib.figure.Figure() (no pyplot needed) and return it."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def heatmap(matrix: Any, title: str, path: Path) -> Path:
    """A matrix (a confusion matrix: rows true, columns predicted) as an annotated heatmap."""
    from matplotlib.figure import Figure

    m = np.asarray(matrix)
    side = min(2.5 + 0.45 * max(m.shape), 12)
    fig = Figure(figsize=(side, side))
    ax = fig.add_subplot()
    im = ax.imshow(m, cmap="Blues")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if m.size <= 400:  # numbers in the cells while they can be read
        top = float(m.max()) if m.size else 0.0
        for (r, c), v in np.ndenumerate(m):
            text = f"{v:.2g}" if np.issubdtype(m.dtype, np.floating) else str(v)
            ax.text(c, r, text, ha="center", va="center", fontsize=8,
                    color="white" if v > top / 2 else "black")  # fmt: skip
    return save(fig, path)


def matrices(n: Nitro, row: dict[str, Any]) -> list[Path]:
    """Heatmaps of the matrix metrics of a validation row, sent to the loggers; a failure
    (or no matplotlib) only warns once per handle and never costs the run."""
    found = {k: v for k, v in row.items() if np.ndim(v) == 2 and np.size(v) > 0}
    if not found or importlib.util.find_spec("matplotlib") is None:
        return []
    if jax.process_index() != 0:  # several processes: process 0 writes the run's files
        return []
    try:
        out = Path(n.run_dir) / "viz"
        paths = {k: heatmap(v, f"{k} (step {n.step})", out / f"{k}-step{n.step:06d}.png")
                 for k, v in found.items()}  # fmt: skip
        _send(n, paths)
        return list(paths.values())
    except Exception as e:  # noqa: BLE001 - a picture must never cost a run
        with contextlib.suppress(Exception):
            warn_user(
                f"could not draw the matrix metrics {sorted(found)}: {e!r}. The run is unaffected.",
                RenderWarning,
            )
        return []


def _send(n: Nitro, images: dict[str, Path]) -> None:
    """To the loggers that take images (`log_images(images, step=...)`): inside `jn.train`'s
    writing session, or in one of its own when the run dir is free (a reader only draws)."""
    log = getattr(n.logger, "log_images", None)
    if not images or not callable(log):
        return
    if n.services.logger_open:
        log(images, step=n.step)
        return
    with n.services.writing("render", step=n.step, required=False) as may_write:
        if may_write:
            log(images, step=n.step)
