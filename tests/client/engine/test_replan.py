"""Strategy replanning in INFERENCE: measured passes as served, a new streaming set installed between passes.

The model is profiled at a large batch, where every block's copy hides under its compute, and then served at
batch 1, where none does. On a CPU host the engine streams through the loader here (``stream_on_cpu``), with
synchronous copies: the probe sees them as stalls, exactly as a GPU's compute stream waiting on its copies.
"""

from __future__ import annotations

import logging

import pytest
import torch

import flextensor as ft
from flextensor.engine import replan
from flextensor.manager import Phase
from tests.helpers.models import DEVICE, cpu_config, mlp_stack, reference, same

# On CUDA the blocks must be large enough for their copies to hide under batch-BIG compute (128 MiB each). On a
# CPU host the adaptive default streams only when the streamed traps' fixed costs stay under 1% of a profiled
# pass, so BIG gives the pass room for them on a fast CPU too.
LAYERS, D, H, BIG = (6, 2048, 8192, 4096) if torch.cuda.is_available() else (6, 256, 1024, 3072)
SMALL = 1


def _config(**kwargs) -> ft.OffloadConfig:
    kwargs.setdefault("pinned_memory", torch.cuda.is_available())
    kwargs.setdefault("num_blocks", 2)
    return cpu_config(**kwargs)


def _profiled(**kwargs):
    """The MLP stack offloaded and profiled at batch ``BIG``; host blocks installed."""
    model = mlp_stack(n=LAYERS, d=D, h=H)
    ref = mlp_stack(n=LAYERS, d=D, h=H).to(DEVICE)
    big = torch.randn(BIG, D, device=DEVICE)
    ft.offload(model, _config(**kwargs))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(big)
    om.wait_for_host_blocks()
    return model, ref, om


def _block_bytes(om, labels) -> int:
    layouts = {layout.label: layout for layout in om.engine.inference.layouts}
    return sum(p.nbytes for label in labels for p in layouts[label].tensors)


def test_served_at_batch_one_the_stalled_blocks_become_resident():
    model, ref, om = _profiled()
    streamed = om.offloaded_tensors
    assert streamed, "profiled at a large batch, the latency plan streams blocks whose copies hide"
    before = om.get_gpu_memory_usage()
    x = torch.randn(SMALL, D, device=DEVICE)
    expected = reference(ref, x)
    with torch.no_grad():
        for i in range(20):
            assert same(model(x), expected), f"pass {i}"
            if om.strategy_replan_status.state == "done":
                break
    status = om.strategy_replan_status
    assert (status.state, status.applied, status.can_request) == ("done", True, True)
    assert om.offloaded_tensors == {}, "at batch 1 no copy hides: every block is resident"
    moved = _block_bytes(om, streamed)
    after = om.get_gpu_memory_usage()
    assert after.block_bytes == 0 and after.resident_bytes == before.resident_bytes + moved
    assert om.engine.inference.loader is None
    with torch.no_grad():  # back at the large batch: the plan holds (it never grows back)
        big = torch.randn(BIG, D, device=DEVICE)
        for _ in range(4):
            assert same(model(big), reference(ref, big))
    assert om.offloaded_tensors == {}
    assert all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in model.state_dict().items())


def test_allow_strategy_replan_false_keeps_the_plan(caplog):
    model, ref, om = _profiled()
    om.allow_strategy_replan = False
    streamed = om.offloaded_tensors
    assert om.strategy_replan_status.can_request is False
    with caplog.at_level(logging.WARNING, logger="flextensor.manager"):
        assert ft.request_strategy_replan() == 0
    assert "allow_strategy_replan=False" in caplog.text
    x = torch.randn(SMALL, D, device=DEVICE)
    with torch.no_grad():
        for _ in range(12):
            assert same(model(x), reference(ref, x))
    assert om.offloaded_tensors == streamed and om.strategy_replan_status.state == "idle"


def test_requested_replan_measures_then_installs_between_passes():
    model, ref, om = _profiled()
    om.engine.inference.replan.probe = None  # no automatic replan: only the requested one
    om.engine.inference.loader.probe = None
    assert ft.request_strategy_replan() == replan.MEASURE_PASSES
    status = ft.strategy_replan_status()
    assert (status.state, status.can_request, status.applied) == ("in_progress", False, None)
    assert ft.request_strategy_replan() == 0  # one at a time
    x = torch.randn(SMALL, D, device=DEVICE)
    with torch.no_grad():
        for i in range(replan.MEASURE_PASSES):
            assert same(model(x), reference(ref, x))
            assert om.strategy_replan_status.state == "in_progress", f"measured pass {i}"
        for _ in range(20):
            assert same(model(x), reference(ref, x))
            if om.strategy_replan_status.state == "done":
                break
    assert om.strategy_replan_status.applied is True and om.offloaded_tensors == {}


def test_manual_update_state_counts_replays_once_per_generation():
    model, ref, om = _profiled(offload_timing="eager")
    om.engine.inference.replan.probe = None
    om.engine.inference.loader.probe = None
    assert ft.request_strategy_replan(manual_update_state=True) == replan.MEASURE_PASSES
    x = torch.randn(SMALL, D, device=DEVICE)
    with torch.no_grad():
        for generation in range(replan.MEASURE_PASSES):
            assert same(model(x), reference(ref, x))  # a stand-in for graph.replay(): no pass advances the replan
            assert om.strategy_replan_status.state == "in_progress"
            ft.update_state(replay_generation=generation)
            if generation < replan.MEASURE_PASSES - 1:
                ft.update_state(replay_generation=generation)  # the same replay again: not counted
                assert om.strategy_replan_status.state == "in_progress"
    status = om.strategy_replan_status
    assert (status.state, status.applied) == ("done", True)
    assert om.offloaded_tensors == {}
    with torch.no_grad():
        assert same(model(x), reference(ref, x))


def test_memory_mode_replan_keeps_the_budget():
    model, ref, om = _profiled()
    layouts = om.engine.inference.layouts
    block = max(layout.nbytes for layout in layouts)
    usage = om.get_gpu_memory_usage()
    om.release()
    model = mlp_stack(n=LAYERS, d=D, h=H)
    budget = usage.total_bytes - usage.block_bytes + 2 * block  # no room for more resident blocks than now
    om = ft.get_offload_manager()
    om.set_memory_budget(budget)
    big = torch.randn(BIG, D, device=DEVICE)
    ft.offload(model, _config())
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(big)
    om.wait_for_host_blocks()
    assert om.get_gpu_memory_usage().total_bytes <= budget
    assert om.engine.inference.replan.probe is None, "memory mode: stalls are the budget's price, no automatic replan"
    assert ft.request_strategy_replan() == replan.MEASURE_PASSES
    x = torch.randn(SMALL, D, device=DEVICE)
    with torch.no_grad():
        for _ in range(20):
            assert same(model(x), reference(ref, x))
            if om.strategy_replan_status.state == "done":
                break
    assert om.strategy_replan_status.state == "done"
    assert om.offloaded_tensors, "the budget still needs blocks streamed"
    assert om.get_gpu_memory_usage().total_bytes <= budget


def test_install_streaming_round_trip_keeps_outputs_and_exact_bytes():
    model, ref, om = _profiled(load_strategy=ft.NthLayerStrategy(1))
    ctx = om.engine
    labels = [layout.label for layout in ctx.inference.layouts]
    assert len(labels) == LAYERS
    x = torch.randn(3, D, device=DEVICE)
    expected = reference(ref, x)
    baseline = om.get_gpu_memory_usage().resident_bytes
    for streamed in (labels[::2], [], labels[1:2], labels):
        replan.install_streaming(ctx, streamed, 2)
        assert sorted(om.offloaded_tensors) == sorted(streamed)
        usage = om.get_gpu_memory_usage()
        assert usage.resident_bytes == baseline + _block_bytes(om, set(labels) - set(streamed))
        sizes = [layout.nbytes for layout in ctx.inference.layouts if layout.label in streamed]
        assert usage.block_bytes == (min(2, len(sizes)) * max(sizes) if sizes else 0)
        with torch.no_grad():
            for _ in range(2):
                assert same(model(x), expected)
    om.release()
    assert all(torch.equal(v, ref.state_dict()[k].cpu()) for k, v in model.state_dict().items())


def test_replan_is_unavailable_where_nothing_can_change(monkeypatch):
    model = mlp_stack(n=2, d=16, h=32)
    ft.offload(model, _config())
    om = ft.get_offload_manager()
    assert ft.request_strategy_replan() == 0  # DISCOVERY: not in INFERENCE
    assert om.strategy_replan_status == ft.StrategyReplanStatus("idle", can_request=False, applied=None)
    with pytest.raises(TypeError, match="manual_update_state must be a bool"):
        ft.request_strategy_replan(manual_update_state=1)
    assert om.phase is Phase.DISCOVERY


def test_a_profile_saved_after_a_replan_records_the_plan_in_force(tmp_path):
    model, ref, om = _profiled(load_strategy=ft.NthLayerStrategy(1))
    labels = [layout.label for layout in om.engine.inference.layouts]
    replan.install_streaming(om.engine, labels[1:3], 2)
    ft.save_profile(str(tmp_path))
    streamed = om.offloaded_tensors
    ft.release()
    fresh = mlp_stack(n=LAYERS, d=D, h=H)
    ft.offload_from_profile(fresh, str(tmp_path), _config(load_strategy=ft.NthLayerStrategy(1)))
    assert ft.get_offload_manager().offloaded_tensors == streamed
    x = torch.randn(2, D, device=DEVICE)
    with torch.no_grad():
        assert same(fresh(x), reference(ref, x))
