"""Strategy replanning during INFERENCE: measure the passes the model is served at, plan again, switch between passes.

Note [replanning]
-----------------
The plan made at the end of PROFILING is only as good as the passes it measured. A latency-mode plan streams the
traps whose copies hide under the compute of the profiled batch; served at a smaller batch the compute shrinks,
the same copies are exposed, and each pass stalls on them. A replan fixes that without another profile:

1. *Trigger.* ``request_strategy_replan()`` (any mode), or, in latency mode with the default adaptive strategy,
   the stall probe (``flextensor.runtime.stall_probe``): a sampled pass whose compute stream waited on copies for
   more than ``STALL_FRACTION`` of its streamed span arms a replan by itself (``allow_strategy_replan=False``
   turns that off).
2. *Measure.* The next ``MEASURE_PASSES`` passes time every trap (bypassed traps get their wrapper back for
   those passes) with a collector of their own; the user's ``offload_timing`` records nothing meanwhile. With
   ``manual_update_state=True`` (CUDA-graph replays run no hooks) the caller's ``update_state()`` calls count the
   steps instead, and the budgets come from the manager's own offload timing.
3. *Plan, off the hot path.* Once the device has passed the last measured pass (polled, never waited for), the
   planner runs on a thread over the measured compute per trap. Each trap keeps the host block it was given at
   the switch, so the choice is per block, whole: stream it or copy it to the device. In latency mode a trap
   whose copy stalled while measured is not streamed again (on a CPU streaming through the loader every copy
   is synchronous, so every streamed trap stalls), and each trap's compute is the smallest seen so far (profile
   and every measurement): a plan holds at every batch the model met and never grows back. In memory mode the
   budget decides, over the compute measured now.
4. *Install, between passes* (:func:`install_streaming`): the loader stops (its copies in flight finish), traps
   leaving the stream get a device copy of their host block's tensors, the others rest on the new loader's
   slots. Host blocks never change, so ``state_dict()``, ``release()`` and a later replan read them as before.

Not for a shared session's workers: their published plan stays fixed (the session turns replanning off).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import replace
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from flextensor.engine.context import StrategyReplanState, block_loader
from flextensor.engine.hooks import assign_data
from flextensor.engine.switch import read_floor_s, resolve_device_budget, trap_stream_cost
from flextensor.planning.plan_model import PlanInput, TensorCost, TransferModel, TrapCost
from flextensor.planning.strategies import AdaptiveStrategy
from flextensor.runtime.host_memory import block_views
from flextensor.runtime.stall_probe import StallProbe
from flextensor.runtime.timing import OffloadTimingReport, TimingCollector
from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = [
    "StrategyReplanState", "StrategyReplanStatus", "MEASURE_PASSES", "StreamingPlan", "allow", "attach_probe",
    "automatic", "begin_pass", "end_pass", "install_streaming", "measuring_timing", "plan_streaming", "request",
    "request_if_available", "status", "step", "streaming_input", "unavailable_reason",
]

logger = logging.getLogger("flextensor.manager")

#: Passes timed per replan (their median compute per trap is planned with).
MEASURE_PASSES = 3
#: A sampled pass stalled when its copies held compute for more than this share of the streamed span ...
STALL_FRACTION = 0.02
#: ... and at least this long (ms): below it, event resolution and launch jitter.
MIN_STALL_MS = 0.05
#: A measured trap whose median wait exceeds this (ms) is not streamed again.
TRAP_STALL_MS = 0.02
#: Passes the probe stays quiet after an automatic replan that changed nothing.
QUIET_PASSES = 256
#: Device memory a latency-mode replan leaves free when it moves blocks onto the device.
DEVICE_MARGIN_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class StrategyReplanStatus:
    """Passive snapshot of the strategy-replan state (reading it never arms or advances anything).

    ``state``: ``"idle"`` before any replan, ``"in_progress"`` while one measures the caller's forwards and
    plans, ``"done"`` once it finished (applied or the plan kept), ``"failed"`` when installing the new plan
    raised (inference is unsafe then: release the model). ``can_request``: whether ``request_strategy_replan()``
    would arm one now. ``applied``: ``None`` before and during a replan, then whether the streaming changed.
    """

    state: StrategyReplanState
    can_request: bool
    applied: bool | None

    def __post_init__(self) -> None:
        if self.state not in ("idle", "in_progress", "done", "failed"):
            raise ValueError(f"StrategyReplanStatus.state must be 'idle', 'in_progress', 'done' or 'failed', "
                             f"got {self.state!r}")


class StreamingPlan:
    """A replan's result: the traps that stream (execution order) and the device slots they rotate through."""

    __slots__ = ("streamed", "num_slots", "strategy", "explanation")

    def __init__(self, streamed: Sequence[str], num_slots: int, strategy: str, explanation: Sequence[str]) -> None:
        self.streamed = tuple(streamed)
        self.num_slots = num_slots
        self.strategy = strategy
        self.explanation = tuple(explanation)


class PlannerThread(threading.Thread):
    """Runs one plan off the caller's thread; the result (or error) is read once ``done``."""

    def __init__(self, fn: Callable[[], StreamingPlan]) -> None:
        super().__init__(name="ft-replan", daemon=True)
        self._fn = fn
        self.result: StreamingPlan | None = None
        self.error: BaseException | None = None
        self.done = False

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # handed to the caller's thread at install
            self.error = exc
        finally:
            self.done = True


# ------------------------------------------------------------------------------------------------- availability
def unavailable_reason(ctx: EngineContext) -> str | None:
    """Why a replan cannot be requested now, or None."""
    replan = ctx.inference.replan
    if not ctx.allow_replan:
        return "this manager was offloaded with allow_strategy_replan=False"
    if ctx.config.shm_enabled:
        return "a shared-memory model's published plan stays fixed"
    if ctx.in_place:
        return "a CPU compute device reads its host blocks in place: nothing streams, nothing to replan"
    if ctx.function_traps is not None:
        return "profile_mode='torch_function' streams from the model's own parameters, not from host blocks"
    if not ctx.inference.layouts:
        return "the plan has no host blocks: every weight is resident already"
    if replan.state == "in_progress":
        return "a replan is in progress"
    if replan.state == "failed":
        return "the last replan failed; release() and offload again"
    return None


def automatic(ctx: EngineContext) -> bool:
    """Whether the stall probe may arm replans: latency mode with the default adaptive strategy."""
    cfg = ctx.config
    strategy_ok = cfg.load_strategy is None or isinstance(cfg.load_strategy, AdaptiveStrategy)
    return (ctx.allow_replan and strategy_ok and ctx.latency_mode and not cfg.shm_enabled and not ctx.in_place
            and ctx.function_traps is None)


def attach_probe(ctx: EngineContext) -> None:
    """Give the loader a stall probe when replans may be automatic (see :func:`automatic`)."""
    loader = ctx.inference.loader
    replan = ctx.inference.replan
    if loader is None or not automatic(ctx):
        replan.probe = None
        if loader is not None:
            loader.probe = None
        return
    if replan.probe is None:
        replan.probe = StallProbe(ctx.device.type == "cuda")
    replan.probe.restart()
    loader.probe = replan.probe


def status(ctx: EngineContext | None) -> StrategyReplanStatus:
    """``strategy_replan_status`` of an INFERENCE context (``None``: no model, or not in INFERENCE yet)."""
    if ctx is None:
        return StrategyReplanStatus("idle", can_request=False, applied=None)
    replan = ctx.inference.replan
    return StrategyReplanStatus(replan.state, unavailable_reason(ctx) is None, replan.applied)


def allow(ctx: EngineContext, allowed: bool) -> None:
    """``allow_strategy_replan = allowed`` on a live engine: requests refused or not, the stall probe on or off."""
    ctx.allow_replan = allowed
    attach_probe(ctx)


def request_if_available(name: str, ctx: EngineContext | None, *, manual: bool) -> int:
    """``request_strategy_replan()`` of an INFERENCE context (else ``None``): :func:`request` when nothing in
    :func:`unavailable_reason` stands in the way, else 0 and the reason logged."""
    reason = "not in INFERENCE" if ctx is None else unavailable_reason(ctx)
    if ctx is None or reason is not None:
        logger.warning("request_strategy_replan(%r): not armed: %s", name, reason)
        return 0
    return request(ctx, manual=manual)


def request(ctx: EngineContext, *, manual: bool, automatic_: bool = False) -> int:
    """Arm a replan (the caller checked :func:`unavailable_reason`); the passes or steps to drive."""
    replan = ctx.inference.replan
    replan.state, replan.applied = "in_progress", None
    replan.manual, replan.automatic = manual, automatic_
    replan.passes_left = MEASURE_PASSES
    replan.measure = None if manual else TimingCollector(ctx.device.type == "cuda", ctx.device)
    replan.last_mark = None
    replan.planner = None
    replan.stalled = {}
    return MEASURE_PASSES


# ------------------------------------------------------------------------------------------------- the passes
def begin_pass(ctx: EngineContext) -> None:
    """INFERENCE pass start: advance an armed replan, or read the probe (steps 1-4 of Note [replanning])."""
    replan = ctx.inference.replan
    probe = replan.probe
    if probe is not None:
        probe.sampling = False
    if replan.state == "in_progress":
        if replan.manual:
            return
        if replan.passes_left > 0:
            _measure_pass(ctx)
        elif replan.planner is None:
            if replan.measure is not None and replan.measure.done(replan.last_mark):
                report = replan.measure.collect()
                replan.measure = None
                _start_planner(ctx, report)
        elif replan.planner.done:
            _install_planned(ctx)
        return
    if probe is None:
        return
    for stall in probe.poll():
        if stall.wait_ms > max(MIN_STALL_MS, STALL_FRACTION * stall.span_ms):
            logger.info("manager %r: copies held compute for %.2f ms of a %.2f ms pass; replanning from the next %d "
                        "passes", ctx.name, stall.wait_ms, stall.span_ms, MEASURE_PASSES)
            request(ctx, manual=False, automatic_=True)
            _measure_pass(ctx)
            return
    probe.begin_pass()


def end_pass(ctx: EngineContext) -> None:
    """INFERENCE pass end: close a measured pass or a sampled one."""
    replan = ctx.inference.replan
    measure = replan.measure
    if replan.measuring and measure is not None:
        measure.end_pass()
        replan.measuring = False
        replan.passes_left -= 1
        if replan.passes_left == 0:
            replan.last_mark = measure.mark()
            _end_measure(ctx)
        return
    probe = replan.probe
    if probe is not None and probe.sampling:
        probe.end_pass(_compute_stream(ctx))


def measuring_timing(ctx: EngineContext) -> TimingCollector | None:
    """The collector this pass's traps report to: a replan's while it measures, else ``offload_timing``'s."""
    replan = ctx.inference.replan
    return replan.measure if replan.measuring else ctx.timing


def step(ctx: EngineContext, replay_generation: int = -1) -> None:
    """``update_state()``: one measured step of a manual replan (a CUDA-graph replay, whose passes are published to
    ``offload_timing`` first); plans and installs after the last. A ``replay_generation >= 0`` already counted is
    ignored. Nothing armed manually: nothing to do (phases advance in the root forward)."""
    replan = ctx.inference.replan
    if 0 <= replay_generation == replan.generation:
        return
    if replay_generation >= 0:
        replan.generation = replay_generation
    if replan.state != "in_progress" or not replan.manual:
        return
    if ctx.timing is not None:
        ctx.timing.publish_replays(replay_generation)
    replan.passes_left -= 1
    if replan.passes_left > 0:
        return
    report = ctx.timing.collect() if ctx.timing is not None else None
    if report is None or not report.passes:
        logger.warning("manager %r: the manual replan measured nothing (offload_timing is %r; CUDA-graph replays "
                       "are timed with offload_timing='cuda_graph' and published with update_offload_timing()); "
                       "the plan stays", ctx.name, ctx.config.offload_timing)
        replan.state, replan.applied = "done", False
        return
    _start_planner(ctx, report, thread=False)
    _install_planned(ctx)


def _compute_stream(ctx: EngineContext):
    return torch.cuda.current_stream(ctx.device) if ctx.device.type == "cuda" else None


def _measure_pass(ctx: EngineContext) -> None:
    """Time this pass: every trap's wrapper back, the loader reporting to the replan's collector."""
    replan = ctx.inference.replan
    measure = replan.measure
    assert measure is not None
    for trap in ctx.traps.values():
        trap.unbypass()
    if ctx.inference.loader is not None:
        ctx.inference.loader.timing = measure
    measure.begin_pass()
    replan.measuring = True


def _end_measure(ctx: EngineContext) -> None:
    """After the last measured pass: the loader reports to ``offload_timing`` again, traps bypassed as before."""
    if ctx.inference.loader is not None:
        ctx.inference.loader.timing = ctx.timing
    _bypass(ctx, set(ctx.inference.block_of))


def _bypass(ctx: EngineContext, streamed: set[str]) -> None:
    for trap in ctx.traps.values():
        if trap.kind != "module":
            continue
        if trap.label in streamed or ctx.timing is not None:
            trap.unbypass()
        else:
            trap.bypass()


# ------------------------------------------------------------------------------------------------- planning
def _start_planner(ctx: EngineContext, report: OffloadTimingReport | None, thread: bool = True) -> None:
    replan = ctx.inference.replan
    measured: dict[str, float] = {}
    synchronous = ctx.device.type != "cuda"  # a CPU streaming through the loader: every copy holds its trap
    if report is not None:
        for stats in report.per_trap:
            measured[stats.label] = stats.compute_budget_ms() / 1e3
            stall = stats.transfer_median if synchronous else stats.wait_median
            if stall > TRAP_STALL_MS:
                replan.stalled[stats.label] = stall
    latency = ctx.latency_mode
    floor = replan.floor_s
    if not floor:
        floor.update(ctx.plan.compute_s)
    read = read_floor_s(ctx)  # latency mode: no pass reads its weights faster than the device's memory
    compute: dict[str, float] = {}
    for label in dict.fromkeys(ctx.sequence):
        seen = measured.get(label, floor.get(label, 0.0))
        bound = read.get(label, 0.0) if read is not None else seen
        compute[label] = min(seen, floor.get(label, seen), bound) if latency else seen
        floor[label] = min(seen, floor.get(label, seen))
    if latency:  # a memory-mode plan streams what its budget needs, stalls or not
        replan.excluded |= set(replan.stalled)
    excluded = set(replan.excluded)
    plan_input, capacity = streaming_input(ctx, compute, excluded)
    strategy = ctx.config.load_strategy if ctx.config.load_strategy is not None else AdaptiveStrategy()
    planner = PlannerThread(lambda: plan_streaming(strategy, plan_input, capacity))
    replan.planner = planner
    if thread:
        planner.start()
    else:
        planner.run()


def streaming_input(ctx: EngineContext, compute_s: dict[str, float],
                    excluded: set[str]) -> tuple[PlanInput, int | None]:
    """The planner's input for a replan, and in latency mode on CUDA the device bytes the plan may hold.

    Each host block is one candidate, whole (stream it or not): its bytes as one ``TensorCost``. Traps without
    a block, or ``excluded``, offer nothing (their bytes are fixed on the device)."""
    cfg = ctx.config
    inference = ctx.inference
    layouts = {layout.label: layout for layout in inference.layouts}
    calls = Counter(ctx.sequence)
    fixed = sum(tensor_nbytes(e.tensor) for n, e in ctx.tensors.items() if n not in inference.placement)
    costs = []
    for label in dict.fromkeys(ctx.sequence):
        compute = compute_s.get(label, 0.0)
        layout = layouts.get(label)
        if layout is None or label in excluded:
            fixed += layout.nbytes if layout is not None else 0
            costs.append(TrapCost(label, compute))
            continue
        costs.append(TrapCost(label, compute, (TensorCost(f"{label}#block", layout.nbytes),),
                              trap_stream_cost(compute, None, calls[label])))
    budget = resolve_device_budget(ctx)
    transfer = TransferModel.fit(ctx.plan.samples) if ctx.plan.samples else TransferModel(1e9)
    position = {label: i for i, label in enumerate(dict.fromkeys(ctx.sequence))}
    plan_input = PlanInput(traps=tuple(costs), transfer=transfer, budget_bytes=budget, num_blocks=cfg.num_blocks,
                           min_blocks=cfg.min_blocks, scale=cfg.transfer_budget_scale, fixed_resident_bytes=fixed,
                           arena=cfg.transfer_mode == "raw_block_transfer",
                           calls=tuple(position[label] for label in ctx.sequence))
    capacity = None
    if budget is None and ctx.device.type == "cuda":  # what moves onto the device must fit there
        free, _total = torch.cuda.mem_get_info(ctx.device)
        held = sum(layouts[label].nbytes for label in inference.resident_blocks if label in layouts)
        slots = inference.loader.device_bytes if inference.loader is not None else 0
        capacity = max(0, fixed + held + slots + free - DEVICE_MARGIN_BYTES)
    return plan_input, capacity


def plan_streaming(strategy, plan_input: PlanInput, capacity: int | None) -> StreamingPlan:
    """Plan with ``strategy``; a latency-mode plan that would not fit in ``capacity`` is planned again in memory
    mode at that budget. Pure: safe on the planner thread."""
    plan = strategy.plan(plan_input)
    if capacity is not None and plan.peak_device_bytes > capacity:
        plan = strategy.plan(replace(plan_input, budget_bytes=capacity))
    streamed = [label for label in plan.offloaded if plan.offloaded[label]]
    return StreamingPlan(streamed, plan.num_blocks, plan.strategy, plan.explanation)


def _install_planned(ctx: EngineContext) -> None:
    replan = ctx.inference.replan
    planner, replan.planner = replan.planner, None
    assert planner is not None and planner.done
    try:
        if planner.error is not None:
            raise planner.error
        result = planner.result
        assert result is not None
        before = tuple(label for label in ctx.sequence if label in ctx.inference.block_of)
        before = tuple(dict.fromkeys(before))
        changed = tuple(result.streamed) != before
        if changed:
            install_streaming(ctx, result.streamed, result.num_slots)
            ctx.plan.strategy_name, ctx.plan.explanation = result.strategy, list(result.explanation)
            replan.applied_count += 1
        ctx.plan.compute_s = dict(replan.floor_s) or ctx.plan.compute_s
    except BaseException:
        replan.state, replan.applied = "failed", False
        logger.exception("manager %r: the replan failed; inference is unsafe until release()", ctx.name)
        raise
    replan.state, replan.applied = "done", changed
    logger.info("manager %r: replan %s: %d of %d host blocks stream%s", ctx.name,
                "applied" if changed else "kept the plan", len(result.streamed), len(ctx.inference.layouts),
                f" (copies stalled in {sorted(replan.stalled)})" if replan.stalled else "")
    attach_probe(ctx)
    if replan.probe is not None and replan.automatic and not changed:
        replan.probe.quiet(QUIET_PASSES)


# ------------------------------------------------------------------------------------------------- install
def install_streaming(ctx: EngineContext, streamed: Sequence[str], num_slots: int) -> None:
    """Stream exactly the host blocks of ``streamed``; every other block's tensors get a device copy.

    Between passes only (no trap running). Host blocks and placements stay; the loader is rebuilt."""
    inference = ctx.inference
    keep = set(streamed)
    was_streamed = set(inference.block_of)
    ctx.plan.small_slot = 0  # replans serve latency mode: no budget, slots of one size
    if inference.loader is not None:
        inference.loader.close()  # its in-flight copies finish; parameters still rest on its slots until below
        inference.loader = None
    for layout in inference.layouts:
        if layout.label in keep or layout.label not in was_streamed:
            continue
        host = inference.host_blocks[layout.index].tensor
        for placement, view in zip(layout.tensors, block_views(host, layout.tensors)):
            assign_data(ctx.tensors[placement.name].tensor, view.to(ctx.device, non_blocking=True))
    inference.resident_blocks = {layout.label for layout in inference.layouts if layout.label not in keep}
    inference.block_of = {layout.label: layout.index for layout in inference.layouts if layout.label in keep}
    schedule = [inference.block_of[label] for label in ctx.sequence if label in keep]
    if keep:
        inference.loader = block_loader(ctx, inference.layouts, inference.host_blocks, schedule, num_slots)
    _bypass(ctx, keep)
