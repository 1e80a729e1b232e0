"""The options of `jn.Nitro(...)` (declared in `run/options.py`), validated into one `Settings`.

A keyword wins over an experiment field of the same name (for every value option, and
`checkpointer`), which wins over the default. Every bad value is a `ConfigError` that names
the option (or the field), what it got, and a value that works.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from jaxnitro._src.run import options

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Hooked


class Settings:
    """Every option of `jn.Nitro(...)`, validated, as attributes (`s.accum`); frozen.

    Services and data are built from these. `run_dir` is a `Path` (runs/<Class> by default),
    `schedules` the table in force (the keyword's, else the experiment's `schedules()`)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"Settings has no option {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Settings are frozen")


def settings(exp: Hooked, given: Mapping[str, Any]) -> Settings:
    """Validate the keywords of `jn.Nitro(exp, **given)` against the experiment's fields."""
    cls = type(exp)
    values = options.checked(exp, given)
    if values["run_dir"] is None:
        values["run_dir"] = Path("runs") / cls.__name__
    if given.get("schedules") is None:  # Nitro(schedules=...) replaces the table; no merge
        values["schedules"] = (exp.schedules() if hasattr(cls, "schedules") else {}) or {}
    values["schedules"] = dict(values["schedules"])
    return Settings(values)


def max_epochs(value: Any) -> int:
    """A new `max_epochs` for a live handle (to train further)."""
    return options.BY_NAME["max_epochs"].check(value)
