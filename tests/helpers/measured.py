"""Numbers a test run measured, printed together at its end: tests assert behaviour, and report what they saw.

A conftest makes one :class:`MeasuredLines` with its section title, hands out its :meth:`~MeasuredLines.record`
and calls :meth:`~MeasuredLines.write` from its ``pytest_terminal_summary`` hook. Nothing timed is asserted.
"""

from __future__ import annotations

import pytest


class MeasuredLines:
    """(test name, line) pairs for one section of the terminal summary."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.lines: list[tuple[str, str]] = []

    def record(self, request: pytest.FixtureRequest, line: str) -> None:
        """Keep a measured number for the end-of-run summary (and print it, for ``-s`` runs)."""
        self.lines.append((request.node.nodeid.split("::")[-1], line))
        print(line)

    def write(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section(self.title)
            for name, line in self.lines:
                terminalreporter.write_line(f"{name}: {line}")
