"""Device slots of unequal size: one small slot beside the large ones, where each streamed block goes, and the
pipeline that gives (the planner's model of ``flextensor.runtime.loaders.block_loader.BlockLoader`` with ``small_slot``).

Pure Python and shared by the planner and the loader, so the planner's device bytes are the loader's to the
byte and its simulated pipeline places blocks as the loader does.

Why a small slot
----------------
Slots of one size cost ``num_blocks`` times the largest streamed block. Under a memory budget, a trap that
streams only part of its tensors (the rest stays resident) is what makes the budget fit; a slot sized to that
part, instead of to a whole trap, leaves the difference to resident tensors, so fewer bytes stream each pass.
The price is prefetch depth: a block larger than the small slot rotates through the ``num_blocks - 1`` large
slots only, so the planner offers the small slot only with three blocks or more (two large slots still
pipeline), only where some streamed block fits it (a slot nothing uses would be a block count below
``min_blocks`` in disguise: ``small_slot_used``), and keeps it where its simulation says the pass
gets faster.

Placement: least recently used slot that fits
---------------------------------------------
Streamed calls are numbered with an ever-growing *entry* index, as in ``flextensor.runtime.loaders.block_loader``. Entry
``e`` goes to the slot whose last entry is the oldest among the slots large enough for it (a slot never used
counts as oldest; ties go to the lower slot index). Placement depends on the sequence of block sizes alone,
never on timing, so every process that replays a schedule places it the same way. With slots of one size
this is ``e % num_blocks``, the rotation of equal slots.

Ordering: a copy into a slot waits for the slot's previous entry to finish computing. That is enough: traps
compute in entry order, so every earlier reader of the slot finished before the previous entry did.

Resuming a changed run
----------------------
BudgetFill's polish asks "what if trap i carried other bytes?" thousands of times at the switch to INFERENCE,
inside the last PROFILING pass. A trace (:class:`PipelineTrace`, :class:`SlotTrace`) remembers its state before
every trap, so a changed run starts at trap i instead of time 0, and it ends early once its state before a later
trap j is the base run's state there *shifted by a constant* ``d`` (every time in it ``d`` later or earlier, the
counts and placements equal, or numbered one off all along where the change streams one trap more or less). The
simulation only adds durations and takes maxima of times, and both commute with a shift
(``max(a + d, b + d) = max(a, b) + d``), so from j on the changed run is the base run ``d`` later: its overhead
is the base run's final clock ``+ d``. ``d = 0`` is the base run itself. Without the shift a copy
bound pipeline never ends early (a changed copy moves every later time by its difference), and each question
cost a walk to the last trap: planning time grew with the square of the layers. With it, a question walks the
few traps until the pipeline is back in step, so planning a 190-layer model takes about as long per question as
a 22-layer one. The times compared were computed in another order, so they are equal up to rounding:
:data:`SHIFT_TOLERANCE` of the clock's magnitude.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from flextensor.planning.transfer_model import TransferModel

__all__ = ["PipelineTrace", "SlotRing", "SlotTrace", "effective_blocks", "overhead_noise", "slot_sizes",
           "small_slot_for", "small_slot_used"]

Owner = TypeVar("Owner")

#: The fewest slots that may include a small one: two large slots keep the large blocks pipelined.
MIN_SLOTS_WITH_SMALL = 3

#: Relative rounding allowed between a changed run's times and the base run's shifted ones (module docstring,
#: "Resuming a changed run"): the same sums taken in another order differ by a few ulps per trap.
SHIFT_TOLERANCE = 1e-12


def overhead_noise(total_compute_s: float) -> float:
    """Overhead this small is float noise from summing in another order, not waiting: what the simulators round
    to 0 and what the planner's searches count as a tie."""
    return 1e-9 * max(total_compute_s, 1e-12)


def _overhead(clock: float, total_compute_s: float) -> float:
    """A run's overhead from its final clock (0 within :func:`overhead_noise`)."""
    overhead = clock - total_compute_s
    return 0.0 if overhead <= overhead_noise(total_compute_s) else overhead


def _same_shift(d: float, now: float, base: float, tolerance: float) -> bool:
    """Whether time ``now`` is ``base`` shifted by ``d`` (up to ``tolerance``)."""
    return abs(now - base - d) <= tolerance


def small_slot_for(largest: int, slots: int, small_slot: int) -> int:
    """The small slot a layout really has: ``small_slot`` when it is smaller than the largest block and there
    are at least ``MIN_SLOTS_WITH_SMALL`` slots, else 0 (slots of one size)."""
    if slots >= MIN_SLOTS_WITH_SMALL and 0 < small_slot < largest:
        return int(small_slot)
    return 0


def small_slot_used(blocks: Sequence[int], slots: int, small_slot: int) -> int:
    """The small slot a plan streaming ``blocks`` (bytes per trap, 0 for resident ones) really has:
    ``small_slot_for`` of its largest block, and 0 when no streamed block fits the slot (a slot nothing uses
    would be a block count below ``min_blocks`` in disguise)."""
    if not small_slot or not any(0 < nbytes <= small_slot for nbytes in blocks):
        return 0
    return small_slot_for(max(blocks, default=0), slots, small_slot)


def slot_sizes(largest: int, slots: int, small_slot: int = 0) -> tuple[int, ...]:
    """Slot bytes: ``slots`` slots of ``largest`` bytes, the last one ``small_slot`` bytes when it applies
    (``small_slot_for``)."""
    if slots <= 0:
        return ()
    small = small_slot_for(largest, slots, small_slot)
    if small:
        return (largest,) * (slots - 1) + (small,)
    return (largest,) * slots


def effective_blocks(requested: int, min_blocks: int, offloaded_traps: int) -> int:
    """Blocks worth allocating: ``requested``, capped at ``max(min_blocks, offloaded_traps)``.

    With at least as many blocks as offloaded traps no slot is ever reused, so more blocks change nothing in
    the pipeline but cost device memory.
    """
    return min(requested, max(min_blocks, offloaded_traps))


def _lru_slot(sizes: Sequence[int], last_use: Sequence[int], nbytes: int) -> int:
    """The placement rule (module docstring): the least recently used slot of ``sizes`` that holds ``nbytes``
    (``last_use``: each slot's last placement counter, -1 for never); ``ValueError`` when none does."""
    best = -1
    for slot, size in enumerate(sizes):
        if size >= nbytes and (best < 0 or last_use[slot] < last_use[best]):
            best = slot
    if best < 0:
        raise ValueError(f"a block of {nbytes} bytes fits none of the device slots {list(sizes)}")
    return best


class SlotRing(Generic[Owner]):
    """Least-recently-used placement over fixed slots (module docstring), remembering each slot's last owner.

    The loader's owners are entry indices, the simulator's the compute end of the trap that used the slot.
    """

    __slots__ = ("sizes", "_last_use", "_owner", "_placed")

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or any(size < 0 for size in sizes):
            raise ValueError(f"SlotRing: slot sizes must be a non-empty sequence of sizes >= 0, got {list(sizes)}")
        self.sizes = tuple(int(size) for size in sizes)
        self._last_use = [-1] * len(self.sizes)  # placement counter of each slot's last entry (-1: never used)
        self._owner: list[Owner | None] = [None] * len(self.sizes)
        self._placed = 0

    def place(self, nbytes: int, owner: Owner) -> tuple[int, Owner | None]:
        """Put a block of ``nbytes`` in the least recently used slot that holds it; returns that slot and the
        slot's previous owner (None for a fresh slot)."""
        best = _lru_slot(self.sizes, self._last_use, nbytes)
        previous = self._owner[best]
        self._owner[best] = owner
        self._last_use[best] = self._placed
        self._placed += 1
        return best, previous

    def set_owner(self, slot: int, owner: Owner) -> None:
        """Replace slot ``slot``'s last owner (the simulator learns a trap's compute end after placing it)."""
        self._owner[slot] = owner


class SlotTrace:
    """The pipeline simulator of ``flextensor.planning.plan_model`` over slots of the sizes ``slot_sizes``
    gives: a copy waits for the copy before it (one copy stream) and for the compute end of its slot's previous
    entry (module docstring); a streamed trap's ``stream_cost_s`` is on the compute path. Like
    :class:`PipelineTrace` it remembers its state before every trap, so ``with_change`` re-simulates from the
    changed trap (BudgetFill's polish asks it thousands of times at the switch to INFERENCE)."""

    # ``inp`` is a PlanInput, typed loosely: flextensor.planning.plan_model imports this module.
    def __init__(self, inp: Any, per_trap: Sequence[int], num_blocks: int, small_slot: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"simulate_overhead: num_blocks must be >= 1, got {num_blocks}")
        self.inp, self.per_trap, self.num_blocks, self.small_slot = inp, list(per_trap), num_blocks, small_slot
        self._sizes = self._slots(self.per_trap)
        # What sizes the slots is the largest block and whether any block fits the small slot: kept as the two
        # largest blocks (by trap) and a count, so that with_change sizes a change without a pass over every trap.
        ranked = sorted(range(len(self.per_trap)), key=lambda j: -self.per_trap[j])[:2]
        self._largest = [(self.per_trap[j], j) for j in ranked]
        self._fitting = sum(1 for nbytes in self.per_trap if 0 < nbytes <= small_slot)
        # Per trap, the state before it: (clock, last copy end, placements so far, each slot's last placement,
        # each slot's owner's compute end), so that with_change can resume there (see _run).
        self.before: list[tuple[float, float, int, tuple[int, ...], tuple[float | None, ...]]] = []
        self.final_clock = 0.0  # the base run's clock after the last trap (a shifted re-run ends from it)
        self.overhead = self._run(0, self._start(), self.per_trap, self._sizes, record=True)

    def with_change(self, trap: int, nbytes: int) -> float:
        """Overhead if trap ``trap`` carried ``nbytes`` instead (same slot count). Resumed before ``trap`` when
        the slots keep their sizes; from the start when the change resizes them (a new largest block, or the
        small slot now used or unused)."""
        per = self.per_trap
        saved, per[trap] = per[trap], nbytes
        try:
            sizes = self._slots_after(trap, saved, nbytes)
            if sizes != self._sizes:  # other slots: no state of the base run is this run's, so no early end
                return self._run(0, self._start(), per, sizes, record=False, converge=False)
            return self._run(trap, self.before[trap], per, sizes, record=False)
        finally:
            per[trap] = saved

    def _slots_after(self, trap: int, was: int, nbytes: int) -> tuple[int, ...]:
        """``_slots`` of the base run's blocks with trap ``trap`` carrying ``nbytes`` instead of ``was``."""
        others = next((size for size, j in self._largest if j != trap), 0)
        largest = nbytes if nbytes > others else others
        small = self.small_slot
        fitting = self._fitting - (0 < was <= small) + (0 < nbytes <= small)
        used = small_slot_for(largest, self.num_blocks, small) if fitting else 0
        return slot_sizes(largest, self.num_blocks, used) or (0,)

    def _slots(self, per: Sequence[int]) -> tuple[int, ...]:
        largest = max(per, default=0)
        return slot_sizes(largest, self.num_blocks, small_slot_used(per, self.num_blocks, self.small_slot)) or (0,)

    def _start(self) -> tuple[float, float, int, tuple[int, ...], tuple[float | None, ...]]:
        slots = len(self._sizes)
        return 0.0, 0.0, 0, (-1,) * slots, (None,) * slots

    def _run(self, first: int, state: tuple[float, float, int, tuple[int, ...], tuple[float | None, ...]],
             per: Sequence[int], sizes: tuple[int, ...], record: bool, converge: bool = True) -> float:
        """Simulate from trap ``first`` in ``state``: :class:`SlotRing`'s placement (``_lru_slot``) over plain
        lists, so that a state is cheap to save and compare.

        A re-run (``record=False``) over the base run's slots (``converge``) ends early once its state before some
        later trap is the base run's there, shifted (module docstring, "Resuming a changed run"): the clock,
        last copy end and every slot owner's compute end moved by one ``d``, and the placements numbered alike
        (each slot's last placement the base run's, or one off from it all along when the change streams one
        trap more or less: least recently used is an order, which the offset keeps)."""
        inp = self.inp
        transfer, scale, compute, cost = inp.transfer, inp.scale, inp.compute, inp.stream_costs
        clock, last_end, placed, last_use_t, owner_t = state
        last_use, owner = list(last_use_t), list(owner_t)
        before = self.before
        for i in range(first, len(compute)):
            if record:
                before.append((clock, last_end, placed, tuple(last_use), tuple(owner)))
            elif converge and i > first:
                b_clock, b_last, b_placed, b_use, b_owner = before[i]
                offset = b_placed - placed  # one placement more (-1) or less (1) than the base run, or as many
                if -1 <= offset <= 1 and all(u == b == -1 or u >= 0 and u + offset == b
                                             for u, b in zip(last_use, b_use)):
                    d = clock - b_clock
                    tolerance = SHIFT_TOLERANCE * (abs(b_clock) + abs(d))
                    if _same_shift(d, last_end, b_last, tolerance) and all(
                            o is b is None or (o is not None and b is not None and _same_shift(d, o, b, tolerance))
                            for o, b in zip(owner, b_owner)):
                        return self.overhead if d == 0.0 else _overhead(self.final_clock + d, inp.total_compute_s)
            nbytes = per[i]
            if nbytes > 0:
                best = _lru_slot(sizes, last_use, nbytes)
                release = owner[best]
                last_use[best] = placed
                placed += 1
                start = last_end if release is None or release < last_end else release
                last_end = start + transfer.seconds(nbytes) / scale
                if last_end > clock:
                    clock = last_end
                clock += compute[i] + cost[i]
                owner[best] = clock
            else:
                clock += compute[i]
        if record:
            self.final_clock = clock
        return _overhead(clock, inp.total_compute_s)


class PipelineTrace:
    """One run of the simulator that remembers its state before every trap.

    Searches (BudgetFill's polish) try many variants that differ from a base selection in one trap only;
    ``with_change(i, nbytes)`` re-simulates from trap ``i`` instead of from time 0. The simulation itself is the
    model of ``flextensor.planning.plan_model``'s docstring: one copy stream, ``num_blocks`` rotating slots of one
    size, one compute stream (``inp`` is a PlanInput, typed loosely as in ``SlotTrace``).
    """

    def __init__(self, inp: Any, per_trap: Sequence[int], num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"simulate_overhead: num_blocks must be >= 1, got {num_blocks}")
        self.inp, self.per_trap, self.num_blocks = inp, list(per_trap), num_blocks
        self.used_until: list[float] = []  # compute end of the j-th offloaded trap (releases its block slot)
        self.before: list[tuple[float, int, float]] = []  # per trap: (clock, copies so far, last copy end)
        self.final_clock = 0.0  # the base run's clock after the last trap (a shifted re-run ends from it)
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
        """Simulate from trap ``first`` in ``state`` (the model of ``flextensor.planning.plan_model``).

        Written for speed (BudgetFill's polish runs it thousands of times at the switch to INFERENCE), with the
        very same float operations as the plain model: ``a if not b > a else b`` is what ``max(a, b)`` returns,
        and a copy takes ``(latency + n / bandwidth) / scale`` as ``transfer.seconds(n) / scale`` does (the
        bound method is called instead when a subclass overrides ``seconds``).

        A re-run (``record=False``, from ``with_change``) ends early once its state before some later trap is the
        base run's there, shifted (module docstring, "Resuming a changed run"): the clock, last copy end and the
        compute end of every block slot a later copy may still wait for moved by one ``d``. A change that streams
        one trap more or less numbers the later copies one off from the base run's (``offset``): its copy ``c``
        is the base run's ``c + offset``, waiting for the slot of ``c - blocks`` as that one waits for the slot
        of ``c + offset - blocks``. Compute ends from before ``first`` are the base run's own (not kept in
        ``used``): a window that reaches them ends early only unshifted.
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
                offset = b_copies - copies  # the change streams one trap more (-1) or less (1), or as many
                d = clock - b_clock
                tolerance = SHIFT_TOLERANCE * (abs(b_clock) + abs(d))
                shifted = d != 0.0 or offset != 0
                if (-1 <= offset <= 1 and _same_shift(d, last_end, b_last, tolerance)
                        and (not shifted or copies - blocks >= base and copies - blocks + offset >= 0)
                        and all(_same_shift(d, used[k - base], shared[k + offset], tolerance)
                                for k in range(max(base, copies - blocks), copies))):
                    return self.overhead if d == 0.0 else _overhead(self.final_clock + d, inp.total_compute_s)
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
        if record:
            self.final_clock = clock
        return _overhead(clock, inp.total_compute_s)
