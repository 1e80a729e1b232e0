"""`jn.TensorBoardLogger`: scalars as TensorBoard events (tensorboardX, an optional extra)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..jsonable import jsonable
from .scalars import require, scalars, section


class TensorBoardLogger:
    """TensorBoard event files in `log_dir` (default `run_dir/tensorboard`).

    Tags are `<context>/<metric>`: `train/loss`, `train/lr` (or `train/lr/<group>`),
    `train/grad_norm`, your `train_metrics` as `train/<name>` at each optimizer step;
    `validate/val_loss`, `validate/<metric>` at the step validation ran (each epoch's last
    step); `data/steps_per_s`, `data/data_wait_frac`, ... once per epoch;
    `evaluate/<split>/<metric>` for `jn.evaluate(n, split=...)` of a split other than 'val'.
    Only finite scalars are written (arrays, None and NaN are skipped). The params line is a
    text summary `params`, `log_other` values are text summaries `other/<key>`.

    A resume writes into the same directory and marks the checkpoint's step, so TensorBoard
    drops the events a killed run wrote after it (its purge of orphaned data).

    Needs `pip install 'jaxnitro[tensorboard]'` (tensorboardX).

    Example:
        >>> n = jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), jn.TensorBoardLogger()])
        >>> jn.train(n)  # then: tensorboard --logdir runs/MnistMLP/tensorboard
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, *, flush_secs: float = 10):
        self._tbx = require("tensorboardX", "TensorBoardLogger", "tensorboard")
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary = Summary
        self.log_dir = Path(log_dir).absolute() if log_dir is not None else None
        self._named = log_dir is not None  # the default follows the run dir, even if moved
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._open = False
        self._purge_step: int | None = None
        self._params: str | None = None

    def open(self, run_dir: Path, *, resume: bool) -> None:
        if not self._named:
            self.log_dir = (Path(run_dir) / "tensorboard").absolute()
        self._open = True

    def _w(self) -> Any:
        """The writer, created at the first write (after a resume marker has been seen)."""
        if self._writer is None and self._open:
            assert self.log_dir is not None
            self._writer = self._tbx.SummaryWriter(
                logdir=str(self.log_dir),
                flush_secs=self.flush_secs,
                max_queue=1000,  # the default 10 makes a train step wait for the writer thread
                purge_step=self._purge_step,
                # a file per session; the name has whole seconds only: two sessions in one
                # second would share (and truncate) a file. TensorBoard reads in name order.
                filename_suffix=f".{time.time_ns()}",
            )
            self._purge_step = None
            if self._params is not None:
                self._writer.add_text("params", self._params, global_step=0)
                self._params = None
        return self._writer

    def log_params(self, params: dict[str, Any]) -> None:
        # written with the first scalars: a resume marker may still come, and must come first
        self._params = "```\n" + json.dumps(jsonable(params), indent=2, sort_keys=True) + "\n```"

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        values = scalars(metrics)
        if not values:
            return
        w, prefix = self._w(), section(context, metrics)
        if w is None:
            return
        # one event for the whole line: a third of add_scalar's cost for a train step
        Value = self._summary.Value
        summary = self._summary(
            value=[Value(tag=f"{prefix}/{key}", simple_value=v) for key, v in values.items()]
        )
        w.file_writer.add_summary(summary, global_step=int(step))

    def log_images(self, images: dict[str, Path], *, step: int) -> None:
        """PNG files as TensorBoard images, under `images/<name>`."""
        from matplotlib.image import imread

        w = self._w()
        if w is None:
            return
        for name, path in images.items():
            pixels = imread(str(path))[..., :3]  # RGBA floats in [0, 1]: drop alpha
            w.add_image(f"images/{name}", pixels, global_step=int(step), dataformats="HWC")

    def log_other(self, values: dict[str, Any]) -> None:
        if values.get("key") == "resumed" and isinstance(values.get("from_step"), int):
            if self._writer is None:  # TensorBoard drops what the killed run wrote after it
                self._purge_step = values["from_step"] + 1
            return
        w = self._w()
        if w is not None:
            for key, value in values.items():
                w.add_text(f"other/{key}", json.dumps(jsonable(value)))

    def finish(self, status: str, **info: Any) -> None:
        w = self._writer  # none yet: this session logged nothing (a stop during setup)
        if w is not None:
            w.add_text("finish", json.dumps(jsonable({"status": status, **info})))
            w.flush()

    def close(self) -> None:
        writer, self._writer, self._open = self._writer, None, False
        if writer is not None:
            writer.close()

    def state_dict(self) -> dict[str, Any]:
        """{"log_dir": the directory named at construction, or None for the default}."""
        return {"log_dir": str(self.log_dir) if self._named else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._named and isinstance(state.get("log_dir"), str):
            self.log_dir, self._named = Path(state["log_dir"]), True
