"""The device memory's read rate that bounds latency-mode compute from below (Note [the smallest pass])."""

from __future__ import annotations

import pytest
import torch

from flextensor.runtime.device_read_rate import copy_read_rate, device_read_rate, peak_read_rate


def test_a_cpu_has_no_device_memory_of_its_own_to_bound_with():
    assert device_read_rate(torch.device("cpu")) is None


@pytest.mark.cuda
def test_the_rate_bounds_what_a_device_copy_reaches_and_both_estimates_agree():
    device = torch.device("cuda", 0)
    rate = device_read_rate(device)
    assert rate is not None and device_read_rate(device) == rate  # measured once, cached
    peak = peak_read_rate(device)
    estimate = copy_read_rate(device)
    if peak is not None:
        assert rate == peak
        assert 0.5 * peak <= estimate <= 1.6 * peak, (estimate, peak)
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    traffic = 2 * n / (start.elapsed_time(end) / 1e3)
    assert traffic <= rate, "no copy moves more bytes than the memory's peak: the floor stays a lower bound"
