"""Which checkpoints a Top-K store keeps: ranked by one metric, best first, plus the newest.

Pure functions of manifest rows; `TopKCheckpointer` deletes what they leave out.
"""

from __future__ import annotations

import math


def score(row: dict, metric: str) -> float | None:
    """The row's `metric` as a rankable number, or None (missing, null or non-finite)."""
    # From the row's metrics, not its stored score, so a dir reused with another metric works.
    # A missing, null or non-finite score is never "best": it is ranked after every number.
    value = row.get("metrics", {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return value


def ranked(rows: list[dict], metric: str, mode: str) -> list[dict]:
    """Rows with a finite metric, best first (stable sort: on ties the older wins)."""
    scored = [(value, r) for r in rows if (value := score(r, metric)) is not None]
    scored.sort(key=lambda sr: sr[0], reverse=mode == "max")
    return [r for _, r in scored]


def newest(rows: list[dict]) -> dict | None:
    """The row of the highest step (the last listed on ties), or None."""
    return max(enumerate(rows), key=lambda ir: (ir[1]["step"], ir[0]))[1] if rows else None


def kept(rows: list[dict], *, k: int, metric: str, mode: str) -> set[str]:
    """Names of the rows retention keeps: the `k` best by `metric`, the newest, and every
    checkpoint the user asked for (`requested`: `handle.checkpoint()`, the MCP `checkpoint`
    tool), which stays until the user deletes its directory.

    Example:
        >>> rows = [{"name": "a", "step": 1, "requested": True}, {"name": "b", "step": 2}]
        >>> sorted(kept(rows, k=1, metric="val_loss", mode="min"))
        ['a', 'b']
    """
    last = newest(rows)
    if last is None:
        return set()
    asked = {r["name"] for r in rows if r.get("requested")}
    return {r["name"] for r in ranked(rows, metric, mode)[:k]} | {last["name"]} | asked
