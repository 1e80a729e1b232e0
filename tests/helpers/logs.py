"""Reading what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (metrics.jsonl), blank lines skipped."""
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
