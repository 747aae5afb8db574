"""Byte sizes: rounding up to an alignment and writing a size for people. One copy each for the whole package."""

from __future__ import annotations

__all__ = ["align_up", "format_bytes"]


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (> 0)."""
    return -(-n // alignment) * alignment


def format_bytes(n: int | None, digits: int = 1) -> str:
    """Human-readable size in binary units, e.g. ``1.5 GiB`` (``digits`` after the point; ``unknown`` for None)."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
