"""Warm-up residency: whether DISCOVERY/PROFILING keep the offload candidates on the device, and those copies.

Why
---
A warm-up pass must compute exactly what the plain model computes, so every trap needs its weights on the
compute device while it runs. Streaming them in per trap call (the :class:`~flextensor.engine.hooks.WarmLoader`'s
*stream* mode) makes every warm-up pass a full host-to-device sweep of the offloaded weights: on an H200 a
4.49 GiB model paid 81 ms of copies per pass for 3.5 ms of compute. When the candidates fit on the device, it is
much cheaper to copy each of them ONCE, keep the copies for the remaining warm-up passes (*resident* mode), and
free them when INFERENCE is built; the profile phase then costs about one transfer sweep plus ordinary resident
forwards, and per-trap timings contain no copies at all.

The decision (a pure function, :func:`decide_warmup`, so it is tested with plain numbers)
---------------------------------------------------------------------------------------------
- ``needed``: the bytes of the offload candidates not on the compute device yet.
- Memory mode (``max_gpu_mem_fraction`` or ``set_memory_budget``): available = budget - bytes already resident on
  the device (what ``offload()`` put there: buffers, shared and non-trap tensors). It is also never more than the
  device's free memory less the safety margin below: a budget is a promise of what FlexTensor *may* use, not proof
  that the memory exists, and the forward's activations need room too.
- Latency mode (no budget): available = free device memory (``torch.cuda.mem_get_info``) - a safety margin of
  ``max(10% of the device's total memory, 1 GiB)`` kept for activations, the transfer sweep and the INFERENCE
  build.
- Resident iff ``needed <= available`` (or nothing is needed); else stream (copies per trap call).
- A CPU compute device is *in-place*: the weights already live in the memory the CPU computes from, so nothing is
  copied at all (unchanged behaviour).
- ``override`` ("resident" / "stream", internal, for tests) forces a mode. The manager then also makes the CPU
  copy the candidates (``WarmLoader.same_device_copies``), so both modes' bookkeeping runs end to end on hosts without CUDA.

:func:`choose_warmup` gathers those numbers for an engine, decides, and logs ONE INFO line with the mode and
the reason (bytes against the limit). The decision is made once, in ``offload()``; the copies themselves happen
at the start of the first warm-up pass (:func:`preload`), so ``offload()`` stays cheap and the one
sweep is paid inside the profile phase, where the goal accounts for it.

The warm-up's copies
--------------------
When the offload candidates fit on the device, DISCOVERY/PROFILING keep one device copy of each
(:class:`~flextensor.runtime.warm_loader.WarmLoader`). The functions below do the work around those copies, in
the order it happens:

1. ``offload()``: :func:`stage` registers the candidates' host storages in place (``flextensor.runtime.staging``), so
   the copies are direct DMA and may be queued (``non_blocking``); :func:`choose_warmup` records the decision
   and the names still to copy; with DISCOVERY skipped, :func:`overlap_stream` makes the side stream the first
   pass will copy on.
2. The first warm-up pass, before any trap: :func:`preload` copies every pending candidate once, trap
   by trap, between CUDA timing events. In a PROFILING pass the copies run on the side stream and each trap's
   compute waits only for its own group's copy (:func:`wait_copy`, called at its entry), so the pass's
   compute overlaps the sweep.
3. The switch to INFERENCE: :func:`sweep_samples` turns the sweep's events into ``(bytes, seconds)`` samples,
   the transfer measurement the planner fits (no second sweep).

Ordering: all copies and their events are recorded on one stream, in trap order; a trap's compute waits for
its group's end event, and everything after the pass (or a trap the pass did not enter) waits for the last one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import enum
from typing import TYPE_CHECKING, Any, Iterable

import torch

from flextensor.runtime.sweep import device_memory
from flextensor.shm.sizes import format_bytes
from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = [
    "WarmupMode",
    "stage",
    "overlap_stream",
    "preload",
    "wait_copy",
    "sweep_samples",
    "WarmupDecision",
    "decide_warmup",
    "choose_warmup",
    "warmup_margin",
    "WARMUP_MARGIN_FRACTION",
    "WARMUP_MARGIN_MIN_BYTES",
]

logger = logging.getLogger(__name__)

WARMUP_MARGIN_FRACTION = 0.10
WARMUP_MARGIN_MIN_BYTES = 1 << 30


class WarmupMode(str, enum.Enum):
    RESIDENT = "resident"  # copied once, kept on the device until INFERENCE is built
    STREAM = "stream"  # copied before each trap call, host data put back after it
    IN_PLACE = "in-place"  # CPU compute device: the weights are used where they are


@dataclass(frozen=True)
class WarmupDecision:
    """The chosen warm-up mode, the numbers behind it and a one-line reason (logged)."""

    mode: WarmupMode
    needed_bytes: int
    available_bytes: int | None
    reason: str
    forced: bool = False

    @property
    def resident(self) -> bool:
        return self.mode is WarmupMode.RESIDENT


def warmup_margin(total_bytes: int) -> int:
    """Device memory kept free during a resident warm-up: 10% of the device, at least 1 GiB."""
    return max(int(total_bytes * WARMUP_MARGIN_FRACTION), WARMUP_MARGIN_MIN_BYTES)


def _check_bytes(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decide_warmup: {name} must be an int >= 0 (bytes), got {value!r}")


def decide_warmup(
    needed_bytes: int,
    *,
    device_type: str,
    budget_bytes: int | None = None,
    resident_bytes: int = 0,
    free_bytes: int = 0,
    total_bytes: int = 0,
    override: str | None = None,
) -> WarmupDecision:
    """Resident, stream or in-place warm-up (see the module docstring for the rule and why).

    ``free_bytes``/``total_bytes`` describe the device (``mem_get_info``) and are required (total > 0) for a
    CUDA device; ``budget_bytes`` is the memory-mode budget (None: latency mode); ``resident_bytes`` what the
    model already holds on the device.
    """
    _check_bytes("needed_bytes", needed_bytes)
    _check_bytes("budget_bytes", budget_bytes, optional=True)
    _check_bytes("resident_bytes", resident_bytes)
    _check_bytes("free_bytes", free_bytes)
    _check_bytes("total_bytes", total_bytes)
    if override is not None:
        try:
            mode = WarmupMode(override)
        except ValueError:
            raise ValueError(f"warm-up override must be None, 'resident' or 'stream', got {override!r}") from None
        if mode is WarmupMode.IN_PLACE:
            raise ValueError("warm-up override must be None, 'resident' or 'stream', got 'in-place'")
        return WarmupDecision(mode, needed_bytes, None, f"forced to {mode.value} (internal override)", forced=True)
    if device_type != "cuda":
        return WarmupDecision(WarmupMode.IN_PLACE, needed_bytes, None,
                              f"the compute device is {device_type}: warm-up uses the weights where they are "
                              "(no copies)")
    if total_bytes <= 0:
        raise ValueError("decide_warmup: total_bytes (device memory) must be > 0 for a CUDA device")
    if needed_bytes == 0:  # e.g. a model handed over on the device: nothing to copy, nothing to decide
        return WarmupDecision(WarmupMode.RESIDENT, 0, None, "every offload candidate is on the device already")
    margin = warmup_margin(total_bytes)
    physical = free_bytes - margin
    physical_text = f"{format_bytes(free_bytes, 2)} free - {format_bytes(margin, 2)} safety margin"
    if budget_bytes is None:
        available, detail = physical, f"latency mode: {physical_text}"
    else:
        by_budget = budget_bytes - resident_bytes
        detail = f"memory budget {format_bytes(budget_bytes, 2)} - {format_bytes(resident_bytes, 2)} already resident"
        if physical < by_budget:
            available, detail = physical, f"{detail}, capped by {physical_text}"
        else:
            available = by_budget
    if needed_bytes <= available:
        return WarmupDecision(WarmupMode.RESIDENT, needed_bytes, available,
                              f"{format_bytes(needed_bytes, 2)} of offload candidates fit in {format_bytes(available, 2)} available "
                              f"({detail}): copied once, kept on the device until INFERENCE")
    return WarmupDecision(WarmupMode.STREAM, needed_bytes, available,
                          f"{format_bytes(needed_bytes, 2)} of offload candidates exceed the {format_bytes(available, 2)} available "
                          f"({detail}): copied before each trap call instead")


def choose_warmup(ctx: EngineContext, candidates: Iterable[str]) -> WarmupDecision:
    """Decide for ``ctx`` (after ``offload()`` placed the non-candidates), log the one INFO line, and arm the
    warm loader: resident candidates are copied at the first pass (:func:`preload`)."""
    device = ctx.device
    entries = ctx.tensors
    candidates = set(candidates)
    needed = sum(tensor_nbytes(entries[n].tensor) for n in candidates if entries[n].tensor.device != device)
    resident = sum(tensor_nbytes(e.tensor) for e in entries.values() if e.tensor.device == device)
    total = free = 0
    budget: int | None = ctx.budget_bytes
    if device.type == "cuda" and ctx.warmup_override is None:
        total, free = device_memory(device)
        fraction = ctx.config.max_gpu_mem_fraction
        if budget is None and fraction is not None:
            # As flextensor.engine.switch resolves it (without its < 256 MiB error, raised there).
            budget = min(int(fraction * total), free + resident)
    decision = decide_warmup(needed, device_type=device.type, budget_bytes=budget, resident_bytes=resident,
                             free_bytes=free, total_bytes=total, override=ctx.warmup_override)
    logger.info("manager %r: %s warm-up on %s: %s", ctx.name, decision.mode.value, device, decision.reason)
    warm = ctx.warm
    warm.decision = decision
    warm.loader.keep = decision.resident
    forced_copies = ctx.warmup_override is not None and device.type != "cuda"
    if forced_copies:  # tests: the CPU "copies" the candidates too, as a GPU would, so the bookkeeping runs
        warm.loader.same_device_copies = {id(entries[n].tensor) for n in candidates}
    if decision.resident:
        warm.pending = sorted(n for n in candidates if forced_copies or entries[n].tensor.device != device)
    return decision


def stage(ctx: EngineContext, candidates: set[str]) -> None:
    """Pin the candidates' host storages in place for the warm-up copies (``flextensor.runtime.staging``)."""
    if not candidates or not ctx.warm.staging.wanted(ctx.config, ctx.device):
        return
    ctx.warm.staging.stage({n: ctx.tensors[n].tensor for n in sorted(candidates)}, ctx.device)
    # Unless staging failed, every host candidate is now page-locked (by us, or already before).
    ctx.warm.loader.non_blocking = not ctx.warm.staging.failed

def overlap_stream(ctx: EngineContext) -> Any:
    """The side stream the first PROFILING pass's warm-up copies will run on, made now, in ``offload()``.

    The first stream a process makes creates PyTorch's whole stream pool (tens of ``cudaStreamCreate``,
    4.6 ms measured on an H200 host). Made at the first pass, that set-up held back the first copy of the
    sweep by as long; here it is part of setting the model up, where the host registration already is.
    None when there will be no overlapped preload (no resident copies pending, CPU, pageable sources).
    """
    if not ctx.warm.pending or ctx.device.type != "cuda" or not ctx.warm.loader.non_blocking:
        return None
    return torch.cuda.Stream(device=ctx.device)

def preload(ctx: EngineContext, profiling: bool) -> None:
    """Start of a warm-up pass: copy the pending resident candidates (once), before any trap or timing.

    Trap by trap, between CUDA timing events when the copies come from page-locked memory: this one sweep of
    the offloaded weights is also the transfer measurement the planner fits (:func:`sweep_samples`), so the
    switch to INFERENCE does not sweep again.

    In a PROFILING pass (DISCOVERY skipped, so each trap's weights are its own) the copies run on a side
    stream and each trap's compute waits only for its own group's copy (:func:`wait_copy`): the
    pass's compute overlaps the sweep instead of following it. This relies on what skipping DISCOVERY
    already means (INFERENCE streams each trap's weights only while that trap runs): a trap's weights are
    read inside its own forward, not by pre-hooks, other traps or code between traps. A DISCOVERY pass has
    not yet learnt which trap uses what, so there the copies stay on the compute stream, ahead of everything.
    """
    names, ctx.warm.pending = ctx.warm.pending, []
    if not names:
        return
    pending = set(names)
    labelled = [(label, [n for n in trap.candidates if n in pending]) for label, trap in ctx.traps.items()]
    grouped = {n for _label, group in labelled for n in group}
    groups = [(None, [n for n in names if n not in grouped])] + [(label, g) for label, g in labelled if g]
    timed = ctx.device.type == "cuda" and ctx.warm.loader.non_blocking
    compute = torch.cuda.current_stream(ctx.device) if timed else None
    stream = compute
    if timed and profiling:
        stream, ctx.warm.stream = ctx.warm.stream or torch.cuda.Stream(device=ctx.device), None
        stream.wait_stream(compute)  # memory the compute freed may be handed to these copies
        ctx.warm.loader.copy_stream = stream
    ready: dict[str | None, Any] = {}
    ordered = stream is compute  # True once every reader is ordered after the side-stream copies
    try:
        for label, group in groups:
            if not group:
                continue
            start = end = None
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
            if not ctx.warm.loader.preload(ctx.tensor_objs(group)):
                ctx.warm.events = []
                ready.clear()
                return  # stream mode (out of device memory): the planner sweeps instead
            if timed:
                end.record(stream)
                ctx.warm.events.append((sum(tensor_nbytes(ctx.tensors[n].tensor) for n in group), start, end))
                ready[label] = end
        if stream is not compute and ready:
            outside = ready.pop(None, None)
            if outside is not None:  # candidates of no trap: whoever reads them, they are there first
                compute.wait_event(outside)
            ctx.warm.ready = ready
            ctx.warm.last = ctx.warm.events[-1][2]
            ordered = True
    finally:
        ctx.warm.loader.copy_stream = None
        if not ordered:  # out of memory, or an error part-way: copies already made stay; order them now
            compute.wait_stream(stream)
    logger.debug("manager %r: %d warm-up tensors (%d bytes) copied to %s and kept", ctx.name, len(names),
                 ctx.warm.loader.kept_bytes, ctx.device)

def wait_copy(ctx: EngineContext, label: str | None) -> None:
    """Order the compute stream after trap ``label``'s warm-up copy (``None``: after all of them)."""
    event = ctx.warm.last if label is None else ctx.warm.ready.pop(label, None)
    if label is None:
        ctx.warm.ready, ctx.warm.last = {}, None
    if event is not None:
        torch.cuda.current_stream(ctx.device).wait_event(event)

def sweep_samples(ctx: EngineContext) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of the resident warm-up's copies per trap (empty when not measured).

    One wait serves every pair: :func:`preload` records all of them, in order, on one stream, so once the
    last end event completed every earlier event has too (long finished anyway: the profiling passes ran on
    these copies)."""
    events, ctx.warm.events = ctx.warm.events, []
    if events:
        events[-1][2].synchronize()
    samples = [(nbytes, start.elapsed_time(end) / 1e3) for nbytes, start, end in events]
    return [s for s in samples if s[0] > 0 and s[1] > 0]
