"""The PROFILING phase: per-trap compute windows, read without making the host wait for the device.

A trap's *window* is what INFERENCE can hide the next block's copy behind: the loader issues that copy when the
trap is entered, and the compute stream waits for it when the next trap is entered. So a window runs from one
trap's entry to the next trap's entry (the last one's to the end of the pass), and one mark per entry (a CUDA
event on the compute stream, or ``perf_counter``) times it: half the events of a span per call, which on a
launch-bound pass is host time saved (``TimingCollector.mark``). Once a pass has shown that the device keeps up
with the host, later passes time their traps on the host's clock and mark only their span on the device,
falling back to a mark per entry when the span disagrees (``flextensor.runtime.trap_windows``: which clock,
and why its windows are then the device's).

A trap's exclusive weights are put on the device before its window opens, and an entry that copies weights or
waits for them first closes the window before it with a mark of its own, so copies are in no window. With a
resident warm-up nothing is copied in any PROFILING pass, so no pass is excluded from the medians (with
``skip_discovery`` the preload is issued at the start of the first PROFILING pass on a side stream, and each
trap's compute waits for its own copy before its window opens, so that pass's compute overlaps the sweep).

A pass's marks are read at the end of the next pass, or at its start when the device is past them (reading them
at once would make the host wait for the device every pass), and then reused. Each window also keeps the
host's ``perf_counter`` at both ends: where the device takes longer than the host to get through a trap, the
loader's host work at that trap hides in the difference (``TrapCost.stream_cost_s``, ``flextensor.engine.switch``).

Suspended passes (``suspend_profiling``) record nothing and are not counted. After the first counted pass (when
more follow), :func:`~flextensor.engine.switch.prepare_switch` does the switch's timing-free work while the
device still runs that pass; after the last, the switch plans and the INFERENCE build starts. When the device is
still running the last pass by then (its marks are per entry and its end not reached: a streaming warm-up's
copy-bound pass of a model of tens of GiB leaves the host idle for tenths of a second), the plan is made from
the passes before it while the device finishes, instead of after reading it: the planner's tenths of a second
of Python at that size then cost the phase nothing (``docs/benchmarks.md``, "The profile phase alone"). Only
where every trap of the pass has two samples or more before it (a
trap first entered in the last pass, or one pass before it, waits for the last pass's reading as before). The
medians lose one sample of ten (``ctx.plan.compute_s`` holds the ones the plan used); the last pass's are still
read and kept with the others.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import TYPE_CHECKING, Any

from flextensor.engine.build import enter_inference
from flextensor.engine.inference import InferenceHandler
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.engine.switch import plan_switch, prepare_switch
from flextensor.engine.warmup import preload, wait_copy
from flextensor.runtime.trap_windows import PassWindows, TrapWindow, read_pass

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import Trap

__all__ = ["ProfilingHandler", "resolve_windows", "recycle_windows", "clear_durations"]

logger = logging.getLogger("flextensor.manager")


class ProfilingHandler(PhaseHandler):
    """Times each trap's window per pass (see the module docstring)."""

    phase = Phase.PROFILING

    def begin_pass(self) -> None:
        ctx = self.ctx
        profile = ctx.profile
        if ctx.warm.pending:
            preload(ctx, profiling=True)  # resident warm-up: the one copy of each candidate, ahead of everything
        profile.pass_sequence = []
        if profile.windows:  # windows of trap calls made outside any pass: dropped, their marks reused
            recycle_windows(ctx, PassWindows(profile.windows, True, None, 0.0))
            profile.windows = []
        pending = profile.pending
        behind = False
        if pending and ctx.clock is not None:
            if ctx.clock.done(pending[-1].end):
                resolve_windows(ctx, keep_last=0)  # the device is past them: reading waits for nothing
            else:
                behind = True
        # Per-trap device marks until a pass showed the device keeping up with the host, and whenever the
        # device has not finished the last pass when this one starts (flextensor.runtime.trap_windows)
        profile.on_device = behind or not profile.kept_up

    def end_pass(self, ok: bool) -> PhaseHandler:
        ctx = self.ctx
        profile = ctx.profile
        counted = ok and not profile.suspend
        end = None
        if counted and profile.windows:
            assert ctx.clock is not None
            now = perf_counter()
            end = ctx.clock.mark_at(now)
            _close_window(ctx, end, now)  # the last trap's window ends with the pass
        if ctx.warm.last is not None:  # traps this pass did not enter: everything after waits for all copies
            wait_copy(ctx, None)
        windows, profile.windows = profile.windows, []
        if not counted:
            recycle_windows(ctx, PassWindows(windows, True, None, 0.0))
            return self
        # Read one pass late (or at the next pass's start): this pass's marks are still queued behind its
        # kernels, and reading them now would make the host wait for the device at the end of every pass.
        if end is not None:
            profile.pending.append(PassWindows(windows, profile.on_device, end, now))
        resolve_windows(ctx, keep_last=1)
        ctx.sequence = list(profile.pass_sequence)
        profile.iteration += 1
        if profile.iteration < ctx.iters_before_inference:
            if profile.switch_inputs is None:
                # While the device still runs this pass (the first one carries the warm-up sweep), the host does
                # the switch's timing-free work, so the last pass does not.
                prepare_switch(ctx)
            return self
        last = profile.pending[-1] if profile.pending else None
        durations = profile.durations
        if (last is not None and ctx.clock is not None and last.on_device and not ctx.clock.done(last.end)
                and all(len(durations.get(label, ())) >= 2 for label in ctx.sequence)):
            # The device still runs this pass (a copy-bound one, by tenths of a second for a large model) and the
            # host would only wait for it: plan from the passes before it meanwhile (module docs).
            try:
                plan = plan_switch(ctx)
            finally:  # read even if the strategy raised: the next pass's switch finds every sample as before
                resolve_windows(ctx, keep_last=0, last_span=False)
        else:
            resolve_windows(ctx, keep_last=0, last_span=False)  # no pass follows for the span check to steer
            plan = plan_switch(ctx)
        enter_inference(ctx, plan)
        if logger.isEnabledFor(logging.INFO):  # one check instead of one disabled logging call per line
            for line in plan.explanation:
                logger.info("manager %r: %s", ctx.name, line)
        return InferenceHandler(ctx)

    def enter(self, trap: Trap) -> None:
        ctx = self.ctx
        profile = ctx.profile
        label = trap.label
        warm = ctx.warm
        if profile.suspend or warm.ready or warm.settled.get(label) != warm.loader.removals:
            _prepare_trap(ctx, trap)  # copies or waits for weights, or is not timed
        if profile.suspend:
            return
        # The common case runs inline: this is host time of every launch-bound PROFILING pass.
        profile.pass_sequence.append(label)
        windows = profile.windows
        # A device mark at every entry, or only at the first (the pass's span: flextensor.runtime.trap_windows)
        now = perf_counter()
        clock = ctx.clock
        assert clock is not None
        mark = clock.mark_at(now) if profile.on_device or not windows else None
        if windows:  # the window before, if still open, ends where this one starts
            last = windows[-1]
            if last.host_end is None:
                last.end, last.host_end = mark, now
        windows.append(TrapWindow(label, mark, now))

    def exit(self, trap: Trap) -> None:
        self.ctx.warm.loader.unload()  # the trap's window stays open: it ends at the next entry or the pass's end


def _prepare_trap(ctx: EngineContext, trap: Trap) -> None:
    """PROFILING entry of a trap whose weights may need copying or waiting for, or that is not timed (paused
    inside a pass): the window before ends first, so it holds neither. (A trap whose weights all hold kept
    warm-up copies, timed, needs none of this: ``ProfilingHandler.enter`` skips it.)"""
    warm = ctx.warm
    loader = warm.loader
    unsettled = warm.settled.get(trap.label) != loader.removals
    names = ctx.exclusive.get(trap.label, ()) if unsettled else ()
    if warm.ready or names or ctx.profile.suspend:
        _close_window(ctx)
    if warm.ready:  # the first pass after an overlapped preload: wait for this trap's copy
        wait_copy(ctx, trap.label)
    if unsettled:
        if _times_stream_copies(ctx):
            timed = loader.load_timed(ctx.tensor_objs(names))
            if timed is not None:
                warm.events.append(timed)
        else:
            loader.load(ctx.tensor_objs(names))
        if loader.keep and not loader.active:  # all of this trap's tensors hold kept copies: from now on
            warm.settled[trap.label] = loader.removals  # skip the check until one is given up


def _times_stream_copies(ctx: EngineContext) -> bool:
    """Whether this pass times its streamed copies (``WarmLoader.load_timed``, which also decides whether a copy
    can be timed at all) for the planner's transfer model (``warm_samples``).

    Stream mode copies every trap's weights in every pass: timed, they are the transfer measurement, and the
    switch needs no sweep of its own. A sweep there would wait for the device to finish the last pass (it must
    not share the bus with that pass's copies) while the plan could be made meanwhile. Not the first PROFILING
    pass (its copies grow the device allocator and wait for registrations) nor the last (reading its events
    would wait for the device again)."""
    first = ctx.iters_before_inference - ctx.config.profiling_iters
    return first < ctx.profile.iteration < ctx.iters_before_inference - 1


def _close_window(ctx: EngineContext, mark: Any = None, host: float | None = None) -> None:
    """End the pass's open trap window (if any) at ``mark`` and host time ``host``, or at both taken now (a
    device mark only when this pass marks every entry on the device)."""
    windows = ctx.profile.windows
    if windows and windows[-1].host_end is None:
        window = windows[-1]
        if host is None:
            assert ctx.clock is not None
            host = perf_counter()
            mark = ctx.clock.mark_at(host) if ctx.profile.on_device else None
        window.end, window.host_end = mark, host


def resolve_windows(ctx: EngineContext, keep_last: int, last_span: bool = True) -> None:
    """Turn the pending PROFILING passes (all but the last ``keep_last``) into duration samples, and let the
    newest of them say which clock the next pass marks its traps with (``flextensor.runtime.trap_windows``);
    with ``last_span=False`` a host-marked newest one is read from its host times alone, without waiting for
    the device (``read_pass``; a device-marked one needs its device marks anyway)."""
    profile = ctx.profile
    pending = profile.pending
    while len(pending) > keep_last:
        record = pending.pop(0)
        assert ctx.clock is not None
        reading = read_pass(ctx.clock, record, check_span=last_span or len(pending) > keep_last)
        durations, host_durations, host = profile.durations, profile.host_durations, reading.host
        for label, seconds in reading.device.items():
            samples = durations.get(label)
            if samples is None:
                durations[label], host_durations[label] = [seconds], [host[label]]
            else:
                samples.append(seconds)
                host_durations[label].append(host[label])
        profile.kept_up = reading.kept_up
        recycle_windows(ctx, record)


def recycle_windows(ctx: EngineContext, record: PassWindows) -> None:
    """Give a pass's marks back to the clock's pool, each once (consecutive windows share a mark)."""
    if ctx.clock is not None:
        marks = record.marks()
        if marks:
            ctx.clock.recycle_marks(marks)


def clear_durations(ctx: EngineContext) -> None:
    """Drop every duration sample so far (``clear_profiling_durations``; discovery mappings are kept)."""
    profile = ctx.profile
    for record in profile.pending:
        recycle_windows(ctx, record)
    profile.pending.clear()
    profile.kept_up = False  # the passes after start over: a device mark per entry until one keeps up
    profile.durations.clear()
    profile.host_durations.clear()
