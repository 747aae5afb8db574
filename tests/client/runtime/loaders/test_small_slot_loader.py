"""The slot loader with a small last slot (``BlockLoader(small_slot=...)``, placement by
``flextensor.planning.slot_model.SlotRing``): exact values, the planned device bytes, the plan carried through
the engine and a saved profile, and copy/compute overlap on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.planning.plan_model import PlanInput, make_plan
from flextensor.planning.slot_model import SlotRing
from flextensor.runtime.host_memory import block_view, pack_block
from flextensor.runtime.loaders.block_loader import BlockLoader
from flextensor.runtime.timing import TimingCollector
from tests.helpers.models import (
    DEVICE, MLPBlock, cpu_config, reference, same,
)

BIG, SMALL = 128, 64  # float32 elements of a large and a small block: 512 and 256 bytes


def _loader(sizes, num_slots, small_slot, device=torch.device("cpu"), pinned=False, schedule=None):
    torch.manual_seed(0)
    params, layouts, hosts = [], [], []
    for i, n in enumerate(sizes):
        param = nn.Parameter(torch.randn(n))
        layout = pack_block(i, f"t{i}", [(f"t{i}.w", torch.float32, (n,), (1,))])
        host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pinned)
        block_view(host, layout.tensors[0]).copy_(param.data)
        params.append([param])
        layouts.append(layout)
        hosts.append(host)
    values = [p[0].detach().clone().to(device) for p in params]
    loader = BlockLoader(device=device, layouts=layouts, host_blocks=hosts, params=params,
                         schedule=schedule if schedule is not None else list(range(len(sizes))),
                         num_slots=num_slots, small_slot=small_slot)
    return loader, params, values


def test_blocks_take_the_slot_the_ring_gives_and_stay_exact():
    sizes = [BIG, BIG, SMALL, BIG, BIG, SMALL]
    loader, params, values = _loader(sizes, num_slots=4, small_slot=SMALL * 4)
    assert loader.slot_sizes == (BIG * 4,) * 3 + (SMALL * 4,) and loader.small_slot == SMALL * 4
    assert loader.device_bytes == 3 * BIG * 4 + SMALL * 4
    ring: SlotRing[int] = SlotRing(loader.slot_sizes)
    for entry in range(3 * len(sizes)):
        block = entry % len(sizes)
        expected_slot, _ = ring.place(sizes[block] * 4, entry)
        loader.enter(block)  # copies (synchronous on the CPU) what it prefetches before returning
        param = params[block][0]
        assert torch.equal(param, values[block]), entry
        assert param.untyped_storage().data_ptr() == loader.slots[expected_slot].untyped_storage().data_ptr()
        loader.exit(block)
    assert loader.resyncs == 0


def test_out_of_order_passes_stay_exact_with_a_small_slot():
    sizes = [BIG, SMALL, BIG, SMALL, BIG]
    loader, params, values = _loader(sizes, num_slots=3, small_slot=SMALL * 4)
    for block in [0, 1, 2, 4, 0, 3, 3, 1, 2, 4, 0, 1, 2, 3, 4]:
        loader.enter(block)
        assert torch.equal(params[block][0], values[block])
        loader.exit(block)
    assert loader.resyncs > 0


def test_a_small_slot_that_cannot_pipeline_is_not_made():
    loader, _params, _values = _loader([BIG, SMALL, BIG], num_slots=2, small_slot=SMALL * 4)
    assert loader.small_slot == 0 and loader.slot_sizes == (BIG * 4,) * 2


class SmallSlot:
    """A strategy streaming whole layers and half of layer 3 through four slots, the last one sized to that half."""

    def plan(self, inp: PlanInput):
        selection = {t.label: tuple(x.name for x in t.tensors) for t in inp.traps}
        selection["3"] = ("3.fc2.weight",)
        half = next(x.nbytes for x in inp.traps[3].tensors if x.name == "3.fc2.weight")
        return make_plan(inp, "small_slot", selection, 4, small_slot=half)


def test_engine_streams_through_a_small_slot_and_a_profile_keeps_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(64, 128) for _ in range(6)]).eval()
    x = torch.randn(3, 64, device=DEVICE)
    ref = reference(model, x)
    half = model[3].fc2.weight.numel() * 4
    ft.offload(model, cpu_config(include_patterns=["*"], load_strategy=SmallSlot(), num_blocks=4, min_blocks=4),
               name="small")
    om = ft.get_offload_manager("small")
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 3):
            assert same(model(x), ref)
    loader = om.loader
    assert isinstance(loader, BlockLoader) and loader.small_slot == half
    whole = max(layout.nbytes for layout in om.engine.inference.layouts)
    assert loader.slot_sizes == (whole,) * 3 + (half,)
    made = loader.device_bytes
    om.save_profile(str(tmp_path))
    ft.release("small")
    torch.manual_seed(0)
    fresh = nn.Sequential(*[MLPBlock(64, 128) for _ in range(6)]).eval()
    ft.offload_from_profile(fresh, str(tmp_path), cpu_config(include_patterns=["*"], num_blocks=4, min_blocks=4),
                            name="adopted")
    adopted = ft.get_offload_manager("adopted")
    assert adopted.loader.small_slot == half and adopted.loader.device_bytes == made
    with torch.no_grad():
        for _ in range(3):
            assert same(fresh(x), ref)


@pytest.mark.cuda
def test_cuda_small_slot_loader_overlaps_and_stays_exact():
    """Large blocks rotate through three slots and small ones take any slot that is free the longest: copies
    still hide under compute, and every value is exact after many rotations."""
    n, d = 8, 1024
    sizes = [d * d if i % 4 != 3 else d * d // 2 for i in range(n)]
    loader, params, expected = _loader(sizes, num_slots=4, small_slot=d * d // 2 * 4,
                                       device=torch.device("cuda", 0), pinned=True)
    assert loader.small_slot == d * d * 2
    timing = TimingCollector(use_cuda=True)
    loader.timing = timing
    x = torch.randn(4096, d, device="cuda")
    checks = []
    for pass_index in range(4):
        timing.begin_pass()
        for i in range(n):
            timing.begin_trap(f"t{i}")
            loader.enter(i)
            timing.start_compute()
            w = params[i][0].view(-1, d)
            y = x
            for _ in range(10):  # enough compute to hide the next 4 MiB copy
                y = torch.tanh(y @ w.t() / d)[:, :d // 2].repeat(1, 2) if w.shape[0] != d else torch.tanh(y @ w / d)
            if pass_index == 3:
                checks.append(torch.equal(params[i][0], expected[i]))
            timing.end_trap()
            loader.exit(i)
        timing.end_pass()
    torch.cuda.synchronize()
    assert all(bool(c) for c in checks) and len(checks) == n
    report = timing.collect()
    steady = report.passes[2]
    assert steady.total_transfer_ms > 0
    assert steady.total_wait_ms < 0.25 * steady.total_transfer_ms, ft.format_offload_timing_table(steady)
    loader.close()
