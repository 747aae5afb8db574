"""Offload timing: the report dataclasses and eager collection on the CPU."""

from __future__ import annotations

import pytest
import torch

import flextensor as ft
from flextensor.runtime.timing import OffloadTimingReport, OffloadTimingSnapshot, TrapTimingRecord, TrapTimingStats
from tests.helpers.models import DEVICE, cpu_config, mlp_stack


def test_snapshot_and_report_properties():
    p1 = OffloadTimingSnapshot((TrapTimingRecord("a", 1.0, 2.0, 0.5), TrapTimingRecord("b", 3.0, 4.0, 0.0)))
    p2 = OffloadTimingSnapshot((TrapTimingRecord("a", 2.0, 4.0, 1.5), TrapTimingRecord("b", 1.0, 2.0, 0.0)))
    assert (p1.total_transfer_ms, p1.total_compute_ms, p1.total_wait_ms) == (4.0, 6.0, 0.5)
    report = OffloadTimingReport.from_passes([p1, p2])
    assert report.num_passes == 2
    assert report.total_compute_sum == 12.0 and report.total_compute_avg == 6.0
    assert report.total_transfer_avg == 3.5 and report.total_wait_avg == 1.0
    a = report.per_trap[0]
    assert isinstance(a, TrapTimingStats) and a.label == "a"
    assert (a.compute_min, a.compute_max, a.compute_avg, a.compute_median) == (2.0, 4.0, 3.0, 3.0)
    assert a.compute_std == pytest.approx(1.0) and a.wait_max == 1.5
    assert a.compute_budget_ms() == 3.0 and a.compute_budget_ms(conservative=True) == 2.0
    assert report.compute_budgets_by_profile_label(["x", "y"]) == {"x": 3.0, "y": 3.0}
    assert OffloadTimingReport().total_wait_avg == 0.0
    table = ft.format_offload_timing_table(report)
    assert "average of 2 passes" in table and "TOTAL/pass" in table and "a " in table
    assert "one pass" in ft.format_offload_timing_table(p1)
    with pytest.raises(TypeError):
        ft.format_offload_timing_table("nope")


def test_eager_timing_on_cpu_one_record_per_trap():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(offload_timing="eager", load_strategy=ft.NthLayerStrategy(2)))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
        assert ft.collect_offload_timing() is None  # nothing measured before INFERENCE
        om.wait_for_host_blocks()  # streaming from here on (a resident warm-up builds the blocks behind it)
        for _ in range(3):
            model(x)
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 3
    for snap in report.passes:
        assert [r.label for r in snap.per_trap] == ["0", "1", "2", "3"]
        assert all(r.compute_ms > 0 and r.wait_ms >= 0 for r in snap.per_trap)
        if DEVICE.type == "cpu":
            assert all(r.wait_ms == 0 for r in snap.per_trap)  # synchronous copies never stall
        offloaded = set(om.offloaded_tensors)
        assert offloaded == {"0", "2"}
        assert all((r.transfer_ms > 0) == (r.label in offloaded) for r in snap.per_trap)
    assert ft.collect_offload_timing() is None  # drained
    with torch.no_grad():
        model(x)
    ft.reset_offload_timing()
    assert ft.collect_offload_timing() is None


def test_timing_off_returns_none():
    model = mlp_stack()
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(1)))
    with torch.no_grad():
        for _ in range(ft.get_offload_manager().iters_before_inference + 1):
            model(torch.randn(1, 16, device=DEVICE))
    assert ft.collect_offload_timing() is None


@pytest.mark.cuda
def test_cuda_overlap_through_engine():
    """Compute-bound layers: the next layer's copy hides behind compute, so waits are small against transfers."""
    torch.manual_seed(0)
    d = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(8)]).eval()
    x = torch.randn(8192, d, device="cuda")
    cfg = ft.OffloadConfig(profiling_iters=2, num_blocks=2, min_blocks=2, offload_timing="eager",
                           load_strategy=ft.NthLayerStrategy(1))
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            model(x)
        om.wait_for_host_blocks()  # stream from now on (the blocks may still be building behind resident passes)
        ft.reset_offload_timing()
        for _ in range(3):
            model(x)
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 3 and len(report.per_trap) == 8
    table = ft.format_offload_timing_table(report)
    print(table)
    assert report.total_transfer_avg > 0
    assert report.total_wait_avg < 0.2 * report.total_transfer_avg, table


@pytest.mark.cuda
def test_cuda_current_stream_lookup_follows_a_stream_switch():
    from flextensor.runtime.timing import CurrentStream

    current = CurrentStream(torch.device("cuda"))
    first = current()
    assert first == torch.cuda.current_stream() and current() is first  # the same object while unchanged
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side
    assert current() == torch.cuda.current_stream()


@pytest.mark.cuda
def test_cuda_windows_read_in_one_wait_even_when_one_is_on_a_busy_stream():
    """``read_windows_ms`` waits for the last mark only; a window on another stream still pending is waited for
    itself (a caller that switched streams inside a pass), and its marks go back to the pool once."""
    from flextensor.runtime.timing import TimingCollector

    clock = TimingCollector(True, torch.device("cuda"))
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()  # not the legacy default stream, which waits for both
    with torch.cuda.stream(other):
        # Allocated before the busy stream sleeps: a fresh cudaMalloc for this stream's pool may wait for the
        # sleep, which would put the sleep inside the other window (seen once on the H200: 116 ms).
        small = torch.ones(1, device="cuda")
    with torch.cuda.stream(busy):
        first = clock.mark()
        torch.cuda._sleep(200_000_000)  # well over 50 ms on any current GPU: still running when read
        second = clock.mark()
    with torch.cuda.stream(other):
        third = clock.mark()
        small.add_(1)
        fourth = clock.mark()
    ms = clock.read_windows_ms([(first, second), (third, fourth)])
    assert ms[0] > 20 and 0 <= ms[1] < ms[0]
    clock.recycle_marks([first, second, third, fourth])
    assert len(clock._free_events) == 4 and clock.mark() is fourth  # reused, last in first out


def test_a_host_clock_mark_is_always_done():
    from flextensor.runtime.timing import TimingCollector

    clock = TimingCollector(False)
    assert clock.done(clock.mark())


@pytest.mark.cuda
def test_cuda_mark_is_done_only_once_the_device_passed_it():
    """``done`` asks without waiting: False while the stream is still busy before the mark, True after."""
    from flextensor.runtime.timing import TimingCollector

    clock = TimingCollector(True, torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # well over 50 ms on any current GPU
    mark = clock.mark()
    assert not clock.done(mark)
    torch.cuda.synchronize()
    assert clock.done(mark)
    clock.recycle_marks([mark])
