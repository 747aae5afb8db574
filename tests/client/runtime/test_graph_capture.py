"""CUDA-graph capture of an offloaded model (Note [loader under CUDA-graph capture] in ``flextensor.runtime.loaders.block_loader``)
and its timing read back after replays (Note [timing replayed passes] in ``flextensor.runtime.graph_timing``).

The loaders' capture bookkeeping is the same on every device, so its rules are checked on the CPU through
``begin_pass(capturing=True)``, for the slots and for the arena (``raw_block_transfer``); capture itself, replays
and their timing need CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.manager import Phase
from flextensor.runtime.host_memory import block_view, pack_block, packed_stride
from flextensor.runtime.loaders.arena_loader import make_loader
from flextensor.runtime.loaders.block_loader import StreamingLoader
from tests.helpers.models import (
    ALL,
    DEVICE,
    cpu_config,
    reference,
    same,
    tiny_transformer,
    token_ids,
)


MODES = ["allocation_block_transfer", "raw_block_transfer"]


def _loader(mode: str = "allocation_block_transfer", n_blocks: int = 3, num_slots: int = 2, gate=None):
    torch.manual_seed(0)
    params, layouts, hosts, values = [], [], [], []
    for i in range(n_blocks):
        ps = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5).to(torch.float16))]
        layout = pack_block(i, f"t{i}", [(f"t{i}.{k}", p.dtype, tuple(p.shape), packed_stride(p))
                                         for k, p in enumerate(ps)])
        host = torch.empty(layout.nbytes, dtype=torch.uint8)
        for p, placement in zip(ps, layout.tensors):
            block_view(host, placement).copy_(p.data)
        values.append([p.detach().clone() for p in ps])
        params.append(ps)
        layouts.append(layout)
        hosts.append(host)
    loader = make_loader(mode, device=torch.device("cpu"), layouts=layouts, host_blocks=hosts, params=params,
                         schedule=list(range(n_blocks)), num_slots=num_slots, host_block_gate=gate)
    return loader, params, values


def _pass(loader: StreamingLoader, params, values, capturing: bool = False) -> int:
    """One forward pass through every block; returns the copies it issued."""
    before = loader.copies_issued
    loader.begin_pass(capturing=capturing)
    for b in range(len(params)):
        loader.enter(b)
        assert all(torch.equal(p, v) for p, v in zip(params[b], values[b]))
        loader.exit(b)
    loader.end_pass()
    return loader.copies_issued - before


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_pass_copies_its_own_blocks_and_nothing_past_its_end(mode: str):
    """Eager passes prefetch the next pass's first block; the captured pass issues that copy again inside itself,
    issues none for the pass after it, and so does every later pass (replays may run between any two)."""
    loader, params, values = _loader(mode, n_blocks=3, num_slots=2)
    assert [_pass(loader, params, values) for _ in range(2)] == [4, 3]  # the first block of the next pass ahead
    assert not loader.self_contained
    assert _pass(loader, params, values, capturing=True) == 3  # the block prefetched before: copied again, inside
    assert loader.captures == 1 and loader.self_contained
    assert [_pass(loader, params, values) for _ in range(3)] == [3, 3, 3]
    assert _pass(loader, params, values, capturing=True) == 3 and loader.captures == 2
    assert loader.resyncs == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_pass_that_skips_a_trap_still_copies_within_the_pass(mode: str):
    """Data-dependent control flow inside a captured pass: the loader resynchronises, every copy stays inside."""
    loader, params, values = _loader(mode, n_blocks=4, num_slots=3)
    _pass(loader, params, values)
    loader.begin_pass(capturing=True)
    for b in (0, 2, 3):
        loader.enter(b)
        assert all(torch.equal(p, v) for p, v in zip(params[b], values[b]))
        loader.exit(b)
    loader.end_pass()
    assert loader.resyncs == 1
    assert _pass(loader, params, values) == 4


@pytest.mark.parametrize("mode", MODES)
def test_capture_waits_for_every_host_blocks_registration(mode: str):
    """A follower's blocks register in the background: capture before every block passed its gate is refused
    (the gate is not called while capturing); after one eager pass it is allowed and calls no gate."""
    asked: list[int] = []
    loader, params, values = _loader(mode, gate=asked.append)
    with pytest.raises(RuntimeError, match="eager forward pass before capturing"):
        loader.begin_pass(capturing=True)
    _pass(loader, params, values)
    assert sorted(set(asked)) == [0, 1, 2]
    calls = len(asked)
    assert _pass(loader, params, values, capturing=True) == 3
    assert len(asked) == calls


def test_capture_cannot_begin_inside_a_trap():
    loader, params, values = _loader()
    loader.enter(0)
    with pytest.raises(RuntimeError, match="capture whole forward passes"):
        loader.begin_pass(capturing=True)


def test_cuda_graph_timing_on_a_cpu_times_eager_passes():
    """offload_timing='cuda_graph' without CUDA: nothing can be captured, passes are timed as 'eager' times them
    and update_offload_timing has nothing to publish."""
    if DEVICE.type != "cpu":
        pytest.skip("the CPU compute device's behaviour")
    model = tiny_transformer()
    ids = token_ids()
    ft.offload(model, cpu_config(include_patterns=["blocks.*"], load_strategy=ALL, offload_timing="cuda_graph"))
    manager = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(ids)
        manager.wait_for_host_blocks()  # passes served while the blocks build copy per call: no loader to time
        for _ in range(2):
            model(ids)
    assert ft.update_offload_timing() is True and ft.update_offload_timing(replay_generation=0) is True
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 2
    assert [s.label for s in report.per_trap] == [f"blocks.{i}" for i in range(4)]


# ----------------------------------------------------------------------------------------------------------------
# CUDA: capture, replay, timing
# ----------------------------------------------------------------------------------------------------------------


def _graph_config(**kwargs) -> ft.OffloadConfig:
    kwargs.setdefault("include_patterns", ["blocks.*"])
    kwargs.setdefault("load_strategy", ALL)
    kwargs.setdefault("profiling_iters", 2)
    kwargs.setdefault("num_blocks", 3)  # 3 slots for 4 streamed layers: each pass shifts the slots by one
    kwargs.setdefault("min_blocks", 2)
    kwargs.setdefault("pinned_memory", True)
    kwargs.setdefault("offload_timing", "cuda_graph")
    return ft.OffloadConfig(**kwargs)


def _inference(model, ids: torch.Tensor):
    manager = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(ids)
        manager.wait_for_host_blocks()
        side = torch.cuda.Stream()  # the warm-up torch.cuda.graph's documentation asks for
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(ids)
        torch.cuda.current_stream().wait_stream(side)
    return manager


def _capture(model, static_ids: torch.Tensor):
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static_ids)
    return graph, out


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replays_of_an_offloaded_model_match_and_are_timed(mode: str):
    """Capture one forward of a model whose four layers stream through three slots (or an arena holding three),
    replay it on new inputs, eager passes in between: every output equals the plain model's; each replay's
    per-trap transfer, compute and wait are read back from the graph's external events."""
    model = tiny_transformer()
    inputs = [token_ids(seed=s) for s in range(4)]
    refs = [reference(model, ids) for ids in inputs]
    ft.offload(model, _graph_config(transfer_mode=mode))
    static_ids = inputs[0].to(DEVICE)
    manager = _inference(model, static_ids)
    assert manager.phase is Phase.INFERENCE and manager.loader.num_slots == 3
    graph, static_out = _capture(model, static_ids)
    assert manager.loader.captures == 1
    ft.reset_offload_timing()  # the eager warm-up passes: not part of the measure
    generation = 0
    for round_ in range(2):
        for ids, ref in zip(inputs, refs):
            static_ids.copy_(ids.to(DEVICE))
            graph.replay()
            assert ft.update_offload_timing(replay_generation=generation) is True
            assert ft.update_offload_timing(replay_generation=generation) is True  # the same replay: once
            generation += 1
            assert same(static_out, ref)
        with torch.no_grad():  # eager passes between replays stream correctly too
            assert same(model(inputs[1].to(DEVICE)), refs[1])
            assert same(model(inputs[2].to(DEVICE)), refs[2])
    torch.cuda.synchronize()
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 2 * len(inputs) + 4  # the replays and the eager passes
    assert [s.label for s in report.per_trap] == [f"blocks.{i}" for i in range(4)]
    replayed = [p for i, p in enumerate(report.passes) if i % (len(inputs) + 2) < len(inputs)]
    for snapshot in replayed:
        assert all(r.transfer_ms > 0 and r.compute_ms > 0 and r.wait_ms >= 0 for r in snapshot.per_trap)
    assert "blocks.3" in ft.format_offload_timing_table(report)
    assert ft.update_offload_timing() is True and ft.collect_offload_timing() is None  # no replay since


@pytest.mark.cuda
def test_cuda_graph_update_publishes_the_graphs_replayed_since_the_last_call():
    """Two graphs (two batch sizes): an update publishes one pass per graph replayed since the previous update
    (its latest replay), none for a graph not replayed."""
    model = tiny_transformer()
    small, large = token_ids(batch=1), token_ids(batch=3)
    ref_small, ref_large = reference(model, small), reference(model, large)
    ft.offload(model, _graph_config())
    static_small, static_large = small.to(DEVICE), large.to(DEVICE)
    _inference(model, static_small)
    with torch.no_grad():
        model(static_large)
    graph_small, out_small = _capture(model, static_small)
    graph_large, out_large = _capture(model, static_large)
    ft.reset_offload_timing()
    graph_large.replay()
    graph_large.replay()
    assert ft.update_offload_timing() is True
    graph_small.replay()
    graph_large.replay()
    assert ft.update_offload_timing() is True
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 3
    assert same(out_small, ref_small) and same(out_large, ref_large)


@pytest.mark.cuda
def test_cuda_graph_capture_refusals_name_the_fix():
    """Capture in PROFILING, while a replan is in progress, with pageable host blocks, or while the host blocks
    are still being built: each refused with a RuntimeError before anything is captured, and the model runs on
    afterwards."""
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    ft.offload(model, _graph_config())
    with pytest.raises(RuntimeError, match="capture after INFERENCE starts"):
        _capture(model, ids)
    manager = _inference(model, ids)
    with torch.no_grad():
        assert same(model(ids), ref)
    assert ft.request_strategy_replan() > 0  # a replan installs a new plan at a coming pass: not capturable now
    with pytest.raises(RuntimeError, match="strategy replan is in progress"):
        _capture(model, ids)
    with torch.no_grad():
        for _ in range(20):
            if ft.strategy_replan_status().state == "done":
                break
            model(ids)
    assert ft.strategy_replan_status().state == "done"
    graph, out = _capture(model, ids)
    graph.replay()
    assert same(out, ref)
    ft.release()

    ft.offload(model, _graph_config(pinned_memory=False))
    _inference(model, ids)
    with pytest.raises(RuntimeError, match="needs pinned copy sources"):
        _capture(model, ids)
    ft.release()

    manager = ft.get_offload_manager()
    manager.set_engine_policy(warmup="resident")  # INFERENCE starts resident while the host blocks are built
    ft.offload(model, _graph_config())
    with torch.no_grad():
        for _ in range(manager.iters_before_inference + 1):
            model(ids)
    assert manager.engine.inference.deferred is not None
    with pytest.raises(RuntimeError, match="wait_for_host_blocks"):
        _capture(model, ids)
    manager.wait_for_host_blocks()
    with pytest.raises(RuntimeError, match="run one eager pass before capturing"):
        _capture(model, ids)  # the pinning of the host blocks is checked by an eager pass, never in a capture
    with torch.no_grad():
        assert same(model(ids), ref)
    graph, out = _capture(model, ids)
    graph.replay()
    assert same(out, ref)
