"""`jn.TensorBoardLogger`: scalars as TensorBoard events (tensorboardX, an optional extra)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.observe.loggers.scalars import require, scalars, section


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
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary, self._event, self._session_log = Summary, Event, SessionLog
        self._events_writer, self._summaries = EventsWriter, summary
        self.log_dir = Path(log_dir).absolute() if log_dir is not None else None
        self._named = log_dir is not None  # the default follows the run dir, even if moved
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._flushed = time.monotonic()
        self._open = False
        self._purge_step: int | None = None
        self._params: str | None = None

    def open(self, run_dir: Path, *, resume: bool) -> None:
        if not self._named:
            self.log_dir = (Path(run_dir) / "tensorboard").absolute()
        self._open = True

    def _w(self) -> Any:
        """The event file, created at the first write (after a resume marker has been seen).

        Events are written here, on the caller's thread, into the file's buffer, and flushed
        every `flush_secs`, at `flush()` (before each checkpoint) and at the end:
        tensorboardX's `SummaryWriter` queues them for a thread that its `flush()` does not
        wait for, so a kill could lose what a checkpoint already covers."""
        if self._writer is None and self._open:
            assert self.log_dir is not None
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # a file per session; the name has whole seconds only: two sessions in one
            # second would share (and truncate) a file. TensorBoard reads in name order.
            self._writer = self._events_writer(str(self.log_dir / "events"), f".{time.time_ns()}")
            if self._purge_step is not None:  # TensorBoard drops older sessions' later steps
                step = self._purge_step
                self._add(self._event(step=step, file_version="brain.Event:2"))
                start = self._session_log(status=self._session_log.START)
                self._add(self._event(step=step, session_log=start))
                self._purge_step = None
            if self._params is not None:
                self._add_summary(self._summaries.text("params", self._params), 0)
                self._params = None
        return self._writer

    def _add(self, event: Any) -> None:
        event.wall_time = time.time()
        self._writer.write_event(event)
        if time.monotonic() - self._flushed >= self.flush_secs:
            self.flush()

    def _add_summary(self, summary: Any, step: int) -> None:
        self._add(self._event(step=int(step), summary=summary))

    def flush(self) -> None:
        """Write every event logged so far to disk (the driver calls it before each
        checkpoint, so a resume from that checkpoint never lacks them)."""
        self._flushed = time.monotonic()
        if self._writer is not None:
            self._writer.flush()

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
        self._add_summary(summary, step)

    def log_images(self, images: dict[str, Path], *, step: int) -> None:
        """PNG files as TensorBoard images, under `images/<name>`."""
        from matplotlib.image import imread

        w = self._w()
        if w is None:
            return
        for name, path in images.items():
            pixels = imread(str(path))[..., :3]  # RGBA floats in [0, 1]: drop alpha
            image = self._summaries.image(f"images/{name}", pixels, dataformats="HWC")
            self._add_summary(image, step)

    def log_other(self, values: dict[str, Any]) -> None:
        if values.get("key") == "resumed" and isinstance(values.get("from_step"), int):
            if self._writer is None:  # TensorBoard drops what the killed run wrote after it
                self._purge_step = values["from_step"] + 1
            return
        w = self._w()
        if w is not None:
            for key, value in values.items():
                self._add_summary(
                    self._summaries.text(f"other/{key}", json.dumps(jsonable(value))), 0
                )

    def finish(self, status: str, **info: Any) -> None:
        w = self._writer  # none yet: this session logged nothing (a stop during setup)
        if w is not None:
            text = json.dumps(jsonable({"status": status, **info}))
            self._add_summary(self._summaries.text("finish", text), 0)
            self.flush()

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
