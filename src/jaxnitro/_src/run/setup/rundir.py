"""Setup, [1]-[3]: the run directory, the services (logger, checkpointer, display), and what a
resume continues from: the checkpoint record, the run's id and seed, and the loggers' files."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jaxnitro._src.checkpoint.record import _read_meta as checkpoint_meta
from jaxnitro._src.checkpoint.runlock import FollowerLock, RunLock
from jaxnitro._src.checkpoint.store import TopKCheckpointer, validate_int
from jaxnitro._src.core.errors import CheckpointError, ConfigError, warn_user
from jaxnitro._src.dist import distributed
from jaxnitro._src.observe.display import Display
from jaxnitro._src.observe.loggers import JSONLogger, make_logger
from jaxnitro._src.run.services import Services, check_resumable, make_checkpointer
from jaxnitro._src.run.settings import Settings

if TYPE_CHECKING:
    from typing import Any

    from jaxnitro._src.observe.loggers.base import Logger


def make_run_dir(path: Path) -> None:
    """An unusable run dir fails before any work."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file; give a directory path (run_dir='runs/x').")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create run_dir {path}: {e}. Pick a writable path.") from e


def services(s: Settings) -> tuple[Services, bool]:
    """(the run's services, whether the user named the checkpointer). With several processes
    only process 0 logs and shows progress (the others' logger and display are off); every
    process checkpoints (together), and only process 0 writes the run's files."""
    checkpointer, named = make_checkpointer(s.checkpointer, default=TopKCheckpointer)
    check_resumable(checkpointer, s.resume)
    writer = jax.process_index() == 0
    svc = Services(
        logger=logger_of(s.logger) if writer else logger_of(False),
        checkpointer=checkpointer,
        display=Display(s.progress if writer else False),
        lock=RunLock(s.run_dir) if writer else FollowerLock(s.run_dir),
        run_dir=s.run_dir,
        params_line={},
    )
    checkpointer.bind(s.run_dir, writer=False)
    return svc, named


def logger_of(value: Any) -> Logger:
    return make_logger(value, JSONLogger)


def resume_record(svc: Services, run_dir: Path, resume: Any) -> Path | None:
    """The checkpoint to resume from (None: a fresh run)."""
    if resume in (False, None):
        return None
    if resume in (True, "auto"):
        # The newest checkpoint that verifies: a truncated or corrupted newest one is reported
        # and moved aside, which writes: a run another writer holds cannot be resumed now.
        svc.lock.acquire("resume", what=f"run_dir {run_dir}")
        try:
            svc.checkpointer.bind(run_dir, writer=True)
            latest = svc.checkpointer.latest_valid()
        finally:
            svc.lock.release()
        if latest is None and resume is True:
            raise CheckpointError(
                f"resume=True but {svc.checkpointer.dir} holds no checkpoint. Use "
                f"resume='auto' to start fresh when there is none."
            )
        return latest
    if not isinstance(resume, (str, os.PathLike)):
        raise ConfigError(
            f"resume={resume!r}; use False, 'auto' (continue from the newest checkpoint in "
            f"run_dir if any), True (it must exist) or a checkpoint path."
        )
    path = Path(resume).absolute()
    if not path.exists():
        raise CheckpointError(
            f"resume={resume!r}: no such checkpoint. Pass a checkpoint directory (e.g. "
            f"TopKCheckpointer(dir=...).latest()), or resume='auto' to continue from the "
            f"newest one in run_dir."
        )
    return path


def shared_resume_record(svc: Services, run_dir: Path, resume: Any) -> Path | None:
    """`resume_record`, decided by process 0 alone (it may move a corrupted checkpoint
    aside) and the same on every process; one process: `resume_record` itself."""
    if jax.process_count() == 1:
        return resume_record(svc, run_dir, resume)
    found = distributed.decided_by_process_zero(
        "resume", lambda: _path_str(resume_record(svc, run_dir, resume))
    )
    return None if found is None else Path(found)


def _path_str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def identity(resume_path: Path | None, seed: int) -> tuple[str, int]:
    """(run id, seed): a resumed run keeps its checkpoint's id and seed."""
    run_id = uuid.uuid4().hex[:12]
    if resume_path is None:
        return run_id, seed
    meta = read_meta(resume_path)
    saved = meta.get("run_id")
    if isinstance(saved, str) and re.fullmatch(r"[0-9a-zA-Z_-]{1,64}", saved):
        run_id = saved
    if meta.get("seed") is not None and meta["seed"] != seed:
        warn_user(
            f"resuming with seed {meta['seed']} from the checkpoint instead of {seed}: the "
            f"shuffle order and dropout must continue as they were.",
        )
        seed = validate_int(meta, "seed", resume_path)
    return run_id, seed


def read_meta(path: Path) -> dict:
    """The user meta of a checkpoint, read without its arrays (errors name what is wrong)."""
    full = checkpoint_meta(Path(path))
    return full.get("meta", full)


def restore_loggers(svc: Services, resume_path: Path | None) -> None:
    """A resume hands the loggers the state its checkpoint saved (`meta["loggers"]`), so they
    reattach to their runs: the same TensorBoard dir, MLflow run, W&B run."""
    load = getattr(svc.logger, "load_state_dict", None)
    if resume_path is None or not callable(load):
        return
    state = read_meta(resume_path).get("loggers")
    if isinstance(state, dict):
        load(state)
