"""PROFILING trap windows: what one counted pass records, which clock marks it, and how it is read.

Windows
-------
A trap's *window* runs from its entry to the next trap's entry (the last one's to the end of the pass): the
compute INFERENCE can hide the next block's copy behind (``flextensor.engine.profiling`` says why). Each window keeps two
host times (``perf_counter`` at both ends) and, when its pass marks on the device, two device marks (CUDA events
on the compute stream; consecutive windows share one). A pass is recorded as a :class:`PassWindows`: its windows,
whether they carry device marks, and one device mark and host time taken at the pass's end.

Which clock (``PassWindows.on_device``)
---------------------------------------
The planner needs each window's *device* time: where the device lags the host, a window lasts longer on the
device than the host took to queue it, and that difference is compute a copy can hide behind. Where the device
keeps up with the host (a launch-bound pass: the device waits for each launch), the device's windows are the
host's, and a device mark per trap entry buys nothing but host time: recording and reading one CUDA event per
trap costs a launch-bound PROFILING pass a few percent of its time (``docs/benchmarks.md``, "Profiling
clocks").

So a pass marks every trap entry on the device until one pass has shown that the device kept up: its whole span
agrees on both clocks (:func:`clocks_agree`). The next passes mark only their first entry and their end on the
device (two events a pass) and time the traps on the host clock; each of them checks its span on both clocks,
and one whose span disagrees (the device fell behind) sends the next pass back to device marks.

A pass that starts before the device has reached the last pass's end mark marks every entry on the device too:
the device is behind then, whatever the last pass read said, and that pass's own reading comes only later. The
windows of a host-marked pass are its device windows too, also when its own span check fails: the device took
longer than the host there, so the host's windows are the shorter, cautious estimate (less compute to hide
copies behind), and the passes after it are measured on the device again. ``clear_profiling_durations`` starts
over with device marks.

Why the span and not each window: in a launch-bound pass the device still falls behind locally, inside a trap
whose kernels outlast their launches, and catches up in the next trap, so single windows disagree while the
pass does not. Demanding that every window agree kept small-batch passes on device marks for the whole phase,
even in quiet runs. The host's
windows are close to what the planner needs there: a trap cannot start on the device before the host launched
it, so the time between two host entries is time a copy issued at the first of them can use, unless the copy
itself starts late (behind an earlier copy, or waiting for its block's last reader during a local lag). The span
check bounds how far that can be off: the device ends the pass within 10% + 20 us of the host, and where its
lag lasts to the end the passes go back to device windows.

Reading
-------
Marks are read one pass late, or at the start of the next pass when the device has already passed the end mark
(``TimingCollector.done``): reading them at once would make the host wait for the device every pass. The last
pass before the switch to INFERENCE is read at once; if it is host-marked, from its host times alone
(``read_pass(check_span=False)``), since no pass follows whose clock its span check would choose. A CPU
compute device has one clock: a window's mark is the very ``perf_counter`` reading of its host time
(``TimingCollector.mark_at``), every pass agrees with itself, and the same code runs there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.runtime.timing import TimingCollector

__all__ = ["TrapWindow", "PassWindows", "PassReading", "clocks_agree", "read_pass", "CLOCK_TOLERANCE_REL",
           "CLOCK_TOLERANCE_ABS_S"]

#: How far a device time may stray from the host time of the same window or pass and still count as the host's:
#: 10% plus 20 us. The absolute part covers the launch latency that shifts each device mark behind its host
#: reading (a few microseconds); the relative part is what the planner's estimate may be off by
#: (its decisions turn on copies against compute, not on a few percent).
CLOCK_TOLERANCE_REL = 0.10
CLOCK_TOLERANCE_ABS_S = 20e-6


class TrapWindow:
    """One trap call's window: its entry (device mark or None, host time) and where it ended (``host_end`` None
    while open). Consecutive windows of a device-marked pass share a mark."""

    __slots__ = ("label", "start", "end", "host", "host_end")

    def __init__(self, label: str, start: Any, host: float) -> None:
        self.label = label
        self.start = start
        self.end: Any = None
        self.host = host
        self.host_end: float | None = None


class PassWindows:
    """One counted PROFILING pass: its windows, whether each entry has a device mark (``on_device``; otherwise
    only the first entry has one), and the device mark and host time taken at the pass's end."""

    __slots__ = ("windows", "on_device", "end", "host_end")

    def __init__(self, windows: list[TrapWindow], on_device: bool, end: Any, host_end: float) -> None:
        self.windows = windows
        self.on_device = on_device
        self.end = end
        self.host_end = host_end

    def marks(self) -> list[Any]:
        """Every device mark of the pass, each once (a host-marked pass has two: its first entry's and its end)."""
        if not self.on_device and self.windows:
            first = self.windows[0].start
            return [m for m in (first, self.end) if m is not None]
        found = {id(m): m for w in self.windows for m in (w.start, w.end) if m is not None}
        if self.end is not None:
            found.setdefault(id(self.end), self.end)
        return list(found.values())


class PassReading(NamedTuple):
    """A pass read: per-label seconds on the device's clock and on the host's (a trap called twice in a pass
    sums its windows), and whether the device kept up with the host over the pass (its span agrees)."""

    device: dict[str, float]
    host: dict[str, float]
    kept_up: bool


def clocks_agree(device_s: float, host_s: float) -> bool:
    """True when a device time is the host's within the tolerance above."""
    return abs(device_s - host_s) <= CLOCK_TOLERANCE_REL * host_s + CLOCK_TOLERANCE_ABS_S


def read_pass(clock: "TimingCollector", record: PassWindows, check_span: bool = True) -> PassReading:
    """Read one pass's windows (see the module docstring). A pass without windows reads as empty, not kept up.

    A host-marked pass returns one dict as both clocks' readings (callers only read them): this runs once per
    PROFILING pass, on the host time of launch-bound passes. With ``check_span=False`` such a pass is read from
    its host times alone, without waiting for the device to reach its end mark, and reads as not kept up (not
    known): for the last pass before the switch to INFERENCE, which no pass follows whose clock it would choose.
    """
    windows = record.windows
    if not windows:
        return PassReading({}, {}, False)
    first = windows[0]
    host: dict[str, float] = {}
    for w in windows:  # every window of a recorded pass is closed
        label = w.label
        host[label] = host.get(label, 0.0) + (w.host_end - w.host)  # type: ignore[operator]
    if not record.on_device:
        if not check_span:
            return PassReading(host, host, False)
        span_ms = clock.read_windows_ms([(first.start, record.end)])[0]
        return PassReading(host, host, clocks_agree(span_ms / 1e3, record.host_end - first.host))
    readings = clock.read_windows_ms([(w.start, w.end) for w in windows] + [(first.start, record.end)])
    device: dict[str, float] = {}
    for w, ms in zip(windows, readings):
        device[w.label] = device.get(w.label, 0.0) + ms / 1e3
    return PassReading(device, host, clocks_agree(readings[-1] / 1e3, record.host_end - first.host))
