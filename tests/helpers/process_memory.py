"""This process's memory readings for the tests that bound peak RSS (``/proc/self/status``)."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux 4.0+; a no-op where ``clear_refs`` cannot be written), so a
    peak read later counts only what came after."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
