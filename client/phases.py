"""The phase machine of :class:`~flextensor.manager.OffloadManager`: passes, traps, profiling control.

Kept apart from the manager's setup code because this is what runs on every forward pass: the patched root
``forward`` opens and closes a *pass*; each trap's patched ``forward`` enters and leaves it. What happens there
depends on the phase:

- Warm-up residency (``flextensor.warmup``): when ``offload()`` chose the *resident* mode, the first DISCOVERY or
  PROFILING pass starts by copying every pending candidate to the device (before the recorder, any trap or any
  timing window), and the copies stay there; every later trap entry finds its weights in place. The trap entry
  still asks the :class:`~flextensor.traps.WarmLoader` for its weights: in resident mode a tensor not copied yet
  is copied then, once, and kept (the general rule for a trap that first runs in a later pass; the preload only
  moves all of those copies ahead of the first timed pass). In *stream* mode each trap entry copies and each
  exit puts back.
- DISCOVERY: the :class:`~flextensor.traps.UsageRecorder` is active for the whole pass; each trap gets its
  candidate weights on the device (:class:`~flextensor.traps.WarmLoader`) and is recorded as the user of every
  parameter passed to a torch function while it runs. After ``discovery_iters`` passes, tensors used by several
  traps or outside traps become resident (a kept warm-up copy becomes their device data) and leave the pinned
  staging (``flextensor.staging``).
- PROFILING: a trap's exclusive weights are put on the device, then its timing window opens, so copies are
  never timed. A trap's *window* is what INFERENCE can hide the next block's copy behind: the loader issues
  that copy when the trap is entered, and the compute stream waits for it when the next trap is entered. So a
  window runs from one trap's entry to the next trap's entry (the last one's to the end of the pass), and one
  mark per entry (a CUDA event on the compute stream, or ``perf_counter``) times it: half the events of a span
  per call, which on a launch-bound pass is host time saved (``TimingCollector.mark``). Once a pass has shown
  that the device keeps up with the host, later passes time their traps on the host's clock and mark only their
  span on the device, falling back to a mark per entry when the span disagrees (``flextensor.trap_windows``:
  which clock, and why its windows are then the device's). An entry that copies
  weights or waits for them first closes the window before it with a mark of its own, so the copy is in no
  window. With resident warm-up nothing is copied in any PROFILING pass, so no pass is excluded from the medians
  (with ``skip_discovery`` the preload is issued at the start of the first PROFILING pass on a side stream,
  and each trap's compute waits for its own copy before its window opens, so that pass's compute overlaps the
  sweep). A pass's marks are read at the end of the next pass, or at its start when the device is past them
  (reading them at once would make the host wait for the device every pass), and then reused. Each window
  also keeps the host's ``perf_counter`` at both ends: where the device takes longer than the host to get
  through a trap, the loader's host work at that trap hides in the difference (``TrapCost.stream_cost_s``,
  ``flextensor.inference``).
  Suspended passes (``suspend_profiling``) record nothing and are not counted. After the first counted pass
  (when more follow), ``flextensor.inference.prepare_switch`` does the switch's timing-free work while the device
  still runs that pass; after the last, ``flextensor.inference.plan_inference`` plans and builds INFERENCE.
- INFERENCE: the :class:`~flextensor.loader.BlockLoader` makes the trap's block resident and prefetches the next.

:class:`PhaseMixin` holds only behaviour; the state it works on is created by ``OffloadManager._reset``.
"""

from __future__ import annotations

import enum
import functools
import logging
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from flextensor.trap_windows import PassWindows, TrapWindow, read_pass
from flextensor.traps import OUTSIDE, Trap

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.config import OffloadConfig
    from flextensor.loader import BlockLoader
    from flextensor.staging import PinnedStaging
    from flextensor.state import ModelTensor
    from flextensor.timing import TimingCollector
    from flextensor.traps import UsageRecorder, WarmLoader

__all__ = ["Phase", "PhaseMixin"]

logger = logging.getLogger("flextensor.manager")


class Phase(enum.Enum):
    DISCOVERY = "discovery"
    PROFILING = "profiling"
    INFERENCE = "inference"


class PhaseMixin:
    """Pass and trap handling plus the profiling controls of ``OffloadManager`` (see the module docstring)."""

    # State owned by OffloadManager._reset (declared for readers and type checkers).
    name: str
    model: nn.Module | None
    config: "OffloadConfig | None"
    _phase: Phase | None
    _iteration: int
    _suspend: int
    _traps: dict[str, Trap]
    _tensors: dict[str, "ModelTensor"]
    _shared: set[str]
    _exclusive: dict[str, list[str]]
    _recorder: "UsageRecorder | None"
    _warm: "WarmLoader"
    _warm_pending: list[str]
    _warm_settled: dict[str, int]
    _warm_ready: dict[str | None, Any]
    _warm_last: Any
    _staging: "PinnedStaging"
    _sequence: list[str]
    _pass_sequence: list[str]
    _pass_windows: list[TrapWindow]
    _pass_on_device: bool
    _pending_windows: list[PassWindows]
    _device_kept_up: bool
    _durations: dict[str, list[float]]
    _host_durations: dict[str, list[float]]
    _loader: "BlockLoader | None"
    _switch_inputs: Any  # flextensor.inference.SwitchInputs once prepared
    _deferred: Any  # flextensor.deferred_build.HostBlockBuild while host blocks are built behind inference
    _block_of: dict[str, int]
    _timing: "TimingCollector | None"
    _clock: "TimingCollector | None"
    _active: Trap | None
    _active_phase: Phase | None
    _depth: int
    _root_previous: Any
    _root_had_forward: bool

    if TYPE_CHECKING:  # pragma: no cover - provided by OffloadManager
        def _check_thread(self) -> None: ...
        def _config(self) -> "OffloadConfig": ...
        def _to_device(self, entry: "ModelTensor") -> None: ...
        def _preload_warmup(self) -> None: ...
        def _wait_warm_copy(self, label: str | None) -> None: ...
        @property
        def enabled(self) -> bool: ...
        @property
        def iters_before_inference(self) -> int: ...

    # ------------------------------------------------------------------------------------------------ root forward
    def _install_root(self, model: nn.Module) -> None:
        self._root_had_forward = "forward" in model.__dict__
        self._root_previous = model.__dict__.get("forward")
        original = model.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)
            self._check_thread()
            self._depth = 1
            try:
                self._begin_pass()
            except BaseException:
                self._depth = 0
                raise
            ok = False
            try:
                out = original(*args, **kwargs)
                ok = True
                return out
            finally:
                self._depth = 0
                self._end_pass(ok)

        model.forward = forward

    def _uninstall_root(self) -> None:
        model = self.model
        if model is None:
            return
        if self._root_had_forward:
            model.forward = self._root_previous
        else:
            model.__dict__.pop("forward", None)

    # ------------------------------------------------------------------------------------------------ passes
    def _begin_pass(self) -> None:
        if self._warm_pending and self._phase in (Phase.DISCOVERY, Phase.PROFILING):
            self._preload_warmup()  # resident warm-up: the one copy of each candidate, ahead of everything
        self._pass_sequence = []
        if self._pass_windows:  # windows of trap calls made outside any pass: dropped, their marks reused
            self._recycle_windows(PassWindows(self._pass_windows, True, None, 0.0))
            self._pass_windows = []
        if self._phase is Phase.PROFILING:
            pending = self._pending_windows
            behind = False
            if pending and self._clock is not None:
                if self._clock.done(pending[-1].end):
                    self._resolve_windows(keep_last=0)  # the device is past them: reading waits for nothing
                else:
                    behind = True
            # Per-trap device marks until a pass showed the device keeping up with the host, and whenever the
            # device has not finished the last pass when this one starts (flextensor.trap_windows)
            self._pass_on_device = behind or not self._device_kept_up
        if self._phase is Phase.DISCOVERY and self._recorder is not None:
            self._recorder.current = OUTSIDE
            self._recorder.__enter__()
        elif self._phase is Phase.INFERENCE:
            if self._deferred is not None:
                if not self._deferred.started:  # the first inference pass: host blocks build behind it from now
                    self._deferred.start()
                elif self._deferred.done:  # host blocks ready: stream from this pass on
                    from flextensor.deferred_build import install_deferred

                    install_deferred(self)  # type: ignore[arg-type]
            if self._timing is not None and self._deferred is None:  # passes before the switch stream nothing
                self._timing.begin_pass()

    def _end_pass(self, ok: bool) -> None:
        phase = self._phase
        if self._active is not None:  # an exception escaped a trap without its exit (should not happen)
            self._active = None
            self._warm.unload()
        if phase is Phase.DISCOVERY:
            if self._recorder is not None:
                self._recorder.__exit__(None, None, None)
                self._recorder.clear_copies()
            if ok:
                self._sequence = list(self._pass_sequence)
                self._iteration += 1
                if self._iteration >= self._config().discovery_iters:
                    self._finish_discovery()
        elif phase is Phase.PROFILING:
            counted = ok and not self._suspend
            end = None
            if counted and self._pass_windows:
                assert self._clock is not None
                now = perf_counter()
                end = self._clock.mark_at(now)
                self._close_window(end, now)  # the last trap's window ends with the pass
            if self._warm_last is not None:  # traps this pass did not enter: everything after waits for all copies
                self._wait_warm_copy(None)
            windows, self._pass_windows = self._pass_windows, []
            if not counted:
                self._recycle_windows(PassWindows(windows, True, None, 0.0))
                return
            # Read one pass late (or at the next pass's start): this pass's marks are still queued behind its
            # kernels, and reading them now would make the host wait for the device at the end of every pass.
            if end is not None:
                self._pending_windows.append(PassWindows(windows, self._pass_on_device, end, now))
            self._resolve_windows(keep_last=1)
            self._sequence = list(self._pass_sequence)
            self._iteration += 1
            if self._iteration >= self.iters_before_inference:
                self._start_inference()
            elif self._switch_inputs is None:
                # While the device still runs this pass (the first one carries the warm-up sweep), the host does
                # the switch's timing-free work, so the last pass does not (flextensor.inference.prepare_switch).
                from flextensor.inference import prepare_switch

                prepare_switch(self)  # type: ignore[arg-type]
        elif phase is Phase.INFERENCE and self._timing is not None and self._deferred is None:
            self._timing.end_pass()

    def _finish_discovery(self) -> None:
        """Decide which candidates each trap may offload: used by that trap alone (and never outside traps)."""
        assert self._recorder is not None
        usage = self._recorder.usage
        owned = {n for t in self._traps.values() for n in t.candidates}
        exclusive: dict[str, list[str]] = {}
        for label, trap in self._traps.items():
            if trap.kind == "module":
                names = [n for n in trap.candidates
                         if n not in self._shared and usage.get(n, {label}) <= {label}]
            else:
                names = [n for n, users in usage.items()
                         if users == {label} and n not in owned and self._tensors[n].kind == "parameter"]
            exclusive[label] = names
        keep = {n for names in exclusive.values() for n in names}
        made_resident = sorted(owned - keep)
        self._warm.commit(self._tensor_objs(made_resident), count=False)  # a kept warm-up copy is their device data now
        for name in made_resident:
            self._to_device(self._tensors[name])
        self._staging.release(owned - keep)  # their host copies are no longer read by the warm-up
        self._exclusive = exclusive
        self._recorder = None
        self._phase = Phase.PROFILING
        logger.debug("manager %r: discovery done, %d offloadable tensors in %d traps", self.name, len(keep),
                     len(exclusive))

    def _start_inference(self) -> None:
        from flextensor.inference import plan_inference

        self._resolve_windows(keep_last=0, last_span=False)  # no pass follows for the span check to steer
        plan_inference(self)  # type: ignore[arg-type]

    def _close_window(self, mark: Any = None, host: float | None = None) -> None:
        """End the pass's open trap window (if any) at ``mark`` and host time ``host``, or at both taken now (a
        device mark only when this pass marks every entry on the device)."""
        windows = self._pass_windows
        if windows and windows[-1].host_end is None:
            window = windows[-1]
            if host is None:
                assert self._clock is not None
                host = perf_counter()
                mark = self._clock.mark_at(host) if self._pass_on_device else None
            window.end, window.host_end = mark, host

    def _resolve_windows(self, keep_last: int, last_span: bool = True) -> None:
        """Turn the pending PROFILING passes (all but the last ``keep_last``) into duration samples, and let the
        newest of them say which clock the next pass marks its traps with (``flextensor.trap_windows``); with
        ``last_span=False`` a host-marked newest one is read from its host times alone, without waiting for
        the device (``read_pass``; a device-marked one needs its device marks anyway)."""
        while len(self._pending_windows) > keep_last:
            record = self._pending_windows.pop(0)
            assert self._clock is not None
            reading = read_pass(self._clock, record, check_span=last_span or len(self._pending_windows) > keep_last)
            durations, host_durations, host = self._durations, self._host_durations, reading.host
            for label, seconds in reading.device.items():
                samples = durations.get(label)
                if samples is None:
                    durations[label], host_durations[label] = [seconds], [host[label]]
                else:
                    samples.append(seconds)
                    host_durations[label].append(host[label])
            self._device_kept_up = reading.kept_up
            self._recycle_windows(record)

    def _recycle_windows(self, record: PassWindows) -> None:
        """Give a pass's marks back to the clock's pool, each once (consecutive windows share a mark)."""
        if self._clock is not None:
            marks = record.marks()
            if marks:
                self._clock.recycle_marks(marks)

    # ------------------------------------------------------------------------------------------------ traps
    def _tensor_objs(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self._tensors[n].tensor for n in names]

    def _trap_enter(self, trap: Trap) -> None:
        if self._active is not None:
            raise RuntimeError(
                f"trap {trap.label!r} entered while trap {self._active.label!r} is running: traps cannot nest (an "
                "offload_block around a patched module, or a trap module called from inside another trap); change "
                "include_patterns or where offload_block is used"
            )
        phase = self._phase
        self._active, self._active_phase = trap, phase
        try:
            if phase is Phase.DISCOVERY:
                rec = self._recorder
                if rec is not None:
                    rec.enabled = False
                self._warm.load(self._tensor_objs(trap.candidates))
                self._pass_sequence.append(trap.label)
                if rec is not None:
                    rec.current = trap.label
                    rec.clear_copies()
                    rec.enabled = True
            elif phase is Phase.PROFILING:
                label = trap.label
                if self._suspend or self._warm_ready or self._warm_settled.get(label) != self._warm.removals:
                    self._prepare_profiled_trap(trap)  # copies or waits for weights, or is not timed
                if not self._suspend:
                    # The common case runs inline: this is host time of every launch-bound PROFILING pass.
                    self._pass_sequence.append(label)
                    windows = self._pass_windows
                    # A device mark at every entry, or only at the first (the pass's span: flextensor.trap_windows)
                    now = perf_counter()
                    clock = self._clock
                    assert clock is not None
                    mark = clock.mark_at(now) if self._pass_on_device or not windows else None
                    if windows:  # the window before, if still open, ends where this one starts
                        last = windows[-1]
                        if last.host_end is None:
                            last.end, last.host_end = mark, now
                    windows.append(TrapWindow(label, mark, now))
            elif phase is Phase.INFERENCE:
                timing = self._timing if self._deferred is None else None
                if timing is not None:
                    timing.begin_trap(trap.label)
                block = self._block_of.get(trap.label)
                if block is not None:
                    assert self._loader is not None
                    self._loader.enter(block)
                if timing is not None:
                    timing.start_compute()
        except BaseException:
            self._warm.unload()
            self._active = None
            raise

    def _prepare_profiled_trap(self, trap: Trap) -> None:
        """PROFILING entry of a trap whose weights may need copying or waiting for, or that is not timed (paused
        inside a pass): the window before ends first, so it holds neither. (A trap whose weights all hold kept
        warm-up copies, timed, needs none of this: ``_trap_enter`` skips it.)"""
        warm = self._warm
        unsettled = self._warm_settled.get(trap.label) != warm.removals
        names = self._exclusive.get(trap.label, ()) if unsettled else ()
        if self._warm_ready or names or self._suspend:
            self._close_window()
        if self._warm_ready:  # the first pass after an overlapped preload: wait for this trap's copy
            self._wait_warm_copy(trap.label)
        if unsettled:
            warm.load(self._tensor_objs(names))
            if warm.keep and not warm.active:  # all of this trap's tensors hold kept copies: from now on
                self._warm_settled[trap.label] = warm.removals  # skip the check until one is given up

    def _trap_exit(self, trap: Trap) -> None:
        if self._active is not trap:
            return
        phase = self._active_phase
        try:
            if phase is Phase.DISCOVERY:
                rec = self._recorder
                if rec is not None:
                    rec.enabled = False
                self._warm.unload()
                if rec is not None:
                    rec.current = OUTSIDE
                    rec.clear_copies()
                    rec.enabled = True
            elif phase is Phase.PROFILING:
                self._warm.unload()  # the trap's window stays open: it ends at the next entry or the pass's end
            elif phase is Phase.INFERENCE:
                if self._timing is not None and self._deferred is None:
                    self._timing.end_trap()
                block = self._block_of.get(trap.label)
                if block is not None and self._loader is not None:
                    self._loader.exit(block)
        finally:
            self._active = None

    @contextmanager
    def offload_block(self, block_name: str) -> Iterator[None]:
        """A manual trap around arbitrary code (its exclusive parameters are found during DISCOVERY)."""
        self._check_thread()
        if self.config is not None and not self.config.enabled:
            yield
            return
        if self.config is not None and self.config.skip_discovery:
            raise RuntimeError(
                f"offload_block({block_name!r}) needs DISCOVERY to learn which tensors the block uses, but "
                "skip_discovery=True; set skip_discovery=False"
            )
        if self.model is None:
            # No model offloaded (yet): the block is plain code, so a model with offload_block markers still
            # runs unmodified (reference runs, enabled=False deployments).
            yield
            return
        if not isinstance(block_name, str) or not block_name:
            raise ValueError(f"offload_block needs a non-empty block name, got {block_name!r}")
        trap = self._traps.get(block_name)
        if trap is None:
            trap = Trap(block_name, None, [], kind="block")
            self._traps[block_name] = trap
        elif trap.kind != "block":
            raise ValueError(f"offload_block({block_name!r}) clashes with the module trap of the same label; rename the block")
        self._trap_enter(trap)
        try:
            yield
        finally:
            self._trap_exit(trap)

    # ------------------------------------------------------------------------------------------------ profiling control
    def suspend_profiling(self) -> None:
        """Reference-counted: PROFILING passes record nothing and are not counted while suspended."""
        self._check_thread()
        if self.enabled:
            self._suspend += 1

    def resume_profiling(self) -> None:
        self._check_thread()
        if not self.enabled:
            return
        if self._suspend == 0:
            raise RuntimeError(f"resume_profiling() on manager {self.name!r} without a matching suspend_profiling()")
        self._suspend -= 1

    @contextmanager
    def pause_profiling(self) -> Iterator[None]:
        self.suspend_profiling()
        try:
            yield
        finally:
            self.resume_profiling()

    @property
    def profiling_suspended(self) -> bool:
        return self._suspend > 0

    def clear_profiling_durations(self) -> None:
        """Drop every duration sample so far (discovery mappings are kept)."""
        self._check_thread()
        for record in self._pending_windows:
            self._recycle_windows(record)
        self._pending_windows.clear()
        self._device_kept_up = False  # the passes after start over: a device mark per entry until one keeps up
        self._durations.clear()
        self._host_durations.clear()

    @property
    def profiling_durations(self) -> dict[str, list[float]]:
        """Per-trap seconds of each counted PROFILING pass (copy): each trap's window, from its entry to the next
        trap's entry (the last trap's to the end of the pass), summed over its calls in the pass, on the device's
        clock (the host's, for a pass timed on it: ``flextensor.trap_windows``)."""
        self._check_thread()  # reading the pending passes' events and reusing them is the manager's own work
        self._resolve_windows(keep_last=0)
        return {k: list(v) for k, v in self._durations.items()}
