"""PROFILING windows and the clock they are marked with (``flextensor.runtime.trap_windows``).

The device's clock is faked: each mark records ``scale * perf_counter()`` as its device time, so a scale of 1 is a
device that keeps up with the host and a scale of 2 one whose windows last twice as long as the host's.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.manager import Phase
from flextensor.runtime.trap_windows import (
    CLOCK_TOLERANCE_ABS_S,
    CLOCK_TOLERANCE_REL,
    PassWindows,
    TrapWindow,
    clocks_agree,
    read_pass,
)
from tests.helpers.models import ALL, DEVICE, cpu_config


class FakeMark:
    def __init__(self, device_s: float, behind: bool = False) -> None:
        self.device_s = device_s
        self.behind = behind  # recorded while the device lagged: not done when the next pass starts


class FakeClock:
    """The ``TimingCollector`` surface PROFILING uses, with device times ``scale`` x the host's; a device
    slower than the host (scale > 1) has not reached a mark by the next pass's start."""

    use_cuda = True

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.marks = 0
        self.recycled: list[FakeMark] = []

    def mark(self) -> FakeMark:
        return self.mark_at(time.perf_counter())

    def mark_at(self, now: float) -> FakeMark:
        self.marks += 1
        return FakeMark(self.scale * now, behind=self.scale > 1.0)

    def read_windows_ms(self, pairs):
        return [(end.device_s - start.device_s) * 1e3 for start, end in pairs]

    def done(self, mark) -> bool:
        return not mark.behind

    def recycle_marks(self, marks) -> None:
        self.recycled.extend(marks)


def _window(label: str, start, host: float, end, host_end: float) -> TrapWindow:
    w = TrapWindow(label, start, host)
    w.end, w.host_end = end, host_end
    return w


def test_clocks_agree_within_ten_percent_and_twenty_microseconds():
    assert clocks_agree(1.0, 1.0) and clocks_agree(0.0, 0.0)
    limit = CLOCK_TOLERANCE_REL * 0.01 + CLOCK_TOLERANCE_ABS_S
    assert clocks_agree(0.01 + limit * 0.99, 0.01) and clocks_agree(0.01 - limit * 0.99, 0.01)
    assert not clocks_agree(0.01 + limit * 1.01, 0.01) and not clocks_agree(0.01 - limit * 1.01, 0.01)


def test_a_device_marked_pass_sums_a_trap_called_twice_and_keeps_up_when_its_span_agrees():
    marks = [FakeMark(t) for t in (10.0, 10.1, 10.3, 10.4)]
    windows = [_window("a", marks[0], 0.0, marks[1], 0.1), _window("b", marks[1], 0.1, marks[2], 0.3),
               _window("a", marks[2], 0.3, marks[3], 0.4)]
    reading = read_pass(FakeClock(), PassWindows(windows, True, marks[3], 0.4))
    assert reading.device == pytest.approx({"a": 0.2, "b": 0.2}) and reading.host == pytest.approx({"a": 0.2, "b": 0.2})
    assert reading.kept_up


def test_a_window_lagging_on_the_device_still_keeps_up_when_the_device_caught_up_by_the_end():
    """Window b took twice its host time on the device (a local lag, caught up in c): the pass kept up, and
    its samples are the device's, as measured. A lag that lasts to the end does not keep up."""
    marks = [FakeMark(t) for t in (0.0, 0.05, 0.25, 0.4)]
    windows = [_window("a", marks[0], 0.0, marks[1], 0.1), _window("b", marks[1], 0.1, marks[2], 0.2),
               _window("c", marks[2], 0.2, marks[3], 0.4)]
    reading = read_pass(FakeClock(), PassWindows(windows, True, marks[3], 0.4))
    assert reading.device == pytest.approx({"a": 0.05, "b": 0.2, "c": 0.15})
    assert reading.host == pytest.approx({"a": 0.1, "b": 0.1, "c": 0.2})
    assert reading.kept_up
    late_end = FakeMark(0.5)
    windows[-1].end = late_end
    lagging = read_pass(FakeClock(), PassWindows(windows, True, late_end, 0.4))  # span 0.5 s against 0.4 s
    assert lagging.device == pytest.approx({"a": 0.05, "b": 0.2, "c": 0.25}) and not lagging.kept_up


def test_a_host_marked_pass_reads_its_host_windows_on_both_clocks_and_checks_its_span():
    first, end = FakeMark(5.0), FakeMark(5.3)
    windows = [_window("a", first, 1.0, None, 1.1), _window("b", None, 1.1, None, 1.3)]
    reading = read_pass(FakeClock(), PassWindows(windows, False, end, 1.3))
    assert reading.device == reading.host == pytest.approx({"a": 0.1, "b": 0.2}) and reading.kept_up
    late = read_pass(FakeClock(), PassWindows(windows, False, FakeMark(5.6), 1.3))  # the device took 0.6 s
    assert late.device == late.host == pytest.approx({"a": 0.1, "b": 0.2})  # the host's: the cautious estimate
    assert not late.kept_up


class NoReadClock(FakeClock):
    def read_windows_ms(self, pairs):
        raise AssertionError("the device's marks were read")


def test_a_host_marked_pass_read_without_its_span_check_waits_for_nothing_on_the_device():
    windows = [_window("a", FakeMark(5.0), 1.0, None, 1.1), _window("b", None, 1.1, None, 1.3)]
    reading = read_pass(NoReadClock(), PassWindows(windows, False, FakeMark(5.3), 1.3), check_span=False)
    assert reading.device == reading.host == pytest.approx({"a": 0.1, "b": 0.2}) and not reading.kept_up


def test_a_pass_without_windows_reads_empty_and_not_kept_up():
    assert read_pass(FakeClock(), PassWindows([], True, None, 0.0)) == ({}, {}, False)


# ------------------------------------------------------------------------------------------------ in the manager
class SlowLinear(nn.Linear):
    """2 ms a call: windows long enough that microseconds between a mark and its host reading do not count."""

    def forward(self, x):
        time.sleep(0.002)
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(SlowLinear(8, 8) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _offload_stack(profiling_iters: int):
    """A 4-layer stack offloaded layer by layer, its manager timing on a fake device clock: (model, manager,
    clock, input)."""
    model = Stack()
    ft.offload(model, cpu_config(include_patterns=["layers.*"], load_strategy=ALL, skip_discovery=True,
                                 profiling_iters=profiling_iters))
    om = ft.get_offload_manager()
    clock = om.engine.clock = FakeClock()
    return model, om, clock, torch.ones(2, 8, device=DEVICE)


def _profile(scales: list[float]):
    """Offload a 4-layer stack, then run one PROFILING pass per scale with the fake device clock at that scale;
    returns the manager, the clock and the marks each pass took."""
    model, om, clock, x = _offload_stack(len(scales))
    per_pass = []
    with torch.no_grad():
        for scale in scales:
            assert om.phase is Phase.PROFILING
            clock.scale, before = scale, clock.marks
            model(x)
            per_pass.append(clock.marks - before)
    assert om.phase is Phase.INFERENCE
    return om, clock, per_pass


def test_passes_after_one_that_kept_up_mark_only_their_span_on_the_device():
    om, clock, per_pass = _profile([1.0] * 5)
    # A device-marked pass: each of the 4 entries and the end at least (an entry that may copy or wait first
    # closes the window before it with a mark of its own: on the CPU, in place, every entry after the first).
    # Then only the first entry and the end.
    assert per_pass[0] >= 4 + 1 and per_pass[1:] == [2] * 4
    assert all(len(v) == 5 for v in om.engine.profile.durations.values())
    for label, samples in om.engine.profile.durations.items():
        assert samples == pytest.approx(om.engine.profile.host_durations[label], abs=CLOCK_TOLERANCE_ABS_S)
    assert len(clock.recycled) == sum(per_pass)  # every mark went back to the pool once


def test_a_device_that_lags_keeps_every_pass_marked_on_the_device():
    """Also the last pass: read at the switch, it still gives the device's windows."""
    om, _clock, per_pass = _profile([3.0] * 4)
    assert all(n >= 4 + 1 for n in per_pass)
    for label, samples in om.engine.profile.durations.items():  # the device's windows (3x the host's), not the host's
        assert all(d == pytest.approx(3 * h, rel=0.05) for d, h in zip(samples, om.engine.profile.host_durations[label]))


def test_a_host_marked_pass_whose_span_disagrees_sends_the_next_pass_back_to_device_marks():
    """Pass 3 is host-marked and the device falls behind in it: it still gives one sample per trap (the host's),
    pass 4 marks every entry again, and once that pass kept up, pass 5 is host-marked again."""
    om, _clock, per_pass = _profile([1.0, 1.0, 3.0, 1.0, 1.0])
    assert [n >= 4 + 1 for n in per_pass] == [True, False, False, True, False] and per_pass[1:3] == [2, 2]
    assert all(len(v) == 5 for v in om.engine.profile.durations.values())


def test_a_pass_that_starts_before_the_device_finished_the_last_one_marks_every_entry():
    """The device falls behind from pass 3 on: pass 3 cannot know it (host clock, its host windows are its
    samples), but pass 4 starts while the device is still in pass 3, so it and pass 5 are marked on the device
    and their samples are the device's (3x the host's), not the host's."""
    om, _clock, per_pass = _profile([1.0, 1.0, 3.0, 3.0, 3.0])
    assert [n >= 4 + 1 for n in per_pass] == [True, False, False, True, True]
    for label, samples in om.engine.profile.durations.items():
        ratios = [d / h for d, h in zip(samples, om.engine.profile.host_durations[label])]
        assert ratios[:3] == pytest.approx([1.0] * 3, abs=0.05) and ratios[3:] == pytest.approx([3.0] * 2, rel=0.05)


def test_clearing_the_durations_starts_over_with_device_marks():
    model, om, clock, x = _offload_stack(5)
    counts = []
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                ft.clear_profiling_durations()
            before = clock.marks
            model(x)
            counts.append(clock.marks - before)
    assert [n >= 4 + 1 for n in counts] == [True, False, True, False]
    assert all(len(v) == 2 for v in om.profiling_durations.values())  # the two passes after the clear


def test_the_switch_reads_the_last_host_marked_pass_without_its_span_on_the_device():
    """No pass follows the last one for its span check to steer, so the switch to INFERENCE takes its host
    windows and never reads (so never waits for) its device marks; the marks still go back to the pool."""
    model, om, clock, x = _offload_stack(4)
    read: list = []
    original = clock.read_windows_ms

    def reading(pairs):
        read.extend(pairs)
        return original(pairs)

    clock.read_windows_ms = reading
    with torch.no_grad():
        for _ in range(3):
            model(x)
        last_marks_before = clock.marks
        model(x)  # the last PROFILING pass: host-marked, its first entry and end marked on the device
    assert om.phase is Phase.INFERENCE and clock.marks - last_marks_before == 2
    last = {id(m) for m in clock.recycled[-2:]}
    assert not any(id(start) in last or id(end) in last for start, end in read)
    assert all(len(v) == 4 for v in om.engine.profile.durations.values())
    assert all(om.engine.profile.durations[label][-1] == om.engine.profile.host_durations[label][-1] for label in om.engine.profile.durations)
    assert len(clock.recycled) == clock.marks


def test_a_trap_called_outside_a_pass_during_profiling_is_not_timed_and_breaks_nothing():
    model, om, clock, x = _offload_stack(3)
    with torch.no_grad():
        model(x)
        model.layers[0](x)  # a trap module on its own, between two passes
        model(x)
        model(x)
    assert om.phase is Phase.INFERENCE
    assert all(len(v) == 3 for v in om.engine.profile.durations.values())
    assert len(clock.recycled) == clock.marks  # its mark went back to the pool with the others
