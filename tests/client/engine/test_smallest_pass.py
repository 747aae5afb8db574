"""Latency mode planned for the smallest pass: a plan made at one batch holds at every batch from its first pass.

No pass reads its weights faster than the device's memory (Note [the smallest pass] in
``flextensor.runtime.device_read_rate``), so a latency-mode plan hides its copies under that bound, not under the
profiled compute alone. On a GPU the bound is the device's own; on a CPU host the engine streams through the loader
here and the tests name a rate through the engine policy: a rate so high that no copy hides under any trap's bound
plays a GPU whose memory reads far faster than its host link.
"""

from __future__ import annotations

import pytest
import torch

import flextensor as ft
from tests.helpers.models import DEVICE, cpu_config, mlp_stack, reference, same

CUDA = torch.cuda.is_available()
LAYERS, D, H, BIG = (6, 2048, 8192, 4096) if CUDA else (6, 256, 1024, 3072)
#: The device memory's read rate the tests plan with: the GPU's own (None), or on a CPU one no copy hides under.
READ_RATE = None if CUDA else 1e15


def _profiled(*, read_rate: float | None, budget: int | None = None):
    """The MLP stack offloaded in latency mode (or at ``budget``) and profiled at batch ``BIG``."""
    model = mlp_stack(n=LAYERS, d=D, h=H)
    ref = mlp_stack(n=LAYERS, d=D, h=H)
    om = ft.get_offload_manager()
    om.set_engine_policy(device_read_rate=read_rate)
    if budget is not None:
        om.set_memory_budget(budget)
    ft.offload(model, cpu_config(pinned_memory=CUDA, num_blocks=2))
    big = torch.randn(BIG, D, device=DEVICE)
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(big)
    om.wait_for_host_blocks()
    return model, ref, om


def _offloadable_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_profiled_at_a_large_batch_the_plan_streams_nothing_a_small_pass_would_wait_for():
    _model, _ref, unbounded = _profiled(read_rate=float("inf"))
    assert unbounded.offloaded_tensors, "without the bound the profiled batch hides copies: blocks stream"
    unbounded.release()

    model, ref, om = _profiled(read_rate=READ_RATE)
    assert om.offloaded_tensors == {}, "no copy hides under the smallest pass: every block stays on the device"
    usage = om.get_gpu_memory_usage()
    assert usage.block_bytes == 0
    assert usage.resident_bytes == _offloadable_bytes(ref)
    x = torch.randn(1, D, device=DEVICE)
    expected = reference(ref, x)
    with torch.no_grad():
        for i in range(12):
            assert same(model(x), expected), f"pass {i} at batch 1"
    status = om.strategy_replan_status
    assert (status.state, status.can_request) == ("idle", False), "no host block streams: nothing to replan"
    big = torch.randn(BIG, D, device=DEVICE)
    with torch.no_grad():
        assert same(model(big), reference(ref, big))
    om.release()
    assert all(torch.equal(v.cpu(), ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_memory_mode_streams_what_its_budget_needs_whatever_the_bound():
    layer = 2 * D * H * 4  # one block's fc1 and fc2 in float32
    budget = 4 * layer  # two of the six layers resident, and two rotating blocks
    model, ref, om = _profiled(read_rate=READ_RATE, budget=budget)
    assert om.offloaded_tensors, "the budget needs blocks streamed; the latency-mode bound does not apply"
    assert om.get_gpu_memory_usage().total_bytes <= budget
    x = torch.randn(1, D, device=DEVICE)
    with torch.no_grad():
        assert same(model(x), reference(ref, x))


@pytest.mark.cuda
def test_a_latency_plan_that_would_not_fit_is_planned_at_what_the_device_has():
    from flextensor.planning.warmup_rule import warmup_margin

    free, total = torch.cuda.mem_get_info(DEVICE)
    room = warmup_margin(total) + 3 * 2 * D * H * 4  # the margin, and about three blocks of the model
    filler = torch.empty(max(0, free - room), dtype=torch.uint8, device=DEVICE)
    try:
        model, ref, om = _profiled(read_rate=READ_RATE)
        assert om.offloaded_tensors, "the whole model cannot stay on the device: blocks stream"
        assert om.get_gpu_memory_usage().total_bytes < _offloadable_bytes(ref)
        for batch in (1, BIG):
            x = torch.randn(batch, D, device=DEVICE)
            with torch.no_grad():
                assert same(model(x), reference(ref, x))
        om.release()
    finally:
        del filler
        torch.cuda.empty_cache()
