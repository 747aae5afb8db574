"""Data types of the offload planner and the pipeline cost simulator every strategy is judged by.

Pure Python on purpose: planning happens once, after PROFILING, from numbers the engine measured (per-trap
compute seconds, a host-to-device transfer curve, tensor sizes). Keeping it free of torch makes every strategy
testable on synthetic inputs and lets a profile be re-planned in a process that never touched a GPU.

The execution model (shared by the simulator and by the strategies' transfer windows)
-------------------------------------------------------------------------------------
Traps run one after the other on a *compute stream*. A trap whose tensors are (partly) offloaded gets its
offloaded tensors packed into one host block; one copy per trap moves that block into one of ``num_blocks``
rotating device blocks (slot ``j mod num_blocks`` for the ``j``-th offloaded trap in execution order) on a
single *copy stream*. Hence:

- copy ``j`` starts when copy ``j-1`` finished (one copy stream) and when the trap that used the same slot
  before (offloaded trap ``j - num_blocks``) finished computing (a block is not overwritten before its last
  reader finished); the first ``num_blocks`` copies may start at time 0;
- trap ``i`` starts computing when trap ``i-1`` finished and, if offloaded, when its copy finished;
- an offloaded trap also costs its ``TrapCost.stream_cost_s`` (the loader's own work at a streamed trap that
  the device does not hide, see there) on the compute path;
- the estimated overhead is ``makespan - sum(compute)``: the time the compute stream waited for copies, plus
  those per-trap costs.

``transfer_budget_scale`` (``PlanInput.scale``) is applied as "each second of compute hides ``scale`` seconds
of copy": copy durations are divided by ``scale`` in the simulator, and strategies size their windows as
``scale * compute``. Both views agree, so a plan a strategy calls "hidden" simulates to no waiting for copies
(its overhead is then the ``stream_cost_s`` of the traps it streams, 0 when they are zero).

The model covers one forward pass starting with an idle copy stream, so the first offloaded trap's copy is
exposed unless earlier traps compute while it runs (an engine that prefetches the next pass's first block at
the end of a pass does better than estimated: the estimate is conservative there).

The device arena (``PlanInput.arena``: ``transfer_mode="raw_block_transfer"``)
------------------------------------------------------------------------------
There the rotating blocks are byte ranges of one device arena, each sized to its block, and ``num_blocks``
counts the consecutive streamed calls the arena holds at once: it takes the largest total of that many
consecutive streamed calls (``flextensor.planning.arena_model.window_bytes``), not ``num_blocks`` times the
largest block, and a copy waits for the traps that last used the bytes it overwrites rather than for the trap
``num_blocks`` before it (``ArenaTrace``). ``rotating_bytes`` gives either layout's device bytes and
``simulate_bytes`` either pipeline. The arena has no slots to count, so ``min_blocks`` does not bound it: a
budget search may go down to two blocks (``PlanInput.fewest_blocks``).

A small slot (``flextensor.planning.slot_model``)
-------------------------------------------------
A slot plan may make its last slot smaller than the others, sized to a partly streamed trap: blocks go to the
least recently used slot that holds them, and a copy waits for its slot's previous entry (``SlotTrace``).
``rotating_bytes`` and ``simulate_bytes`` take the slot's bytes as ``small_slot``.

Cost of a block copy: ``TransferModel.seconds(n) = latency_s + n / bandwidth`` (one latency per trap, since a
trap's offloaded tensors travel as one packed block).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from flextensor.planning.arena_model import ArenaMap, ArenaTrace, window_bytes
from flextensor.planning.slot_model import (PipelineTrace, SlotRing, SlotTrace, effective_blocks, slot_sizes,
                                            small_slot_used)
from flextensor.planning.transfer_model import TransferModel

MIB = 1 << 20

__all__ = [
    "MIB",
    "CandidateSummary",
    "PipelineTrace",
    "Plan",
    "PlanInput",
    "TensorCost",
    "TransferModel",
    "TrapCost",
    "effective_blocks",
    "make_plan",
    "peak_device_bytes",
    "plan_from_masks",
    "plan_blocks",
    "plan_small_slot",
    "rotating_bytes",
    "simulate_bytes",
    "simulation",
    "simulate_overhead",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TensorCost:
    """One offloadable tensor: its (unique) name and the bytes it occupies in a packed block."""

    name: str
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorCost.name must be a non-empty str, got {self.name!r}")
        if not _is_int(self.nbytes) or self.nbytes < 0:
            raise ValueError(f"TensorCost {self.name!r}: nbytes must be an int >= 0, got {self.nbytes!r}")


@dataclass(frozen=True)
class TrapCost:
    """One trap in execution order: measured compute seconds and the tensors it may offload.

    A trap without tensors is a *gap trap*: it offloads nothing but its compute still widens the transfer
    window of the next offloaded trap.

    ``stream_cost_s``: what streaming this trap costs a pass beyond its copy, whatever its bytes: the loader's
    work at its entry and exit (issuing the copy, ordering two streams with events, pointing the parameters at
    the slot) that queued device work does not hide. A launch-bound trap pays all of it (the device waits for
    the host anyway); one whose device time exceeds its host time hides the host's part in the difference (the
    device's own part stays). Without it, a plan streaming a few KiB from each of 15 traps of a launch-bound
    pass simulated as free and ran far slower than the resident pass (``docs/benchmarks.md``, "What a streamed
    trap costs"). The engine derives it per trap
    (``flextensor.engine.switch``); 0 keeps the pure transfer model.
    """

    label: str
    compute_s: float
    tensors: tuple[TensorCost, ...] = ()
    stream_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"TrapCost.label must be a non-empty str, got {self.label!r}")
        object.__setattr__(self, "compute_s", self._seconds("compute_s", self.compute_s))
        object.__setattr__(self, "stream_cost_s", self._seconds("stream_cost_s", self.stream_cost_s))
        tensors = tuple(self.tensors)  # accept lists (the older spelling)
        for tensor in tensors:
            if not isinstance(tensor, TensorCost):
                raise ValueError(f"trap {self.label!r}: tensors must be TensorCost objects, got {tensor!r}")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"trap {self.label!r} lists tensor(s) {dup} more than once")
        object.__setattr__(self, "tensors", tensors)

    def _seconds(self, field: str, value: object) -> float:
        seconds = float(value)  # type: ignore[arg-type]
        if not math.isfinite(seconds) or seconds < 0.0:
            raise ValueError(f"trap {self.label!r}: {field} must be a finite float >= 0, got {value!r}")
        return seconds

    def timed(self, compute_s: float, stream_cost_s: float = 0.0) -> "TrapCost":
        """This trap with other timings; only they are checked (its label and tensors were, when it was made).

        Why: the switch to INFERENCE makes one per trap inside the last PROFILING pass, where every microsecond
        is the profile phase's; the tensors are known from the first counted pass on, so the engine validates
        them there (``flextensor.engine.switch.prepare_switch``) and only the timings at the switch."""
        trap = object.__new__(TrapCost)
        trap.__dict__.update(self.__dict__)  # the fields, and total_bytes when computed (it depends on tensors)
        trap.__dict__["compute_s"] = self._seconds("compute_s", compute_s)
        trap.__dict__["stream_cost_s"] = self._seconds("stream_cost_s", stream_cost_s)
        return trap

    @cached_property
    def total_bytes(self) -> int:
        # Cached: the strategies ask for it per trap many times while planning (the fields are frozen).
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class PlanInput:
    """Everything a strategy needs. ``budget_bytes=None`` is latency mode (no memory cap).

    ``arena``: the rotating blocks are ranges of one device arena (``transfer_mode="raw_block_transfer"``, see
    the module docstring) instead of ``num_blocks`` equal slots. ``calls``: the trap indices in the order one
    pass calls them, when a trap is called more than once (None: each trap once, in order); the arena's size
    depends on consecutive calls, so it is counted over these.
    """

    traps: tuple[TrapCost, ...]
    transfer: TransferModel
    budget_bytes: int | None
    num_blocks: int
    min_blocks: int = 2
    scale: float = 1.0
    fixed_resident_bytes: int = 0  # bytes on the device regardless of the plan (non-offloadable tensors)
    arena: bool = False
    calls: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        traps = tuple(self.traps)
        object.__setattr__(self, "traps", traps)
        object.__setattr__(self, "arena", bool(self.arena))
        if self.calls is not None:
            calls = tuple(self.calls)
            if not calls or any(not _is_int(i) or not 0 <= i < len(traps) for i in calls):
                raise ValueError(
                    f"PlanInput.calls must be None or a non-empty sequence of trap indices 0..{len(traps) - 1}, "
                    f"got {self.calls!r}"
                )
            object.__setattr__(self, "calls", calls)
        if not isinstance(self.transfer, TransferModel):
            raise ValueError(f"PlanInput.transfer must be a TransferModel, got {self.transfer!r}")
        if self.budget_bytes is not None and (not _is_int(self.budget_bytes) or self.budget_bytes < 0):
            raise ValueError(f"PlanInput.budget_bytes must be None (latency mode) or an int >= 0, got {self.budget_bytes!r}")
        if not _is_int(self.min_blocks) or self.min_blocks < 2:
            raise ValueError(f"PlanInput.min_blocks must be an int >= 2 (pipelining needs two blocks), got {self.min_blocks!r}")
        if not _is_int(self.num_blocks) or self.num_blocks < self.min_blocks:
            raise ValueError(
                f"PlanInput.num_blocks must be an int >= min_blocks={self.min_blocks}, got {self.num_blocks!r}"
            )
        scale = float(self.scale)
        if not math.isfinite(scale) or scale <= 0.0:
            raise ValueError(f"PlanInput.scale (transfer_budget_scale) must be finite and > 0, got {self.scale!r}")
        object.__setattr__(self, "scale", scale)
        if not _is_int(self.fixed_resident_bytes) or self.fixed_resident_bytes < 0:
            raise ValueError(f"PlanInput.fixed_resident_bytes must be an int >= 0, got {self.fixed_resident_bytes!r}")
        labels: set[str] = set()
        owner: dict[str, str] = {}
        for trap in traps:
            if not isinstance(trap, TrapCost):
                raise ValueError(f"PlanInput.traps must hold TrapCost objects, got {trap!r}")
            if trap.label in labels:
                raise ValueError(f"PlanInput: trap label {trap.label!r} appears twice; labels must be unique")
            labels.add(trap.label)
            for tensor in trap.tensors:
                if tensor.name in owner:
                    raise ValueError(
                        f"PlanInput: tensor {tensor.name!r} is offloadable by both trap {owner[tensor.name]!r} and "
                        f"trap {trap.label!r}; a tensor used by several traps must stay resident (count it in "
                        "fixed_resident_bytes)"
                    )
                owner[tensor.name] = trap.label

    @cached_property
    def index(self) -> dict[str, int]:
        """Trap label -> position in execution order."""
        return {trap.label: i for i, trap in enumerate(self.traps)}

    @cached_property
    def prefix_compute(self) -> tuple[float, ...]:
        """``prefix_compute[i]`` = compute seconds of traps ``0..i-1`` (length ``len(traps) + 1``)."""
        acc, out = 0.0, [0.0]
        for trap in self.traps:
            acc += trap.compute_s
            out.append(acc)
        return tuple(out)

    @property
    def total_compute_s(self) -> float:
        return self.prefix_compute[-1]

    @cached_property
    def compute(self) -> tuple[float, ...]:
        """Per-trap compute seconds, in execution order."""
        return tuple(trap.compute_s for trap in self.traps)

    @cached_property
    def stream_costs(self) -> tuple[float, ...]:
        """Per-trap ``stream_cost_s``, in execution order."""
        return tuple(trap.stream_cost_s for trap in self.traps)

    @cached_property
    def offloadable_bytes(self) -> int:
        return sum(trap.total_bytes for trap in self.traps)

    @cached_property
    def _sizes(self) -> tuple[dict[str, int], ...]:
        """Per trap, tensor name -> bytes: built once, not once per ``make_plan`` / ``simulate_overhead`` call."""
        return tuple({t.name: t.nbytes for t in trap.tensors} for trap in self.traps)

    @cached_property
    def call_order(self) -> tuple[int, ...]:
        """Trap indices in the order one pass calls them (``calls``, or each trap once)."""
        return self.calls if self.calls is not None else tuple(range(len(self.traps)))

    @cached_property
    def calls_per_trap(self) -> tuple[int, ...]:
        """How many times one pass calls each trap."""
        counts = [0] * len(self.traps)
        for i in self.call_order:
            counts[i] += 1
        return tuple(counts)

    def streamed_calls(self, per_trap: Sequence[int]) -> list[int]:
        """Offloaded bytes of each streamed call of one pass, in call order: the loader's schedule of blocks."""
        return [per_trap[i] for i in self.call_order if per_trap[i] > 0]

    @property
    def fewest_blocks(self) -> int:
        """The fewest blocks a plan may use: ``min_blocks`` slots, or an arena of two consecutive blocks (the
        least a pipeline needs; ``min_blocks`` counts slots, which the arena has none of)."""
        return 2 if self.arena else self.min_blocks

    def window_capacity(self, start: int, trap: int) -> int:
        """Bytes trap ``trap``'s copy may carry while traps ``start..trap-1`` compute (scaled window)."""
        seconds = self.scale * (self.prefix_compute[trap] - self.prefix_compute[start])
        return self.transfer.bytes_within(seconds)


@dataclass(frozen=True)
class CandidateSummary:
    """One candidate an AdaptiveStrategy evaluated (for ``format_candidates`` and the explanation)."""

    strategy: str
    estimated_overhead_s: float
    offloaded_bytes: int
    peak_device_bytes: int
    fits_budget: bool
    chosen: bool = False


@dataclass
class Plan:
    """A strategy's decision. Traps missing from ``offloaded`` keep every tensor resident.

    ``offloaded`` is ordered like the traps (execution order), so the ``j``-th key uses device block slot
    ``j % num_blocks`` (see ``block_slots``; with a small slot, ``slot_model``'s placement). ``num_blocks`` is the number of device blocks the loader should
    allocate: never more than there are offloaded traps (extra blocks would never be used), never below the
    input's ``min_blocks`` (with nothing offloaded the loader allocates none). With an arena
    (``PlanInput.arena``) it is the number of consecutive streamed calls the arena holds (at least two, at most
    the streamed calls of a pass).

    ``rotating_bytes``: the device bytes of the rotating blocks or of the arena, the part of
    ``peak_device_bytes`` the loader allocates (``peak = fixed + resident + rotating``).
    """

    strategy: str
    offloaded: dict[str, tuple[str, ...]]
    num_blocks: int
    block_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    peak_device_bytes: int
    estimated_overhead_s: float
    fits_budget: bool
    explanation: list[str] = field(default_factory=list)
    candidates: list[CandidateSummary] = field(default_factory=list)  # filled by AdaptiveStrategy
    rotating_bytes: int = 0
    arena_offsets: dict[str, int] = field(default_factory=dict)  # arena plans: first-pass offset per trap
    small_slot_bytes: int = 0  # slot plans: bytes of the small last slot, 0 for slots of one size (slot_model)
    slot_of: dict[str, int] = field(default_factory=dict)  # plans with a small slot: first-pass slot per trap

    def block_slots(self) -> dict[str, int]:
        """Trap label -> device block slot, for every offloaded trap in a first pass; for an arena plan the
        byte offset of the trap's first call in the arena (later passes may place it elsewhere: ``arena_model``)."""
        if self.arena_offsets:
            return dict(self.arena_offsets)
        if self.slot_of:
            return dict(self.slot_of)
        return {label: j % self.num_blocks for j, label in enumerate(self.offloaded)}


def _per_trap_bytes(inp: PlanInput, offloaded: Mapping[str, Iterable[str]]) -> list[int]:
    """Offloaded bytes per trap (execution order); validates labels and names."""
    out = [0] * len(inp.traps)
    for label, names in offloaded.items():
        i = inp.index.get(label)
        if i is None:
            raise ValueError(f"offload selection names trap {label!r}, which is not in the plan input")
        sizes = inp._sizes[i]
        seen: set[str] = set()
        for name in names:
            if name not in sizes:
                raise ValueError(f"offload selection for trap {label!r} names tensor {name!r}, which that trap does not hold")
            if name not in seen:
                seen.add(name)
                out[i] += sizes[name]
    return out


def plan_blocks(inp: PlanInput, requested: int, per_trap: Sequence[int]) -> int:
    """The block count a plan offloading ``per_trap`` uses: ``effective_blocks`` over its offloaded traps
    (slots), or over its streamed calls with a floor of two (arena: ``PlanInput.fewest_blocks``)."""
    if inp.arena:
        return effective_blocks(requested, 2, len(inp.streamed_calls(per_trap)))
    return effective_blocks(requested, inp.min_blocks, sum(1 for nbytes in per_trap if nbytes > 0))


def plan_small_slot(inp: PlanInput, per_trap: Sequence[int], num_blocks: int, small_slot: int) -> int:
    """The small slot (``flextensor.planning.slot_model``) a slot plan offloading ``per_trap`` through
    ``num_blocks`` slots really has: 0 for an arena, for too few slots, when it would hold the largest block, or
    when it holds no streamed block at all (a slot nothing uses would only hide a lower block count)."""
    return 0 if inp.arena else small_slot_used(per_trap, num_blocks, small_slot)


def rotating_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int, small_slot: int = 0) -> int:
    """Device bytes of the rotating blocks a plan offloading ``per_trap`` needs (none when nothing streams):
    ``effective_blocks`` slots as large as the largest trap's block (the last one ``small_slot`` bytes when it
    applies: ``slot_model``), or the arena holding any ``num_blocks`` consecutive streamed calls
    (``arena_model.window_bytes``), the very bytes the loader allocates."""
    if inp.arena:
        return window_bytes(inp.streamed_calls(per_trap), num_blocks)
    offloaded = sum(1 for nbytes in per_trap if nbytes > 0)
    if not offloaded:
        return 0
    slots = effective_blocks(num_blocks, inp.min_blocks, offloaded)
    return sum(slot_sizes(max(per_trap), slots, plan_small_slot(inp, per_trap, slots, small_slot)))


def peak_device_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int, small_slot: int = 0) -> int:
    """Device bytes a plan needs at its peak, from its offloaded bytes per trap: the fixed tensors, what stays
    resident, and the rotating blocks (``rotating_bytes``). Every plan's ``peak_device_bytes`` and the budget
    searches use it."""
    return (inp.fixed_resident_bytes + inp.offloadable_bytes - sum(per_trap)
            + rotating_bytes(inp, per_trap, num_blocks, small_slot))


def simulation(inp: PlanInput, per_trap: Sequence[int], num_blocks: int,
               small_slot: int = 0) -> PipelineTrace | ArenaTrace | SlotTrace:
    """The simulator run of the input's layout: ``PipelineTrace`` (slots of one size), ``SlotTrace`` (with a
    small slot) or ``ArenaTrace`` (arena); each has ``overhead`` and ``with_change``."""
    if inp.arena:
        return ArenaTrace(inp, per_trap, num_blocks)
    small = plan_small_slot(inp, per_trap, num_blocks, small_slot)
    if small:
        return SlotTrace(inp, per_trap, num_blocks, small)
    return PipelineTrace(inp, per_trap, num_blocks)


def simulate_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int, small_slot: int = 0) -> float:
    """The simulator on per-trap offloaded byte counts (see the module docstring for the model)."""
    return simulation(inp, per_trap, num_blocks, small_slot).overhead


def simulate_overhead(inp: PlanInput, offloaded: Mapping[str, Iterable[str]], num_blocks: int) -> float:
    """Estimated seconds a pass takes longer when ``offloaded`` is streamed through ``num_blocks`` rotating device
    blocks (``makespan - sum(compute)``: waits for copies plus the streamed traps' ``stream_cost_s``)."""
    return simulate_bytes(inp, _per_trap_bytes(inp, offloaded), num_blocks)


def make_plan(
    inp: PlanInput,
    strategy: str,
    selection: Mapping[str, Iterable[str]],
    num_blocks: int,
    explanation: Iterable[str] = (),
    small_slot: int = 0,
) -> Plan:
    """Build a consistent Plan (bytes, peak, simulated overhead, budget check) from a tensor selection, streamed
    through ``num_blocks`` slots (the last one ``small_slot`` bytes where that applies: ``slot_model``).

    Every plan is finished by ``_finish_plan`` (the strategies, which select by per-trap bitmasks over the
    traps' own tensors, reach it through :func:`plan_from_masks` without the validation here), so the numbers
    of competing plans are computed the same way. Tensor names are put in the trap's own order (the
    order the engine packs them), without zero-byte tensors, and traps in execution order.
    """
    if num_blocks < 1:
        raise ValueError(f"make_plan: num_blocks must be >= 1, got {num_blocks}")
    per_trap = _per_trap_bytes(inp, selection)
    offloaded: dict[str, tuple[str, ...]] = {}
    for i, trap in enumerate(inp.traps):
        chosen = set(selection.get(trap.label, ()))
        names = tuple(t.name for t in trap.tensors if t.name in chosen and t.nbytes > 0)
        if names:
            offloaded[trap.label] = names
        else:
            per_trap[i] = 0
    return _finish_plan(inp, strategy, offloaded, per_trap, num_blocks, explanation, small_slot)


def plan_from_masks(inp: PlanInput, strategy: str, masks: Sequence[int], num_blocks: int,
                    explanation: Iterable[str] = (), small_slot: int = 0) -> Plan:
    """``make_plan`` for a selection given as one bitmask per trap (bit ``k``: the trap's tensor ``k``).

    The strategies search over such masks. Names taken from the traps themselves need none of make_plan's
    validation and reordering: the selection is built directly in the form it normalises to (trap order, no
    zero-byte tensors, no trap without a name).
    """
    offloaded: dict[str, tuple[str, ...]] = {}
    per_trap = [0] * len(inp.traps)
    for i, (trap, mask) in enumerate(zip(inp.traps, masks)):
        if not mask:
            continue
        names, nbytes = [], 0
        for k, tensor in enumerate(trap.tensors):
            if mask >> k & 1 and tensor.nbytes > 0:
                names.append(tensor.name)
                nbytes += tensor.nbytes
        if names:
            offloaded[trap.label] = tuple(names)
            per_trap[i] = nbytes
    return _finish_plan(inp, strategy, offloaded, per_trap, num_blocks, explanation, small_slot)


def _finish_plan(
    inp: PlanInput,
    strategy: str,
    offloaded: dict[str, tuple[str, ...]],
    per_trap: list[int],
    num_blocks: int,
    explanation: Iterable[str] = (),
    small_slot: int = 0,
) -> Plan:
    """``make_plan`` for a selection already in its normal form, which it neither validates nor reorders:
    ``offloaded`` ordered like the traps, each trap's names in the trap's order and of non-zero size,
    ``per_trap`` their bytes per trap (0 for traps not in ``offloaded``). ``small_slot``: the bytes of a
    small last slot (``slot_model``; kept only where it applies)."""
    blocks = plan_blocks(inp, num_blocks, per_trap)
    small = plan_small_slot(inp, per_trap, blocks, small_slot)
    block_bytes = max(per_trap, default=0)
    offloaded_bytes = sum(per_trap)
    resident = inp.offloadable_bytes - offloaded_bytes
    rotating = rotating_bytes(inp, per_trap, blocks, small)
    peak = inp.fixed_resident_bytes + resident + rotating
    overhead = simulate_bytes(inp, per_trap, blocks, small)
    fits = inp.budget_bytes is None or peak <= inp.budget_bytes
    offsets: dict[str, int] = {}
    slot_of: dict[str, int] = {}
    if small:
        slots: SlotRing[None] = SlotRing(slot_sizes(block_bytes, blocks, small))
        slot_of = {inp.traps[i].label: slots.place(nbytes, None)[0] for i, nbytes in enumerate(per_trap) if nbytes}
    if inp.arena and rotating:
        ring: ArenaMap[None] = ArenaMap(rotating)
        for i in inp.call_order:
            if per_trap[i] > 0:
                offsets.setdefault(inp.traps[i].label, ring.place(per_trap[i]))
    through = (f"a device arena of {_mib(rotating)} holding any {blocks} consecutive blocks (largest "
               f"{_mib(block_bytes)})" if inp.arena
               else f"{blocks} device blocks of {_mib(block_bytes)}, the last one {_mib(small)}" if small
               else f"{blocks} device blocks of {_mib(block_bytes)}")
    lines = list(explanation)
    lines.append(
        f"{strategy}: {len(offloaded)} of {len(inp.traps)} traps offload {offloaded_bytes} B "
        f"({_mib(offloaded_bytes)}) through {through}; "
        f"estimated overhead {overhead * 1e3:.3f} ms over {inp.total_compute_s * 1e3:.3f} ms of compute"
        + (f" (of which {_streamed_traps_cost(inp, per_trap) * 1e3:.3f} ms the streamed traps' own cost)"
           if any(inp.stream_costs) and offloaded else "")
    )
    budget = "none (latency mode)" if inp.budget_bytes is None else f"{_mib(inp.budget_bytes)}"
    lines.append(
        f"peak device bytes {_mib(peak)} = fixed {_mib(inp.fixed_resident_bytes)} + resident {_mib(resident)}"
        f" + {'arena' if inp.arena else 'blocks'} {_mib(rotating)}; budget {budget}: "
        f"{'fits' if fits else 'does NOT fit'}"
    )
    return Plan(
        strategy=strategy,
        offloaded=offloaded,
        num_blocks=blocks,
        block_bytes=block_bytes,
        resident_bytes=resident,
        offloaded_bytes=offloaded_bytes,
        peak_device_bytes=peak,
        estimated_overhead_s=overhead,
        fits_budget=fits,
        explanation=lines,
        rotating_bytes=rotating,
        arena_offsets=offsets,
        small_slot_bytes=small,
        slot_of=slot_of,
    )


def _streamed_traps_cost(inp: PlanInput, per_trap: Sequence[int]) -> float:
    return sum(cost for cost, nbytes in zip(inp.stream_costs, per_trap) if nbytes > 0)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f} MiB"
