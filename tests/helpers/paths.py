"""The places a test refers to, wherever the test file sits below `tests/`."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: conftest.py and helpers/ live here
ROOT = TESTS.parent  # the checkout: docs/, examples/, src/
SRC = ROOT / "src"  # for PYTHONPATH in child processes, so they import this tree
