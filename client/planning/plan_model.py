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

Cost of a block copy: ``TransferModel.seconds(n) = latency_s + n / bandwidth`` (one latency per trap, since a
trap's offloaded tensors travel as one packed block).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from flextensor.planning.arena_model import ArenaMap, ArenaTrace, window_bytes

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
    "plan_blocks",
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
    pass simulated as free and ran at 1.42x the resident pass (H200, 2026-11-30). The engine derives it per trap
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
class TransferModel:
    """Affine host-to-device copy cost: ``seconds(n) = latency_s + n / bandwidth_bytes_per_s`` (0 for n <= 0)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        bw = float(self.bandwidth_bytes_per_s)
        lat = float(self.latency_s)
        if not math.isfinite(bw) or bw <= 0.0:
            raise ValueError(f"TransferModel.bandwidth_bytes_per_s must be finite and > 0, got {bw!r}")
        if not math.isfinite(lat) or lat < 0.0:
            raise ValueError(f"TransferModel.latency_s must be finite and >= 0, got {lat!r}")
        object.__setattr__(self, "bandwidth_bytes_per_s", bw)
        object.__setattr__(self, "latency_s", lat)

    def seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def bytes_within(self, seconds: float) -> int:
        """The largest block whose copy takes at most ``seconds`` (0 when even the latency does not fit)."""
        if not seconds > self.latency_s:
            return 0
        n = int(math.floor((seconds - self.latency_s) * self.bandwidth_bytes_per_s))
        while n > 0 and self.seconds(n) > seconds:  # float rounding: never report a block that overshoots
            n -= 1
        return max(n, 0)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> TransferModel:
        """Least-squares fit of ``seconds = latency + bytes / bandwidth`` to measured ``(bytes, seconds)`` pairs.

        Robust on purpose, because the engine may measure as little as one tensor: one sample (or samples of a
        single size) gives a zero-latency line through the origin; a negative fitted latency (noise on small
        copies) is clamped to 0 by refitting through the origin.
        """
        points = [(int(b), float(s)) for b, s in samples]
        if not points:
            raise ValueError("TransferModel.fit needs at least one (bytes, seconds) sample; measure a transfer first")
        for b, s in points:
            if b <= 0 or not math.isfinite(s) or s < 0.0:
                raise ValueError(
                    f"TransferModel.fit: bad sample (bytes={b}, seconds={s}); bytes must be > 0 and seconds a "
                    "finite value >= 0"
                )
        n = len(points)
        mean_x = sum(b for b, _ in points) / n
        mean_y = sum(s for _, s in points) / n
        sxx = sum((b - mean_x) ** 2 for b, _ in points)
        slope = intercept = None
        if sxx > 0.0:
            slope = sum((b - mean_x) * (s - mean_y) for b, s in points) / sxx
            intercept = mean_y - slope * mean_x
        if slope is None or slope <= 0.0 or intercept is None or intercept < 0.0:
            # Through the origin: minimise sum (s - k b)^2  ->  k = sum(b s) / sum(b^2).
            slope = sum(b * s for b, s in points) / sum(float(b) * b for b, _ in points)
            intercept = 0.0
        if not slope > 0.0:
            raise ValueError("TransferModel.fit: every sample took 0 seconds; the bandwidth cannot be estimated")
        return cls(bandwidth_bytes_per_s=1.0 / slope, latency_s=intercept)


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
    ``j % num_blocks`` (see ``block_slots``). ``num_blocks`` is the number of device blocks the loader should
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

    def block_slots(self) -> dict[str, int]:
        """Trap label -> device block slot, for every offloaded trap; for an arena plan the byte offset of the
        trap's first call in the arena (later passes may place it elsewhere: ``arena_model``)."""
        if self.arena_offsets:
            return dict(self.arena_offsets)
        return {label: j % self.num_blocks for j, label in enumerate(self.offloaded)}


def effective_blocks(requested: int, min_blocks: int, offloaded_traps: int) -> int:
    """Blocks worth allocating: ``requested``, capped at ``max(min_blocks, offloaded_traps)``.

    With at least as many blocks as offloaded traps no slot is ever reused, so more blocks change nothing in
    the pipeline but cost device memory.
    """
    return min(requested, max(min_blocks, offloaded_traps))


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


class PipelineTrace:
    """One run of the simulator that remembers its state before every trap.

    Searches (BudgetFill's polish) try many variants that differ from a base selection in one trap only;
    ``with_change(i, nbytes)`` re-simulates from trap ``i`` instead of from time 0. The simulation itself is the
    model of the module docstring: one copy stream, ``num_blocks`` rotating slots, one compute stream.
    """

    def __init__(self, inp: PlanInput, per_trap: Sequence[int], num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"simulate_overhead: num_blocks must be >= 1, got {num_blocks}")
        self.inp, self.per_trap, self.num_blocks = inp, list(per_trap), num_blocks
        self.used_until: list[float] = []  # compute end of the j-th offloaded trap (releases its block slot)
        self.before: list[tuple[float, int, float]] = []  # per trap: (clock, copies so far, last copy end)
        self.overhead = self._run(0, (0.0, 0, 0.0), self.per_trap, self.used_until, record=True)

    def with_change(self, trap: int, nbytes: int) -> float:
        """Overhead if trap ``trap`` carried ``nbytes`` instead (same block count)."""
        per = self.per_trap
        saved, per[trap] = per[trap], nbytes
        try:
            return self._run(trap, self.before[trap], per, [], record=False)
        finally:
            per[trap] = saved

    def _run(self, first: int, state: tuple[float, int, float], per: Sequence[int], used: list[float],
             record: bool) -> float:
        """Simulate from trap ``first`` in ``state``; see the module docstring for the model.

        Written for speed (BudgetFill's polish runs it thousands of times at the switch to INFERENCE), with the
        very same float operations as the plain model: ``a if not b > a else b`` is what ``max(a, b)`` returns,
        and a copy takes ``(latency + n / bandwidth) / scale`` as ``transfer.seconds(n) / scale`` does (the
        bound method is called instead when a subclass overrides ``seconds``).

        A re-run (``record=False``, from ``with_change``) stops early once it is back in the base run's state
        before some later trap: same clock, copies and last copy end, and the same compute ends for every block
        slot a later copy may still wait for. The traps after it are unchanged, so from there it would repeat
        the base run's operations exactly and end with the base run's overhead, which it returns.
        """
        inp, blocks = self.inp, self.num_blocks
        transfer, scale, compute, cost = inp.transfer, inp.scale, inp.compute, inp.stream_costs
        inline = type(transfer).seconds is TransferModel.seconds
        seconds, latency, bandwidth = transfer.seconds, transfer.latency_s, transfer.bandwidth_bytes_per_s
        clock, copies, last_end = state
        base = copies  # used[k] holds the compute end of offloaded trap base + k (when not recording)
        shared = self.used_until
        before = self.before
        for i in range(first, len(compute)):
            if record:
                before.append((clock, copies, last_end))
            elif i > first:
                b_clock, b_copies, b_last = before[i]
                if (clock == b_clock and copies == b_copies and last_end == b_last
                        and all(used[k - base] == shared[k] for k in range(max(base, copies - blocks), copies))):
                    return self.overhead
            nbytes = per[i]
            if nbytes > 0:
                start = last_end
                if copies >= blocks:
                    k = copies - blocks
                    release = shared[k] if record or k < base else used[k - base]
                    if release > start:
                        start = release
                last_end = start + ((latency + nbytes / bandwidth) if inline else seconds(nbytes)) / scale
                if last_end > clock:
                    clock = last_end
                clock += compute[i] + cost[i]
                copies += 1
                used.append(clock)
            else:
                clock += compute[i]
        overhead = clock - inp.total_compute_s
        # Differences this small are float noise from summing in another order, not waiting.
        return 0.0 if overhead <= 1e-9 * max(inp.total_compute_s, 1e-12) else overhead


def plan_blocks(inp: PlanInput, requested: int, per_trap: Sequence[int]) -> int:
    """The block count a plan offloading ``per_trap`` uses: ``effective_blocks`` over its offloaded traps
    (slots), or over its streamed calls with a floor of two (arena: ``PlanInput.fewest_blocks``)."""
    if inp.arena:
        return effective_blocks(requested, 2, len(inp.streamed_calls(per_trap)))
    return effective_blocks(requested, inp.min_blocks, sum(1 for nbytes in per_trap if nbytes > 0))


def rotating_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int) -> int:
    """Device bytes of the rotating blocks a plan offloading ``per_trap`` needs (none when nothing streams):
    ``effective_blocks`` slots as large as the largest trap's block, or the arena holding any ``num_blocks``
    consecutive streamed calls (``arena_model.window_bytes``), the very bytes the loader allocates."""
    if inp.arena:
        return window_bytes(inp.streamed_calls(per_trap), num_blocks)
    offloaded = sum(1 for nbytes in per_trap if nbytes > 0)
    return effective_blocks(num_blocks, inp.min_blocks, offloaded) * max(per_trap) if offloaded else 0


def peak_device_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int) -> int:
    """Device bytes a plan needs at its peak, from its offloaded bytes per trap: the fixed tensors, what stays
    resident, and the rotating blocks (``rotating_bytes``). Every plan's ``peak_device_bytes`` and the budget
    searches use it."""
    return inp.fixed_resident_bytes + inp.offloadable_bytes - sum(per_trap) + rotating_bytes(inp, per_trap, num_blocks)


def simulation(inp: PlanInput, per_trap: Sequence[int], num_blocks: int) -> PipelineTrace | ArenaTrace:
    """The simulator run of the input's layout: ``PipelineTrace`` (slots) or ``ArenaTrace`` (arena); both have
    ``overhead`` and ``with_change``."""
    if inp.arena:
        return ArenaTrace(inp, per_trap, num_blocks)
    return PipelineTrace(inp, per_trap, num_blocks)


def simulate_bytes(inp: PlanInput, per_trap: Sequence[int], num_blocks: int) -> float:
    """The simulator on per-trap offloaded byte counts (see the module docstring for the model)."""
    return simulation(inp, per_trap, num_blocks).overhead


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
) -> Plan:
    """Build a consistent Plan (bytes, peak, simulated overhead, budget check) from a tensor selection.

    Every plan is finished by ``_finish_plan`` (the strategies, which select by per-trap bitmasks over the
    traps' own tensors, reach it through ``basic_strategies._plan_from_masks`` without the validation here), so
    the numbers of competing plans are computed the same way. Tensor names are put in the trap's own order (the
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
    return _finish_plan(inp, strategy, offloaded, per_trap, num_blocks, explanation)


def _finish_plan(
    inp: PlanInput,
    strategy: str,
    offloaded: dict[str, tuple[str, ...]],
    per_trap: list[int],
    num_blocks: int,
    explanation: Iterable[str] = (),
) -> Plan:
    """``make_plan`` for a selection already in its normal form, which it neither validates nor reorders:
    ``offloaded`` ordered like the traps, each trap's names in the trap's order and of non-zero size,
    ``per_trap`` their bytes per trap (0 for traps not in ``offloaded``)."""
    blocks = plan_blocks(inp, num_blocks, per_trap)
    block_bytes = max(per_trap, default=0)
    offloaded_bytes = sum(per_trap)
    resident = inp.offloadable_bytes - offloaded_bytes
    rotating = rotating_bytes(inp, per_trap, blocks)
    peak = inp.fixed_resident_bytes + resident + rotating
    overhead = simulate_bytes(inp, per_trap, blocks)
    fits = inp.budget_bytes is None or peak <= inp.budget_bytes
    offsets: dict[str, int] = {}
    if inp.arena and rotating:
        ring: ArenaMap[None] = ArenaMap(rotating)
        for i in inp.call_order:
            if per_trap[i] > 0:
                offsets.setdefault(inp.traps[i].label, ring.place(per_trap[i]))
    through = (f"a device arena of {_mib(rotating)} holding any {blocks} consecutive blocks (largest "
               f"{_mib(block_bytes)})" if inp.arena else f"{blocks} device blocks of {_mib(block_bytes)}")
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
    )


def _streamed_traps_cost(inp: PlanInput, per_trap: Sequence[int]) -> float:
    return sum(cost for cost, nbytes in zip(inp.stream_costs, per_trap) if nbytes > 0)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f} MiB"
