"""From PROFILING to INFERENCE: planning (transfer sweep, budget, strategy) and building the block loader.

``plan_inference`` runs once, after the last counted PROFILING pass: per-trap compute seconds (median over
passes) and each trap's exclusive tensors become the planner's ``TrapCost`` list (tensor sizes rounded up to the
256-byte packing alignment, so the planner's block bytes equal the loader's); tensors no trap may offload are
``fixed_resident_bytes``. The plan's ``offloaded`` map becomes packed block layouts, one per offloaded trap.

``build_inference`` is shared with adoption (profiles, published states): it first ends a resident warm-up
(``flextensor.warmup``: the device copies of the tensors about to be offloaded are freed before any device block
exists, the tensors that stay resident keep their warm-up copy), then allocates or adopts host blocks,
copies weights in (from the model, or ``weights`` for meta tensors) unless a block is prefilled, points each
offloaded parameter at its host view (freeing the original storage), moves every other tensor to the compute
device, and creates the :class:`~flextensor.loader.BlockLoader`. Traps that never ran during warm-up are not in
the schedule, so their tensors stay resident.

Host memory during the build: the provider is told every block size first (``reserve``), so the pinned
providers carve blocks out of a few arenas instead of one pinned allocation per block (see
``flextensor.host_memory``). Blocks are filled from the weights' current host storages, which are the pinned
warm-up staging when there was one; a trap's staged storages are unregistered and dropped as soon as its block is
filled (so the original copy is freed block by block, not after the whole build), the rest (tensors that stay
resident) once they are on the device. No staging registration outlives the build.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import torch

from flextensor.deferred_build import can_defer, defer_inference
from flextensor.host_memory import (ALIGN, BlockLayout, FillProgress, HostBlock, block_views, make_provider, pack_block,
                                    packed_stride)
from flextensor.loader import BlockLoader
from flextensor.state import tensor_nbytes
from flextensor.traps import assign_data

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.manager import OffloadManager

__all__ = ["plan_inference", "prepare_switch", "SwitchInputs", "build_inference", "bypass_resident_traps"]

logger = logging.getLogger(__name__)
NOTICE = 25  # the spec logs the block assignment table at "NOTICE" level
# What a streamed trap costs a launch-bound pass beyond its copy: the loader's host work at its entry and exit
# (see ``TrapCost.stream_cost_s``). Measured on the H200 host (2026-11-30) with plans streaming only each layer's
# norm weights (16 KiB per trap) of a 3.5 ms pass: +90 us per streamed trap before the copy issue was made
# cheaper (the loader's host time alone: 105 us), +71-77 us after (40 us of it the loader's host time). A
# constant, not a measurement per run: nothing streams before the plan exists.
STREAMED_TRAP_COST_S = 70e-6
# What a streamed trap costs even where the device lags the host (the host's part then hides): the device's
# own share, ordering the compute stream after the copy stream and sharing memory bandwidth with the copy.
# Measured on the same host and day where the device lagged the host: 5 streamed layers of a 7.6 ms pass
# (1x1024 tokens) +66 us each, 15 of a 60.5 ms pass (4x2048) +23 us each; the floor is about the lower one.
STREAMED_TRAP_DEVICE_S = 25e-6


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SwitchInputs(NamedTuple):
    """What the switch to INFERENCE needs that no PROFILING timing changes, per trap label.

    ``traps``: the planner's ``TrapCost`` of each trap with its exclusive tensors of non-zero size (aligned
    bytes, the trap's order) and no timings yet (the switch adds them with ``TrapCost.timed``); ``whole``: the packed block of all of them, with the names it packs, for the usual plan that
    streams a trap whole (a plan streaming part of a trap packs that part at the switch); ``exclusive_bytes``:
    each exclusive tensor's unaligned bytes; ``others``: every other model tensor, whose bytes are counted at the
    switch (a buffer may grow in place while the model is profiled; exclusive tensors are parameters, whose
    shape, dtype and layout are taken as fixed from the first counted pass on).
    """

    traps: dict[str, Any]
    whole: dict[str, tuple[tuple[str, ...], BlockLayout]]
    exclusive_bytes: dict[str, int]
    others: tuple[torch.Tensor, ...]


def prepare_switch(m: "OffloadManager") -> SwitchInputs:
    """Compute (and keep on the manager) the timing-free part of the switch to INFERENCE.

    Why ahead of the switch: ``plan_inference`` runs inside the last PROFILING pass, where every millisecond is
    the profile phase's. Sizes, packing and the exclusive sets are known from the first counted PROFILING pass
    on, so ``PhaseMixin._end_pass`` calls this at the end of that pass: with the resident warm-up's sweep in
    flight the device is busy for tens of milliseconds after the host has queued the pass, so this host work
    (0.3-0.5 ms on the H200 host for 16 traps) costs the phase nothing there. The exclusive sets do not change
    after DISCOVERY, so the result stays valid until the switch consumes it. The traps' direct forwards for
    ``Trap.bypass`` are built here too.
    """
    from flextensor.plan_model import TensorCost, TrapCost

    tensors = m._tensors
    raw = {n: tensor_nbytes(tensors[n].tensor) for names in m._exclusive.values() for n in names}
    per_trap: dict[str, Any] = {}
    whole: dict[str, tuple[tuple[str, ...], BlockLayout]] = {}
    for label, exclusive in m._exclusive.items():
        names = tuple(n for n in exclusive if raw[n] > 0)
        per_trap[label] = TrapCost(label, 0.0, tuple(TensorCost(n, _aligned(raw[n])) for n in names))
        if names:
            whole[label] = (names, pack_block(0, label, [_layout_entry(tensors[n].tensor, n) for n in names]))
    others = tuple(e.tensor for n, e in tensors.items() if n not in raw)
    inputs = SwitchInputs(per_trap, whole, raw, others)
    m._switch_inputs = inputs
    if m._timing is None:  # the traps INFERENCE may call directly (bypass_resident_traps)
        for trap in m._traps.values():
            if trap.kind == "module":
                trap.prepare_bypass()
    return inputs


def _layout_entry(t: torch.Tensor, name: str) -> tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    return name, t.dtype, tuple(t.shape), packed_stride(t)


def plan_inference(m: "OffloadManager") -> None:
    """End of PROFILING: measure transfers, plan with the strategy, then build the INFERENCE loader."""
    from flextensor.plan_model import PlanInput, TransferModel, TrapCost
    from flextensor.profiling import transfer_sweep
    from flextensor.strategies import AdaptiveStrategy

    cfg = m._config()
    order = list(dict.fromkeys(m._sequence))
    tensors = m._tensors
    inputs = m._switch_inputs if m._switch_inputs is not None else prepare_switch(m)
    m._switch_inputs = None  # used once: a later plan (after a release) starts from the model again
    m._compute_s = {label: statistics.median(m._durations.get(label) or [0.0]) for label in order}
    calls = Counter(m._sequence)
    costs = []
    offloadable: set[str] = set()
    for label in order:
        compute = m._compute_s[label]
        template = inputs.traps.get(label)
        if template is None or not template.tensors:  # a gap trap: its compute only widens the next window
            costs.append(TrapCost(label, compute) if template is None else template.timed(compute))
            continue
        offloadable.update(t.name for t in template.tensors)
        costs.append(template.timed(compute, _trap_stream_cost(compute, m._host_durations.get(label), calls[label])))
    fixed = (sum(tensor_nbytes(t) for t in inputs.others)
             + sum(nbytes for n, nbytes in inputs.exclusive_bytes.items() if n not in offloadable))
    m._samples = m._warm_samples() or transfer_sweep(m._device, [c.total_bytes for c in costs],
                                                     pinned=cfg.pinned_memory)
    transfer = TransferModel.fit(m._samples) if m._samples else TransferModel(1e9)
    budget = _resolve_budget(m)
    strategy = cfg.load_strategy if cfg.load_strategy is not None else AdaptiveStrategy()
    if offloadable:
        plan_input = PlanInput(traps=tuple(costs), transfer=transfer, budget_bytes=budget,
                               num_blocks=cfg.num_blocks, min_blocks=cfg.min_blocks,
                               scale=cfg.transfer_budget_scale, fixed_resident_bytes=fixed)
        plan = strategy.plan(plan_input)
        offloaded = {label: tuple(names) for label, names in plan.offloaded.items()}
        num_slots = plan.num_blocks
        m._strategy_name, m._explanation = plan.strategy, list(plan.explanation)
        if budget is not None and not plan.fits_budget:
            logger.warning("manager %r: the plan needs %d bytes on the device, over the budget of %d bytes",
                           m.name, plan.peak_device_bytes, budget)
        if cfg.enable_diagnostics:
            _log_diagnostics(m, plan, costs, transfer)
    else:
        offloaded, num_slots = {}, cfg.min_blocks
        m._strategy_name = getattr(strategy, "name", type(strategy).__name__)
        m._explanation = ["no trap has offloadable tensors: everything stays resident"]
    layouts = []
    for label in order:
        names = offloaded.get(label)
        if not names:
            continue
        packed_names, layout = inputs.whole.get(label, ((), None))
        if names == packed_names:  # the whole trap streams: its block was packed ahead (prepare_switch)
            layouts.append(BlockLayout(len(layouts), label, layout.nbytes, layout.tensors))
        else:
            layouts.append(pack_block(len(layouts), label, [_layout_entry(tensors[n].tensor, n) for n in names]))
    if can_defer(m, layouts):  # every streamed weight is still on the device: run resident, build behind it
        defer_inference(m, layouts, list(m._sequence), num_slots)
    else:
        build_inference(m, layouts, list(m._sequence), num_slots)
    if logger.isEnabledFor(logging.INFO):  # one check instead of one disabled logging call per line
        for line in m._explanation:
            logger.info("manager %r: %s", m.name, line)


def _trap_stream_cost(compute_s: float, host: Sequence[float] | None, calls: int) -> float:
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


def _resolve_budget(m) -> int | None:
    if m._budget_override is not None:
        return m._budget_override
    fraction = m._config().max_gpu_mem_fraction
    if fraction is None:
        return None
    from flextensor.profiling import device_memory
    from flextensor.strategies import resolve_budget

    total, free = device_memory(m._device)
    held = sum(tensor_nbytes(e.tensor) for e in m._tensors.values() if e.tensor.device == m._device)
    if m._device.type == "cpu":
        held = 0  # host RAM is not "held" by moving tensors; the CPU device is only a stand-in
    budget, warning = resolve_budget(fraction, total, min(total, free + held))
    if warning:
        logger.warning("manager %r: %s", m.name, warning)
    return budget


def _log_diagnostics(m, plan: Any, costs: Sequence[Any], transfer: Any) -> None:
    from flextensor.diagnostics import format_block_assignment, format_candidates, format_transfer_stats, format_trap_durations

    logger.info("%s", format_transfer_stats(m._samples, transfer))
    logger.info("%s", format_trap_durations({label: m._durations.get(label, []) for label in m._traps}))
    logger.log(NOTICE, "%s", format_block_assignment(plan, costs))
    logger.info("%s", format_candidates(plan))


def _lookup_weight(m, name: str, weights: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    entry = m._tensors[name]
    if weights is not None:
        for key in (name, *entry.aliases):
            if key in weights:
                value = weights[key]
                if value.dtype != entry.tensor.dtype or tuple(value.shape) != tuple(entry.tensor.shape):
                    raise ValueError(
                        f"weight {key!r} has dtype {value.dtype} shape {tuple(value.shape)}, but the model "
                        f"expects {entry.tensor.dtype} {tuple(entry.tensor.shape)}"
                    )
                return value
    raise ValueError(
        f"tensor {name!r} is on the meta device and no weight for it was supplied; pass weights={{name: tensor}} "
        "(e.g. safetensors.torch.load_file(...)) or materialize the model first"
    )


def build_inference(
    m: "OffloadManager",
    layouts: list[BlockLayout],
    schedule: list[str],
    num_slots: int,
    host_blocks: Sequence[torch.Tensor] | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    block_names: Sequence[str] | None = None,
    host_block_gate: Callable[[int], None] | None = None,
) -> None:
    cfg = m._config()
    _settle_warmup(m, {p.name for layout in layouts for p in layout.tensors})
    if host_blocks is None and layouts:
        m._provider = make_provider(cfg, m._device, shm_owner=_ensure_shm_owner(m))
        m._provider.reserve([layout.nbytes for layout in layouts])
    blocks: list[HostBlock] = []
    m._host_blocks = blocks  # filled as we go: a failure part-way leaves teardown every block a tensor points at
    progress = FillProgress(m.name, sum(p.nbytes for layout in layouts for p in layout.tensors))
    for layout in layouts:
        if host_blocks is not None:
            name = block_names[layout.index] if block_names else ""
            block = HostBlock(host_blocks[layout.index], name=name, prefilled=True)
        else:
            assert m._provider is not None
            block = m._provider.allocate(layout.index, layout.nbytes)
        blocks.append(block)
        for placement, view in zip(layout.tensors, block_views(block.tensor, layout.tensors)):
            tensor = m._tensors[placement.name].tensor
            if not block.prefilled:
                source = _lookup_weight(m, placement.name, weights) if tensor.is_meta else tensor.data
                view.copy_(source)
                progress.add(placement.nbytes)
            assign_data(tensor, view)
            m._placement[placement.name] = (layout.index, placement)
        m._staging.release(p.name for p in layout.tensors)  # this block is filled: its sources may go
    progress.finish()
    if m._provider is not None:
        m._provider.finish()  # e.g. host_register pins the filled (populated) arenas now
    for name, entry in m._tensors.items():
        if name in m._placement:
            continue
        if entry.tensor.is_meta:
            assign_data(entry.tensor, _lookup_weight(m, name, weights).to(m._device))
        else:
            m._to_device(entry)
    start_loader(m, layouts, blocks, schedule, num_slots, host_block_gate)


def start_loader(m: "OffloadManager", layouts: list[BlockLayout], blocks: list[HostBlock], schedule: list[str],
                 num_slots: int, host_block_gate: Callable[[int], None] | None = None) -> None:
    """The last step of every INFERENCE build: host blocks in place, tensors pointed at them; create the loader."""
    cfg = m._config()
    m._layouts = layouts
    m._block_of = {layout.label: layout.index for layout in layouts}
    m._host_blocks = blocks
    m._staging.release_all()
    loader_schedule = [m._block_of[label] for label in schedule if label in m._block_of]
    missing = [layout.label for layout in layouts if layout.index not in loader_schedule]
    if missing:
        raise ValueError(f"offloaded trap(s) {missing} never appear in the trap schedule {schedule}")
    m._loader = BlockLoader(
        device=m._device,
        layouts=layouts,
        host_blocks=[b.tensor for b in blocks],
        params=[[m._tensors[p.name].tensor for p in layout.tensors] for layout in layouts],
        schedule=loader_schedule,
        num_slots=num_slots,
        per_tensor=cfg.transfer_mode == "strategy",
        timing=m._timing,
        host_block_gate=host_block_gate,
    )
    m._sequence = list(schedule)
    from flextensor.phases import Phase

    m._phase = Phase.INFERENCE
    bypass_resident_traps(m, set(m._block_of))


def bypass_resident_traps(m: "OffloadManager", streamed: set[str]) -> None:
    """INFERENCE: module traps outside ``streamed`` call their forward directly (``Trap.bypass``), unless offload
    timing is on (it times every trap call). Traps not installed yet (adoption installs them after the build)
    are left alone; adoption calls this again once they are."""
    if m._timing is not None:
        return
    for label, trap in m._traps.items():
        if trap.kind == "module" and label not in streamed:
            trap.bypass()


def _settle_warmup(m: "OffloadManager", placed: set[str]) -> None:
    """End of a resident warm-up, before any host or device block exists.

    Tensors packed into host blocks get their host data back (their blocks are filled from it) and their
    warm-up device copies are freed now, so device memory never holds both the warm-up copies and the rotating
    device blocks; the other kept tensors stay resident and keep their warm-up copy (no second copy). The freed
    copies are handed back to the driver (``empty_cache``) once: they can be GiBs that other processes, or this
    device's free-memory readings, should see again.
    """
    m._warm.unload()
    freed = m._warm.restore([m._tensors[n].tensor for n in sorted(placed)])
    debug = logger.isEnabledFor(logging.DEBUG)
    kept = m._warm.commit(count=debug)
    if freed and m._device.type == "cuda":
        torch.cuda.empty_cache()
    if debug and (freed or kept):
        logger.debug("manager %r: warm-up copies freed: %d bytes (offloaded); kept as resident: %d bytes", m.name,
                     freed, kept)


def _ensure_shm_owner(m) -> Any:
    cfg = m._config()
    if not cfg.shm_enabled or m._shm_owner is not None:
        return m._shm_owner
    # Lower-level path (spec): shm_enabled + shm_namespace, the caller owns coordination. Join the manager's
    # namespace so blocks are journaled and cleaned up by the last participant.
    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.names import manager_namespace

    timeout = cfg.shm_wait_timeout or None
    assert cfg.shm_namespace is not None
    m._shm_coordinator = ShmCoordinator(manager_namespace(cfg.shm_namespace, m.name), timeout=timeout)
    m._shm_owner = m._shm_coordinator.memory_owner
    return m._shm_owner
