"""A stand-in for IPython's `display` in a kernel, as the notebook display calls it."""

from __future__ import annotations


class DisplayRecorder:
    """IPython's `display` as the notebook display calls it: one display, then updates."""

    def __init__(self):
        self.shown: list[str] = []
        self.updates: list[str] = []

    def __call__(self, obj, display_id=None):
        self.shown.append(obj._repr_html_())
        return self

    def update(self, obj):
        self.updates.append(obj._repr_html_())
