"""Aligned text columns for people: one copy for every table the package prints.

``ftd``'s listings and the planner's diagnostics both print rows of cells under a header; the alignment lives
here, in the lowest layer, because the daemon may not import the client (``docs/design.md``). Pure formatting:
no logging, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_columns"]


def format_columns(headers: Sequence[object], rows: Sequence[Sequence[object]], align: str | None = None) -> list[str]:
    """The header line, then one line per row, each column as wide as its widest cell, two spaces between
    columns, trailing blanks removed. ``align`` has one letter per column, ``l`` or ``r`` (default: all ``l``)."""
    align = align or "l" * len(headers)
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} must have one letter, l or r, per column ({len(headers)} columns)")
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    for row in cells[1:]:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(headers)} columns")
    widths = [max(len(row[j]) for row in cells) for j in range(len(headers))]
    return ["  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()
            for row in cells]
