"""Fixtures shared by the shm tests."""

from __future__ import annotations

import pytest

from tests.shm.procs import Child, start_children


@pytest.fixture
def children():
    """``children(n)`` starts n helper processes (tests/shm/procs.py); all are killed after the test."""
    started: list[Child] = []

    def spawn(n: int) -> list[Child]:
        new = start_children(n)
        started.extend(new)
        return new

    yield spawn
    for child in started:
        child.kill()
        child.stop()
