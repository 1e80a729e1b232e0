"""Sizes as people read them: the one bytes formatter for tables, plans and error messages."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Bytes in binary units, one decimal above a KiB: ``512 B``, ``3.2 KiB``, ``1.5 GiB``.

    Example:
        >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(1.5 * 2**30)
        ('512 B', '3.0 MiB', '1.5 GiB')
    """
    size = float(n)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"


_PARSE = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(name: str, value, *, error: type[Exception] = ValueError) -> int:
    """A size given as bytes (an int) or a string such as "1GB", "512MiB", "1.5 GiB";
    anything else raises `error` naming `name` and the forms it takes.

    Example:
        >>> parse_bytes("memory_budget", "1.5 GiB"), parse_bytes("cap", 1000)
        (1610612736, 1000)
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m and m.group(2).lower()
        if not m or unit not in _PARSE:
            raise error(
                f"{name}={value!r} is not a size; pass bytes as an int or a "
                f"string like '1GB' or '512MiB' (units: B, KB, MB, GB, TB, KiB, "
                f"MiB, GiB, TiB)."
            )
        number = float(m.group(1)) * _PARSE[unit]
        if not math.isfinite(number):
            raise error(f"{name} is not finite.")
        value = int(number)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        and not _is_np_int(value)
        or value <= 0
    ):
        raise error(
            f"{name} must be a positive number of bytes (or '1GB', '512MiB'), got {value!r}."
        )
    return int(value)


def _is_np_int(value) -> bool:
    import numpy as np

    return isinstance(value, np.integer)
