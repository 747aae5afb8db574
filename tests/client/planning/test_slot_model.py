"""Slots of unequal size (``flextensor.planning.slot_model``): placement, the simulator, and a memory-mode plan
that sizes its last slot to a partly streamed trap."""

from __future__ import annotations

import random

import pytest

from flextensor.planning.plan_model import (
    MIB,
    PlanInput,
    TensorCost,
    TransferModel,
    TrapCost,
    make_plan,
    peak_device_bytes,
    rotating_bytes,
    simulate_bytes,
)
from flextensor.planning.slot_model import PipelineTrace, SlotRing, SlotTrace, slot_sizes, small_slot_for
from flextensor.planning.strategies import AdaptiveStrategy, BudgetFillStrategy


def test_equal_slots_rotate_like_modulo():
    ring: SlotRing[int] = SlotRing((100,) * 4)
    assert [ring.place(size, e)[0] for e, size in enumerate([100, 60, 100, 1, 100, 100, 100, 30, 100])] == \
        [e % 4 for e in range(9)]


def test_each_block_goes_to_the_least_recently_used_slot_that_holds_it():
    ring: SlotRing[int] = SlotRing((512, 512, 512, 256))
    sizes = [512, 512, 256, 512, 512, 256] * 2
    placed = [ring.place(size, entry) for entry, size in enumerate(sizes)]
    assert [slot for slot, _ in placed] == [0, 1, 2, 0, 1, 3, 2, 0, 1, 2, 0, 3]
    # each placement names the slot's previous entry: the one a copy into it must wait for
    assert [previous for _, previous in placed] == [None, None, None, 0, 1, None, 2, 3, 4, 6, 7, 5]
    with pytest.raises(ValueError, match="fits none of the device slots"):
        ring.place(513, 12)


def test_layout_keeps_a_small_slot_only_beside_two_large_ones():
    assert slot_sizes(256, 4, 128) == (256, 256, 256, 128)
    assert slot_sizes(256, 3, 128) == (256, 256, 128)
    assert slot_sizes(256, 2, 128) == (256, 256)  # two slots: a small one would stop the large blocks' pipeline
    assert slot_sizes(256, 4, 256) == slot_sizes(256, 4, 0) == (256,) * 4
    assert small_slot_for(256, 4, 300) == 0 and slot_sizes(256, 0, 128) == ()


def test_with_slots_of_one_size_the_slot_simulator_is_the_pipeline_simulator():
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 12)
        traps = tuple(TrapCost(f"t{i}", rng.uniform(0.0, 2.0), (TensorCost(f"t{i}.w", rng.randint(1, 9) * 100),),
                               rng.choice([0.0, 0.01])) for i in range(n))
        inp = PlanInput(traps, TransferModel(500.0, rng.choice([0.0, 0.05])), None, 4, 2)
        per = [rng.choice([0, t.total_bytes]) for t in traps]
        blocks = rng.randint(1, 4)
        assert SlotTrace(inp, per, blocks, 0).overhead == pytest.approx(PipelineTrace(inp, per, blocks).overhead,
                                                                         abs=1e-12)


def _llm_like(layers: int = 24, tensor: int = 128 * MIB) -> tuple[TrapCost, ...]:
    """Transfer-bound layers of two equal tensors (the 6 GiB bf16 benchmark model's shape)."""
    return tuple(TrapCost(f"layers.{i}", 1e-3, (TensorCost(f"layers.{i}.fc1", tensor),
                                                TensorCost(f"layers.{i}.fc2", tensor)), 2e-5) for i in range(layers))


def _ring_overhead(inp: PlanInput, per: list[int], blocks: int, small: int) -> float:
    """The slot simulator written plainly over a SlotRing: the reference SlotTrace's resumed runs must equal."""
    largest = max(per, default=0)
    used = small if small and any(0 < b <= small for b in per) else 0
    ring: SlotRing[float] = SlotRing(slot_sizes(largest, blocks, used) or (0,))
    clock = last_end = 0.0
    for i, nbytes in enumerate(per):
        if nbytes > 0:
            slot, release = ring.place(nbytes, 0.0)
            start = last_end if release is None or release < last_end else release
            last_end = start + inp.transfer.seconds(nbytes) / inp.scale
            clock = max(clock, last_end) + inp.compute[i] + inp.stream_costs[i]
            ring.set_owner(slot, clock)
        else:
            clock += inp.compute[i]
    overhead = clock - inp.total_compute_s
    return 0.0 if overhead <= 1e-9 * max(inp.total_compute_s, 1e-12) else overhead


def test_slot_trace_resumes_like_a_full_simulation():
    """with_change resumes before the changed trap when the slots keep their sizes, and starts over when the
    change resizes them (a new largest block, the small slot used or no longer used): equal either way."""
    rng = random.Random(11)
    for _ in range(80):
        n = rng.randint(2, 10)
        traps = tuple(TrapCost(f"t{i}", rng.uniform(0.0, 2.0), (TensorCost(f"t{i}.w", 900),),
                               rng.choice([0.0, 0.01])) for i in range(n))
        inp = PlanInput(traps, TransferModel(500.0, rng.choice([0.0, 0.05])), None, 4, 2)
        per = [rng.choice([0, 100, 300, 600, 900]) for _ in traps]
        blocks, small = rng.randint(3, 5), rng.choice([0, 300, 600])
        trace = SlotTrace(inp, per, blocks, small)
        assert trace.overhead == pytest.approx(_ring_overhead(inp, per, blocks, small), abs=1e-12)
        for i in range(n):
            for nbytes in (0, 100, 600, 900, 1200):
                changed = per[:i] + [nbytes] + per[i + 1:]
                assert trace.with_change(i, nbytes) == pytest.approx(
                    _ring_overhead(inp, changed, blocks, small), abs=1e-12)
        assert trace.per_trap == per  # probing leaves the base untouched


def test_a_long_slot_trace_resumes_like_a_full_simulation():
    """The same over long, mostly copy-bound runs, where a changed copy moves every later time and the re-run
    ends as the base run shifted (``flextensor.planning.slot_model``, "Resuming a changed run")."""
    rng = random.Random(12)
    for _ in range(12):
        n = rng.randint(30, 60)
        traps = tuple(TrapCost(f"t{i}", rng.choice([0.1, 0.3, 2.5]), (TensorCost(f"t{i}.w", 900),),
                               rng.choice([0.0, 0.01])) for i in range(n))
        inp = PlanInput(traps, TransferModel(500.0, rng.choice([0.0, 0.05])), None, 4, 2)
        per = [rng.choice([0, 100, 300, 600, 900]) for _ in traps]
        blocks, small = rng.randint(3, 5), rng.choice([300, 600])
        trace = SlotTrace(inp, per, blocks, small)
        for i in range(n):
            for nbytes in (0, 100, 600, 900, 1200):
                changed = per[:i] + [nbytes] + per[i + 1:]
                assert trace.with_change(i, nbytes) == pytest.approx(
                    _ring_overhead(inp, changed, blocks, small), rel=1e-9, abs=1e-12)


def test_a_change_sizes_the_slots_as_the_changed_blocks_do():
    """with_change sizes the slots of a change from running totals (the two largest blocks, how many fit the
    small slot): equal to sizing the changed blocks afresh, the largest one shrunk or grown included."""
    rng = random.Random(13)
    for _ in range(300):
        n = rng.randint(1, 8)
        inp = PlanInput(tuple(TrapCost(f"t{i}", 1.0, (TensorCost(f"t{i}.w", 1200),)) for i in range(n)),
                        TransferModel(500.0), None, 4, 2)
        per = [rng.choice([0, 100, 300, 600, 900]) for _ in range(n)]
        trace = SlotTrace(inp, per, rng.randint(3, 5), rng.choice([300, 600]))
        for i in range(n):
            for nbytes in (0, 100, 300, 600, 900, 1200):
                changed = per[:i] + [nbytes] + per[i + 1:]
                assert trace._slots_after(i, per[i], nbytes) == trace._slots(changed)


def test_memory_mode_sizes_the_last_slot_to_the_partly_streamed_trap():
    """At a budget of 2057 MiB (1.5% of the H200's memory) with the default 4 blocks: four whole-layer slots
    leave room for 4 resident layers (5.0 GiB stream); three whole-layer slots and one of a tensor leave room
    for 4.5 (4.875 GiB stream), and the pass, transfer-bound, gets faster by the bytes not streamed."""
    traps = _llm_like()
    inp = PlanInput(traps, TransferModel(50e9, 2e-5), 2057 * MIB, 4, 4, fixed_resident_bytes=4 * MIB)
    plan = AdaptiveStrategy().plan(inp)
    assert plan.fits_budget and plan.num_blocks == 4
    assert plan.small_slot_bytes == 128 * MIB and plan.rotating_bytes == 3 * 256 * MIB + 128 * MIB
    assert plan.offloaded_bytes <= int(4.875 * 1024) * MIB
    per = [sum(128 * MIB for _ in plan.offloaded.get(t.label, ())) for t in traps]
    assert plan.peak_device_bytes == peak_device_bytes(inp, per, 4, plan.small_slot_bytes) <= inp.budget_bytes
    assert plan.estimated_overhead_s == simulate_bytes(inp, per, 4, plan.small_slot_bytes)
    assert "the last one 128.00 MiB" in " ".join(plan.explanation)
    slots = plan.block_slots()
    assert set(slots) == set(plan.offloaded) and set(slots.values()) <= {0, 1, 2, 3}
    assert all(slots[label] < 3 for label, names in plan.offloaded.items() if len(names) == 2)  # whole layers
    uniform = BudgetFillStrategy()
    uniform.small_slot_sizes = 0
    without = uniform.plan(inp)
    assert without.small_slot_bytes == 0 and without.offloaded_bytes == 5 * 1024 * MIB
    assert plan.estimated_overhead_s < without.estimated_overhead_s


def test_no_small_slot_with_two_blocks_or_in_latency_mode():
    traps = _llm_like(8, 8 * MIB)
    two = BudgetFillStrategy().plan(PlanInput(traps, TransferModel(50e9), 80 * MIB, 2, 2))
    assert two.small_slot_bytes == 0 and two.num_blocks == 2
    latency = AdaptiveStrategy().plan(PlanInput(traps, TransferModel(50e9), None, 4, 4))
    assert latency.small_slot_bytes == 0


def test_make_plan_takes_a_small_slot_where_it_applies():
    traps = _llm_like(6, 1000)
    inp = PlanInput(traps, TransferModel(1e6), None, 4, 4)
    selection = {t.label: (f"{t.label}.fc1", f"{t.label}.fc2") for t in traps}
    selection["layers.3"] = ("layers.3.fc2",)
    plan = make_plan(inp, "fixed", selection, 4, small_slot=1000)
    assert plan.small_slot_bytes == 1000 and plan.rotating_bytes == 3 * 2000 + 1000
    per = [2000, 2000, 2000, 1000, 2000, 2000]
    assert rotating_bytes(inp, per, 4, 1000) == plan.rotating_bytes and rotating_bytes(inp, per, 4) == 8000
    assert make_plan(inp, "fixed", selection, 4, small_slot=2000).small_slot_bytes == 0  # holds the largest


def test_a_small_slot_no_streamed_block_fits_is_not_kept():
    """A small slot that no streamed block fits would be a lower block count in disguise (``min_blocks`` says
    four): neither the bytes nor the simulation count one, and the budget search never keeps one."""
    traps = _llm_like(6, 1000)
    inp = PlanInput(traps, TransferModel(1e6), None, 4, 4)
    whole = {t.label: (f"{t.label}.fc1", f"{t.label}.fc2") for t in traps}
    plan = make_plan(inp, "fixed", whole, 4, small_slot=999)
    assert plan.small_slot_bytes == 0 and plan.rotating_bytes == 4 * 2000
    budgeted = PlanInput(_llm_like(), TransferModel(50e9, 2e-5), 2057 * MIB, 4, 4, fixed_resident_bytes=4 * MIB)
    for compute in (1e-3, 1e-2, 1e-4):
        traps = tuple(TrapCost(t.label, compute, t.tensors, t.stream_cost_s) for t in budgeted.traps)
        plan = AdaptiveStrategy().plan(PlanInput(traps, budgeted.transfer, budgeted.budget_bytes, 4, 4,
                                                 fixed_resident_bytes=4 * MIB))
        streamed = [sum(128 * MIB for _ in plan.offloaded.get(t.label, ())) for t in traps]
        assert not plan.small_slot_bytes or any(0 < b <= plan.small_slot_bytes for b in streamed)
        assert plan.fits_budget
