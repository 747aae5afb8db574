"""The device arena's model (raw_block_transfer): its size, next-fit placement and last writers, the pipeline it
simulates on hand-computed timelines, and memory-mode plans that keep a partly streamed trap resident."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flextensor.planning.arena_model import ArenaMap, ArenaTrace, window_bytes
from flextensor.planning.plan_model import (
    PipelineTrace,
    PlanInput,
    TensorCost,
    TransferModel,
    TrapCost,
    make_plan,
    peak_device_bytes,
    rotating_bytes,
    simulate_bytes,
)
from flextensor.planning.strategies import AdaptiveStrategy, BudgetFillStrategy, KnapsackStrategy

UNIT = TransferModel(bandwidth_bytes_per_s=1.0)  # 1 byte per second: sizes read as seconds


def trap(label: str, compute: float, *sizes: int) -> TrapCost:
    return TrapCost(label, compute, tuple(TensorCost(f"{label}.{k}", s) for k, s in enumerate(sizes)))


def arena_input(traps, budget=None, *, transfer=UNIT, num_blocks=2, min_blocks=2, fixed=0, calls=None):
    return PlanInput(tuple(traps), transfer, budget, num_blocks, min_blocks, 1.0, fixed, arena=True, calls=calls)


# ------------------------------------------------------------------------------------------------ size, placement


def test_window_bytes_is_the_largest_run_of_consecutive_calls_around_the_pass():
    assert window_bytes([4, 4, 2, 4], 2) == 8
    assert window_bytes([4, 2, 4, 2], 2) == 6  # every pair holds the small block
    assert window_bytes([1, 5, 1, 1, 5], 2) == 6  # wraps: the last call and the next pass's first
    assert window_bytes([3, 1, 2], 3) == 6 == window_bytes([3, 1, 2], 9)  # never more than a whole pass
    assert window_bytes([7], 2) == 7 and window_bytes([], 3) == 0


def test_next_fit_wraps_to_zero_and_names_the_last_writers():
    ring: ArenaMap[str] = ArenaMap(10)
    assert [ring.place(n) for n in (4, 4)] == [0, 4]
    assert ring.write(0, 4, "a") == [] and ring.write(4, 4, "b") == []
    assert ring.place(3) == 0  # 8 + 3 > 10: wraps, the end [8, 10) stays unused
    assert ring.owners(0, 3) == ["a"] and ring.owners(2, 4) == ["a", "b"]
    assert ring.write(0, 3, "c") == ["a"]
    assert ring.spans == [(0, 3, "c"), (3, 4, "a"), (4, 8, "b")]  # a keeps the byte c did not cover
    assert ring.place(5) == 3 and ring.write(3, 5, "d") == ["a", "b"]
    assert ring.spans == [(0, 3, "c"), (3, 8, "d")]
    with pytest.raises(ValueError, match="does not fit the device arena of 10 bytes"):
        ring.place(11)


# ------------------------------------------------------------------------------------------------------ simulator


def test_arena_waits_for_the_writer_of_its_bytes_not_the_slot_occupant():
    """Blocks 2, 1, 2, 1 in an arena of 3 (two consecutive blocks, where two slots take 4): the third copy wraps
    to 0 and overwrites the first block only, so it waits for t0, as the slots would; the fourth for t1."""
    traps = [trap("t0", 1.0, 2), trap("t1", 1.0, 1), trap("t2", 1.0, 2), trap("t3", 1.0, 1)]
    per = [2, 1, 2, 1]
    plan_in, slots = arena_input(traps), PlanInput(tuple(traps), UNIT, None, 2)
    assert rotating_bytes(plan_in, per, 2) == 3 and rotating_bytes(slots, per, 2) == 4
    # copy0 [0,2] t0 [2,3]; copy1 at 2: [2,3] t1 [3,4]; copy2 wraps to 0, waits for t0 (3): [3,5] t2 [5,6];
    # copy3 at 2 waits for t1 (4): [5,6] t3 [6,7] -> 3 s over 4 s of compute, as with two slots
    assert simulate_bytes(plan_in, per, 2) == pytest.approx(3.0) == simulate_bytes(slots, per, 2)


def test_a_wrap_costs_depth():
    """Where the wrap leaves the arena's end unused, a copy can overlap the block just before it and wait for
    it: blocks 1, 1, 2 in an arena of 3 wait one second longer than in two slots of 2."""
    traps = [trap("t0", 1.0, 1), trap("t1", 1.0, 1), trap("t2", 1.0, 2)]
    plan_in = arena_input(traps)
    assert rotating_bytes(plan_in, [1, 1, 2], 2) == 3
    # copy0 [0,1] t0 [1,2]; copy1 at 1: [1,2] t1 [2,3]; copy2 wraps to 0 over t0 and t1: waits for t1 (3):
    # [3,5] t2 [5,6] -> 3 s over 3 s of compute. Two slots: copy2 waits for t0 (2): [2,4] t2 [4,5] -> 2 s.
    assert simulate_bytes(plan_in, [1, 1, 2], 2) == pytest.approx(3.0)
    assert simulate_bytes(PlanInput(tuple(traps), UNIT, None, 2), [1, 1, 2], 2) == pytest.approx(2.0)
    # Blocks 2, 2, 1, 2, 2 in an arena of 4: placed at 0, 2, 0, 1, 0.
    traps = [trap(f"t{i}", 1.0, n) for i, n in enumerate((2, 2, 1, 2, 2))]
    per = [2, 2, 1, 2, 2]
    ring: ArenaMap[int] = ArenaMap(rotating_bytes(arena_input(traps), per, 2))
    assert ring.arena_bytes == 4 and [ring.place(n) for n in per] == [0, 2, 0, 1, 0]
    # c0 [0,2] t0 [2,3]; c1 [2,4] t1 [4,5]; c2 over t0: [4,5] t2 [5,6]; c3 over t0 and t1 (5): [5,7] t3 [7,8];
    # c4 over t2 and t3 (8): [8,10] t4 [10,11] -> 6 s over 5 s of compute
    assert simulate_bytes(arena_input(traps), per, 2) == pytest.approx(6.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=7), st.integers(2, 4), st.floats(0.1, 3.0),
       st.data())
def test_arena_trace_resumes_like_a_full_simulation(per, blocks, compute, data):
    traps = [TrapCost(f"t{i}", compute * (1 + i % 3), (TensorCost(f"t{i}.0", 6),), 0.1 * (i % 2))
             for i in range(len(per))]
    plan_in = arena_input(traps, transfer=TransferModel(2.0, 0.25))
    trace = ArenaTrace(plan_in, per, blocks)
    assert trace.overhead == simulate_bytes(plan_in, per, blocks)
    i = data.draw(st.integers(0, len(per) - 1))
    nbytes = data.draw(st.integers(0, 6))
    changed = per[:i] + [nbytes] + per[i + 1:]
    assert trace.with_change(i, nbytes) == pytest.approx(simulate_bytes(plan_in, changed, blocks))
    assert trace.per_trap == per


def test_one_size_blocks_simulate_as_slots():
    """Equal blocks: the arena is ``blocks`` slots laid end to end and the pipelines agree to the second."""
    traps = [trap(f"t{i}", c, 3) for i, c in enumerate((1.0, 4.0, 0.5, 2.0, 1.0))]
    per = [3] * 5
    for blocks in (2, 3, 4):
        arena, slots = arena_input(traps, num_blocks=4), PlanInput(tuple(traps), UNIT, None, 4, 2)
        assert rotating_bytes(arena, per, blocks) == 3 * blocks == rotating_bytes(slots, per, blocks)
        assert simulate_bytes(arena, per, blocks) == pytest.approx(PipelineTrace(slots, per, blocks).overhead)


def test_repeated_calls_size_the_arena():
    """A trap called twice a pass puts its block twice into the windows the arena must hold."""
    traps = [trap("a", 1.0, 5), trap("b", 1.0, 1), trap("c", 1.0, 1)]
    once = arena_input(traps)
    twice = arena_input(traps, calls=(0, 1, 0, 2))  # a, b, a, c
    assert rotating_bytes(once, [5, 1, 1], 2) == 6
    assert rotating_bytes(twice, [5, 1, 1], 3) == 11  # a, b, a
    assert rotating_bytes(twice, [5, 0, 1], 2) == 10  # b resident: a, a are consecutive calls
    with pytest.raises(ValueError, match="trap indices 0..2"):
        arena_input(traps, calls=(0, 3))


# ---------------------------------------------------------------------------------------------------------- plans


def test_a_plan_reports_the_arena_it_needs():
    traps = [trap(f"t{i}", 1.0, 4, 4) for i in range(4)]
    selection = {"t0": ("t0.0", "t0.1"), "t1": ("t1.0",), "t2": ("t2.0", "t2.1"), "t3": ("t3.1",)}
    plan = make_plan(arena_input(traps), "mixed", selection, 2)
    assert plan.num_blocks == 2 and plan.block_bytes == 8
    assert plan.rotating_bytes == 12 == window_bytes([8, 4, 8, 4], 2)  # two slots would take 16
    assert plan.peak_device_bytes == plan.resident_bytes + 12 == 8 + 12
    assert plan.block_slots() == {"t0": 0, "t1": 8, "t2": 0, "t3": 8}  # 12 + 8 > 12 wraps to 0
    assert any("device arena of" in line for line in plan.explanation)


def _layers(n: int, tensor: int, compute: float) -> list[TrapCost]:
    """``n`` layers of two equal tensors (fc1, fc2) each, with a streamed trap's own cost."""
    return [TrapCost(f"layers.{i}", compute, (TensorCost(f"layers.{i}.fc1", tensor),
                                               TensorCost(f"layers.{i}.fc2", tensor)), 1e-6) for i in range(n)]


def test_memory_mode_keeps_the_partial_trap_resident():
    """24 transfer-bound layers (a tensor's copy takes ten times a layer's compute), default block counts (4 and
    4) and a budget of 8.5 layers: three slots of a whole layer and a small one of a tensor leave room for 5
    layers, while the arena takes two consecutive layers and keeps 6.5 resident, some of it as layers that keep
    fc1 and stream fc2 (or the reverse), which cost the arena only the tensor they stream."""
    tensor = 1000
    layers = _layers(24, tensor, compute=100.0)
    budget = 17 * tensor  # 8.5 layers
    slots = PlanInput(tuple(layers), UNIT, budget, 4, 4)
    arena = PlanInput(tuple(layers), UNIT, budget, 4, 4, arena=True)
    slot_plan, arena_plan = AdaptiveStrategy().plan(slots), AdaptiveStrategy().plan(arena)
    assert slot_plan.fits_budget and arena_plan.fits_budget
    assert slot_plan.resident_bytes == 10 * tensor and slot_plan.rotating_bytes == 7 * tensor
    assert slot_plan.small_slot_bytes == tensor
    assert arena_plan.resident_bytes == 13 * tensor  # 6.5 layers
    assert arena_plan.rotating_bytes == 4 * tensor and arena_plan.num_blocks == 2
    assert arena_plan.peak_device_bytes == 17 * tensor == arena_plan.resident_bytes + arena_plan.rotating_bytes
    partial = [label for label, names in arena_plan.offloaded.items() if len(names) == 1]
    assert partial  # layers that keep one tensor resident and stream the other
    per = [sum(tensor for _ in arena_plan.offloaded.get(t.label, ())) for t in layers]
    assert arena_plan.peak_device_bytes == peak_device_bytes(arena, per, arena_plan.num_blocks)
    assert arena_plan.estimated_overhead_s < slot_plan.estimated_overhead_s


def test_min_blocks_bounds_slots_not_the_arena():
    layers = _layers(6, 100, compute=1.0)
    budget = 8 * 100
    assert [BudgetFillStrategy().plan(PlanInput(tuple(layers), UNIT, budget, 4, 4, arena=a)).num_blocks
            for a in (False, True)] == [4, 2]
    infeasible = BudgetFillStrategy().plan(PlanInput(tuple(layers), UNIT, 300, 4, 4, arena=True))
    assert not infeasible.fits_budget and "min_blocks" not in infeasible.explanation[0]


def test_latency_mode_plans_count_the_arena():
    traps = [trap("gap", 10.0)] + [trap(f"t{i}", 3.0, 2, 1) for i in range(4)]
    plan = KnapsackStrategy().plan(arena_input(traps, num_blocks=3))
    per = [0] + [sum(n.nbytes for n in t.tensors if n.name in plan.offloaded.get(t.label, ())) for t in traps[1:]]
    assert plan.rotating_bytes == window_bytes([b for b in per if b], plan.num_blocks)
    assert plan.peak_device_bytes == plan.resident_bytes + plan.rotating_bytes
