"""Packed layout, the block loader's rotation/resync on the CPU, and host block providers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import flextensor as ft
import flextensor.runtime.host_memory as host_memory
from flextensor.runtime.host_memory import (
    ALIGN,
    ARENA_MAX_BYTES,
    PINNED_REGISTER_SETTING,
    PageableProvider,
    ShmProvider,
    TorchPinnedProvider,
    block_view,
    make_provider,
    pack_block,
    pinned_allocator_hint,
    packed_stride,
    plan_arenas,
)
from flextensor.runtime.loaders.block_loader import BlockLoader
from flextensor.runtime.timing import TimingCollector
from tests.helpers.models import (
    DEVICE, count_new_streams, cpu_config, mlp_stack, reference, same,
)


def test_packed_stride():
    assert packed_stride(torch.empty(3, 4)) == (4, 1)
    assert packed_stride(torch.empty(4, 3).t()) == (1, 3)  # dense transposed: kept
    assert packed_stride(torch.empty(3, 8)[:, ::2]) == (4, 1)  # not dense: contiguous
    assert packed_stride(torch.empty(2, 1, 3).permute(2, 1, 0)) == (1, 3, 3)  # size-1 dims do not matter


def test_pack_block_alignment_and_views_roundtrip():
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randint(-5, 5, (7,), dtype=torch.int64),
        "c": torch.randn(4, 6, dtype=torch.bfloat16).t(),
        "d": torch.tensor([True, False, True]),
        "e": torch.empty(0, 3),
        "f": torch.tensor(2.5),
    }
    layout = pack_block(0, "trap", [(n, t.dtype, tuple(t.shape), packed_stride(t)) for n, t in tensors.items()])
    offsets = [p.byte_offset for p in layout.tensors]
    assert all(o % ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert layout.nbytes % ALIGN == 0 and layout.nbytes >= layout.tensors[-1].byte_offset + layout.tensors[-1].nbytes
    assert [p.nbytes for p in layout.tensors] == [60, 56, 48, 3, 0, 4]
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for p in layout.tensors:
        block_view(block, p).copy_(tensors[p.name])
    for p in layout.tensors:
        view = block_view(block, p)
        assert view.dtype == tensors[p.name].dtype and view.stride() == packed_stride(tensors[p.name])
        assert torch.equal(view, tensors[p.name])
        assert view.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()


def _loader(n_blocks=3, num_slots=2, per_tensor=False, schedule=None, gate=None):
    torch.manual_seed(0)
    params, layouts, hosts, values = [], [], [], []
    for i in range(n_blocks):
        ps = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
        layout = pack_block(i, f"t{i}", [(f"t{i}.{k}", p.dtype, tuple(p.shape), packed_stride(p)) for k, p in enumerate(ps)])
        host = torch.empty(layout.nbytes, dtype=torch.uint8)
        for p, pl in zip(ps, layout.tensors):
            block_view(host, pl).copy_(p.data)
        values.append([p.detach().clone() for p in ps])
        params.append(ps)
        layouts.append(layout)
        hosts.append(host)
    loader = BlockLoader(device=torch.device("cpu"), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=schedule if schedule is not None else list(range(n_blocks)), num_slots=num_slots,
                         per_tensor=per_tensor, host_block_gate=gate)
    return loader, params, values


@pytest.mark.parametrize("per_tensor", [False, True])
def test_loader_rotation_in_order(per_tensor):
    loader, params, values = _loader(per_tensor=per_tensor)
    assert loader.num_slots == 2 and loader.device_bytes == 2 * loader.slot_bytes
    for _pass in range(3):
        for b in range(3):
            loader.enter(b)
            for p, v in zip(params[b], values[b]):
                assert torch.equal(p, v)
                # the parameter is a view into the device slot of its entry
                assert p.untyped_storage().data_ptr() == loader.slots[loader._active[1]].untyped_storage().data_ptr()
            loader.exit(b)
    assert loader.resyncs == 0
    # every entry is copied once: 9 entries entered plus the 1 prefetched ahead into the next pass
    assert loader.copies_issued == 10


@pytest.mark.parametrize("per_tensor", [False, True])
def test_host_block_gate_is_asked_before_every_copy_from_that_block(per_tensor):
    """A shared follower's background registration: each copy from block b first waits for block b."""
    calls: list[tuple[int, int]] = []  # (block, copies issued when asked)
    holder: dict = {}

    def gate(block: int) -> None:
        calls.append((block, holder["loader"].copies_issued))

    loader, params, values = _loader(per_tensor=per_tensor, gate=gate)
    holder["loader"] = loader
    for _pass in range(2):
        for b in range(3):
            loader.enter(b)
            assert all(torch.equal(p, v) for p, v in zip(params[b], values[b]))
            loader.exit(b)
    assert [b for b, _ in calls] == [0, 1, 2, 0, 1, 2, 0]  # the entries copied, in order, one call each
    assert [issued for _, issued in calls] == list(range(7))  # asked before the copy, never after
    assert loader.copies_issued == len(calls)


def test_loader_resync_out_of_order_and_repeats():
    loader, params, values = _loader(n_blocks=3, num_slots=3)
    for b in [0, 1, 2, 2, 0, 2, 1, 1, 0]:
        loader.enter(b)
        assert all(torch.equal(p, v) for p, v in zip(params[b], values[b]))
        loader.exit(b)
    assert loader.resyncs > 0


def test_loader_repeated_trap_in_schedule():
    loader, params, values = _loader(n_blocks=2, num_slots=2, schedule=[0, 1, 0])
    for _ in range(2):
        for b in [0, 1, 0]:
            loader.enter(b)
            assert all(torch.equal(p, v) for p, v in zip(params[b], values[b]))
            loader.exit(b)
    assert loader.resyncs == 0


def test_loader_refuses_nesting_and_unknown_blocks():
    loader, _params, _values = _loader(n_blocks=3, schedule=[0, 1])
    loader.enter(0)
    with pytest.raises(RuntimeError, match="cannot nest"):
        loader.enter(1)
    loader.exit(0)
    with pytest.raises(RuntimeError, match="not in the loader's schedule"):
        loader.enter(2)
    with pytest.raises(ValueError, match="uint8"):
        BlockLoader(device=torch.device("cpu"), layouts=loader.layouts[:1], host_blocks=[torch.empty(4)],
                    params=[[]], schedule=[0], num_slots=2)


def test_make_provider_cpu_is_pageable():
    provider = make_provider(cpu_config(), torch.device("cpu"))
    assert isinstance(provider, PageableProvider)
    block = provider.allocate(0, 1024)
    assert block.tensor.dtype == torch.uint8 and block.tensor.numel() == 1024 and not block.prefilled


def test_shm_provider_creator_then_follower(namespace):
    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.names import manager_namespace

    ns = manager_namespace(namespace, "m")
    creator = ShmCoordinator(ns, lease_seconds=1.0)
    follower = None
    made = ShmProvider(creator.memory_owner, pin=False)
    mine = None
    try:
        assert creator.is_creator
        with pytest.raises(RuntimeError, match="call reserve"):
            made.allocate(0, 4096)  # the arena is laid out for every block at once: all sizes first
        made.reserve([4096, 100])
        with pytest.raises(RuntimeError, match="already reserved"):
            made.reserve([4096, 100])
        block, small = made.allocate(0, 4096), made.allocate(1, 100)
        assert not block.prefilled and block.name == small.name  # a small arena is one segment
        assert small.tensor.data_ptr() - block.tensor.data_ptr() == 4096  # each block on its own page
        with pytest.raises(ValueError, match="reserved with 100 bytes"):
            made.allocate(1, 64)
        block.tensor.copy_(torch.arange(4096) % 251)
        small.tensor.fill_(7)
        follower = ShmCoordinator(ns, lease_seconds=1.0)
        assert not follower.is_creator
        mine = ShmProvider(follower.memory_owner, pin=False)
        mine.reserve([4096, 100])
        attached, attached_small = mine.allocate(0, 4096), mine.allocate(1, 100)
        assert attached.prefilled and torch.equal(attached.tensor, block.tensor)
        assert torch.equal(attached_small.tensor, small.tensor) and attached.name == block.name
        del attached, attached_small, block, small
    finally:
        made.close()
        if mine is not None:
            mine.close()
        if follower is not None:
            follower.close()
        creator.close()


def test_engine_with_shm_host_blocks(namespace):
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    cfg = cpu_config(shm_enabled=True, shm_namespace=namespace, load_strategy=ft.NthLayerStrategy(1))
    ft.offload(model, cfg, name="shm")
    om = ft.get_offload_manager("shm")
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            assert same(model(x), ref)
    state = om.export_state()
    assert all(b.name for b in state.blocks)  # shared blocks are named
    ft.release("shm")  # closes the coordinator: the last participant unlinks every segment
    assert same(reference(model, x), ref)


MiB, GiB = 1 << 20, 1 << 30
LAYER = 268_451_840  # one bench layer (hidden 4096, mlp_ratio 2, bf16): just over 256 MiB


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _arena_cost(sizes, groups, rounded: bool) -> int:
    page = lambda n: (n + 4095) // 4096 * 4096  # noqa: E731
    per = [sum(page(sizes[i]) for i in g) for g in groups]
    return sum(_pow2(b) if rounded else b for b in per)


def test_plan_arenas_power_of_two_beats_one_allocation_per_block():
    sizes = [LAYER] * 16
    groups = plan_arenas(sizes, power_of_two=True)
    assert [i for g in groups for i in g] == list(range(16))  # consecutive, in order, each block once
    assert all(_arena_cost(sizes, [g], False) <= ARENA_MAX_BYTES for g in groups)
    per_block = 16 * _pow2(LAYER)  # what one pin_memory allocation per block page-locks: 8 GiB
    assert per_block == 8 * GiB
    assert _arena_cost(sizes, groups, True) == 5 * GiB  # [7, 7, 2] layers: 2 + 2 + 1 GiB
    # never worse than one allocation per block, whatever the sizes
    for sizes in ([3 * MiB, 5 * MiB, 1 * MiB], [700 * MiB] * 3 + [10 * MiB], [3 * GiB, 1 * MiB], [4096] * 50):
        groups = plan_arenas(sizes, power_of_two=True)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert _arena_cost(sizes, groups, True) <= sum(_pow2((s + 4095) // 4096 * 4096) for s in sizes)


def test_plan_arenas_exact_fills_up_to_the_cap():
    sizes = [300 * MiB] * 10
    groups = plan_arenas(sizes, power_of_two=False, max_arena_bytes=1 * GiB)
    assert [len(g) for g in groups] == [3, 3, 3, 1]
    assert plan_arenas([3 * GiB, 1 * MiB], power_of_two=False, max_arena_bytes=GiB) == [[0], [1]]  # larger block alone
    assert plan_arenas([], power_of_two=True) == []


def test_arena_provider_carves_disjoint_page_aligned_blocks():
    provider = PageableProvider(max_arena_bytes=64 * 1024)
    sizes = [5000, 256, 40000, 70000, 3000]
    provider.reserve(sizes)
    blocks = [provider.allocate(i, n) for i, n in enumerate(sizes)]
    provider.finish()
    spans = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.tensor.numel()) for b in blocks)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # disjoint
    assert all(b.tensor.numel() == n and b.tensor.storage_offset() % 4096 == 0 for b, n in zip(blocks, sizes))
    assert len(provider.arena_bytes) == 3  # [5000, 256, 40000] | [70000] (over the cap, alone) | [3000]
    for i, b in enumerate(blocks):
        b.tensor.fill_(i + 1)
    assert all(bool((b.tensor == i + 1).all()) for i, b in enumerate(blocks))
    extra = provider.allocate(7, 100)  # not reserved: an arena of its own
    assert extra.tensor.numel() == 100 and len(provider.arena_bytes) == 4
    provider.close()
    assert all(bool((b.tensor == i + 1).all()) for i, b in enumerate(blocks))  # views keep their arena alive


def test_the_pinned_allocator_hint_names_the_setting_unless_it_is_set():
    hint = pinned_allocator_hint({})
    assert hint is not None and f"add {PINNED_REGISTER_SETTING} to PYTORCH_ALLOC_CONF" in hint
    assert "host_register" in hint
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert pinned_allocator_hint({name: "expandable_segments:True, pinned_use_cuda_host_register :\tTrue"}) is None
        assert f"to {name} " in pinned_allocator_hint({name: "expandable_segments:True"})
        assert pinned_allocator_hint({name: "pinned_use_cuda_host_register:False"}) is not None
        assert pinned_allocator_hint({name: "pinned_use_cuda_host_register:true"}) is not None  # PyTorch: True only
        # the last value of a key counts, as PyTorch parses it
        assert pinned_allocator_hint({name: "pinned_use_cuda_host_register:True,pinned_use_cuda_host_register:False"})
    # PyTorch reads PYTORCH_CUDA_ALLOC_CONF whenever it is set, even empty, and PYTORCH_ALLOC_CONF only otherwise
    both = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": PINNED_REGISTER_SETTING}
    assert "to PYTORCH_CUDA_ALLOC_CONF " in pinned_allocator_hint(both)
    assert pinned_allocator_hint({**both, "PYTORCH_CUDA_ALLOC_CONF": PINNED_REGISTER_SETTING}) is None


def test_the_torch_provider_logs_the_hint_once_per_process(monkeypatch, caplog):
    """Through its first arena (on the build thread in the engine); CPU torch cannot pin, so the allocation
    itself is made pageable here."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(host_memory, "_allocator_hint_logged", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with caplog.at_level(logging.INFO, logger="flextensor.runtime.host_memory"):
        for _ in range(2):
            provider = TorchPinnedProvider()
            provider.reserve([4096, 4096])
            provider.allocate(0, 4096)
            provider.allocate(1, 4096)
            provider.close()
    assert [r.getMessage() for r in caplog.records] == [pinned_allocator_hint({})]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["torch", "host_register"])
def test_pinned_providers(mode):
    cfg = ft.OffloadConfig(pinned_memory=True, pinned_memory_mode=mode)
    provider = make_provider(cfg, torch.device("cuda", 0))
    assert provider.kind == mode
    sizes = [1 << 20, 3 << 20, 5000]
    provider.reserve(sizes)
    blocks = [provider.allocate(i, n) for i, n in enumerate(sizes)]
    if mode == "host_register":
        assert len(provider.arena_bytes) == 1  # one arena, one registration
    else:
        # PyTorch's pinned allocator rounds each allocation up to a power of two: one 4 MiB + 5000 B arena
        # would cost 8 MiB, so the small block gets an arena of its own (4 MiB + 8 KiB in all)
        assert len(provider.arena_bytes) == 2 and sum(provider.arena_bytes) < 8 << 20
    if mode == "host_register":
        assert not any(b.tensor.is_pinned() for b in blocks)  # registered once filled, at finish()
    provider.finish()
    assert all(b.tensor.is_pinned() for b in blocks)
    provider.close()
    if mode == "host_register":
        assert not any(b.tensor.is_pinned() for b in blocks)  # unregistered, still alive through the views


def _pinned_square_blocks(params: list[list[nn.Parameter]]) -> tuple[list, list[torch.Tensor]]:
    """One block per trap holding its one square float32 weight, in pinned host memory, filled from it."""
    layouts, hosts = [], []
    for i, ps in enumerate(params):
        d = ps[0].shape[0]
        layout = pack_block(i, f"t{i}", [(f"t{i}.w", torch.float32, (d, d), (d, 1))])
        host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
        block_view(host, layout.tensors[0]).copy_(ps[0].data)
        layouts.append(layout)
        hosts.append(host)
    return layouts, hosts


@pytest.mark.cuda
def test_cuda_loader_overlaps_without_syncs():
    """The copy for trap N+1 runs on the side stream while trap N computes; values exact after rotation."""
    torch.manual_seed(0)
    n, d = 6, 1024
    params = [[nn.Parameter(torch.randn(d, d))] for _ in range(n)]
    layouts, hosts = _pinned_square_blocks(params)
    expected = [p[0].detach().clone().cuda() for p in params]
    timing = TimingCollector(use_cuda=True)
    loader = BlockLoader(device=torch.device("cuda", 0), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=list(range(n)), num_slots=2, timing=timing)
    x = torch.randn(4096, d, device="cuda")
    checks = []
    for pass_index in range(4):
        timing.begin_pass()
        for i in range(n):
            timing.begin_trap(f"t{i}")
            loader.enter(i)
            timing.start_compute()
            y = x
            for _ in range(10):  # enough compute to hide the next 4 MiB copy
                y = torch.tanh(y @ params[i][0] / d)
            if pass_index == 3:  # compare on the device, read back only at the end
                checks.append(torch.equal(params[i][0], expected[i]))
            timing.end_trap()
            loader.exit(i)
        timing.end_pass()
    torch.cuda.synchronize()
    assert all(bool(c) for c in checks) and len(checks) == n
    report = timing.collect()
    assert report is not None and report.num_passes == 4
    steady = report.passes[2]
    assert steady.total_transfer_ms > 0
    assert steady.total_wait_ms < 0.25 * steady.total_transfer_ms, ft.format_offload_timing_table(steady)
    loader.close()


def test_block_views_equal_block_view_for_every_placement():
    """One typed view per dtype + as_strided gives the very views narrow/view/as_strided gives, for a block that
    starts inside a larger storage and for transposed and empty tensors; a placement outside is refused."""
    from flextensor.runtime.host_memory import TensorPlacement, block_view, block_views

    layout = pack_block(0, "t", [("a", torch.float32, (3, 4), (1, 3)), ("b", torch.bfloat16, (5,), (1,)),
                                 ("c", torch.int64, (0, 2), (2, 1)), ("d", torch.float16, (2, 3), (3, 1))])
    storage = torch.arange(layout.nbytes + 512, dtype=torch.int64).remainder(251).to(torch.uint8)
    for block in (storage.narrow(0, 0, layout.nbytes), storage.narrow(0, 256, layout.nbytes)):
        fast = block_views(block, layout.tensors)
        for placement, view in zip(layout.tensors, fast):
            slow = block_view(block, placement)
            assert (view.dtype, view.shape, view.stride(), view.data_ptr()) == \
                   (slow.dtype, slow.shape, slow.stride(), slow.data_ptr()), placement.name
            assert torch.equal(view, slow)
    outside = TensorPlacement("x", torch.float32, (4,), (1,), layout.nbytes - 8, 16)
    misaligned = TensorPlacement("y", torch.float32, (2,), (1,), 2, 8)
    for bad, name in ((outside, "'x' at bytes"), (misaligned, "'y' at bytes")):
        with pytest.raises(ValueError, match=name):
            block_views(storage.narrow(0, 0, layout.nbytes), [bad])


@pytest.mark.cuda
def test_cuda_a_gated_loader_takes_its_copy_stream_at_its_first_copy(monkeypatch):
    """With a host-block gate (a follower's blocks register in the background) the loader takes its stream from
    PyTorch's pool at its first copy, which waits for the gate anyway, never while the follower attaches (making
    the pool held the GIL for 3-12 ms beside the model factory); without one, when it is built (the switch)."""
    made = count_new_streams(monkeypatch)
    params = [[nn.Parameter(torch.randn(256, 256))] for _ in range(2)]
    layouts, hosts = _pinned_square_blocks(params)
    expected = [p[0].detach().clone().cuda() for p in params]
    gated: list[int] = []

    def build(gate=None):
        return BlockLoader(device=torch.device("cuda", 0), layouts=layouts, host_blocks=hosts, params=params,
                           schedule=[0, 1], num_slots=2, host_block_gate=gate)

    build(gate=gated.append).close()  # closed before any copy: no stream, nothing to wait for
    loader = build(gate=gated.append)
    assert made == []
    for i in range(2):
        loader.enter(i)
        assert torch.equal(params[i][0], expected[i])
        loader.exit(i)
    assert len(made) == 1 and gated[:2] == [0, 1]  # one stream, taken at the first copy and kept
    loader.close()
    build().close()
    assert len(made) == 2  # ungated: made in the constructor


@pytest.mark.cuda
def test_cuda_copies_leave_the_callers_stream_and_device_current():
    """The loader enqueues its copies with its side stream made current and sets the caller's stream back by id
    (cheaper than ``with torch.cuda.stream``): after every enter the caller's own stream (here not the default
    one) is current again, the weights are exact, and a copy that fails still restores it."""
    params = [[nn.Parameter(torch.randn(128, 128))] for _ in range(3)]
    layouts, hosts = _pinned_square_blocks(params)
    expected = [p[0].detach().clone().cuda() for p in params]
    loader = BlockLoader(device=torch.device("cuda", 0), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=[0, 1, 2], num_slots=2)
    mine = torch.cuda.Stream()
    device = torch.cuda.current_device()
    with torch.cuda.stream(mine):
        for _ in range(2):
            for i in range(3):
                loader.enter(i)
                assert torch.cuda.current_stream() == mine and torch.cuda.current_device() == device
                assert torch.equal(params[i][0], expected[i])
                loader.exit(i)
        # Entry 6 (block 0) was issued by entry 5; entering it issues entry 7 (block 1 into slot 1): make it fail.
        loader._copy_pairs[(1, 1)] = (loader._copy_pairs[(1, 1)][0], torch.empty(3, dtype=torch.float64))
        with pytest.raises(RuntimeError):
            loader.enter(0)
        assert torch.cuda.current_stream() == mine
    mine.synchronize()
    loader.close()


def test_host_register_provider_registers_each_block_on_its_own_page_range(monkeypatch):
    """Registration is per block (pages never shared between two registrations), with ``between`` after each
    but the last, and ``close`` unregisters exactly what was registered."""
    import flextensor.shm.pinning as pinning
    from tests.helpers.fake_cudart import FakeCudart

    fake = FakeCudart()
    monkeypatch.setattr(pinning, "host_register", fake.register)
    monkeypatch.setattr(pinning, "host_unregister", fake.unregister)
    provider = host_memory.HostRegisterProvider()
    sizes = [5000, 70000, 4096, 123]
    provider.reserve(sizes)
    blocks = [provider.allocate(i, n) for i, n in enumerate(sizes)]
    pauses: list[int] = []
    provider.finish(between=lambda: pauses.append(len(fake.registers)))
    page = host_memory.PAGE
    assert [(ptr, n) for _, ptr, n in fake.registers] == [(b.tensor.data_ptr(), n) for b, n in zip(blocks, sizes)]
    assert all(ptr % page == 0 for _, ptr, _n in fake.registers)
    spans = sorted((ptr // page, (ptr + n - 1) // page) for _, ptr, n in fake.registers)
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no page in two
    assert pauses == [1, 2, 3]
    provider.close()
    assert fake.live == {} and sorted(fake.unregisters) == sorted(ptr for _, ptr, _n in fake.registers)


def test_a_background_build_never_uses_pytorchs_pinned_allocator(monkeypatch):
    """With pinned memory (the default mode "torch"), a build behind running inference gets blocks registered in
    place: cudaHostAlloc would hold up the running passes' launches."""
    import flextensor.shm.pinning as pinning

    monkeypatch.setattr(pinning, "cudart_available", lambda: True)
    config = ft.OffloadConfig(pinned_memory=False)
    config.pinned_memory = True  # (construction refuses it without CUDA; only the provider choice is tested)
    cuda = torch.device("cuda", 0)
    assert isinstance(host_memory.make_provider(config, cuda), host_memory.TorchPinnedProvider)
    assert isinstance(host_memory.make_provider(config, cuda, register_in_place=True), host_memory.HostRegisterProvider)
