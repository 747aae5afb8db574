"""Offload strategies: which tensors stay resident on the GPU and which stream through rotating device blocks.

The engine measures per-trap compute seconds and a transfer curve during PROFILING, builds a ``PlanInput``
(see ``flextensor.planning.plan_model`` for the types and the pipeline model) and calls ``strategy.plan(inp)``. The
basic strategies (NthLayer, Greedy, Knapsack) and the transfer windows they share live in
``flextensor.planning.basic_strategies``; this module adds the budget search (BudgetFill), the default Adaptive choice
and ``resolve_budget``, and is the public home of every strategy.

Modes: ``budget_bytes=None`` is latency mode (offload only what costs no material overhead: copies that hide
behind compute, and streamed traps' own costs that fit in 1% of the pass, see ``AdaptiveStrategy``); otherwise
memory mode (the peak device bytes must stay within the budget). ``resolve_budget`` turns
``max_gpu_mem_fraction`` into that budget.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Sequence
from dataclasses import replace

from flextensor.planning.plan_model import (
    MIB,
    CandidateSummary,
    Plan,
    PlanInput,
    TensorCost,
    TransferModel,
    TrapCost,
    effective_blocks,
    make_plan,
    peak_device_bytes,
    plan_blocks,
    plan_from_masks,
    plan_small_slot,
    rotating_bytes,
    simulate_bytes,
    simulate_overhead,
    simulation,
)
from flextensor.planning.basic_strategies import (  # noqa: F401 - the basic strategies are public from here too
    GreedyStrategy,
    KnapsackStrategy,
    NthLayerStrategy,
    Strategy,
    SubsetSums,
    hidden_chain,
    subset_sum_tables,
)
from flextensor.planning.slot_model import MIN_SLOTS_WITH_SMALL, overhead_noise, slot_sizes, small_slot_for

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_GPU_BUDGET_BYTES",
    "AdaptiveStrategy",
    "BudgetFillStrategy",
    "CandidateSummary",
    "GreedyStrategy",
    "KnapsackStrategy",
    "NthLayerStrategy",
    "Plan",
    "PlanInput",
    "Strategy",
    "TensorCost",
    "TransferModel",
    "TrapCost",
    "make_plan",
    "resolve_budget",
    "simulate_overhead",
]

MIN_GPU_BUDGET_BYTES = 256 * MIB

class BudgetFillStrategy(Strategy):
    """Hard GPU budget with minimal estimated overhead (and, among equal overheads, minimal offload).

    Search over the number of device blocks ``B`` (``num_blocks`` down to ``min_blocks``, or exactly
    ``n_blocks``) and over a cap ``L`` on per-trap offloaded bytes (which bounds the device blocks at
    ``B * L``). For each (B, L): start from the hidden Knapsack offloads (no copy waited for) clipped to ``L``,
    then add tensors ranked by exposed seconds per byte saved (exposure: the part of a trap's copy beyond its
    gap-aware window, i.e. the compute since the previous trap that has offloadable tensors, plus the trap's
    ``stream_cost_s`` for its first tensor) until the peak fits; if the ranking runs dry, take each trap's
    largest subset <= L. Every fitting candidate is simulated; the best
    ``polish_candidates`` are polished by a simulator-driven local search that gives back offloads the budget
    does not need (``_polish``); the lowest overhead wins, ties go to fewer offloaded bytes, then the lower
    peak. On random small cases checked against exhaustive search it finds the optimum in about 98% of them.

    Feasibility is decided exactly (when per-trap subset sums are exact): the smallest reachable peak uses the
    fewest blocks and, for some cap ``L`` among the per-trap subset totals, each trap's largest subset <= L.
    Without a budget it plans like Knapsack.

    With an arena (``PlanInput.arena``) the peak counts the arena (``rotating_bytes``: the largest total of
    ``B`` consecutive streamed calls, bounded by ``B * L`` too), ``B`` goes down to two whatever ``min_blocks``
    says (``PlanInput.fewest_blocks``), and the simulator places blocks as the arena does. Feasibility is then
    decided on the same candidates, but no longer exactly: which traps stream next to each other changes the
    arena, and the caps do not search that.
    """

    name = "budget_fill"

    def __init__(self, n_blocks: int | None = None, *, max_levels: int = 32, resolution: int = 200,
                 max_states: int = 4096, polish_candidates: int = 3, polish_evaluations: int = 4000) -> None:
        if n_blocks is not None and (not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or n_blocks < 2):
            raise ValueError(f"BudgetFillStrategy: n_blocks must be None (search) or an int >= 2, got {n_blocks!r}")
        if max_levels < 1:
            raise ValueError(f"BudgetFillStrategy: max_levels must be >= 1, got {max_levels!r}")
        self.n_blocks = n_blocks
        self.max_levels = max_levels
        self.polish_candidates = max(1, polish_candidates)
        self.polish_evaluations = polish_evaluations
        self.small_slot_sizes = 3  # small last slot sizes tried per (blocks, cap), twice: see _small_slots
        self.knapsack = KnapsackStrategy(resolution, max_states)

    def __repr__(self) -> str:
        return f"BudgetFillStrategy(n_blocks={self.n_blocks!r})"

    def plan(self, inp: PlanInput) -> Plan:
        if inp.budget_bytes is None:
            plan = self.knapsack.plan(inp)
            plan.strategy = self.name
            plan.explanation.insert(0, "budget_fill: no GPU budget (latency mode): planned like knapsack")
            return plan
        budget, fixed = inp.budget_bytes, inp.fixed_resident_bytes
        blocks = ([self.n_blocks] if self.n_blocks is not None
                  else list(range(inp.num_blocks, inp.fewest_blocks - 1, -1)))
        if fixed + inp.offloadable_bytes <= budget:
            return make_plan(inp, self.name, {}, blocks[0], [
                f"budget_fill: every tensor fits the budget ({fixed + inp.offloadable_bytes} B <= {budget} B); "
                "nothing offloaded"])
        tables = subset_sum_tables(inp, self.knapsack.resolution, self.knapsack.max_states)
        hidden = hidden_chain(inp, tables)
        fewest = min(blocks)

        def widest(level: int) -> list[int]:  # each trap's largest subset <= level (the max-offload masks)
            return [0 if t is None else t.best(level)[1] for t in tables]

        levels = sorted({s for t in tables if t is not None for s in t.sums if s > 0})
        levels = _spread(levels, 2048)
        peaks = {lv: peak_device_bytes(inp, _per_trap(inp, widest(lv)), fewest) for lv in levels}
        floor_level = min(levels, key=lambda lv: (peaks[lv], lv), default=0)
        if not levels or peaks[floor_level] > budget:
            if not levels or fixed + inp.offloadable_bytes <= peaks[floor_level]:  # offloading only adds blocks
                return self._infeasible(inp, [0] * len(tables), fewest, fixed + inp.offloadable_bytes)
            return self._infeasible(inp, widest(floor_level), fewest, peaks[floor_level])

        feasible = [lv for lv in levels if peaks[lv] <= budget]
        hidden_top = max((b for b, _ in hidden), default=0)
        grid = set(_spread(feasible, self.max_levels)) | {floor_level} | ({hidden_top} if hidden_top else set())
        windows = _gap_windows(inp)
        scores: dict[tuple[int, int, int], float] = {}
        found: list[tuple[tuple[float, int, int], int, int, int, list[int]]] = []
        for count in blocks:
            for level in sorted(grid):
                masks = self._fill(inp, tables, hidden, windows, scores, count, level)
                if masks is not None:
                    found.append((_key(inp, masks, count), count, level, 0, masks))
        assert found, "the floor level fits with the fewest blocks, so some candidate fits"
        found.sort(key=lambda f: f[:3])
        # A small last slot, tried where slots of one size did best (each try is a fill: kept to a few).
        for _, count, level, _, masks in found[: self.polish_candidates]:
            for small in self._small_slots(inp, levels, count, level, _per_trap(inp, masks)):
                masks = self._fill(inp, tables, hidden, windows, scores, count, level, small)
                if masks is not None:
                    found.append((_key(inp, masks, count, small), count, level, small, masks))
        found.sort(key=lambda f: f[:3])
        chosen = found[: self.polish_candidates]
        # A small slot's candidates leave the fill with the hidden offloads that fit it (a few KiB each, every one
        # a streamed trap), which polishing gives back: the best of them is polished too, whatever its rank.
        chosen += [f for f in found if f[3]][:1] if not any(f[3] for f in chosen) else []
        polished = []
        for _, count, level, small, masks in chosen:
            masks = _polish(inp, list(masks), count, self.polish_evaluations, small)
            polished.append((_key(inp, masks, count, small), count, level, small, masks))
        key, count, level, small, masks = min(polished, key=lambda f: f[:3])
        slots = f", the last one {small} B" if plan_small_slot(inp, _per_trap(inp, masks), count, small) else ""
        why = [
            f"budget_fill: budget {budget} B; hidden offloads {sum(b for b, _ in hidden)} B; searched "
            f"{len(blocks)} block count(s) x {len(grid)} per-trap caps, and a small last slot beside the best "
            f"({len(found)} fit); polished the best {len(polished)}; kept {count} blocks{slots} with cap {level} "
            f"B, offloading {key[1]} B (lowest estimated overhead, then fewest offloaded bytes, then lowest peak)"
        ]
        return plan_from_masks(inp, self.name, masks, count, why, small)

    def _small_slots(self, inp: PlanInput, levels: list[int], count: int, level: int,
                     uniform: Sequence[int]) -> list[int]:
        """Sizes to try for a small last slot beside ``count - 1`` slots of up to ``level`` bytes
        (``flextensor.planning.slot_model``): the partly streamed traps' bytes of the plan with slots of one size
        (``uniform``, per trap), where such a slot pays off first, then a few per-trap subset totals below the
        cap. None for an arena (its ranges are sized to each block already) or with too few slots to keep two
        large ones."""
        if inp.arena or count < MIN_SLOTS_WITH_SMALL or self.small_slot_sizes <= 0:
            return []
        largest = max(uniform, default=0)
        partial = sorted({nbytes for nbytes in uniform if 0 < nbytes < largest}, reverse=True)
        spread = _spread([lv for lv in levels if lv < level], self.small_slot_sizes)
        return list(dict.fromkeys(partial[: self.small_slot_sizes] + spread))

    def _fill(self, inp: PlanInput, tables: list[SubsetSums | None], hidden: list[tuple[int, int]],
              windows: list[float], scores: dict[tuple[int, int, int], float], count: int, level: int,
              small: int = 0) -> list[int] | None:
        """Masks meeting the budget with per-trap bytes <= level, or None when this (count, level) cannot;
        ``small``: the bytes of a small last slot (``flextensor.planning.slot_model``), 0 for none; ``scores``:
        the ranking of (trap, its offloaded bytes, a tensor's bytes), kept across the fills of one plan."""
        budget = inp.budget_bytes
        assert budget is not None
        masks, cur = [], []
        for table, (hb, hm) in zip(tables, hidden):
            if table is None:
                masks.append(0)
                cur.append(0)
            elif hb <= level:
                masks.append(hm)
                cur.append(hb)
            else:  # a smaller subset of a hidden block is hidden too
                s, m = table.best(min(level, hb))
                masks.append(m)
                cur.append(s)
        if peak_device_bytes(inp, cur, count, small) <= budget:
            return masks
        transfer, scale = inp.transfer, inp.scale

        def exposed(i: int, nbytes: int) -> float:
            return max(0.0, transfer.seconds(nbytes) / scale - windows[i])

        def score(i: int, nbytes: int) -> float:  # exposed seconds per byte saved (a first tensor: + the trap's cost)
            key = (i, cur[i], nbytes)
            value = scores.get(key)
            if value is None:  # the fills of one plan share their scores: most traps start every fill alike
                extra = inp.traps[i].stream_cost_s if cur[i] == 0 else 0.0
                value = scores[key] = (exposed(i, cur[i] + nbytes) - exposed(i, cur[i]) + extra) / nbytes
            return value

        version = [0] * len(cur)
        heap = [
            (score(i, t.nbytes), -t.nbytes, i, k, 0)
            for i, trap in enumerate(inp.traps)
            for k, t in enumerate(trap.tensors)
            if t.nbytes > 0 and not masks[i] >> k & 1 and cur[i] + t.nbytes <= level
        ]
        heapq.heapify(heap)
        off, n_off, blk = sum(cur), sum(1 for b in cur if b > 0), max(cur, default=0)
        fixed_total = inp.fixed_resident_bytes + inp.offloadable_bytes
        calls = inp.calls_per_trap
        n_calls, call_bytes = sum(calls[i] for i, b in enumerate(cur) if b), sum(c * b for c, b in zip(calls, cur))
        in_small = sum(1 for b in cur if 0 < b <= small)  # streamed blocks the small slot holds (0: no such slot)
        while heap:
            _, neg, i, k, ver = heapq.heappop(heap)
            nbytes = -neg
            if masks[i] >> k & 1 or cur[i] + nbytes > level:
                continue
            if ver != version[i]:  # trap i changed since this entry was scored
                heapq.heappush(heap, (score(i, nbytes), neg, i, k, version[i]))
                continue
            n_off += cur[i] == 0
            n_calls += calls[i] if cur[i] == 0 else 0
            call_bytes += calls[i] * nbytes
            in_small -= 0 < cur[i] <= small
            in_small += cur[i] + nbytes <= small
            masks[i] |= 1 << k
            cur[i] += nbytes
            version[i] += 1
            off += nbytes
            blk = max(blk, cur[i])
            # peak_device_bytes, kept up to date from the running totals instead of recomputed per tensor (the
            # arena's bytes depend on which calls stream next to each other: recomputed)
            if inp.arena:
                # The arena holds the largest block, and at least the mean window of consecutive calls (each
                # call is in as many windows as a window has calls): exact only once those bounds fit.
                lower = max(blk, min(count, n_calls) * call_bytes // n_calls) if n_calls else blk
                if fixed_total - off + lower > budget:
                    continue
                rotating = rotating_bytes(inp, cur, count)
            else:
                slots = effective_blocks(count, inp.min_blocks, n_off)
                rotating = sum(slot_sizes(blk, slots, small)) if in_small else slots * blk
            if fixed_total - off + rotating <= budget:
                return masks
        masks = [0 if t is None else t.best(level)[1] for t in tables]
        return masks if peak_device_bytes(inp, _per_trap(inp, masks), count, small) <= budget else None

    def _infeasible(self, inp: PlanInput, masks: list[int], count: int, peak: int) -> Plan:
        budget = inp.budget_bytes
        assert budget is not None
        missing = peak - budget
        lower = "" if inp.arena else " lower min_blocks,"  # the arena's floor of two blocks is no option
        why = [
            f"budget_fill: cannot meet the GPU budget of {budget} B ({budget / MIB:.2f} MiB): the smallest peak "
            f"any selection reaches is {peak} B with {count} device blocks, {missing} B ({missing / MIB:.2f} MiB) "
            f"missing. Raise max_gpu_mem_fraction, free GPU memory,{lower} or use finer include patterns so that "
            "device blocks get smaller"
        ]
        if inp.fixed_resident_bytes > budget:
            why.append(f"budget_fill: the non-offloadable tensors alone take {inp.fixed_resident_bytes} B")
        return plan_from_masks(inp, self.name, masks, count, why)


def _per_trap(inp: PlanInput, masks: Sequence[int]) -> list[int]:
    """Offloaded bytes per trap of a selection given as one bitmask per trap (bit ``k``: the trap's tensor ``k``)."""
    return [sum(t.nbytes for k, t in enumerate(trap.tensors) if mask >> k & 1) for trap, mask in zip(inp.traps, masks)]


def _gap_windows(inp: PlanInput) -> list[float]:
    """Per trap: compute seconds since the previous trap that has offloadable tensors (from 0 for the first).

    The window trap ``i`` has when every offloadable trap is offloaded: a stable, conservative yardstick for
    ranking extra offloads in memory mode, where most traps end up offloaded.
    """
    out, last = [], 0
    prefix = inp.prefix_compute
    for i, trap in enumerate(inp.traps):
        out.append(prefix[i] - prefix[last])
        if trap.total_bytes > 0:
            last = i
    return out


def _key(inp: PlanInput, masks: Sequence[int], count: int, small: int = 0) -> tuple[float, int, int]:
    """BudgetFill's ranking: estimated overhead, then offloaded bytes, then peak."""
    per_trap = _per_trap(inp, masks)
    overhead = simulate_bytes(inp, per_trap, plan_blocks(inp, count, per_trap), small)
    return overhead, sum(per_trap), peak_device_bytes(inp, per_trap, count, small)


def _polish(inp: PlanInput, masks: list[int], count: int, evaluations: int, small: int = 0) -> list[int]:
    """Give back offloads the budget does not need, best first, judged by the simulator.

    The fill ranks by a per-trap window estimate and stops at the first selection that fits, so it can
    overshoot the budget or offload a big tensor where a smaller one of the same trap would do (the first
    trap's copy, for one, is always exposed). Moves: drop an offloaded tensor, or swap it for a smaller
    resident tensor of the same trap (one candidate per distinct size: equal sizes are interchangeable). Each
    round applies the move that keeps the budget and lowers the simulated overhead most (ties, overheads within
    float noise: the move that offloads fewer bytes). Every move offloads fewer bytes and is taken only when it
    does not lengthen the simulated pipeline by more than that noise (1e-9 of the compute per move), so the
    search ends and never gets worse by more than that; ``evaluations`` bounds the number of simulations.
    With an arena a move may also shrink the arena (the budget check recomputes it) and move later blocks in it
    (the simulation re-places them).
    """
    budget = inp.budget_bytes
    assert budget is not None
    per = _per_trap(inp, masks)
    base_total = inp.fixed_resident_bytes + inp.offloadable_bytes
    min_blocks, traps, arena = inp.min_blocks, inp.traps, inp.arena
    # The search runs at the switch to INFERENCE (inside the last PROFILING pass), so its loops are kept lean
    # without changing a single decision: a trap's move list is rebuilt only when its mask changed (one trap per
    # round), the two block counts a move can lead to are computed once per round (the slots' bytes once per
    # distinct outcome, by _slots_after_move's cache), and the loops stop as soon as the evaluations are spent
    # (the remaining iterations could only ``continue``).
    move_cache: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}
    noise = overhead_noise(inp.total_compute_s)

    def moves(i: int) -> list[tuple[int, int, int]]:
        """Trap i's moves as (gain, tensor given back, tensor taken instead or -1), in the search's order."""
        mask = masks[i]
        hit = move_cache.get(i)
        if hit is not None and hit[0] == mask:
            return hit[1]
        tensors = traps[i].tensors
        inside = {t.nbytes: k for k, t in enumerate(tensors) if mask >> k & 1}
        outside = {t.nbytes: k for k, t in enumerate(tensors) if not mask >> k & 1 and t.nbytes > 0}
        out = []
        for size, k in inside.items():
            out.append((size, k, -1))
            out.extend((size - o, k, ko) for o, ko in outside.items() if o < size)
        move_cache[i] = (mask, out)
        return out

    while evaluations > 0:
        n_off = sum(1 for b in per if b > 0)
        blocks = plan_blocks(inp, count, per)
        # Blocks after a move: n_off - (left == 0) offloaded traps, 0 blocks when that is 0.
        kept_blocks = blocks if n_off else 0
        fewer_blocks = effective_blocks(count, min_blocks, n_off - 1) if n_off - 1 else 0
        trace = simulation(inp, per, blocks, small)
        current, off = trace.overhead, sum(per)
        room = budget - base_total + off  # integers: "base_total - off + gain + peak_blocks > budget" rearranged
        order = sorted(range(len(per)), key=lambda j: -per[j])
        in_small = sum(1 for b in per if 0 < b <= small) if small else 0  # blocks the small slot could hold
        best: tuple[float, int, int, int, int] | None = None  # (overhead, gain, trap, tensor, taken)
        for i in range(len(traps)):
            if evaluations <= 0:
                break
            if not masks[i]:
                continue
            others_max = per[order[0]] if order[0] != i else (per[order[1]] if len(order) > 1 else 0)
            per_i = per[i]
            for gain, k, other in moves(i):
                left = per_i - gain
                if arena:
                    per[i] = left
                    now_blocks = plan_blocks(inp, count, per)
                    fits = gain + rotating_bytes(inp, per, now_blocks) <= room
                    per[i] = per_i
                    if not fits:
                        continue
                else:
                    now_blocks = fewer_blocks if left == 0 else kept_blocks
                    if small and now_blocks:  # exact: whether a block still fits the small slot may change
                        rotating = _slots_after_move(n_off - (per_i > 0) + (left > 0), now_blocks, min_blocks,
                                                     others_max if others_max >= left else left, small,
                                                     in_small - (0 < per_i <= small) + (0 < left <= small) > 0)
                    else:
                        rotating = now_blocks * (others_max if others_max >= left else left)
                    if gain + rotating > room:
                        continue
                if evaluations <= 0:
                    break
                evaluations -= 1
                if now_blocks == blocks:
                    overhead = trace.with_change(i, left)
                else:
                    per[i] = left
                    overhead = simulate_bytes(inp, per, max(now_blocks, 1), small)
                    per[i] += gain
                # Overheads within float noise of each other are ties (a resumed run's overhead is equal to a
                # full simulation's up to rounding: slot_model, "Resuming a changed run"), so that rounding
                # never decides between two moves: ties go to the larger gain, then the earlier move.
                if overhead <= current + noise and (best is None or overhead < best[0] - noise or (
                        overhead <= best[0] + noise and gain > best[1])):
                    best = (overhead, gain, i, k, other)
        if best is None:
            break
        _, gain, i, k, other = best
        masks[i] &= ~(1 << k)
        if other >= 0:
            masks[i] |= 1 << other
        per[i] -= gain
    return masks


@functools.lru_cache(maxsize=4096)
def _slots_after_move(offloaded: int, num_blocks: int, min_blocks: int, largest: int, small: int,
                      in_small: int) -> int:
    """``rotating_bytes`` of a slot plan after one polish move, from the running totals instead of a pass over
    every trap (the polish asks this for every move of every round, with a handful of distinct arguments per
    round: hence the cache): ``offloaded`` streamed traps, the ``largest`` block, and ``in_small`` streamed
    blocks that fit the ``small`` slot (only whether there are any counts)."""
    if not offloaded:
        return 0
    slots = effective_blocks(num_blocks, min_blocks, offloaded)
    return sum(slot_sizes(largest, slots, small_slot_for(largest, slots, small) if in_small else 0))


def _spread(values: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the sorted ``values``, evenly spaced, always keeping the first and last."""
    if len(values) <= limit:
        return values
    if limit == 1:
        return [values[-1]]
    step = (len(values) - 1) / (limit - 1)
    return sorted({values[round(j * step)] for j in range(limit)})


class AdaptiveStrategy(Strategy):
    """The default: run several strategies and keep the best plan.

    Candidates: Knapsack, Greedy, NthLayer(1), plus BudgetFill when a budget is set (``extra_optimization``
    adds NthLayer(2) and a BudgetFill with a 4x finer per-trap cap grid and a longer polish).
    Memory mode: the lowest estimated overhead among the plans that fit (ties: fewer offloaded bytes, then lower
    peak); when none fits, the plan with the lowest peak, marked ``fits_budget=False``.
    Latency mode: among the plans whose overhead is within 1% of the total compute of the best one, the lowest
    peak device memory (ties: lower overhead, then fewer offloaded bytes), with keeping everything resident
    (``keep_resident``, no overhead) among them. The point of offloading at no material cost is to free device
    memory, and streaming frees less than it offloads: the rotating blocks hold copies too. One or two streamed
    blocks through two device blocks free nothing at all (they need as much room as they take off), yet most
    offloaded bytes would choose them; at equal peak, streaming only adds copies.

    Latency mode decided without the candidates: every plan that streams a trap costs at least that trap's
    ``stream_cost_s`` (the simulator adds it on the compute path, waits only add to it), so when the cheapest
    streamable trap's cost is over the 1% slack, no streaming plan can be chosen, and ``keep_resident`` streams
    what the full comparison would choose (nothing; that comparison may name its choice after a candidate that
    streams nothing instead). Why bother: a short, launch-bound pass (a small batch) is exactly this
    case, and there planning the candidates (a fraction of a millisecond of host time) is paid inside the last
    PROFILING pass, against passes of a few milliseconds.
    """

    name = "adaptive"

    def __init__(self, extra_optimization: bool = False) -> None:
        self.extra_optimization = bool(extra_optimization)

    def __repr__(self) -> str:
        return f"AdaptiveStrategy(extra_optimization={self.extra_optimization})"

    def candidates(self, inp: PlanInput) -> list[Strategy]:
        out: list[Strategy] = [KnapsackStrategy(), GreedyStrategy(), NthLayerStrategy(1)]
        if self.extra_optimization:
            out.append(NthLayerStrategy(2))
        if inp.budget_bytes is not None:
            out.append(BudgetFillStrategy())
            if self.extra_optimization:
                fine = BudgetFillStrategy(max_levels=128, polish_candidates=8, polish_evaluations=20000)
                fine.name = "budget_fill(fine)"
                out.append(fine)
        return out

    def plan(self, inp: PlanInput) -> Plan:
        if inp.budget_bytes is None:
            resident = self._resident_without_candidates(inp)
            if resident is not None:
                return resident
        plans = [strategy.plan(inp) for strategy in self.candidates(inp)]
        if inp.budget_bytes is None:
            plans.append(make_plan(inp, "keep_resident", {}, inp.num_blocks))
            slack = 0.01 * inp.total_compute_s
            floor = min(p.estimated_overhead_s for p in plans)
            pool = [p for p in plans if p.estimated_overhead_s <= floor + slack]
            chosen = min(pool, key=lambda p: (p.peak_device_bytes, p.estimated_overhead_s, p.offloaded_bytes))
            rule = (f"latency mode: lowest peak device memory among plans within {slack * 1e3:.3f} ms (1% of "
                    f"compute) of the lowest overhead {floor * 1e3:.3f} ms")
        else:
            fitting = [p for p in plans if p.fits_budget]
            if fitting:
                chosen = min(fitting, key=lambda p: (p.estimated_overhead_s, p.offloaded_bytes, p.peak_device_bytes))
                rule = f"memory mode: lowest estimated overhead among the {len(fitting)} plan(s) within the budget"
            else:
                chosen = min(plans, key=lambda p: (p.peak_device_bytes, p.estimated_overhead_s))
                rule = (f"memory mode: NO candidate fits the budget of {inp.budget_bytes} B; kept the lowest peak, "
                        f"{chosen.peak_device_bytes - inp.budget_bytes} B missing")
        summaries = [
            CandidateSummary(p.strategy, p.estimated_overhead_s, p.offloaded_bytes, p.peak_device_bytes,
                             p.fits_budget, p is chosen)
            for p in plans
        ]
        lines = [f"adaptive: chose {chosen.strategy} ({rule})"]
        lines += [
            f"adaptive: candidate {s.strategy}: overhead {s.estimated_overhead_s * 1e3:.3f} ms, offloaded "
            f"{s.offloaded_bytes} B, peak {s.peak_device_bytes} B, fits budget: {'yes' if s.fits_budget else 'no'}"
            for s in summaries
        ]
        result = replace(chosen, strategy=f"{self.name}:{chosen.strategy}", explanation=lines + chosen.explanation,
                         candidates=summaries, offloaded=dict(chosen.offloaded))
        if not result.fits_budget:
            logger.warning("%s", lines[0])
        return result

    def _resident_without_candidates(self, inp: PlanInput) -> Plan | None:
        """Latency mode's ``keep_resident`` when no streaming plan can be within the slack (see the class
        docstring), else None. The margin on the slack covers float rounding in the simulator's sums."""
        slack = 0.01 * inp.total_compute_s
        costs = [cost for cost, trap in zip(inp.stream_costs, inp.traps) if trap.total_bytes > 0]
        if not costs or not min(costs) > slack * (1 + 1e-9) + 1e-15:
            return None
        plan = make_plan(inp, "keep_resident", {}, inp.num_blocks)
        line = (f"adaptive: chose keep_resident (latency mode: streaming any trap costs at least "
                f"{min(costs) * 1e3:.3f} ms, its own stream_cost_s, over the {slack * 1e3:.3f} ms (1% of compute) "
                "within which a plan may cost more than keeping everything resident; the candidates were not "
                "planned)")
        summary = CandidateSummary(plan.strategy, plan.estimated_overhead_s, plan.offloaded_bytes,
                                   plan.peak_device_bytes, plan.fits_budget, True)
        return replace(plan, strategy=f"{self.name}:keep_resident", explanation=[line] + plan.explanation,
                       candidates=[summary])


# ------------------------------------------------------------------------------------------------------------
# Budget resolution (memory mode)
# ------------------------------------------------------------------------------------------------------------


def resolve_budget(fraction: float, total_bytes: int, free_bytes: int) -> tuple[int, str | None]:
    """``max_gpu_mem_fraction`` -> (budget bytes, warning or None): ``min(fraction * total, free)``.

    The warning (returned, so the caller logs it once with its own context) says when free memory capped the
    request. Raises RuntimeError when fewer than 256 MiB remain, naming the cause and the fix.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"resolve_budget: fraction (max_gpu_mem_fraction) must be a float in (0, 1], got {fraction!r}")
    if total_bytes <= 0 or free_bytes < 0:
        raise ValueError(f"resolve_budget: need total_bytes > 0 and free_bytes >= 0, got {total_bytes}, {free_bytes}")
    requested = int(fraction * total_bytes)
    budget = min(requested, free_bytes)
    warning = None
    if free_bytes < requested:
        warning = (
            f"max_gpu_mem_fraction={fraction} asks for {requested / MIB:.0f} MiB of the device's "
            f"{total_bytes / MIB:.0f} MiB, but only {free_bytes / MIB:.0f} MiB are free (CUDA context, KV cache, "
            f"other processes); the GPU budget is capped to {budget / MIB:.0f} MiB"
        )
    if budget < MIN_GPU_BUDGET_BYTES:
        if free_bytes < MIN_GPU_BUDGET_BYTES:
            fix = ("free GPU memory first: stop other processes on this device (see nvidia-smi), shrink what else "
                   "this process keeps there (e.g. a smaller KV cache / vLLM gpu_memory_utilization, "
                   "torch.cuda.empty_cache()), or use a device with more free memory")
        else:
            fix = ("raise max_gpu_mem_fraction, or set it to None for latency mode (no memory cap)")
        raise RuntimeError(
            f"only {budget / MIB:.0f} MiB of GPU memory are available to FlexTensor (max_gpu_mem_fraction="
            f"{fraction} of {total_bytes / MIB:.0f} MiB total, {free_bytes / MIB:.0f} MiB free); at least "
            f"{MIN_GPU_BUDGET_BYTES // MIB} MiB are needed: {fix}"
        )
    return budget, warning
