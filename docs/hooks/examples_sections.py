"""A Griffe extension for the API reference: read an `Example:` section as `Examples:`.

jaxnitro's docstrings head their doctests `Example:` (one example), which Google style allows;
Griffe's Google parser knows only the plural and would render the doctest as a paragraph of
prose. The docstrings stay as they are; only what the docs site parses changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename a docstring's `Example:` heading to `Examples:` before it is parsed."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
