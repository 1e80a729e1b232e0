"""Step lines given as columns: the rows a logger's `log_step_rows` takes, built from them.

The training loop reads a chunk of steps back as one column per output; every line of the
chunk shares its learning rates and throughput (`extra`). A logger that can write the
columns as they are has `log_step_columns`; any other gets these rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def step_rows(
    names: Sequence[str], lists: Sequence[Sequence[Any]], extra: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """One row per step: the outputs (`lists[i]` is output `names[i]`'s column) `update`d
    with `extra` (the keys in that order; a value of `extra` wins over an output's).

    Example:
        >>> step_rows(["loss"], [[0.5, 0.25]], {"lr": 0.1})
        [{'loss': 0.5, 'lr': 0.1}, {'loss': 0.25, 'lr': 0.1}]
    """
    keys = (*names, *(k for k in extra if k not in names))  # (an output's own place first)
    tail = tuple(extra[k] for k in keys[len(names) :])
    rows = [dict(zip(keys, (*values, *tail), strict=True)) for values in zip(*lists, strict=True)]
    if len(keys) < len(names) + len(extra):  # an output named as an extra: the extra's
        for row in rows:  # value, as `update` gives it
            row.update(extra)
    return rows
