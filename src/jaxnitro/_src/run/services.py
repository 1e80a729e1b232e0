"""A run's services: where it logs, checkpoints and shows progress, and the writer session.

`Services` is the I/O half of a handle (the compiled, pure half never sees it). It owns the
run lock and opens the logger lazily: a writing session (`jn.train`, an evaluation that logs)
takes the lock, opens the logger, logs the params line once per handle and a resume marker
once, and closes the logger when the outermost session ends. Setup writes nothing.

`checkpointer=False` gives a `NoCheckpointer` and `logger=False` a `NullLogger`: the driver
calls them as it would the real ones. What the run calls on them is written down as
`typing.Protocol`s: `Checkpointer` here, `jn.Logger` in `observe/loggers/base.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.core.errors import CheckpointError, warn_user
from jaxnitro._src.observe.events.phases import PhaseTracker
from jaxnitro._src.observe.events.signals import StopControl
from jaxnitro._src.observe.loggers.base import Logger

if TYPE_CHECKING:
    from jaxnitro._src.observe.display import Display


@runtime_checkable
class Checkpointer(Protocol):
    """What a run calls on its checkpointer: `jn.TopKCheckpointer`, or `NoCheckpointer`
    (`checkpointer=False`).

    `metric` and `mode` rank the checkpoints (setup may pick the metric when the user named
    none); `dir` is None until `bind` picks one; `for_run` limits retention to one run's
    checkpoints.
    """

    metric: str
    mode: str
    k: int
    dir: Path | None
    run_id: str | None

    def bind(self, run_dir: str | os.PathLike, *, writer: bool = True) -> None: ...
    def for_run(self, run_id: str | None) -> None: ...
    def monitor(self, metric: str) -> None: ...
    def save(
        self,
        *,
        epoch: int,
        step: int,
        metrics: dict[str, float],
        trees: dict[str, Any],
        meta: dict,
        background: bool = False,
    ) -> Path | None: ...
    def wait(self) -> None: ...
    def records(self) -> list[dict]: ...
    def latest(self) -> Path | None: ...
    def latest_valid(self, *, quarantine: bool = True) -> Path | None: ...
    def best(self) -> Path | None: ...


class NoCheckpointer:
    """`checkpointer=False`: no checkpoint is written; nothing can be resumed from one."""

    def __init__(self, metric: str = "val_loss", mode: str = "min") -> None:
        self.metric, self.mode, self.k = metric, mode, 0
        self.dir: Path | None = None
        self.run_id: str | None = None

    def bind(self, run_dir: str | os.PathLike, *, writer: bool = True) -> None:
        pass

    def for_run(self, run_id: str | None) -> None:
        self.run_id = run_id

    def monitor(self, metric: str) -> None:
        self.metric = metric

    def save(self, **_: Any) -> None:
        return None

    def wait(self) -> None:
        pass

    def records(self) -> list[dict]:
        return []

    def latest(self) -> None:
        return None

    def latest_valid(self, *, quarantine: bool = True) -> None:
        return None

    def best(self) -> None:
        return None


@dataclasses.dataclass
class Services:
    """The run's logger, checkpointer, display and lock, its phase and stop request, and the
    state of its writing session.

    Attributes:
        params_line: the `params` log line, logged by the handle's first writing session.
        resume_path: the checkpoint the run resumed from (a marker line is logged once).
    """

    logger: Logger
    checkpointer: Checkpointer
    display: Display
    lock: RunLock
    run_dir: Path
    params_line: dict
    resume_path: Path | None = None
    step_callbacks: list = dataclasses.field(default_factory=list)  # (every n steps, fn)
    phases: PhaseTracker = dataclasses.field(default_factory=PhaseTracker)  # jn.on_phase
    control: StopControl = dataclasses.field(default_factory=StopControl)  # stop requests
    logger_open: bool = False
    _params_logged: bool = False
    _resume_marked: bool = False
    _read_only_warned: bool = False

    def describe(self, params_line: dict, resume_path: Path | None) -> None:
        """What the first writing session logs: the run's params line and where it resumed."""
        self.params_line, self.resume_path = params_line, resume_path

    @contextlib.contextmanager
    def writing(self, purpose: str, *, step: int, required: bool = True) -> Iterator[bool]:
        """Hold the run lock while writing the run's files; yields whether this call may write.

        `required` (training): another writer is an error naming it. Otherwise (an
        evaluation), a run dir held by another writer is only read: nothing is logged, and
        that is said once.
        """
        if required:
            self.lock.acquire(purpose, what=f"run_dir {self.run_dir}")
        elif not self.lock.try_acquire(purpose):
            if not self._read_only_warned:
                self._read_only_warned = True
                warn_user(
                    f"run_dir {self.run_dir} is being written by {self.lock.describe()}; "
                    f"this handle only reads it: results are returned, not logged. To evaluate "
                    f"the trainer's weights, load its checkpoint: jn.Nitro(exp, "
                    f"run_dir='runs/eval', checkpoint=path).",
                )
            yield False
            return
        opened = False
        try:
            if required:
                self.checkpointer.bind(self.run_dir, writer=True)  # a dead writer's leftovers
            if not self.logger_open:
                self.logger.open(self.run_dir, resume=self.resume_path is not None)
                self.logger_open = opened = True
                self._first_lines(step)
            yield True
        finally:
            try:
                if opened:
                    self.logger_open = False
                    self.logger.close()
            finally:
                self.lock.release()

    def _first_lines(self, step: int) -> None:
        if not self._params_logged:
            self._params_logged = True
            self.logger.log_params(self.params_line)
        if self.resume_path is not None and not self._resume_marked:
            self._resume_marked = True
            self.logger.log_other(
                {
                    "key": "resumed",
                    "from_step": step,
                    "from_checkpoint": str(self.resume_path),
                    "time": time.time(),
                }
            )

    def log_other(self, values: dict) -> None:
        """An `other` line, if a writing session is open (a reader logs nothing)."""
        if self.logger_open:
            self.logger.log_other(values)


def make_checkpointer(
    value: Any, *, default: Callable[[], Checkpointer]
) -> tuple[Checkpointer, bool]:
    """(checkpointer, named by the user): None → `default()`, False → a `NoCheckpointer`, a
    `TopKCheckpointer` → a copy of it (`configured`): the user's object is never changed."""
    from jaxnitro._src.checkpoint.store import TopKCheckpointer
    from jaxnitro._src.core.errors import ConfigError

    if value is None:
        return default(), False
    if value is False:
        return NoCheckpointer(), False
    if not isinstance(value, TopKCheckpointer):
        raise ConfigError(
            f"checkpointer must be a jn.TopKCheckpointer, got {type(value).__name__}. Pass "
            f"jn.TopKCheckpointer(...), or checkpointer=False to write none."
        )
    return value.configured(), True


def check_resumable(checkpointer: Checkpointer, resume: Any) -> None:
    if isinstance(checkpointer, NoCheckpointer) and resume in (True, "auto"):
        raise CheckpointError(
            f"resume={resume!r} needs checkpoints, but checkpointer=False writes none. Pass a "
            f"jn.TopKCheckpointer (or leave checkpointer out for the default) to resume."
        )
