"""The basic offload strategies and what they share: transfer windows, subset sums, the strategy base class.

Transfer windows (shared by Greedy, Knapsack and BudgetFill's "hidden" part)
---------------------------------------------------------------------------
With two or more device blocks, the copy for offloaded trap ``i`` can run while traps ``p..i-1`` compute,
where ``p`` is the previous *offloaded* trap (its own copy has finished by the time ``p`` starts, so the copy
stream is free from then on); before the first offloaded trap the window reaches back to time 0. Gap traps
(no offloadable tensors) and traps that keep everything resident therefore widen the next window. If every
offloaded trap's copy fits its window (``scale * compute``), the simulator reports no wait for a copy: by
induction each copy ends before its trap starts, and the block slot it reuses was released by an earlier
trap (slots rotate over >= 2 blocks). What such a plan still costs is the streamed traps' own
``TrapCost.stream_cost_s``, which the windows do not see: Adaptive weighs it when it compares plans. Windows
are conservative: the simulator also credits slack that accumulates when copies finish early and more blocks
allow running further ahead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Sequence

from flextensor.planning.plan_model import Plan, PlanInput, plan_from_masks

__all__ = ["GreedyStrategy", "KnapsackStrategy", "NthLayerStrategy", "Strategy", "SubsetSums", "hidden_chain",
           "subset_sum_tables"]


class Strategy(ABC):
    """Base of every strategy: a ``name`` and ``plan(inp) -> Plan``. ``OffloadConfig.load_strategy`` takes one."""

    name: str = "strategy"

    @abstractmethod
    def plan(self, inp: PlanInput) -> Plan: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ------------------------------------------------------------------------------------------------------------
# Subset sums of one trap's tensors (the knapsack table) and the hidden-offload chain
# ------------------------------------------------------------------------------------------------------------


class SubsetSums:
    """Reachable byte totals of subsets of one trap's tensors, each with one subset (a bitmask) reaching it.

    Since a trap's offloaded tensors travel as one block, its copy time is affine in the block's bytes and the
    per-trap 0/1 knapsack "most bytes whose transfer fits the window" is a subset-sum over bytes. Sizes in a
    transformer layer repeat (q/o, gate/up/down...), so the exact table stays small; when a trap exceeds
    ``max_states`` distinct totals, totals are merged into ``resolution`` buckets (the time discretisation),
    keeping the smallest and largest exact total of each bucket. Totals stay exact, so an answer never
    overshoots its window; merging can only lose at most a bucket's width of bytes per merge.
    """

    def __init__(self, sizes: Sequence[int], resolution: int, max_states: int) -> None:
        self.exact = True
        width = max(1, -(-sum(sizes) // resolution))
        states: dict[int, int] = {0: 0}
        for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
            if sizes[k] <= 0:
                continue  # a zero-byte tensor gains nothing from offloading
            bit, size = 1 << k, sizes[k]
            # In place over a snapshot of the items: the same keys, masks and insertion order as growing a copy
            # (first subset to reach a total keeps it either way), without copying the dict per tensor.
            for total, mask in list(states.items()):
                states.setdefault(total + size, mask | bit)
            if len(states) > max_states:
                self.exact = False
                keep: dict[int, tuple[int, int]] = {}
                for total in states:
                    lo, hi = keep.get(total // width, (total, total))
                    keep[total // width] = (min(lo, total), max(hi, total))
                states = {t: states[t] for pair in keep.values() for t in pair} | {0: 0}
        self.sums = sorted(states)
        self.masks = [states[s] for s in self.sums]

    def best(self, cap: int) -> tuple[int, int]:
        """(bytes, mask) of the largest reachable total <= cap."""
        i = bisect_right(self.sums, cap) - 1
        return self.sums[i], self.masks[i]


def subset_sum_tables(inp: PlanInput, resolution: int, max_states: int) -> list[SubsetSums | None]:
    """One subset-sum table per trap (None without offloadable bytes).

    Traps with the same tensor sizes in the same order (every layer of a transformer) share one table: a table
    depends on nothing else and is never modified after it is built, so this only saves rebuilding it per layer
    at the switch to INFERENCE.
    """
    built: dict[tuple[int, ...], SubsetSums] = {}
    out: list[SubsetSums | None] = []
    for trap in inp.traps:
        if trap.total_bytes <= 0:
            out.append(None)
            continue
        sizes = tuple(t.nbytes for t in trap.tensors)
        table = built.get(sizes)
        if table is None:
            table = built[sizes] = SubsetSums(sizes, resolution, max_states)
        out.append(table)
    return out


def hidden_chain(inp: PlanInput, tables: list[SubsetSums | None]) -> list[tuple[int, int]]:
    """Per trap (bytes, mask) of the hidden selection that offloads the most bytes in total.

    Dynamic programming over "which trap was offloaded last": ``value[i]`` is the most bytes a hidden plan can
    offload when trap ``i`` is its last offloaded trap, maximised over the previous one ``p`` (whose choice
    sets trap ``i``'s window ``p..i-1``) or none (window from time 0). Offloading a small slice of a trap can
    shrink the next trap's window, which is why a trap-by-trap greedy walk is not optimal and this is.

    Trap ``i``'s candidates are, in the DP's order, the window from time 0, then ``p = 0, 1, ..., i-1``; the
    first with the most bytes wins. They are visited in reverse (``p`` from ``i-1`` down, time 0 last), with
    ``>=`` keeping that same winner, because ``value[p]`` mostly grows with ``p``: the latest ``p`` sets a high
    bound early, a candidate that cannot reach it even with the trap's whole table (``full``) is skipped without
    computing its window, and the scan stops once ``max(value[:p + 1])`` cannot reach it either. A trap then
    costs a few window computations instead of one per earlier trap.
    """
    n = len(inp.traps)
    value = [0] * n
    value_max = [0] * n  # value_max[p] = max(value[:p + 1])
    choice: list[tuple[int, int, int]] = [(0, 0, -1)] * n  # (bytes, mask, previous offloaded trap)
    for i in range(n):
        table = tables[i]
        if table is not None:
            full = table.sums[-1]
            best_value, best = 0, None
            for p in range(i - 1, -1, -1):
                if value_max[p] + full < best_value:
                    break
                if value[p] <= 0 or value[p] + full < best_value:
                    continue
                s, m = table.best(inp.window_capacity(p, i))
                if s > 0 and value[p] + s >= best_value:
                    best_value, best = value[p] + s, (s, m, p)
            if full >= best_value:
                s, m = table.best(inp.window_capacity(0, i))
                if s > 0 and s >= best_value:
                    best_value, best = s, (s, m, -1)
            if best is not None:
                value[i], choice[i] = best_value, best
        value_max[i] = max(value[i], value_max[i - 1]) if i else value[i]
    return _chain_back(value, choice)


def _chain_back(value: Sequence[int], choice: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The chain ending at the trap with the most hidden bytes, followed back through each trap's choice."""
    out = [(0, 0)] * len(value)
    last = max(range(len(value)), key=lambda k: value[k], default=-1)
    while last >= 0 and value[last] > 0:
        s, m, prev = choice[last]
        out[last] = (s, m)
        last = prev
    return out


# ------------------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------------------


class NthLayerStrategy(Strategy):
    """Offload every tensor of traps 0, n, 2n, ... (n=1 offloads every trap). Predictable, ignores timing."""

    def __init__(self, n: int = 1) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"NthLayerStrategy: n must be an int >= 1 (1 offloads every trap), got {n!r}")
        self.n = n
        self.name = f"nth_layer({n})"

    def __repr__(self) -> str:
        return f"NthLayerStrategy(n={self.n})"

    def plan(self, inp: PlanInput) -> Plan:
        every_tensor = [(1 << len(trap.tensors)) - 1 if i % self.n == 0 else 0 for i, trap in enumerate(inp.traps)]
        why = f"{self.name}: offload all tensors of every trap whose index is a multiple of {self.n}"
        return plan_from_masks(inp, self.name, every_tensor, inp.num_blocks, [why])


class GreedyStrategy(Strategy):
    """Cumulative compute-budget heuristic: one pass in execution order, largest tensors first.

    Trap ``i``'s window is ``scale *`` the compute of the traps since the previous offloaded trap (inclusive;
    from time 0 before the first), so resident and gap traps accumulate budget. Tensors are taken largest
    first, skipping any that would overflow the window (first-fit decreasing). Fast, not optimal: see
    ``KnapsackStrategy``.
    """

    name = "greedy"

    def plan(self, inp: PlanInput) -> Plan:
        masks: list[int] = []
        start = 0
        for i, trap in enumerate(inp.traps):
            cap = inp.window_capacity(start, i)
            mask, used = 0, 0
            for k, tensor in sorted(enumerate(trap.tensors), key=lambda kt: -kt[1].nbytes):
                if 0 < tensor.nbytes <= cap - used:
                    mask |= 1 << k
                    used += tensor.nbytes
            masks.append(mask)
            if mask:
                start = i
        why = "greedy: per trap, largest tensors first while the copy fits the compute since the last offloaded trap"
        return plan_from_masks(inp, self.name, masks, inp.num_blocks, [why])


class KnapsackStrategy(Strategy):
    """Dynamic programming: the most offloaded bytes whose every copy hides behind compute.

    Per trap a 0/1 knapsack over its tensors (most bytes whose block copy fits the trap's window, see
    ``SubsetSums`` for the ``resolution``-bucket discretisation used on traps with many distinct sizes), and
    over traps a DP on the previous offloaded trap, which fixes each window (see ``hidden_chain``). The
    result is hidden by construction: no copy is waited for (its estimated overhead is the streamed traps'
    ``stream_cost_s`` alone). In memory mode it does not chase the budget; ``fits_budget`` just reports it
    (use BudgetFill / Adaptive for a hard budget).
    """

    name = "knapsack"

    def __init__(self, resolution: int = 200, max_states: int = 4096) -> None:
        if resolution < 1 or max_states < 2 * resolution + 1:
            raise ValueError("KnapsackStrategy: need resolution >= 1 and max_states >= 2 * resolution + 1")
        self.resolution = resolution
        self.max_states = max_states

    def plan(self, inp: PlanInput) -> Plan:
        tables = subset_sum_tables(inp, self.resolution, self.max_states)
        chain = hidden_chain(inp, tables)
        why = [
            "knapsack: per-trap 0/1 knapsack of tensor bytes under each transfer window (window = scale x compute "
            "since the previous offloaded trap; gap and resident traps widen it), DP over traps for the windows"
        ]
        if any(t is not None and not t.exact for t in tables):
            why.append(f"knapsack: some traps had > {self.max_states} subset totals; merged into "
                       f"{self.resolution} buckets (still hidden, possibly a little less than optimal)")
        return plan_from_masks(inp, self.name, [m for _, m in chain], inp.num_blocks, why)
