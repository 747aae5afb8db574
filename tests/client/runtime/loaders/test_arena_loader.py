"""The raw_block_transfer loader: one device arena, blocks of unequal size placed on a ring, resync, its views
made once, its bytes equal to the planner's, and the engine streaming through it bit-exactly (CPU; CUDA at the
end)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor as ft
import flextensor.runtime.loaders.arena_loader as arena_loader
from flextensor.planning.arena_model import window_bytes
from flextensor.planning.plan_model import PlanInput, TensorCost, TransferModel, TrapCost, make_plan, rotating_bytes
from flextensor.runtime.loaders.arena_loader import ArenaLoader
from flextensor.runtime.host_memory import ALIGN, block_view, pack_block, packed_stride
from flextensor.runtime.timing import TimingCollector
from tests.helpers.models import (
    DEVICE, MLPBlock, SkippingModel, cpu_config, reference, same,
)

# Rows of each block's one (rows, 64) float32 tensor: 256 B a row, so a block is ``rows * 256`` bytes.
ROWS = (4, 1, 3, 2, 3)


def _blocks(rows=ROWS, *, pinned: bool = False, device: str = "cpu"):
    torch.manual_seed(0)
    params, layouts, hosts, values = [], [], [], []
    for i, r in enumerate(rows):
        p = nn.Parameter(torch.randn(r, 64))
        layout = pack_block(i, f"t{i}", [(f"t{i}.w", p.dtype, tuple(p.shape), packed_stride(p))])
        host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pinned)
        block_view(host, layout.tensors[0]).copy_(p.data)
        values.append(p.detach().clone().to(device))
        params.append([p])
        layouts.append(layout)
        hosts.append(host)
    return params, layouts, hosts, values


def _loader(rows=ROWS, schedule=None, num_blocks=2, gate=None):
    params, layouts, hosts, values = _blocks(rows)
    loader = ArenaLoader(device=torch.device("cpu"), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=schedule if schedule is not None else list(range(len(rows))),
                         num_blocks=num_blocks, host_block_gate=gate)
    return loader, params, values


def _inside_arena(loader: ArenaLoader, tensor: torch.Tensor) -> bool:
    start = loader.arena.data_ptr()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * 4 <= start + loader.arena_bytes


def test_unequal_blocks_rotate_exactly_through_an_arena_sized_to_them():
    """Five blocks of 4, 1, 3, 2, 3 rows through an arena holding any two consecutive ones (7 rows: the last
    block and the next pass's first); the pass does not fill the ring evenly, so blocks move between passes."""
    loader, params, values = _loader(num_blocks=2)
    assert loader.device_bytes == loader.arena_bytes == 7 * 256 == window_bytes([r * 256 for r in ROWS], 2)
    seen: dict[int, set[int]] = {b: set() for b in range(5)}
    for _pass in range(6):
        for b in range(5):
            loader.enter(b)
            assert torch.equal(params[b][0], values[b])
            assert _inside_arena(loader, params[b][0])
            seen[b].add(params[b][0].data_ptr() - loader.arena.data_ptr())
            loader.exit(b)
            assert torch.equal(params[b][0], values[b])  # nothing copied over it while it ran
    assert loader.resyncs == 0
    assert any(len(offsets) > 1 for offsets in seen.values())  # the ring moved blocks between passes
    assert loader.copies_issued == 30 + 1  # every entry once, plus the next pass's first, prefetched


def test_views_are_made_once_per_block_and_offset(monkeypatch):
    made: list[int] = []
    real = arena_loader.block_views

    def counting(block, tensors):
        made.append(1)
        return real(block, tensors)

    monkeypatch.setattr(arena_loader, "block_views", counting)
    loader, params, values = _loader(num_blocks=2)
    counts = []
    for _pass in range(12):
        for b in range(5):
            loader.enter(b)
            loader.exit(b)
        counts.append(len(made))
    assert counts[-1] == counts[len(counts) // 2]  # the placement repeats: no view is built again
    assert counts[-1] <= 5 * 6  # at most L + 1 offsets per schedule position


def test_prefetch_goes_as_far_as_the_arena_holds():
    """Equal blocks, an arena of three: entering a trap keeps two copies ahead, as three slots would; the
    same arena with half-size blocks around holds more of them ahead."""
    loader, _params, _values = _loader(rows=(2, 2, 2, 2, 2), num_blocks=3)
    loader.enter(0)
    assert loader.copies_issued == 3  # entries 0, 1, 2
    loader.exit(0)
    loader.enter(1)
    assert loader.copies_issued == 4
    mixed, _params, _values = _loader(rows=(4, 1, 1, 1, 4), num_blocks=2)  # arena of 8 rows
    mixed.enter(0)
    assert mixed.copies_issued == 4  # 4 + 1 + 1 + 1 rows fit behind the running block


# The CUDA overlap test's blocks in units of 16 MiB (65536 rows): wherever the two-block arena's ring places them,
# each one fits beside the one before it, so every copy can be issued while the trap before it runs.
OVERLAP_UNITS = (4, 1, 3, 1, 1, 2)


def _copies_ahead(rows, passes: int = 4) -> list[int]:
    """Per trap call: how many copies past its own had been issued once it entered (two-block arena)."""
    loader, _params, _values = _loader(rows=rows, num_blocks=2)
    ahead, entry = [], 0
    for _pass in range(passes):
        for b in range(len(rows)):
            loader.enter(b)
            ahead.append(loader.copies_issued - entry - 1)
            loader.exit(b)
            entry += 1
    return ahead


def test_where_the_ring_wraps_decides_if_the_next_block_fits_beside_the_running_one():
    """Two blocks' arena: the next copy is issued at a trap's entry only when its range misses the running
    trap's. With 4, 1, 3, 2, 4, 1 units (arena of 6) the 2-unit block lands at 3..5 after the 3-unit one took
    0..3, and the 4-unit block after it fits nowhere beside it: every pass, that one copy waits for its trap."""
    assert min(_copies_ahead(OVERLAP_UNITS)) >= 1  # some calls even have two or three small copies ahead
    assert _copies_ahead((4, 1, 3, 2, 4, 1)) == [1, 1, 1, 0, 1, 1] * 4


def test_resync_skips_reorders_and_repeats():
    loader, params, values = _loader(num_blocks=3)
    for b in [0, 1, 2, 2, 0, 4, 1, 1, 3, 0, 2, 4, 4]:
        loader.enter(b)
        assert torch.equal(params[b][0], values[b])
        loader.exit(b)
    assert loader.resyncs > 0
    repeated, params, values = _loader(rows=(3, 1), schedule=[0, 1, 0], num_blocks=2)
    assert repeated.device_bytes == 6 * 256  # block 0 then block 0 again (end of pass, start of the next)
    for _ in range(3):
        for b in [0, 1, 0]:
            repeated.enter(b)
            assert torch.equal(params[b][0], values[b])
            repeated.exit(b)
    assert repeated.resyncs == 0


def test_an_aborted_trap_releases_its_range_and_the_gate_is_asked_first():
    asked: list[tuple[int, int]] = []  # (block, copies issued when asked)
    holder: dict = {}
    loader, params, values = _loader(num_blocks=2, gate=lambda block: asked.append((block,
                                                                                    holder["loader"].copies_issued)))
    holder["loader"] = loader
    loader.enter(0)  # copies entries 0 and 1; entry 2 would wrap over the running block 0
    assert asked == [(0, 0), (1, 1)]
    loader.abort()  # an exception inside trap 0
    for b in range(5):
        loader.enter(b)
        assert torch.equal(params[b][0], values[b])
        loader.exit(b)
    assert [issued for _, issued in asked] == list(range(loader.copies_issued))  # asked before each copy
    with pytest.raises(RuntimeError, match="not in the loader's schedule"):
        _loader(schedule=[0, 1])[0].enter(4)
    loader.enter(0)
    with pytest.raises(RuntimeError, match="cannot nest"):
        loader.enter(1)


def test_the_planner_counts_the_bytes_the_loader_allocates():
    """The same streamed calls, the same block count: the plan's rotating bytes are the arena's, to the byte."""
    rows = (4, 1, 3, 2, 4, 1, 1)
    traps = tuple(TrapCost(f"t{i}", 1.0, (TensorCost(f"t{i}.w", r * 256),)) for i, r in enumerate(rows))
    for blocks in (2, 3, 4, 7, 9):
        plan_in = PlanInput(traps, TransferModel(1e9), None, blocks, 2, arena=True)
        plan = make_plan(plan_in, "all", {t.label: (t.tensors[0].name,) for t in traps}, blocks)
        loader, _params, _values = _loader(rows=rows, num_blocks=plan.num_blocks)
        assert loader.device_bytes == plan.rotating_bytes == rotating_bytes(plan_in, [r * 256 for r in rows],
                                                                            plan.num_blocks)


# -------------------------------------------------------------------------------------------------------- engine


class Partial:
    """A strategy streaming a fixed selection per trap (some traps partly), keeping the plan it made."""

    def __init__(self, selection: dict[str, tuple[str, ...]], num_blocks: int = 2) -> None:
        self.selection, self.num_blocks, self.plan_made = selection, num_blocks, None

    def plan(self, inp: PlanInput):
        self.plan_made = make_plan(inp, "partial", self.selection, self.num_blocks)
        return self.plan_made


def _unequal_mlp() -> nn.Sequential:
    """Four MLP blocks of unequal width; every tensor a multiple of the 256-byte packing alignment."""
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(64, h) for h in (128, 64, 192, 128)]).eval()


@pytest.mark.parametrize("timing", ["off", "eager"])
def test_engine_streams_unequal_partly_streamed_traps_exactly(timing):
    model = _unequal_mlp()
    x = torch.randn(3, 64, device=DEVICE)
    ref = reference(model, x)
    strategy = Partial({"0": ("0.fc1.weight", "0.fc1.bias", "0.fc2.weight", "0.fc2.bias"),
                        "1": ("1.fc1.weight",), "2": ("2.fc2.weight", "2.fc1.weight"), "3": ("3.fc2.bias",)},
                       num_blocks=3)
    ft.offload(model, cpu_config(include_patterns=["*"], load_strategy=strategy, num_blocks=3,
                                 transfer_mode="raw_block_transfer", offload_timing=timing), name="raw")
    om = ft.get_offload_manager("raw")
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            assert same(model(x), ref)
        om.wait_for_host_blocks()
        for _ in range(4):
            assert same(model(x), ref)
    loader, plan = om.loader, strategy.plan_made
    assert isinstance(loader, ArenaLoader)
    sizes = [sum(t.numel() * 4 for t in ts) for ts in ([p for p in model[0].parameters()], [model[1].fc1.weight],
                                                       [model[2].fc1.weight, model[2].fc2.weight],
                                                       [model[3].fc2.bias])]
    assert all(n % ALIGN == 0 for n in sizes)
    assert loader.device_bytes == plan.rotating_bytes == window_bytes(sizes, 3) < 3 * max(sizes)
    usage = ft.get_gpu_memory_usage("raw")
    assert usage.block_bytes == loader.device_bytes
    assert usage.total_bytes == plan.peak_device_bytes  # resident + arena, as planned
    report = ft.collect_offload_timing("raw")
    if timing == "off":
        assert report is None
    else:  # every streamed trap's copy is attributed to it, in every pass that streamed
        assert report is not None and report.passes
        streamed = {rec.label for snap in report.passes for rec in snap.per_trap if rec.transfer_ms > 0}
        assert streamed == {"0", "1", "2", "3"}


def test_engine_resyncs_when_control_flow_skips_a_trap():
    torch.manual_seed(0)
    model = SkippingModel().eval()
    pos, neg = torch.ones(2, 16, device=DEVICE), -torch.ones(2, 16, device=DEVICE)
    ref_pos, ref_neg = reference(model, pos), reference(model, neg)
    strategy = Partial({"layers.0": ("layers.0.weight",), "layers.1": ("layers.1.weight", "layers.1.bias"),
                        "layers.2": ("layers.2.weight",), "layers.3": ("layers.3.weight", "layers.3.bias")},
                       num_blocks=3)
    ft.offload(model, cpu_config(include_patterns=["layers.*"], load_strategy=strategy, num_blocks=3,
                                 transfer_mode="raw_block_transfer"))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(pos)
        om.wait_for_host_blocks()
        for x, ref in [(pos, ref_pos), (neg, ref_neg), (neg, ref_neg), (pos, ref_pos), (neg, ref_neg)]:
            assert same(model(x), ref)
    assert isinstance(om.loader, ArenaLoader) and om.loader.resyncs >= 2


def test_engine_memory_mode_fits_its_budget_through_the_arena():
    model = nn.Sequential(*[MLPBlock(64, 128) for _ in range(6)]).eval()
    x = torch.randn(2, 64, device=DEVICE)
    ref = reference(model, x)
    layer = sum(p.numel() * 4 for p in model[0].parameters())
    om = ft.get_offload_manager("budget")
    om.set_memory_budget(int(3.5 * layer))  # four slots would take 4 layers: too much
    ft.offload(model, cpu_config(include_patterns=["*"], num_blocks=4, min_blocks=4,
                                 transfer_mode="raw_block_transfer"), name="budget")
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            assert same(model(x), ref)
        om.wait_for_host_blocks()
        assert same(model(x), ref)
    assert isinstance(om.loader, ArenaLoader)
    assert ft.get_gpu_memory_usage("budget").total_bytes <= int(3.5 * layer)
    assert om.offloaded_tensors


def test_an_adopted_profile_keeps_the_arena_its_plan_sized(tmp_path):
    """The plan's block count travels with the state: a profile made in memory mode (an arena of two blocks
    where the config allows four) is adopted with the same arena, not one sized from the config."""
    x = torch.randn(2, 64, device=DEVICE)
    model = _unequal_mlp()
    ref = reference(model, x)
    cfg = cpu_config(include_patterns=["*"], num_blocks=4, min_blocks=4, transfer_mode="raw_block_transfer",
                     load_strategy=Partial({"0": ("0.fc1.weight",), "1": ("1.fc1.weight", "1.fc2.weight"),
                                            "2": ("2.fc2.weight",), "3": ("3.fc1.weight",)}, num_blocks=2))
    ft.offload(model, cfg, name="made")
    om = ft.get_offload_manager("made")
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            model(x)
    made = om.loader.device_bytes
    assert om.loader.num_slots == 2 and made < window_bytes([l.nbytes for l in om.engine.inference.layouts], 4)
    om.save_profile(str(tmp_path))
    ft.release("made")
    fresh = _unequal_mlp()
    ft.offload_from_profile(fresh, str(tmp_path), cpu_config(include_patterns=["*"], num_blocks=4, min_blocks=4,
                                                             transfer_mode="raw_block_transfer"), name="adopted")
    adopted = ft.get_offload_manager("adopted")
    assert isinstance(adopted.loader, ArenaLoader) and adopted.loader.device_bytes == made
    with torch.no_grad():
        assert same(fresh(x), ref)


def test_a_replan_streams_its_new_set_through_an_arena_sized_to_it():
    from flextensor.engine import replan

    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(64, h) for h in (128, 64, 192, 128, 64, 128)]).eval()
    x = torch.randn(2, 64, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(include_patterns=["*"], load_strategy=ft.NthLayerStrategy(1),
                                 transfer_mode="raw_block_transfer"))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    om.wait_for_host_blocks()
    ctx = om.engine
    plan_input, _capacity = replan.streaming_input(ctx, {label: 1e-3 for label in ctx.sequence}, set())
    assert plan_input.arena and plan_input.calls == tuple(range(6))
    labels = [layout.label for layout in ctx.inference.layouts]
    for streamed in (labels[::2], labels[1:2], labels):
        replan.install_streaming(ctx, streamed, 2)
        assert isinstance(om.loader, ArenaLoader)
        sizes = [layout.nbytes for layout in ctx.inference.layouts if layout.label in streamed]
        assert om.get_gpu_memory_usage().block_bytes == window_bytes(sizes, 2)
        with torch.no_grad():
            for _ in range(2):
                assert same(model(x), ref)


# ---------------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_arena_overlaps_without_syncs_and_stays_exact():
    """Unequal blocks through the arena on the side stream: exact after many passes (a copy overwriting a
    range still read would show here), and the steady pass waits little for copies. The blocks are ones whose
    every copy fits beside the running trap (``OVERLAP_UNITS``); where the ring leaves no room for one, its
    trap waits for all of its copy by design, and the planner's ``ArenaTrace`` counts that wait."""
    rows = tuple(65536 * u for u in OVERLAP_UNITS)  # rows of 64 float32: 16 .. 64 MiB, copies of 0.3-1.3 ms
    params, layouts, hosts, values = _blocks(rows, pinned=True, device="cuda")
    timing = TimingCollector(use_cuda=True)
    loader = ArenaLoader(device=torch.device("cuda", 0), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=list(range(len(rows))), num_blocks=2, timing=timing)
    x = torch.randn(256, 64, device="cuda")  # 2.5-10 ms of compute per trap: each next copy can hide
    checks, ahead = [], []
    for pass_index in range(6):
        timing.begin_pass()
        for i in range(len(rows)):
            timing.begin_trap(f"t{i}")
            loader.enter(i)
            ahead.append(loader.copies_issued - len(ahead) - 1)
            timing.start_compute()
            y = x
            for _ in range(30):  # compute that hides the next copy
                y = torch.tanh(y @ params[i][0].t() @ params[i][0] / 1024)
            checks.append((params[i][0] == values[i]).all())  # on the compute stream, inside the trap: no sync
            timing.end_trap()
            loader.exit(i)
        timing.end_pass()
    torch.cuda.synchronize()
    assert len(checks) == 6 * len(rows) and bool(torch.stack(checks).all()), \
        [i for i, ok in enumerate(checks) if not bool(ok)]
    assert min(ahead) >= 1, f"copies issued past its own at each trap entry: {ahead}"
    report = timing.collect()
    steady = report.passes[4]
    table = ft.format_offload_timing_table(steady)
    assert steady.total_transfer_ms > 0, table
    assert steady.total_wait_ms < 0.25 * steady.total_transfer_ms, (
        f"steady pass waited {steady.total_wait_ms:.3f} ms for {steady.total_transfer_ms:.3f} ms of copies "
        f"(arena {loader.arena_bytes >> 20} MiB; per pass, wait/transfer: "
        f"{[(round(p.total_wait_ms, 3), round(p.total_transfer_ms, 3)) for p in report.passes]})\n{table}")
    loader.close()


@pytest.mark.cuda
def test_cuda_arena_engine_bf16_matches_the_slots():
    """The same model streamed through slots and through the arena on the GPU gives the same outputs."""
    outputs = {}
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    for mode in ("allocation_block_transfer", "raw_block_transfer"):
        model = _unequal_mlp().to(torch.bfloat16)
        strategy = Partial({"0": ("0.fc1.weight",), "1": ("1.fc1.weight", "1.fc2.weight"),
                            "2": ("2.fc2.weight",), "3": ("3.fc1.weight", "3.fc2.weight")})
        ft.offload(model, ft.OffloadConfig(include_patterns=["*"], load_strategy=strategy, num_blocks=2,
                                           min_blocks=2, profiling_iters=2, transfer_mode=mode), name=mode)
        om = ft.get_offload_manager(mode)
        with torch.no_grad():
            for _ in range(om.iters_before_inference + 1):
                model(x)
            om.wait_for_host_blocks()
            outputs[mode] = [model(x) for _ in range(3)]
        assert om.loader.device_bytes == strategy.plan_made.rotating_bytes
        ft.release(mode)
    for a, b in zip(outputs["allocation_block_transfer"], outputs["raw_block_transfer"]):
        assert torch.equal(a, b)
