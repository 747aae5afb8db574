"""From PROFILING to a plan: measured passes -> an immutable :class:`Plan` for the INFERENCE build.

:func:`plan_switch` runs once, after the last counted PROFILING pass: per-trap compute seconds (median over
passes) and each trap's exclusive tensors become the planner's ``TrapCost`` list (tensor sizes rounded up to the
256-byte packing alignment, so the planner's block bytes equal the loader's); tensors no trap may offload are
``fixed_resident_bytes``. The transfer model comes from the warm-up's timed copies (``warm_samples``: the
resident warm-up's one sweep, or a stream warm-up's per-call copies), or from a sweep now when there were none.
The strategy's ``offloaded`` map becomes packed block layouts, one per offloaded trap, in trap order.
``flextensor.engine.build`` turns the plan into host blocks and a loader.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from flextensor.engine.context import SwitchInputs
from flextensor.engine.warmup import warm_samples
from flextensor.planning.plan_model import PlanInput, TensorCost, TransferModel, TrapCost
from flextensor.planning.strategies import AdaptiveStrategy, resolve_budget
from flextensor.planning.warmup_rule import warmup_margin
from flextensor.runtime.device_read_rate import device_read_rate
from flextensor.runtime.host_memory import ALIGN, BlockLayout, pack_block, packed_stride
from flextensor.runtime.sweep import device_memory, transfer_sweep
from flextensor.shm.sizes import align_up
from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = ["Plan", "latency_capacity", "plan_switch", "prepare_switch", "read_floor_s", "resolve_device_budget",
           "trap_stream_cost"]

logger = logging.getLogger("flextensor.manager")
NOTICE = 25  # the block assignment table is logged at "NOTICE" level
# What a streamed trap costs a launch-bound pass beyond its copy: the loader's host work at its entry and exit
# (see ``TrapCost.stream_cost_s``). Calibrated with plans that stream only a few KiB per trap of a launch-bound
# pass, so the copies cost nothing and the pass's growth is this cost (``docs/benchmarks.md``, "What a streamed
# trap costs"). A constant, not a measurement per run: nothing streams before the plan exists.
STREAMED_TRAP_COST_S = 70e-6
# What a streamed trap costs even where the device lags the host (the host's part then hides): the device's
# own share, ordering the compute stream after the copy stream and sharing memory bandwidth with the copy.
# Calibrated the same way on passes where the device lagged the host: the cost per streamed trap falls with the
# lag, and the floor is about the lowest seen.
STREAMED_TRAP_DEVICE_S = 25e-6
#: The transfer model of a CPU computing from its host blocks in place: an offloaded tensor costs no copy.
IN_PLACE_TRANSFER = TransferModel(1e15)


@dataclass(frozen=True)
class Plan:
    """What INFERENCE streams: one packed block per offloaded trap, the trap schedule, the rotating slots
    (``num_slots``; with ``raw_block_transfer`` the consecutive blocks the device arena holds)."""

    layouts: tuple[BlockLayout, ...]
    schedule: tuple[str, ...]
    num_slots: int
    strategy_name: str
    explanation: tuple[str, ...]


def prepare_switch(ctx: EngineContext) -> SwitchInputs:
    """Compute (and keep in ``ctx.profile``) the timing-free part of the switch to INFERENCE.

    Why ahead of the switch: the plan is made inside the last PROFILING pass, where every millisecond is the
    profile phase's. Sizes, packing and the exclusive sets are known from the first counted PROFILING pass on,
    so the PROFILING handler calls this at the end of that pass: with the resident warm-up's sweep in flight
    the device is busy for tens of milliseconds after the host has queued the pass, so this host work (a fraction
    of a millisecond for a model of 16 traps) costs the phase nothing there. The exclusive sets do not change after
    DISCOVERY, so the result stays valid until the switch consumes it. The traps' direct forwards for
    ``Trap.bypass`` are built here too.
    """
    tensors = ctx.tensors
    raw = {n: tensor_nbytes(tensors[n].tensor) for names in ctx.exclusive.values() for n in names}
    per_trap: dict[str, TrapCost] = {}
    whole: dict[str, tuple[tuple[str, ...], BlockLayout]] = {}
    for label, exclusive in ctx.exclusive.items():
        names = tuple(n for n in exclusive if raw[n] > 0)
        per_trap[label] = TrapCost(label, 0.0, tuple(TensorCost(n, align_up(raw[n], ALIGN)) for n in names))
        if names:
            whole[label] = (names, pack_block(0, label, [_layout_entry(tensors[n].tensor, n) for n in names]))
    others = tuple(e.tensor for n, e in tensors.items() if n not in raw)
    inputs = SwitchInputs(per_trap, whole, raw, others)
    ctx.profile.switch_inputs = inputs
    if ctx.timing is None:  # the traps INFERENCE may call directly (bypass_resident_traps)
        for trap in ctx.traps.values():
            if trap.kind == "module":
                trap.prepare_bypass()
    return inputs


def _layout_entry(t: torch.Tensor, name: str) -> tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    return name, t.dtype, tuple(t.shape), packed_stride(t)


def warn_traps_never_called(ctx: EngineContext, called: list[str]) -> None:
    """Name the traps no warm-up pass entered: their weights stay on the device. The usual cause is a trap on a
    container nothing calls (the default ``["*"]`` traps a model's top-level children, and a ``ModuleList`` of
    layers is one of them; the model's forward calls the layers, never the list), which would otherwise leave
    a user with an offload that offloads nothing and no word of why."""
    seen = set(called)
    idle = [trap for trap in ctx.traps.values() if trap.kind == "module" and trap.label not in seen]
    if not idle:
        return
    held = sum(tensor_nbytes(ctx.tensors[n].tensor) for trap in idle for n in ctx.exclusive.get(trap.label, ()))
    hints = [f"{trap.label!r} ({type(trap.module).__name__}, never called: name its layers, e.g. "
             f"include_patterns=['{trap.label}.*'])" if trap.module is not None
             and type(trap.module).forward is nn.Module.forward else repr(trap.label) for trap in idle]
    logger.warning("manager %r: %d trap(s) were never called during the warm-up, so their %.1f MiB stay on the "
                   "device: %s", ctx.name, len(idle), held / 2**20, "; ".join(hints))


def plan_switch(ctx: EngineContext) -> Plan:
    """End of PROFILING: fit the transfers, plan with the strategy, and record the timings in ``ctx.plan``."""
    cfg = ctx.config
    sequence = ctx.sequence
    order = list(dict.fromkeys(sequence))
    warn_traps_never_called(ctx, order)
    tensors = ctx.tensors
    inputs = ctx.profile.switch_inputs if ctx.profile.switch_inputs is not None else prepare_switch(ctx)
    ctx.profile.switch_inputs = None  # used once: a later plan (after a release) starts from the model again
    durations = ctx.profile.durations
    record = ctx.plan
    record.compute_s = {label: statistics.median(durations.get(label) or [0.0]) for label in order}
    floor = read_floor_s(ctx)  # latency mode: plan for the smallest pass, not only the profiled one
    calls = Counter(sequence)
    costs = []
    offloadable: set[str] = set()
    for label in order:
        compute = record.compute_s[label]
        if floor is not None:
            compute = min(compute, floor.get(label, 0.0))
        template = inputs.traps.get(label)
        if template is None or not template.tensors:  # a gap trap: its compute only widens the next window
            costs.append(TrapCost(label, compute) if template is None else template.timed(compute))
            continue
        offloadable.update(t.name for t in template.tensors)
        host = ctx.profile.host_durations.get(label)
        costs.append(template.timed(compute, trap_stream_cost(compute, host, calls[label])))
    fixed = (sum(tensor_nbytes(t) for t in inputs.others)
             + sum(nbytes for n, nbytes in inputs.exclusive_bytes.items() if n not in offloadable))
    if ctx.in_place:  # nothing is ever copied (Note [CPU in place]): no sweep, and its buffers never allocated
        record.samples, transfer = [], IN_PLACE_TRANSFER
    else:
        record.samples = warm_samples(ctx) or transfer_sweep(ctx.device, [c.total_bytes for c in costs],
                                                              pinned=cfg.pinned_memory)
        transfer = TransferModel.fit(record.samples) if record.samples else TransferModel(1e9)
    budget = resolve_device_budget(ctx)
    strategy = cfg.load_strategy if cfg.load_strategy is not None else AdaptiveStrategy()
    if offloadable:
        position = {label: i for i, label in enumerate(order)}
        plan_input = PlanInput(traps=tuple(costs), transfer=transfer, budget_bytes=budget,
                               num_blocks=cfg.num_blocks, min_blocks=cfg.min_blocks,
                               scale=cfg.transfer_budget_scale, fixed_resident_bytes=fixed,
                               arena=cfg.transfer_mode == "raw_block_transfer",
                               calls=tuple(position[label] for label in sequence))
        plan = strategy.plan(plan_input)
        capacity = latency_capacity(ctx) if budget is None else None
        if capacity is not None and plan.peak_device_bytes > capacity:  # latency first, within what the device has
            logger.info("manager %r: the latency-mode plan needs %d bytes on the device, %d are available: planned "
                        "at that budget instead", ctx.name, plan.peak_device_bytes, capacity)
            plan = strategy.plan(replace(plan_input, budget_bytes=capacity))
        offloaded = {label: tuple(names) for label, names in plan.offloaded.items()}
        num_slots = plan.num_blocks
        small_slot = plan.small_slot_bytes
        record.strategy_name, record.explanation = plan.strategy, list(plan.explanation)
        if budget is not None and not plan.fits_budget:
            logger.warning("manager %r: the plan needs %d bytes on the device, over the budget of %d bytes",
                           ctx.name, plan.peak_device_bytes, budget)
        if cfg.enable_diagnostics:
            _log_diagnostics(ctx, plan, costs, transfer)
    else:
        offloaded, num_slots, small_slot = {}, cfg.min_blocks, 0
        record.strategy_name = getattr(strategy, "name", type(strategy).__name__)
        record.explanation = ["no trap has offloadable tensors: everything stays resident"]
    layouts: list[BlockLayout] = []
    for label in order:
        names = offloaded.get(label)
        if not names:
            continue
        packed = inputs.whole.get(label)  # (names, layout): the block prepare_switch packed ahead for the trap
        if packed is not None and names == packed[0]:  # the whole trap streams: that block is its block
            layout = packed[1]
            layouts.append(BlockLayout(len(layouts), label, layout.nbytes, layout.tensors))
        else:
            layouts.append(pack_block(len(layouts), label, [_layout_entry(tensors[n].tensor, n) for n in names]))
    if small_slot:  # the slot in packed bytes: the largest block the planner meant for it, padding included
        planned = {c.label: sum(t.nbytes for t in c.tensors if t.name in offloaded.get(c.label, ())) for c in costs}
        small_slot = max((l.nbytes for l in layouts if planned[l.label] <= small_slot), default=0)
    record.small_slot = small_slot
    return Plan(tuple(layouts), tuple(sequence), num_slots, record.strategy_name, tuple(record.explanation))


def trap_stream_cost(compute_s: float, host: Sequence[float] | None, calls: int) -> float:
    """``TrapCost.stream_cost_s`` of a trap called ``calls`` times per pass: ``STREAMED_TRAP_COST_S`` per call,
    less what the device's lag hides, never under ``STREAMED_TRAP_DEVICE_S``. Where the device took longer over
    the trap than the host did (median windows: ``compute_s`` on the device, ``host`` on the host), the host is
    ahead by the difference and the loader's host work there only shortens the device's queue; a launch-bound
    trap (device time = host time, and on a CPU compute device always) pays it in full. No host samples: taken
    as launch-bound."""
    calls = max(calls, 1)
    host_s = statistics.median(host) if host else compute_s
    spare = max(0.0, compute_s - host_s) / calls
    return calls * max(STREAMED_TRAP_DEVICE_S, STREAMED_TRAP_COST_S - spare)


def read_floor_s(ctx: EngineContext) -> dict[str, float] | None:
    """Latency mode's lower bound on each trap's compute at any batch size: its exclusive weights' bytes over the
    device memory's read rate (Note [the smallest pass] in ``flextensor.runtime.device_read_rate``); a trap without
    weights is bounded by 0. None where no bound applies: memory mode, a CPU computing in place, or no rate (a
    CPU without ``EnginePolicy.device_read_rate``, or that rate infinite)."""
    if not ctx.latency_mode or ctx.in_place:
        return None
    rate = ctx.policy.device_read_rate if ctx.policy.device_read_rate is not None else device_read_rate(ctx.device)
    if rate is None or math.isinf(rate):
        return None
    tensors = ctx.tensors
    return {label: sum(tensor_nbytes(tensors[n].tensor) for n in names if n in tensors) / rate
            for label, names in ctx.exclusive.items()}


def latency_capacity(ctx: EngineContext) -> int | None:
    """The device bytes a latency-mode plan may hold on CUDA (None elsewhere): free memory plus what the model
    holds there now, less the warm-up's safety margin. A plan for the smallest pass keeps most of the model
    resident; where it does not fit, the switch plans at this budget instead."""
    if ctx.device.type != "cuda":
        return None
    total, free = device_memory(ctx.device)
    return max(0, free + _held_on_device(ctx) - warmup_margin(total))


def _held_on_device(ctx: EngineContext) -> int:
    """Bytes of the model's tensors on the compute device now (a plan may count them as room it can use)."""
    return sum(tensor_nbytes(e.tensor) for e in ctx.tensors.values() if e.tensor.device == ctx.device)


def resolve_device_budget(ctx: EngineContext) -> int | None:
    """The memory-mode budget in bytes (``set_memory_budget`` or ``max_gpu_mem_fraction``), None in latency
    mode. A fraction is capped by what the device can give (free memory plus what the model holds there)."""
    if ctx.budget_bytes is not None:
        return ctx.budget_bytes
    fraction = ctx.config.max_gpu_mem_fraction
    if fraction is None:
        return None
    total, free = device_memory(ctx.device)
    # On a CPU, host RAM is not "held" by moving tensors: the CPU device is only a stand-in.
    held = _held_on_device(ctx) if ctx.device.type != "cpu" else 0
    budget, warning = resolve_budget(fraction, total, min(total, free + held))
    if warning:
        logger.warning("manager %r: %s", ctx.name, warning)
    return budget


def _log_diagnostics(ctx: EngineContext, plan: Any, costs: Sequence[TrapCost], transfer: TransferModel) -> None:
    from flextensor.planning.diagnostics import (format_block_assignment, format_candidates, format_transfer_stats,
                                                 format_trap_durations)

    durations = ctx.profile.durations
    logger.info("%s", format_transfer_stats(ctx.plan.samples, transfer))
    logger.info("%s", format_trap_durations({label: durations.get(label, []) for label in ctx.traps}))
    logger.log(NOTICE, "%s", format_block_assignment(plan, costs))
    logger.info("%s", format_candidates(plan))
