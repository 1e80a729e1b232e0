"""`Progress`: where a run is, frozen; the loop returns a new one with `advance`/`replace`.

A checkpoint stores it (with the arrays of the `TrainState`), so a resume continues at the
same epoch, batch and step, with the same history and early-stopping state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxnitro._src.run.early_stop import EarlyStopState, StopState


@dataclasses.dataclass(frozen=True)
class Progress:
    """Epoch (0-based, completed epochs), the batch position in it, optimizer steps taken,
    skipped steps, the history rows, the early-stopping state, and the first epoch's length
    (for a source without `len()`), and a stream's iterator state.

    Example:
        >>> p = Progress().advance(steps=4, batches=4)
        >>> p.step, p.batch_in_epoch
        (4, 4)
        >>> p.next_epoch().epoch
        1
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    skipped_steps: int = 0
    history: tuple[Mapping[str, Any], ...] = ()
    #: early stopping's counters (one per member of a population; `EarlyStopConfig.advance`
    #: steps them), or None when the run has no early stopping
    early_stop: StopState | None = None
    #: the plateau rule's counters (`run/plateau.py`; a checkpoint stores them)
    plateau: EarlyStopState | None = None
    first_epoch_batches: int | None = None
    #: a stream's iterator state after the last batch trained on (grain; JSON), or None
    data_state: Mapping[str, Any] | None = None
    #: the current epoch's train losses read so far, (sum in step order, count): a resume
    #: mid-epoch reports the whole epoch's mean, not only the steps after it
    epoch_loss: tuple[float, int] = (0.0, 0)

    def replace(self, **changes: Any) -> Progress:
        return dataclasses.replace(self, **changes)

    def advance(self, *, steps: int, batches: int) -> Progress:
        """After a dispatch of `steps` optimizer steps over `batches` batches."""
        return dataclasses.replace(
            self, step=self.step + steps, batch_in_epoch=self.batch_in_epoch + batches
        )

    def next_epoch(self) -> Progress:
        return dataclasses.replace(
            self, epoch=self.epoch + 1, batch_in_epoch=0, data_state=None, epoch_loss=(0.0, 0)
        )

    @property
    def epoch_number(self) -> int:
        """The epoch every report names (status, checkpoint names, logs, history, the
        display): that of the last step taken, 1-based; 0 before the first. An epoch's end
        and the next one's start before its first step are the same epoch (docs/training.md,
        "Counting").

        Example:
            >>> Progress(epoch=1, batch_in_epoch=7).epoch_number  # inside the 2nd epoch
            2
            >>> Progress(epoch=2).epoch_number  # two epochs done, the 3rd not begun
            2
        """
        return self.epoch + (1 if self.batch_in_epoch else 0)

    def where(self) -> str:
        """Where the run is, in words (for the resume and preemption lines).

        Example:
            >>> Progress(epoch=1, batch_in_epoch=7, step=15).where()
            'epoch 2 at batch 7, step 15'
        """
        if self.batch_in_epoch:
            return f"epoch {self.epoch + 1} at batch {self.batch_in_epoch}, step {self.step}"
        return f"the end of epoch {self.epoch}, step {self.step}" if self.epoch else "the start"

    def with_row(self, row: Mapping[str, Any]) -> Progress:
        """The history with `row` added: one row per validation, mid-epoch ones included.

        An epoch's end row (it carries `train_loss`) replaces an earlier end row of the same
        epoch: the row of an epoch a stop cut short, which the resume then finished, so the
        history equals the straight run's.
        """
        rows = list(self.history)
        if "train_loss" in row:
            rows = [r for r in rows if not (r.get("epoch") == row["epoch"] and "train_loss" in r)]
        rows.append(dict(row))
        return dataclasses.replace(self, history=tuple(rows))
