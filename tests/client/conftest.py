"""Fixtures of the engine's tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from flextensor.engine.policy import default_engine_policy, set_default_engine_policy


@pytest.fixture
def stream_on_cpu() -> Iterator[None]:
    """Managers made in this test stream through the block loader on a CPU compute device, as on a GPU (by
    default a CPU computes from its host blocks in place), so the streaming path runs on hosts without CUDA."""
    previous = set_default_engine_policy(replace(default_engine_policy(), stream_on_cpu=True))
    yield
    set_default_engine_policy(previous)


@pytest.fixture
def profiled_compute() -> Iterator[None]:
    """Latency-mode plans made in this test hide copies under the compute the profile measured only, without the
    bound for the smallest pass (Note [the smallest pass] in ``flextensor.runtime.device_read_rate``): on a GPU
    that bound keeps a test's small model resident, and a test of the streaming path needs blocks that stream.
    The bound itself is tested with it on (``tests/client/engine/test_smallest_pass.py``)."""
    previous = set_default_engine_policy(replace(default_engine_policy(), device_read_rate=float("inf")))
    yield
    set_default_engine_policy(previous)
