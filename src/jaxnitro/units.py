"""Sizes as people read them: the one bytes formatter for tables, plans and error messages."""

from __future__ import annotations

__all__ = ["format_bytes"]

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
