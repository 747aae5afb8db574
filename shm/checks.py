"""Argument checks shared by the public entry points (one wording for every timeout in the project)."""

from __future__ import annotations

import math


def check_seconds(value: object, what: str, *, allow_none: bool, positive: bool = False) -> float | None:
    """``value`` as a float number of seconds, or ``None`` when ``allow_none`` and it is ``None``.

    ``ValueError`` naming ``what`` for bools, non-numbers, NaN, infinities, negatives (and 0 when ``positive``).
    """
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        bound = "> 0" if positive else ">= 0"
        none = " or None (no limit)" if allow_none else ""
        raise ValueError(f"invalid {what} {value!r}: pass a finite number of seconds {bound}{none}")
    return float(value)
