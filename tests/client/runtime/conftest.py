"""The streaming path is what these tests exercise: on a host without CUDA it runs with the CPU as the device."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _streaming(stream_on_cpu: None, profiled_compute: None) -> None:
    """Every test here streams through the block loader, also on a CPU compute device, and plans latency mode
    with the compute its profile measured (on a GPU the bound for the smallest pass keeps small models resident)."""
