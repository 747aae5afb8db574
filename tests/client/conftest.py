"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from flextensor.manager import OffloadManager


@pytest.fixture
def stream_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Managers made in this test stream through the block loader on a CPU compute device, as on a GPU (by
    default a CPU computes from its host blocks in place), so the streaming path runs on hosts without CUDA."""
    monkeypatch.setattr(OffloadManager, "_stream_on_cpu", True)
