"""`jn.MLflowLogger`: params, metrics and the checkpoint manifest in an MLflow run (mlflow,
an optional extra)."""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import warn_user
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.observe.loggers.jsonl import LogWarning
from jaxnitro._src.observe.loggers.scalars import require, scalars

# the driver's finish status -> MLflow's run status
_STATUS = {"completed": "FINISHED", "early_stop": "FINISHED", "requested": "FINISHED"}
_STATUS.update({"preempted": "KILLED", "error": "FAILED"})
_BATCH = 1000  # MLflow's most metrics in one log_batch call
_PARAMS_BATCH = 100  # and params
_TAGS = ("experiment", "run_id", "seed", "backend", "n_devices", "max_epochs")  # params line


class MLflowLogger:
    """An MLflow run per jaxnitro run, through `mlflow.MlflowClient` (no global active run).

    - Where: `tracking_uri` (a server `http://...`, `databricks`, `sqlite:///...`), default
      the local file store `run_dir/mlruns` (set `MLFLOW_ALLOW_FILE_STORE=true` to read it
      from another process, e.g. `mlflow ui --backend-store-uri file:runs/MnistMLP/mlruns`);
      the experiment is `experiment`, default the experiment class name.
    - Params: the experiment's field values (GraphConst, Device and Host), by field name.
      Tags: `experiment` (class name), `run_id` (jaxnitro's), `seed`, `backend`,
      `n_devices`, `max_epochs`; `stop_reason` at the end.
    - Metrics, with the optimizer step as MLflow's step: train metrics by their names
      (`loss`, `lr`, `grad_norm`, your `train_metrics`), validation metrics by theirs
      (`val_loss`, `acc`; one that a train metric also names gets `val_`), the per-epoch
      `data` metrics (`steps_per_s`, ...), and `jn.evaluate` on a split other than 'val' as
      `<split>_<name>` (`test_acc`, `test_loss`). Only finite scalars are logged.
      Metrics are sent in batches (every `flush_secs`, at each validation and at the end)
      from a background thread, so neither a remote server nor the file store (a file write
      per metric) stalls a train step; `flush` (before each checkpoint is written),
      `finish` and `close` wait for them (`flush_timeout`), so a run killed after a
      checkpoint has every metric up to it in MLflow.
    - At `finish`: `checkpoints/manifest.json` as an artifact (when the run has one), and
      the run's status (FINISHED, KILLED for a preemption, FAILED for an error).
    - Resume continues the same MLflow run (its id is saved in every checkpoint). Params
      cannot change in MLflow: a field whose value differs on resume is recorded as the tag
      `resumed/<field>`.

    Needs `pip install 'jaxnitro[mlflow]'` (mlflow-skinny is enough).

    Example:
        >>> ml = jn.MLflowLogger(experiment="mnist")
        >>> jn.train(jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), ml]))
        >>> MlflowClient(ml.tracking_uri).get_metric_history(ml.run_id, "loss")[-1].step
        1875
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        *,
        flush_secs: float = 2.0,
        flush_timeout: float = 120.0,
    ):
        self._mlflow = require("mlflow", "MLflowLogger", "mlflow")
        self.tracking_uri = tracking_uri
        self._named_uri = tracking_uri is not None  # the default follows the run dir
        self.experiment = experiment
        self.flush_secs, self.flush_timeout = flush_secs, flush_timeout
        self.run_id: str | None = None
        self._client: Any = None
        self._run_dir: Path | None = None
        self._active = False  # the run is marked RUNNING by this session
        self._params: dict[str, Any] = {}
        self._existing: dict[str, str] = {}  # the params a reattached run already has
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, time ms, step)
        self._flushed = time.monotonic()
        self._sender = _Sender(self._send)
        self._train_names: set[str] = set()
        self._for_run: Any = None  # the jaxnitro run the MLflow run was made for

    # -- lifecycle ---------------------------------------------------------------------
    def open(self, run_dir: Path, *, resume: bool) -> None:
        self._run_dir = Path(run_dir)
        uri = self.tracking_uri if self._named_uri else None
        uri = uri or (self._run_dir.absolute() / "mlruns").as_uri()
        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless asked for (it suggests sqlite, whose
            # first use takes seconds to create its tables): the local default is one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if self._client is None or uri != self.tracking_uri:
            self._client = self._mlflow.MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri

    def _run(self) -> str:
        """The run this session logs to: reattached (a resume, a later session) or new."""
        if self._active and self.run_id is not None:
            return self.run_id
        c = self._client
        if self.run_id is not None and self._reattach(c, self.run_id):
            c.update_run(self.run_id, status="RUNNING")
        else:
            name = self.experiment or self._params.get("experiment") or "jaxnitro"
            found = c.get_experiment_by_name(name)
            exp_id = found.experiment_id if found is not None else c.create_experiment(name)
            parts = [str(self._params[k]) for k in ("experiment", "run_id") if k in self._params]
            self.run_id = c.create_run(exp_id, run_name="-".join(parts) or None).info.run_id
            self._existing = {}
            self._for_run = self._params.get("run_id")
        self._active = True
        return self.run_id

    def _reattach(self, client: Any, run_id: str) -> bool:
        try:
            run = client.get_run(run_id)
        except self._mlflow.exceptions.MlflowException as e:
            if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            warn_user(
                f"MLflow run {run_id} is not in {self.tracking_uri} (deleted, or another "
                f"store); logging to a new run.",
                LogWarning,
            )
            return False
        self._existing = dict(run.data.params)
        return True

    def log_params(self, params: dict[str, Any]) -> None:
        if self._for_run is not None and params.get("run_id") != self._for_run:
            self.close()  # this logger reused for another jaxnitro run: a new MLflow run
            self.run_id, self._for_run = None, None
        self._params = dict(params)
        run_id = self._run()
        entities = self._mlflow.entities
        values = {_name(k): _param(v) for k, v in (params.get("config") or {}).items()}
        new = [entities.Param(k, v) for k, v in values.items() if k not in self._existing]
        changed = {k: v for k, v in values.items() if self._existing.get(k, v) != v}
        tags: dict[str, Any] = {k: params[k] for k in _TAGS if k in params}
        tags.update({f"resumed/{k}": v for k, v in changed.items()})
        tag_list = [entities.RunTag(k, _param(v)) for k, v in tags.items()]
        for i in range(0, max(len(new), len(tag_list)), _PARAMS_BATCH):
            self._client.log_batch(
                run_id,
                params=new[i : i + _PARAMS_BATCH],
                tags=tag_list[i : i + _PARAMS_BATCH],
            )
        self._existing.update(values)

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        values = scalars(metrics)
        if not values:
            return
        self._run()
        self._sender.check()  # a failed send is this call's error (the fan-out drops us)
        split, now = metrics.get("split"), int(time.time() * 1000)
        for key, v in values.items():
            self._buffer.append((self._key(context, split, key), v, now, int(step)))
        if (
            context != "train"
            or len(self._buffer) >= _BATCH
            or time.monotonic() - self._flushed >= self.flush_secs
        ):
            self._flush()

    def _key(self, context: str, split: Any, name: str) -> str:
        if isinstance(split, str) and split != "val":  # jn.evaluate(n, split="test")
            return _name(name if name.startswith(f"{split}_") else f"{split}_{name}")
        if context == "train":
            self._train_names.add(name)
        elif context == "validate" and name in self._train_names:
            name = name if name.startswith("val_") else f"val_{name}"
        return _name(name)

    def _flush(self, *, wait: bool = False) -> None:
        """Hand the buffered metrics to the sender thread (and wait until they are sent)."""
        batch, self._buffer = self._buffer, []
        self._flushed = time.monotonic()
        if batch:
            self._sender.put((self.run_id, batch))
        if wait:
            self._sender.wait(timeout=self.flush_timeout)

    def flush(self) -> None:
        """Send every metric logged so far and wait until MLflow has it (the driver calls it
        before each checkpoint: a resume from that checkpoint replays only later steps, so
        what was still buffered would be lost for good if the process were killed)."""
        if self.run_id is not None:
            self._flush(wait=True)

    def _send(self, item: tuple[str, list]) -> None:
        """On the sender thread: the metrics as MLflow entities, in batches it accepts."""
        run_id, batch = item
        metric = self._mlflow.entities.Metric
        for i in range(0, len(batch), _BATCH):
            chunk = [metric(*row) for row in batch[i : i + _BATCH]]
            self._client.log_batch(run_id, metrics=chunk)

    def log_images(self, images: dict[str, Path], *, step: int) -> None:
        """PNG files as artifacts of the run, under `viz/`."""
        run_id = self._run()
        for path in images.values():
            self._client.log_artifact(run_id, str(path), artifact_path="viz")

    def log_other(self, values: dict[str, Any]) -> None:
        if values.get("key") == "resumed" and "from_step" in values:
            self._client.set_tag(self._run(), "resumed_from_step", str(values["from_step"]))

    def finish(self, status: str, **info: Any) -> None:
        if self.run_id is None:
            return  # nothing was logged (a stop during setup)
        run_id = self._run()
        self._flush(wait=True)
        self._client.set_tag(run_id, "stop_reason", status)
        manifest = self._run_dir / "checkpoints" / "manifest.json" if self._run_dir else None
        if manifest is not None and manifest.is_file():
            self._client.log_artifact(run_id, str(manifest), artifact_path="checkpoints")
        self._client.set_terminated(run_id, status=_STATUS.get(status, "FINISHED"))
        self._active = False

    def close(self) -> None:
        if self.run_id is None:
            return
        self._flush(wait=True)
        if self._active:  # a session without finish (an evaluation)
            self._active = False
            self._client.set_terminated(self.run_id, status="FINISHED")

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"mlflow_run_id": the run, "tracking_uri": the one named, or None (the default)}."""
        return {
            "mlflow_run_id": self.run_id,
            "tracking_uri": self.tracking_uri if self._named_uri else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("mlflow_run_id"), str):
            self.run_id = state["mlflow_run_id"]
        if not self._named_uri and isinstance(state.get("tracking_uri"), str):
            self.tracking_uri, self._named_uri = state["tracking_uri"], True


class _Sender:
    """Sends batches from one background thread, so a slow store (the file store writes a
    file per metric, a server a request per batch) never stalls a train step. A failure is
    kept and raised by the next `check`, `put` or `wait` on the training thread; later
    batches are discarded. At most `max_pending` batches wait (then `put` blocks)."""

    def __init__(self, send: Callable[[Any], None], *, max_pending: int = 64):
        self._send = send
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self.error: Exception | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, item: Any) -> None:
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jaxnitro-mlflow", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def wait(self, *, timeout: float) -> None:
        """Until every batch handed over is sent (the thread ends; `put` starts another)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"MLflow did not take the last metrics within {timeout} s")
        self.check()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:
                try:
                    self._send(item)
                except Exception as e:  # noqa: BLE001 - raised on the training thread
                    self.error = e


def _name(key: str) -> str:
    """A metric, param or tag name in the characters MLflow accepts."""
    return re.sub(r"[^\w.\- :/]", "_", str(key)) or "_"


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(jsonable(value))
    return text[:6000]  # MLflow's longest param value
