"""Argument checks shared by the public entry points (one wording for every timeout in the project).

Every duration has an upper bound as well as a lower one: a value that passes construction must work for
the whole run. ``threading`` and ``time.sleep`` raise ``OverflowError`` beyond ``threading.TIMEOUT_MAX``
(about 292 years on Linux, less elsewhere), and a lease is stored as u64 nanoseconds; far below both, a wait of
more than 30 days or a lease of more than a day is a typo, not a plan.  A lease shorter than 0.1 s cannot be
kept: the heartbeat thread beats every quarter lease, and a scheduler hiccup of a few ms would end it.
"""

from __future__ import annotations

import math
from typing import Literal, overload

__all__ = ["MAX_WAIT_SECONDS", "MIN_LEASE_SECONDS", "MAX_LEASE_SECONDS", "check_seconds", "check_lease_seconds"]

#: Longest timeout or wait accepted anywhere (30 days). 0 or None mean "no limit" where documented.
MAX_WAIT_SECONDS = 30 * 24 * 3600.0
#: Bounds of a lease (``lease_seconds``): heartbeats run every quarter of it.
MIN_LEASE_SECONDS = 0.1
MAX_LEASE_SECONDS = 24 * 3600.0


@overload
def check_seconds(value: object, what: str, *, allow_none: Literal[False], positive: bool = False,
                  minimum: float | None = None, maximum: float = MAX_WAIT_SECONDS) -> float: ...
@overload
def check_seconds(value: object, what: str, *, allow_none: bool, positive: bool = False,
                  minimum: float | None = None, maximum: float = MAX_WAIT_SECONDS) -> float | None: ...
def check_seconds(value: object, what: str, *, allow_none: bool, positive: bool = False,
                  minimum: float | None = None, maximum: float = MAX_WAIT_SECONDS) -> float | None:
    """``value`` as a float number of seconds, or ``None`` when ``allow_none`` and it is ``None``.

    ``ValueError`` naming ``what`` and the valid range for bools, non-numbers, NaN, infinities, negatives (and
    0 when ``positive``), values below ``minimum`` and values above ``maximum``.
    """
    if value is None and allow_none:
        return None
    low = minimum if minimum is not None else 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
        or (positive and value == 0)
        or value > maximum
    ):
        if minimum is not None:
            bound = f"between {minimum:g} and {maximum:g}"
        else:
            bound = f"{'> 0' if positive else '>= 0'} and at most {maximum:g}"
        none = " or None (no limit)" if allow_none else ""
        raise ValueError(f"invalid {what} {value!r}: pass a finite number of seconds {bound}{none}")
    return float(value)


def check_lease_seconds(value: object, what: str = "lease_seconds") -> float:
    """A lease length: between ``MIN_LEASE_SECONDS`` and ``MAX_LEASE_SECONDS`` (``ValueError`` otherwise)."""
    return check_seconds(value, what, allow_none=False, minimum=MIN_LEASE_SECONDS, maximum=MAX_LEASE_SECONDS)
