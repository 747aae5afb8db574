"""Fixtures of the engine's tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from flextensor.engine.policy import EnginePolicy, set_default_engine_policy


@pytest.fixture
def stream_on_cpu() -> Iterator[None]:
    """Managers made in this test stream through the block loader on a CPU compute device, as on a GPU (by
    default a CPU computes from its host blocks in place), so the streaming path runs on hosts without CUDA."""
    previous = set_default_engine_policy(EnginePolicy(stream_on_cpu=True))
    yield
    set_default_engine_policy(previous)
