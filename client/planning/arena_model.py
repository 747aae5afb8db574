"""The device arena of ``transfer_mode="raw_block_transfer"``: its size, where each streamed block goes, and the
pipeline that gives (the planner's model of ``flextensor.runtime.loaders.arena_loader``).

Pure Python and shared by the planner and the loader, so the planner's device bytes are the loader's to the
byte and its simulated pipeline places blocks as the loader does.

Entries
-------
The loader numbers streamed trap calls with an ever-growing *entry* index: entry ``e`` streams the block of
schedule position ``e % L`` (``L`` streamed calls per pass), ``sizes[e % L]`` bytes.

Size
----
An arena for ``blocks`` holds any ``blocks`` consecutive entries of the cyclic schedule: its bytes are the
largest total of ``blocks`` consecutive entries (:func:`window_bytes`). With blocks of one size that is what
``blocks`` rotating slots take; where a partly streamed trap sits among whole ones, every window that holds it
is smaller, and so is the arena, by up to the bytes the trap keeps resident. Why not "what the budget leaves":
an integer ``blocks`` travels where the slot count does (plan, profile, shared state) and gives the same arena
in every process that adopts the plan.

Placement: next fit on a ring
-----------------------------
Entry ``e`` goes right after entry ``e - 1``, or at offset 0 when it would cross the arena's end
(:meth:`ArenaMap.place`). The offset is a function of the entry index alone (skipped entries advance the ring
too), so it never depends on how a pass went. A block meets only a few offsets: after a pass's first wrap the
rest of that pass depends only on where the wrap happened, so a pass ends at one of at most ``L`` offsets, and
every later pass starts from one of them; with blocks of one size, block ``b`` meets ``blocks`` offsets at most.
The loader caches its device views per (block, offset).

The wrap can leave the end of the arena unused, so a window of ``blocks`` consecutive entries does not always
fit at once: the prefetch depth is what fits (``blocks - 1`` ahead with blocks of one size, less for a few
entries after a smaller block shifted the ring), and the simulator below sees the same placement, so the
planner weighs those waits.

Ordering: who may still hold a range
------------------------------------
:class:`ArenaMap` remembers, per byte range, the *owner* of the last copy written there. A copy into a range may
start once each owner of a byte in it has finished reading: they are the only readers left, because every
earlier reader of such a byte finished before that owner's copy started (its copy waited for them), and copies
run in order on one copy stream. The loader issues a copy only when those owners have exited (skipped entries
count as exited) and makes the copy stream wait on their reader-done events; the simulator starts the copy at
the latest of their compute ends. Entries skipped before their copy was issued write nothing, so they never
hide an earlier reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from flextensor.planning.slot_model import overhead_noise

__all__ = ["ArenaMap", "ArenaTrace", "window_bytes"]

Owner = TypeVar("Owner")


def window_bytes(sizes: Sequence[int], blocks: int) -> int:
    """Arena bytes that hold any ``blocks`` consecutive entries of the cyclic schedule ``sizes`` (the bytes of
    one pass's streamed calls, in order): the largest such total; every entry once when there are fewer."""
    n = len(sizes)
    if n == 0:
        return 0
    k = min(max(int(blocks), 1), n)
    total = sum(sizes[:k])
    best = total
    for i in range(1, n):
        total += sizes[(i + k - 1) % n] - sizes[i - 1]
        if total > best:
            best = total
    return best


class ArenaMap(Generic[Owner]):
    """Next-fit placement on a ring of ``arena_bytes`` and, per byte range, the owner of the last copy there.

    ``spans`` holds ``(start, end, owner)`` for every range written so far, sorted and disjoint; the loader's
    owners are entry indices, the simulator's their compute ends. It holds at most about two passes' worth of
    ranges (a write replaces what it covers), so a linear scan is the cheap way.
    """

    __slots__ = ("arena_bytes", "pointer", "spans")

    def __init__(self, arena_bytes: int) -> None:
        if arena_bytes < 0:
            raise ValueError(f"ArenaMap: arena_bytes must be >= 0, got {arena_bytes}")
        self.arena_bytes = arena_bytes
        self.pointer = 0
        self.spans: list[tuple[int, int, Owner]] = []

    def place(self, size: int) -> int:
        """The offset of the next entry, ``size`` bytes: after the previous one, or 0 when it would cross the
        end. Advances the ring."""
        if size > self.arena_bytes:
            raise ValueError(f"a block of {size} bytes does not fit the device arena of {self.arena_bytes} bytes")
        start = self.pointer if self.pointer + size <= self.arena_bytes else 0
        self.pointer = start + size
        return start

    def owners(self, start: int, size: int) -> list[Owner]:
        """The owners of the last copies into bytes ``[start, start + size)``, in offset order."""
        end = start + size
        return [owner for lo, hi, owner in self.spans if lo < end and start < hi]

    def write(self, start: int, size: int, owner: Owner) -> list[Owner]:
        """Record a copy of ``owner`` into ``[start, start + size)``; returns the owners it replaces there."""
        end = start + size
        if size <= 0:
            return []
        replaced: list[Owner] = []
        kept: list[tuple[int, int, Owner]] = []
        placed = False
        for lo, hi, who in self.spans:
            if hi <= start or end <= lo:
                if not placed and lo >= end:
                    kept.append((start, end, owner))
                    placed = True
                kept.append((lo, hi, who))
                continue
            replaced.append(who)
            if lo < start:
                kept.append((lo, start, who))
            if end < hi:
                if not placed:
                    kept.append((start, end, owner))
                    placed = True
                kept.append((end, hi, who))
        if not placed:
            kept.append((start, end, owner))
        self.spans = kept
        return replaced


class ArenaTrace:
    """The pipeline simulator of ``flextensor.planning.plan_model`` with the arena's placement and ordering.

    Same model as ``PipelineTrace`` (one copy stream, one compute stream, a pass from an idle copy stream, each
    trap once in execution order, a streamed trap's ``stream_cost_s`` on the compute path), except what a copy
    waits for: not the trap that used the same slot before, but the latest compute end among the owners of the
    bytes it overwrites (module docstring). The arena is ``window_bytes`` of the plan's streamed calls.

    ``with_change(i, nbytes)`` (BudgetFill's polish) re-simulates from trap ``i`` when the arena keeps its size
    (the placement before trap ``i`` is then unchanged), else from the start; a re-run stops early once its
    state (clock, copy stream, ring and owners) equals the base run's before the same trap.
    """

    # ``inp`` is a PlanInput, typed loosely: flextensor.planning.plan_model imports this module.
    def __init__(self, inp: Any, per_trap: Sequence[int], num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"simulate_overhead: num_blocks must be >= 1, got {num_blocks}")
        self.inp, self.per_trap, self.num_blocks = inp, list(per_trap), num_blocks
        self.arena_bytes = window_bytes(inp.streamed_calls(self.per_trap), num_blocks)
        self.before: list[tuple[float, float, int, tuple]] = []  # per trap: (clock, last copy end, pointer, spans)
        self.overhead = self._run(0, (0.0, 0.0, 0, ()), self.per_trap, self.arena_bytes, record=True)

    def with_change(self, trap: int, nbytes: int) -> float:
        """Overhead if trap ``trap`` carried ``nbytes`` instead (same block count)."""
        per = self.per_trap
        saved, per[trap] = per[trap], nbytes
        try:
            arena = window_bytes(self.inp.streamed_calls(per), self.num_blocks)
            if arena != self.arena_bytes:
                return self._run(0, (0.0, 0.0, 0, ()), per, arena, record=False, compare=False)
            return self._run(trap, self.before[trap], per, arena, record=False, compare=True)
        finally:
            per[trap] = saved

    def _run(self, first: int, state: tuple[float, float, int, tuple], per: Sequence[int], arena: int,
             record: bool, compare: bool = False) -> float:
        inp = self.inp
        transfer, scale, compute, cost = inp.transfer, inp.scale, inp.compute, inp.stream_costs
        clock, last_end, pointer, spans = state
        ring: ArenaMap[float] = ArenaMap(arena)
        ring.pointer, ring.spans = pointer, list(spans)
        before = self.before
        for i in range(first, len(compute)):
            if record:
                before.append((clock, last_end, ring.pointer, tuple(ring.spans)))
            elif compare and i > first:
                b_clock, b_last, b_pointer, b_spans = before[i]
                if (clock == b_clock and last_end == b_last and ring.pointer == b_pointer
                        and tuple(ring.spans) == b_spans):
                    return self.overhead
            nbytes = per[i]
            if nbytes > 0:
                start_at = ring.place(nbytes)
                start = last_end
                for release in ring.owners(start_at, nbytes):
                    if release > start:
                        start = release
                last_end = start + transfer.seconds(nbytes) / scale
                if last_end > clock:
                    clock = last_end
                clock += compute[i] + cost[i]
                ring.write(start_at, nbytes, clock)
            else:
                clock += compute[i]
        overhead = clock - inp.total_compute_s
        return 0.0 if overhead <= overhead_noise(inp.total_compute_s) else overhead
