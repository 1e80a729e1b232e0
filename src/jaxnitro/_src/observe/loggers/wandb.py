"""`jn.WandbLogger`: a Weights & Biases run (wandb, an optional extra), offline too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.observe.loggers.scalars import require, scalars, section

_EXIT = {"error": 1, "preempted": 143}  # the run's exit code as W&B shows it; others 0


class WandbLogger:
    """A W&B run per jaxnitro run, with jaxnitro's run id as the W&B run id.

    - `project` (default: the experiment class name), `mode` ("online", "offline",
      "disabled"; None: W&B's own default, `WANDB_MODE` or online). The run's files go under
      `run_dir/wandb`; an offline run can be uploaded later with `wandb sync`. Other
      `wandb.init` arguments (entity, group, tags, notes, settings) pass through `**init`.
    - Config: the experiment's field values, plus `jaxnitro` (seed, max_epochs, n_devices,
      backend, run_id, experiment).
    - History, with the optimizer step as W&B's step and `epoch` in every row: the same
      names as TensorBoard's tags (`train/loss`, `train/lr`, `validate/val_loss`,
      `validate/<metric>`, `data/steps_per_s`, `evaluate/<split>/<metric>`). Only finite
      scalars are logged. The summary gets `stop_reason` at the end.
    - Resume reattaches to the same W&B run (`resume="allow"` with the saved id). W&B
      keeps steps increasing: rows a resumed run logs at steps it already has are dropped by
      W&B (with its warning).

    Needs `pip install 'jaxnitro[wandb]'`.

    Example:
        >>> wb = jn.WandbLogger(project="mnist", mode="offline")
        >>> jn.train(jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), wb]))
        >>> wb.run_id, wb.run_dir  # runs/MnistMLP/wandb/offline-run-<time>-<run_id>
    """

    def __init__(self, project: str | None = None, mode: str | None = None, **init: Any):
        self._wandb = require("wandb", "WandbLogger", "wandb")
        self.project, self.mode, self.init = project, mode, init
        self.run_id: str | None = None
        self.run_dir: Path | None = None  # the W&B run's own directory, once started
        self._run: Any = None
        self._dir: Path | None = None
        self._params: dict[str, Any] = {}
        self._status: str | None = None

    def open(self, run_dir: Path, *, resume: bool) -> None:
        self._dir = Path(run_dir).absolute()

    def _start(self) -> Any:
        """The W&B run, started at the first call that logs (the params name the project)."""
        if self._run is not None or self._dir is None:
            return self._run
        p = self._params
        run_id = self.run_id or (p["run_id"] if isinstance(p.get("run_id"), str) else None)
        config = dict(p.get("config") or {})
        keys = ("experiment", "run_id", "seed", "max_epochs", "n_devices", "backend")
        config["jaxnitro"] = {k: p[k] for k in keys if k in p}
        kwargs: dict[str, Any] = dict(
            project=self.project or p.get("experiment") or "jaxnitro",
            id=run_id,
            resume="allow",
            dir=str(self._dir),
            config=jsonable(config),
            reinit="create_new",
        )
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if run_id is not None and "experiment" in p:
            kwargs["name"] = f"{p['experiment']}-{run_id}"
        kwargs.update(self.init)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._run = self._wandb.init(**kwargs)
        self.run_id = self._run.id
        self.run_dir = Path(self._run.dir).parent  # .../offline-run-<time>-<id>/files
        self._status = None
        return self._run

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run_id is not None and params.get("run_id") not in (None, self.run_id):
            self.close()  # this logger reused for another jaxnitro run: a new W&B run
            self.run_id = None
        self._params = dict(params)
        self._start()

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        values = scalars(metrics)
        run = self._start() if values else None
        if run is None:
            return
        prefix = section(context, metrics)
        row: dict[str, Any] = {f"{prefix}/{k}": v for k, v in values.items()}
        row["epoch"] = epoch
        run.log(row, step=int(step))

    def log_other(self, values: dict[str, Any]) -> None:
        pass  # compile records and resume markers are in metrics.jsonl

    def finish(self, status: str, **info: Any) -> None:
        if self._run is not None:
            self._run.summary["stop_reason"] = status
            self._status = status

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish(exit_code=_EXIT.get(self._status or "", 0))

    def state_dict(self) -> dict[str, Any]:
        """{"wandb_run_id": the W&B run id, "project": the project named, or None}."""
        return {"wandb_run_id": self.run_id, "project": self.project}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("wandb_run_id"), str):
            self.run_id = state["wandb_run_id"]
        if self.project is None and isinstance(state.get("project"), str):
            self.project = state["project"]
