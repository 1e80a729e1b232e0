"""An HTML table for a notebook's `_repr_html_`, shared by every layer that shows one (the
compile report, the runs listing, a history, the background runs)."""

from __future__ import annotations

import html


def html_table(header, rows, *, marked: int | None = None, caption: str = "") -> str:
    """An HTML table for a notebook's `_repr_html_` (cells escaped; row `marked` in bold)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td><b>{html.escape(_cell(c))}</b></td>"
            if i == marked
            else f"<td>{html.escape(_cell(c))}</td>"
            for c in row
        )
        + "</tr>"
        for i, row in enumerate(rows)
    )
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
