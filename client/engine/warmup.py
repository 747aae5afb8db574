"""Warm-up residency: whether DISCOVERY/PROFILING keep the offload candidates on the device, and those copies.

Why
---
A warm-up pass must compute exactly what the plain model computes, so every trap needs its weights on the
compute device while it runs. Streaming them in per trap call (the :class:`~flextensor.engine.hooks.WarmLoader`'s
*stream* mode) makes every warm-up pass a full host-to-device sweep of the offloaded weights, which at a small
batch costs many times the pass's compute (``docs/benchmarks.md``, "Offload engine": the transfer-bound pass
against the resident one). When the candidates fit on the device, it is
much cheaper to copy each of them ONCE, keep the copies for the remaining warm-up passes (*resident* mode), and
free them when INFERENCE is built; the profile phase then costs about one transfer sweep plus ordinary resident
forwards, and per-trap timings contain no copies at all.

The decision is a pure function, ``flextensor.planning.warmup_rule.decide_warmup``.
:func:`choose_warmup` gathers those numbers for an engine, decides, and logs ONE INFO line with the mode and
the reason (bytes against the limit). The decision is made once, in ``offload()``; the copies themselves happen
at the start of the first warm-up pass (:func:`preload`), so ``offload()`` stays cheap and the one
sweep is paid inside the profile phase, where the goal accounts for it.

The warm-up's copies
--------------------
When the offload candidates fit on the device, DISCOVERY/PROFILING keep one device copy of each
(:class:`~flextensor.runtime.loaders.warm_loader.WarmLoader`). The functions below do the work around those copies, in
the order it happens:

1. ``offload()``: :func:`stage` registers the candidates' host storages in place (``flextensor.runtime.pinned.in_place``), so
   the copies are direct DMA and may be queued (``non_blocking``); for a large model on a thread, in trap order,
   each copy waiting for its own region; :func:`choose_warmup` records the decision
   and the names still to copy; with DISCOVERY skipped, :func:`overlap_stream` makes the side stream the first
   pass will copy on.
2. The first warm-up pass, before any trap: :func:`preload` copies every pending candidate once, trap
   by trap, between CUDA timing events. In a PROFILING pass the copies run on the side stream and each trap's
   compute waits only for its own group's copy (:func:`wait_copy`, called at its entry), so the pass's
   compute overlaps the sweep.
3. The switch to INFERENCE: :func:`warm_samples` turns the sweep's events into ``(bytes, seconds)`` samples,
   the transfer measurement the planner fits (no second sweep). A stream warm-up times its per-call copies
   instead (``flextensor.engine.profiling``).

Ordering: all of the resident sweep's copies and their events are recorded on one stream, in trap order; a
trap's compute waits for its group's end event, and everything after the pass (or a trap the pass did not
enter) waits for the last one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch

from flextensor.planning.warmup_rule import WarmupDecision, decide_warmup
from flextensor.runtime.sweep import device_memory
from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = ["choose_warmup", "stage", "overlap_stream", "preload", "wait_copy", "warm_samples"]

logger = logging.getLogger(__name__)

#: Offload candidates of at least this many bytes are staged on a thread (:func:`stage`); fewer take
#: milliseconds, and ``offload()`` then returns with them registered.
BACKGROUND_STAGING_BYTES = 1 << 30


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
    if device.type == "cuda" and ctx.policy.warmup is None:
        total, free = device_memory(device)
        fraction = ctx.config.max_gpu_mem_fraction
        if budget is None and fraction is not None:
            # As flextensor.engine.switch resolves it (without its < 256 MiB error, raised there).
            budget = min(int(fraction * total), free + resident)
    decision = decide_warmup(needed, device_type=device.type, budget_bytes=budget, resident_bytes=resident,
                             free_bytes=free, total_bytes=total, override=ctx.policy.warmup)
    logger.info("manager %r: %s warm-up on %s: %s", ctx.name, decision.mode.value, device, decision.reason)
    warm = ctx.warm
    warm.decision = decision
    warm.loader.keep = decision.resident
    forced_copies = ctx.policy.warmup is not None and device.type != "cuda"
    if forced_copies:  # tests: the CPU "copies" the candidates too, as a GPU would, so the bookkeeping runs
        warm.loader.same_device_copies = {id(entries[n].tensor) for n in candidates}
    if decision.resident:
        warm.pending = sorted(n for n in candidates if forced_copies or entries[n].tensor.device != device)
    return decision


def stage(ctx: EngineContext, candidates: set[str], *, background: bool = False) -> None:
    """Pin the candidates' host storages in place for the warm-up copies (``flextensor.runtime.pinned.in_place``).

    ``background`` (``offload()``'s warm-up): from :data:`BACKGROUND_STAGING_BYTES` on, a thread registers them
    in trap order while ``offload()`` returns, and each warm-up copy waits for its own region (the loader's
    ``gate``): the registration (seconds for a large model) overlaps the first pass instead of holding
    ``offload()``."""
    staging = ctx.warm.staging
    if not candidates or not staging.wanted(ctx.config, ctx.device):
        return
    tensors = {n: ctx.tensors[n].tensor for n in sorted(candidates)}
    if background and sum(tensor_nbytes(t) for t in tensors.values()) >= BACKGROUND_STAGING_BYTES:
        order = [n for trap in ctx.traps.values() for n in trap.candidates if n in tensors]
        staging.stage_in_background(tensors, ctx.device, order)
        ctx.warm.loader.gate = staging.wait_for
        ctx.warm.loader.turns = staging.turns
        ctx.warm.loader.non_blocking = True  # a region the thread could not pin is copied from pageable memory:
        return  # safe with non_blocking too (the copy returns once the driver holds the bytes)
    staging.stage(tensors, ctx.device)
    # Unless staging failed, every host candidate is now page-locked (by us, or already before).
    ctx.warm.loader.non_blocking = not staging.failed


def overlap_stream(ctx: EngineContext) -> Any:
    """The side stream the first PROFILING pass's warm-up copies will run on, made now, in ``offload()``.

    The first stream a process makes creates PyTorch's whole stream pool (tens of ``cudaStreamCreate``,
    milliseconds). Made at the first pass, that set-up held back the first copy of the
    sweep by as long; here it is part of setting the model up, where the host registration already is.
    None when there will be no overlapped preload (no resident copies pending, CPU, pageable sources).
    """
    if not ctx.warm.pending or ctx.device.type != "cuda" or not ctx.warm.loader.non_blocking:
        return None
    return torch.cuda.Stream(device=ctx.device)


def preload(ctx: EngineContext, profiling: bool) -> None:
    """Start of a warm-up pass: copy the pending resident candidates (once), before any trap or timing.

    Trap by trap, between CUDA timing events when the copies come from page-locked memory: this one sweep of
    the offloaded weights is also the transfer measurement the planner fits (:func:`warm_samples`), so the
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
    if compute is not None and profiling:
        stream, ctx.warm.stream = ctx.warm.stream or torch.cuda.Stream(device=ctx.device), None
        stream.wait_stream(compute)  # memory the compute freed may be handed to these copies
        ctx.warm.loader.copy_stream = stream
    ready: dict[str | None, Any] = {}
    ordered = stream is compute  # True once every reader is ordered after the side-stream copies
    # The side-stream copies switch streams (WarmLoader: torch.cuda.stream), which restores the current
    # device's stream on exit and so sets that device: inside the engine's own device scope that is the
    # engine's device, and the scope's exit never creates a context on another one (cuda:0 of a process that
    # never chose a device).
    scope = torch.cuda.device(ctx.device) if stream is not compute else contextlib.nullcontext()
    turns = ctx.warm.loader.turns  # registrations still running on a thread take turns with these copies
    pinned = True  # every copy so far came from registered memory: its events time a DMA (the samples' premise)
    last: Any = None  # the last group's end event
    try:
        for label, group in groups:
            if not group:
                continue
            tensors = ctx.tensor_objs(group)
            # Before the start event: waiting for a region, or for the registrations in flight, is no copy time.
            pinned = ctx.warm.loader.ready_to_time(tensors) and pinned
            start = end = None
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
            with scope:
                kept = ctx.warm.loader.preload(tensors)
            if not kept:
                ctx.warm.events = []
                ready.clear()
                return  # stream mode (out of device memory): the planner sweeps instead
            if end is not None:
                end.record(stream)
                ctx.warm.events.append((sum(tensor_nbytes(ctx.tensors[n].tensor) for n in group), start, end))
                ready[label] = last = end
        if not pinned:  # part of the sweep came from pageable memory: no samples, the planner sweeps itself
            ctx.warm.events = []
        if stream is not compute and ready:
            assert compute is not None
            outside = ready.pop(None, None)
            if outside is not None:  # candidates of no trap: whoever reads them, they are there first
                compute.wait_event(outside)
            ctx.warm.ready = ready
            ctx.warm.last = last
            ordered = True
    finally:
        if turns is not None:  # after the last end event, which would otherwise queue behind a registration
            turns.give()
        ctx.warm.loader.copy_stream = None
        if not ordered:  # out of memory, or an error part-way: copies already made stay; order them now
            assert compute is not None and stream is not None
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


def warm_samples(ctx: EngineContext) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of the warm-up's timed copies (empty when none were timed): the fastest copy of each
    size, as the transfer sweep keeps the fastest of its repeats (a copy is never faster than the bus).

    Two sources: the resident warm-up's one sweep (:func:`preload`, per trap group, on one stream: its copies
    are launched back to back, nothing of the host's between them) and the stream warm-up's copies in the
    passes between the first PROFILING pass and the last (per trap call, ``WarmLoader.load_timed``, on whatever
    stream was current). One wait on the last end event completes every earlier pair recorded on its stream;
    a pair on another stream is waited for on its own (a query first: by now all of them have long finished)."""
    events, ctx.warm.events = ctx.warm.events, []
    if events:
        events[-1][2].synchronize()
    fastest: dict[int, float] = {}
    for nbytes, start, end in events:
        if not end.query():
            end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        if nbytes > 0 and seconds > 0:
            fastest[nbytes] = min(seconds, fastest.get(nbytes, seconds))
    return sorted(fastest.items())
