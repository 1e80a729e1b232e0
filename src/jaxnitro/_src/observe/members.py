"""A population run as people watch it (`jn.Nitro(exp, population=...)`): how many members
still train (for the train bar), the epoch's summary line, and the members table at the end.

The members train in lockstep in one program, so one bar serves them all. What a person needs
from the lines is what the logs spread over `name/i` keys: the best member's metrics, which
member that is, how far apart the members are, and at the end their ranking.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jaxnitro._src.core.html_table import html_table

if TYPE_CHECKING:
    import numpy as np

    from jaxnitro._src.steps.population import Population

# The members table shows the best this many and the worst `_WORST`, when there are more.
_BEST = 10
_WORST = 3


class _Stopping(Protocol):
    def active(self, states: Any, /) -> np.ndarray: ...


class _PopulationSpec(Protocol):
    @property
    def population(self) -> Population | None: ...
    @property
    def early_stop(self) -> _Stopping | None: ...


class _StopStates(Protocol):
    @property
    def early_stop(self) -> object: ...


class PopulationRun(Protocol):
    """What `training` reads of a run (a `jn.Nitro` is one): its population and early-stopping
    rule (`spec`), and the members' stopping states (`progress.early_stop`)."""

    @property
    def spec(self) -> _PopulationSpec: ...
    @property
    def progress(self) -> _StopStates: ...


def training(n: PopulationRun) -> tuple[int, int] | None:
    """(members still training, members) of a population run; None for one model. Read from
    the early-stopping states on the host (the driver's `active` mask), no device sync."""
    pop = n.spec.population
    if pop is None:
        return None
    states, es = n.progress.early_stop, n.spec.early_stop
    if es is None or not isinstance(states, tuple):  # no per-member early stopping
        return pop.size, pop.size
    return int(es.active(states).sum()), pop.size


def epoch_summary(
    row: Mapping[str, Any], *, size: int, metric: str, rate: float, mfu: float | None = None
) -> str:
    """The epoch's line for a population: the members' mean train loss, the best member's
    metrics (the plain names in `row`), the spread of `metric` over the members.

    Example:
        >>> row = {"train_loss": 0.97, "member": 1, "acc": 0.87, "acc/0": 0.86, "acc/1": 0.87}
        >>> line = epoch_summary(row, size=2, metric="acc", rate=561.0)
        >>> for part in line.split(" · "):
        ...     print(part)
        train_loss 0.9700 (mean of 2)
        best member 1: acc 0.8700
        acc over members 0.8600–0.8700
        561 steps/s
    """
    parts = []
    if row.get("train_loss") is not None:
        parts.append(f"train_loss {row['train_loss']:.4f} (mean of {size})")
    plain = [
        f"{k} {v:.4f}"
        for k, v in row.items()
        if k not in ("epoch", "step", "train_loss", "member")
        and isinstance(v, float)
        and not _per_member(k, row, size)
    ]
    if plain and isinstance(row.get("member"), int):
        plain[0] = f"best member {row['member']}: {plain[0]}"
    parts += plain
    values = [row.get(f"{metric}/{i}") for i in range(size)]
    finite = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if len(finite) > 1:
        parts.append(f"{metric} over members {min(finite):.4f}–{max(finite):.4f}")
    parts.append(f"{rate:,.0f} steps/s")
    if mfu is not None:
        parts.append(f"MFU {mfu:.1%}")
    return " · ".join(parts)


def _per_member(key: str, row: Mapping[str, Any], size: int) -> bool:
    """Whether `key` is one member's value (`acc/3` beside the best member's `acc`)."""
    name, _, index = key.rpartition("/")
    return index.isdigit() and int(index) < size and name in row


def table(
    pop: Population, members: Sequence[Mapping[str, Any]], *, metric: str
) -> tuple[str, str] | None:
    """The members table, as text (a terminal, a log) and as HTML (a notebook): ranked best
    first (`members` is `TrainResult.members`), one row per member with the values the
    population varies (or its seed), `metric`, the other metrics of the last validation and,
    with per-member early stopping, `stopped_epoch`. A big population shows its best
    `_BEST` and worst `_WORST` and says how many are left out and where they are. None
    before a validation has scored the members by `metric`: nothing ranks them yet."""
    first = members[0] if members else {}
    if metric not in first:
        return None
    varied = [*pop.values, *(pop.labels or pop.rates)] or ["seed"]
    described = set(pop.describe(0))
    others = [k for k in first if k not in described and k not in (metric, "stopped_epoch")]
    header = ["member", *varied, metric, *others]
    stopped = any("stopped_epoch" in m for m in members)
    if stopped:
        header.append("stopped_epoch")
    rows = [
        [_text(m.get(k), metric=k not in varied and k != "member") for k in header] for m in members
    ]
    left = len(rows) - _BEST - _WORST
    caption = f"members, best first by {metric}"
    if left > 1:  # leaving out one row would save nothing
        gap = [f"… {left} more"] + [""] * (len(header) - 1)
        rows = [*rows[:_BEST], gap, *rows[-_WORST:]]
        caption += f" ({len(members)}; jn.train(n).members lists every one)"
    return f"{caption}:\n{_text_table(header, rows)}", html_table(
        header, rows, marked=0, caption=caption
    )


def _text(value: Any, *, metric: bool) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and metric:
        return f"{value:.4f}"
    if isinstance(value, float) and len(str(value)) > 10:  # 0.30000000000000004
        return f"{value:.6g}"
    return str(value)  # the values given to population= as the user wrote them


def _text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, right-aligned (numbers, mostly)."""
    every = [list(header), *rows]
    widths = [max(len(r[i]) for r in every) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in every]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
