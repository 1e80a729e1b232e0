"""What a run shows while it works: a rich display on a terminal, a live display updated in
place in a Jupyter kernel, plain lines otherwise.

The train bar counts the batches read back (in chunks of `READBACK_CHUNK`, train/epoch.py):
its rate and ETA need no per-step device sync, and the epoch's last drain moves it to the true
count. It is transient, like the bar of a validation, evaluation or prediction: what stays on
screen per epoch is the one summary line.
"""

from __future__ import annotations

import contextlib
import html
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")

# Below this many columns the bar drops its rate and times (narrow terminals, 60 columns).
_FULL_WIDTH = 100
# A full row takes a population's note only where its bar keeps this many cells.
_MIN_BAR = 10
# The notebook display is redrawn at most this often (each redraw is a kernel message).
_NOTEBOOK_INTERVAL_S = 0.25
# A bar in plain mode (`bar(..., lines=True)`) prints about this many lines at most.
_PLAIN_LINES = 10


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel; imports nothing (IPython is only looked up
    when the kernel already loaded it)."""
    if "ipykernel" not in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def show_image(path: Any) -> None:
    """Show a PNG inline when this process is a Jupyter kernel; elsewhere nothing."""
    if in_notebook():
        from IPython.display import Image, display  # the kernel loaded IPython already

        display(Image(filename=str(path)))


def _count_text(label: str, done: int, total: int | None, note: str) -> str:
    count = f"{done}/{total}" if total else f"{done}"
    return f"{label}: {count}" + (f" · {note}" if note else "")


class _Bar(Progress):
    """A rich progress whose columns follow the console's width at each redraw (a resized or
    narrow terminal gets the compact set, never a line the terminal wraps)."""

    def __init__(self, console: Console, *, rate: bool):
        self._full = _columns(full=True, rate=rate)
        self._noted = _columns(full=True, rate=rate, noted=True)
        self._compact = _columns(full=False, rate=rate)
        self._console = console
        super().__init__(*self._full, console=console, transient=True)

    def get_renderables(self):
        width = self._console.width  # read at each redraw: follows a resize
        self.columns = self._full if width >= _FULL_WIDTH else self._compact
        if width >= _FULL_WIDTH and any(t.fields.get("note") for t in self.tasks):
            if self._cells(self._noted) <= width:  # a population's note, where it fits
                self.columns = self._noted
        yield self.make_tasks_table(self.tasks)

    def _cells(self, columns: tuple[ProgressColumn, ...]) -> int:
        """The cells the widest rows of `columns` take with a bar of `_MIN_BAR` cells."""
        options = self._console.options
        cells = len(columns) - 1  # a space between columns
        for column in columns:
            if isinstance(column, BarColumn):
                cells += _MIN_BAR
                continue
            cells += max(
                (Measurement.get(self._console, options, column(t)).maximum for t in self.tasks),
                default=0,
            )
        return cells


def _columns(*, full: bool, rate: bool, noted: bool = False) -> tuple[ProgressColumn, ...]:
    # `noted`: a population's train row says " · 5/8 members training" after its label and
    # "mean " before its loss (fields "" on other rows); only where the full row still fits.
    head: tuple[ProgressColumn, ...] = (
        SpinnerColumn(),
        TextColumn("[bold]{task.description}" + ("{task.fields[note]}" if noted else "")),
        BarColumn(bar_width=None if full else 12),
        MofNCompleteColumn(),
    )
    # "loss 0.5472" on a train row, "" otherwise
    loss = TextColumn(("{task.fields[mean]}" if noted else "") + "{task.fields[loss]}")
    if not full:
        return head + ((loss,) if rate else ())
    if rate:
        head += (loss, TextColumn("{task.fields[rate]}"))
    return head + (TimeElapsedColumn(), TimeRemainingColumn())


class Display:
    """Phase, epoch, step, loss, steps/s and ETA; a live line while a program compiles.

    `mode` is "rich" (a terminal), "notebook" (a Jupyter kernel), "plain" (one line per
    event, for logs and CI) or "off". None/True pick one: a notebook in a kernel, rich on an
    interactive terminal (not `TERM=dumb`), plain otherwise.
    """

    def __init__(self, mode: str | bool | None = None, *, file=None, show: Callable | None = None):
        file = file if file is not None else sys.stdout
        if mode is None or mode is True:
            if in_notebook():
                mode = "notebook"
            else:
                interactive = Console(file=file).is_interactive  # a tty, and TERM not dumb
                mode = "rich" if interactive else "plain"
        self.mode = mode or "off"
        self.file = file
        self.console = Console(file=file) if self.mode == "rich" else None
        self._progress: _Bar | None = None
        self._task: TaskID | None = None
        self._epoch_label = ""
        self._note = self._mean = ""  # a population's train bar: its members, its mean loss
        self._notebook = _Notebook(show) if self.mode == "notebook" else None

    @property
    def width(self) -> int | None:
        """The terminal's columns now (a resize included) in mode "rich"; None elsewhere
        (a log or a notebook does not wrap lines)."""
        return self.console.width if self.console is not None else None

    # -- lines -------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.console is not None:  # mode "rich"
            self.console.print(text, highlight=False)
        elif self.mode in ("plain", "notebook"):
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
    def start_epoch(
        self,
        epoch: int,
        max_epochs: int,
        total: int | None,
        done: int = 0,
        *,
        members: tuple[int, int] | None = None,
    ) -> None:
        """The epoch's train bar; for a population `members` is (members still training,
        members): the bar says so (`epoch 2/10 · 5/8 members training`) and that its loss
        is their mean."""
        self._epoch_t0 = time.perf_counter()
        self._epoch_label = f"epoch {epoch + 1}/{max_epochs}"
        self._note = self._mean = ""
        if members is not None:
            training, size = members
            self._note = (
                f" · {size} members"
                if training == size
                else f" · {training}/{size} members training"
            )
            self._mean = "mean "
        if self._notebook is not None:
            self._notebook.bar(self._epoch_label + self._note, done, total, "", force=True)
        if self.console is None:
            return
        self._progress = _Bar(self.console, rate=True)
        self._progress.start()
        self._task = self._progress.add_task(
            self._epoch_label,
            total=total,
            completed=done,
            loss="loss –",
            rate="– steps/s",
            note=self._note,
            mean=self._mean,
        )

    def update(self, done: int, loss: float | None, rate: float | None) -> None:
        """The batches read back so far, the last loss and the steps/s (from the read-back
        chunks: no device sync of its own)."""
        if self._notebook is None and (self._progress is None or self._task is None):
            return  # nothing shown: nothing to format (it runs every read-back chunk)
        loss_text = f"{loss:.4f}" if loss is not None else "–"
        rate_text = f"{rate:,.0f}" if rate else "–"
        if self._notebook is not None:
            self._notebook.bar(
                self._epoch_label + self._note,
                done,
                None,
                f"{self._mean}loss {loss_text} · {rate_text} steps/s",
            )
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, completed=done, loss=f"loss {loss_text}", rate=f"{rate_text} steps/s"
            )

    def end_train(self, done: int) -> None:
        """The epoch's train steps are all read back: the bar shows the true count (the
        total too, for a split without len()), then leaves the screen."""
        if self._notebook is not None:
            label = self._epoch_label + self._note
            self._notebook.bar(label, done, done, "", force=True, final=True)
        if self._progress is not None and self._task is not None:
            task = self._progress.tasks[0]
            total = task.total if task.total is not None and task.total >= done else done
            self._progress.update(self._task, completed=done, total=total)
            self._progress.refresh()
            self._progress.stop()
        self._progress = self._task = None

    @contextlib.contextmanager
    def bar(
        self, label: str, total: int | None, *, lines: bool = False
    ) -> Iterator[Callable[..., None]]:
        """A transient bar over a split's batches (validation, evaluation, prediction) or the
        items of other long work; yields `advance(k=1, note="")`, `note` naming the item
        done (e.g. "model mnist, batch 8"). Inside an epoch's train bar it shows below it.

        In plain mode (no terminal) the bar prints nothing unless `lines`: then it prints
        `label: done/total · note` lines, at most about ten per bar, the last one always.
        """
        if self.mode not in ("rich", "notebook"):
            plain = lines and self.mode == "plain"
            count = [0]
            step = max(1, -(-total // _PLAIN_LINES)) if total else 1

            def advance_plain(k: int = 1, note: str = "") -> None:
                before, count[0] = count[0], count[0] + k
                if plain and (count[0] // step > before // step or count[0] == total):
                    self.line(_count_text(label, count[0], total, note))

            yield advance_plain
            return
        if self._notebook is not None:
            nb, done = self._notebook, [0]
            shown = [label]

            def advance_nb(k: int = 1, note: str = "") -> None:
                done[0] += k
                shown[0] = f"{label} · {note}" if note else label
                nb.sub(shown[0], done[0], total)

            nb.sub(label, 0, total, force=True)
            try:
                yield advance_nb
            finally:
                nb.sub(shown[0], done[0], total, force=True)  # its last count is shown
                nb.sub(None, 0, None, force=True)
            return
        assert self.console is not None
        inner = self._progress  # a mid-epoch validation: a second row under the train bar
        progress = inner if inner is not None else _Bar(self.console, rate=False)
        task = progress.add_task(label, total=total, loss="", rate="", note="", mean="")
        if inner is None:
            progress.start()

        def advance(k: int = 1, note: str = "") -> None:
            if note:
                progress.update(task, description=f"{label} · {note}")
            progress.advance(task, k)

        try:
            yield advance
        finally:
            progress.refresh()  # the bar's last state is drawn (its true count), then goes
            if inner is None:
                progress.stop()
            else:
                progress.remove_task(task)

    def phase(self, text: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=f"{self._epoch_label} · {text}")

    def end_epoch(self, summary: str, row: dict | None = None) -> None:
        self.close()
        text = f"{self._epoch_label}: {summary}"
        if self._notebook is not None:
            self._notebook.summary(self._epoch_label, row or {}, summary)
            return
        self.line(text)

    def table(self, text: str, html_text: str) -> None:
        """A table that stays (a population's members at the end of a run): `text` in a
        terminal or a log, `html_text` in the notebook display, below the epochs' table."""
        if self._notebook is not None:
            self._notebook.block(html_text)
        else:
            self.line(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None


def each(items: Sequence[T], label: str, display: Display | None, *, many: int = 20) -> Iterator[T]:
    """`items` one by one under `display`'s bar (none when `display` is None); in plain mode
    its lines only for `many` items or more, so a short listing stays one screen."""
    if display is None:
        yield from items
        return
    with display.bar(label, len(items), lines=len(items) >= many) as advance:
        for item in items:
            yield item
            advance(1)


class _Notebook:
    """One display per run in a Jupyter kernel, updated in place (`update_display_data`):
    the current bar and, once epochs end, the per-epoch summary table that stays."""

    def __init__(self, show: Callable | None):
        self._show = show  # tests pass a recorder; in a kernel IPython.display.display
        self._handle: Any = None
        self._cell: int | None = None  # the kernel's execution count when it was shown
        self._last = 0.0
        self._bar = ""
        self._sub = ""
        self._rows: list[tuple[str, dict, str]] = []
        self._blocks: list[str] = []  # tables that stay below the epochs' (Display.table)
        self._total: int | None = None

    def bar(self, label, done, total, extra, *, force=False, final=False) -> None:
        if total is not None:
            self._total = total
        total = self._total
        if final:
            self._bar = ""
        else:
            frac = f'value="{done}" max="{total}"' if total else ""
            count = f"{done}/{total}" if total else f"{done}"
            self._bar = (
                f"<div><b>{html.escape(label)}</b> <progress {frac}></progress> "
                f"{count} {html.escape(extra)}</div>"
            )
        self._draw(force or final)

    def sub(self, label, done, total, *, force=False) -> None:
        if label is None:
            self._sub = ""
        else:
            frac = f'value="{done}" max="{total}"' if total else ""
            count = f"{done}/{total}" if total else f"{done}"
            self._sub = f"<div>{html.escape(label)} <progress {frac}></progress> {count}</div>"
        self._draw(force)

    def summary(self, label: str, row: dict, text: str) -> None:
        self._rows.append((label, row, text))
        self._draw(True)

    def block(self, html_text: str) -> None:
        self._blocks.append(html_text)
        self._draw(True)

    def html(self) -> str:
        table = ""
        if self._rows:
            body = "".join(
                f"<tr><td>{html.escape(label)}</td><td>{html.escape(text)}</td></tr>"
                for label, _, text in self._rows
            )
            table = f"<table><tr><th>epoch</th><th>summary</th></tr>{body}</table>"
        blocks = "".join(self._blocks)
        return f"<div class='jaxnitro-run'>{table}{blocks}{self._bar}{self._sub}</div>"

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last < _NOTEBOOK_INTERVAL_S:
            return
        self._last = now
        cell = _execution_count()
        if self._handle is not None and cell != self._cell:
            # a later cell (jn.validate, a second jn.train on the same handle): an output of
            # its own there, never an update of the earlier cell's
            self._handle = None
            self._rows = []
        content = _Html(self.html())
        if self._handle is None:
            self._cell = cell
            self._handle = self._display_fn()(content, display_id=True)
        else:
            self._handle.update(content)

    def _display_fn(self) -> Callable:
        if self._show is None:
            from IPython.display import display  # only reached inside a kernel

            self._show = display
        return self._show


def _execution_count() -> int | None:
    """Which cell the kernel runs (IPython's execution count); None outside a kernel."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None


class _Html:
    """HTML for IPython's display (and plain text for a front end without HTML)."""

    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return "jaxnitro run display"
