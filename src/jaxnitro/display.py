"""What a run shows while it works: a rich display on a terminal, plain lines otherwise."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Display:
    """Phase, epoch, step, loss, steps/s and ETA; a live line while a program compiles.

    `mode` is "rich" (a terminal), "plain" (one line per event, for logs and CI) or "off".
    """

    def __init__(self, mode: str | bool | None = None, *, file=None):
        file = file if file is not None else sys.stdout
        if mode is None or mode is True:
            mode = "rich" if file.isatty() else "plain"
        self.mode = mode or "off"
        self.file = file
        self.console = Console(file=file) if self.mode == "rich" else None
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    # -- lines -------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.console is not None:  # mode "rich"
            self.console.print(text, highlight=False)
        elif self.mode == "plain":
            print(text, file=self.file, flush=True)

    @contextlib.contextmanager
    def compiling(self, kind: str, label: str = ""):
        """Show that a program compiles, with its elapsed time. Yields a note whose
        `loaded` the caller sets when JAX loaded the program from its persistent cache
        instead (then the line says so)."""
        what = f"{kind} program" + (f" ({label})" if label else "")
        t0 = time.perf_counter()
        note = types.SimpleNamespace(loaded=False)
        if self.console is not None:  # mode "rich"
            with self.console.status(f"compiling the {what}…") as status:
                stop = threading.Event()

                def tick():
                    while not stop.wait(0.5):
                        status.update(f"compiling the {what}… {time.perf_counter() - t0:.1f}s")

                t = threading.Thread(target=tick, daemon=True)
                t.start()
                try:
                    yield note
                finally:
                    stop.set()
                    t.join()
        else:
            yield note
        seconds = time.perf_counter() - t0
        if note.loaded:
            self.line(f"loaded the {what} from the persistent cache in {seconds:.2f}s")
        else:
            self.line(f"compiled the {what} in {seconds:.2f}s")

    # -- epochs ------------------------------------------------------------------------
    def start_epoch(self, epoch: int, max_epochs: int, total: int | None, done: int = 0) -> None:
        self._epoch_t0 = time.perf_counter()
        self._epoch_label = f"epoch {epoch + 1}/{max_epochs}"
        if self.mode != "rich":
            return
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} steps/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            self._epoch_label, total=total, completed=done, loss="–", rate="–"
        )

    def update(self, done: int, loss: float | None, rate: float | None) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=done,
                loss=f"{loss:.4f}" if loss is not None else "–",
                rate=f"{rate:,.0f}" if rate else "–",
            )

    def phase(self, text: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=f"{self._epoch_label} · {text}")

    def end_epoch(self, summary: str) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.line(f"{self._epoch_label}: {summary}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
