"""`SplitSpec`: what the first batch of a split showed at setup, the shapes every later batch
of the split must match. Setup (`run/setup/data.py`) makes one per split; the feed, the
program builders and the loop read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """What the first batch of a split showed at setup.

    Attributes:
        batch_size: rows per batch (the last batch of an eval split may be shorter).
        fields: the batch fields a traced hook names (sent to the device, in order).
        keys: every field of a batch (host-only ones included).
        has_loss: the batches carry the fields `loss` needs (validation logs a loss).
        first: the first host batch (for planning programs without iterating the source).
        specs: field -> (per-example shape, dtype) every later batch must match.
    """

    batch_size: int
    fields: tuple[str, ...]
    keys: frozenset
    has_loss: bool
    first: Mapping[str, Any]
    specs: Mapping[str, Any]
