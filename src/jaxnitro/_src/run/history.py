"""`jn.history(n)`: one row per validation (epoch, step, val metrics; an epoch's end row also
its train loss), best row marked."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import TYPE_CHECKING

from jaxnitro._src.core.errors import check_mode
from jaxnitro._src.core.html_table import html_table

if TYPE_CHECKING:
    from typing import Any


class History:
    """A row per validation as dicts, with the best row by the checkpointer's metric.

    `jn.history(n)` returns one for a run: a row at each epoch's end (`epoch`, `step`,
    `train_loss` and the validation metrics) and one per validation inside an epoch
    (`Nitro(val_every=N)`: `epoch`, `step` and the metrics, no `train_loss`). `best` is chosen
    from all of them. Indexing by an int gives a row, by a slice a History, by a column name
    that column's values.

    Example:
        >>> h = jn.History([{"epoch": 1, "acc": 0.8}, {"epoch": 2, "acc": 0.9}],
        ...                metric="acc", mode="max")
        >>> h.best["epoch"], h["acc"], h[-1]["epoch"]
        (2, [0.8, 0.9], 2)
    """

    def __init__(self, rows: list[dict], *, metric: str | None, mode: str = "min") -> None:
        self.rows, self.metric, self.mode = rows, metric, check_mode("History mode", mode)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):  # a column
            return [row.get(key) for row in self.rows]
        if isinstance(key, slice):
            return History(self.rows[key], metric=self.metric, mode=self.mode)
        return self.rows[key]

    @property
    def best_index(self) -> int | None:
        """Index of the best row by ``metric`` and ``mode`` (rows without a finite value
        never win), or None.

        Example:
            >>> h.best_index
            1
        """
        scored = [
            (i, v) for i, r in enumerate(self.rows) if (v := _score(r.get(self.metric))) is not None
        ]
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda iv: iv[1])[0]

    @property
    def best(self) -> dict | None:
        """The best row (see `best_index`), or None."""
        i = self.best_index
        return None if i is None else self.rows[i]

    def to_pandas(self) -> Any:
        """A DataFrame with a boolean `best` column (needs pandas).

        Example:
            >>> h.to_pandas()["best"].tolist()
            [False, True]
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("History.to_pandas needs pandas: pip install pandas") from e
        df = pd.DataFrame(self.rows)
        df["best"] = [i == self.best_index for i in range(len(self.rows))]
        return df

    def _repr_html_(self) -> str:
        """The rows as a table in a notebook, the best row in bold."""
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        rows = [[row.get(k) for k in columns] for row in self.rows]
        caption = f"best by {self.metric} ({self.mode})" if self.metric else ""
        return html_table(columns, rows, marked=self.best_index, caption=caption)

    def __repr__(self) -> str:
        """`History(3 rows; best by max acc: rows[2], acc=0.91)`: the best row's index and
        its value, never a value the metric could be mistaken for.

        Example:
            >>> History([{"acc": 0.5}, {"acc": 0.91}], metric="acc", mode="max")
            History(2 rows; best by max acc: rows[1], acc=0.91)
        """
        i = self.best_index
        if not self.metric:
            return f"History({len(self.rows)} rows)"
        if i is None:
            return (
                f"History({len(self.rows)} rows; best by {self.mode} {self.metric}: None, "
                f"no row has a finite {self.metric})"
            )
        value = self.rows[i][self.metric]
        shown = f"{value:.4g}" if isinstance(value, float) else repr(value)
        return (
            f"History({len(self.rows)} rows; best by {self.mode} {self.metric}: rows[{i}], "
            f"{self.metric}={shown})"
        )


def _score(value: Any) -> float | None:
    """A finite real scalar as a float (numpy/jax scalars included, e.g. from
    `finalize_metrics`), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if not isinstance(value, numbers.Real):
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        if getattr(value, "shape", None) != () or kind not in ("i", "u", "f"):
            return None
    try:
        value = float(value)
    except (OverflowError, TypeError, ValueError):  # e.g. an int beyond float range
        return None
    return value if math.isfinite(value) else None  # NaN and +-inf never score
