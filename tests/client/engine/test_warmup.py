"""Warm-up residency (flextensor.warmup and the WarmLoader's two modes).

On the CPU: the decision as a pure function (fits / does not fit / memory budget / latency margin / CPU / override),
the WarmLoader's bookkeeping (kept copies, restore, commit, out-of-memory fallback), and the engine end to end in
both modes, forced through the manager's internal override (which makes the CPU "copy" too): outputs exactly equal
in every phase, one copy per tensor for a resident warm-up, none inside a timing window, the data-dependent model,
copies freed before the INFERENCE blocks, reuse of kept copies for tensors that stay resident, release mid-warm-up.
On the GPU (@pytest.mark.cuda): the mode chosen from real free memory, one H2D copy per tensor, device memory back
to the pre-warm-up level plus the INFERENCE blocks, outputs close to the resident model; the stream mode and a
budget that forces it.
"""

from __future__ import annotations

import logging

import time

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import flextensor as ft
import flextensor.engine.build as inference_mod
from flextensor.engine.phase import Phase
from flextensor.engine.warmup import warm_samples
from flextensor.planning.warmup_rule import WarmupMode, decide_warmup, warmup_margin
from flextensor.runtime.loaders.warm_loader import WarmLoader
from tests.helpers.models import (
    ALL,
    DEVICE,
    count_new_streams,
    ManualBlockModel,
    SkippingModel,
    cpu_config,
    mlp_stack,
    reference,
    same,
    snapshot,
    tiny_transformer,
    token_ids,
)

GIB = 1 << 30
MODES = ["resident", "stream"]


# ---------------------------------------------------------------------------------------------------- decision
def test_margin_is_ten_percent_or_one_gib():
    assert warmup_margin(100 * GIB) == 10 * GIB
    assert warmup_margin(5 * GIB) == GIB
    assert warmup_margin(0) == GIB


def test_latency_mode_fits_and_does_not_fit():
    common = dict(device_type="cuda", free_bytes=50 * GIB, total_bytes=100 * GIB)  # margin 10 GiB -> 40 GiB
    fits = decide_warmup(40 * GIB, **common)
    assert fits.mode is WarmupMode.RESIDENT and fits.resident and fits.available_bytes == 40 * GIB
    assert "latency mode" in fits.reason and "40.00 GiB" in fits.reason
    over = decide_warmup(40 * GIB + 1, **common)
    assert over.mode is WarmupMode.STREAM and not over.resident and over.available_bytes == 40 * GIB
    assert "exceed" in over.reason


def test_latency_margin_is_at_least_one_gib_on_a_small_device():
    common = dict(device_type="cuda", free_bytes=3 * GIB, total_bytes=4 * GIB)  # 10% = 0.4 GiB < 1 GiB
    assert decide_warmup(2 * GIB, **common).resident
    assert decide_warmup(2 * GIB + 1, **common).mode is WarmupMode.STREAM
    tiny = decide_warmup(1, device_type="cuda", free_bytes=GIB // 2, total_bytes=GIB)  # margin above free
    assert tiny.mode is WarmupMode.STREAM and tiny.available_bytes < 0


def test_memory_budget_minus_resident():
    common = dict(device_type="cuda", budget_bytes=20 * GIB, resident_bytes=5 * GIB, free_bytes=80 * GIB,
                  total_bytes=100 * GIB)
    fits = decide_warmup(15 * GIB, **common)
    assert fits.resident and fits.available_bytes == 15 * GIB and "memory budget" in fits.reason
    assert "capped" not in fits.reason
    assert decide_warmup(15 * GIB + 1, **common).mode is WarmupMode.STREAM
    over_budget = decide_warmup(1, **{**common, "resident_bytes": 21 * GIB})  # resident alone exceeds it
    assert over_budget.mode is WarmupMode.STREAM and over_budget.available_bytes == -GIB
    nothing = decide_warmup(0, **{**common, "resident_bytes": 21 * GIB})  # weights handed over on the device
    assert nothing.resident and "already" in nothing.reason


def test_memory_budget_capped_by_free_memory_less_margin():
    decision = decide_warmup(25 * GIB, device_type="cuda", budget_bytes=100 * GIB, free_bytes=30 * GIB,
                             total_bytes=100 * GIB)  # set_memory_budget larger than what is free
    assert decision.mode is WarmupMode.STREAM and decision.available_bytes == 20 * GIB and "capped" in decision.reason
    assert decide_warmup(20 * GIB, device_type="cuda", budget_bytes=100 * GIB, free_bytes=30 * GIB,
                         total_bytes=100 * GIB).resident


def test_cpu_is_in_place_whatever_the_numbers():
    for budget in (None, 0, 10 * GIB):
        decision = decide_warmup(5 * GIB, device_type="cpu", budget_bytes=budget)
        assert decision.mode is WarmupMode.IN_PLACE and not decision.resident and "no copies" in decision.reason


def test_override_and_invalid_inputs():
    forced = decide_warmup(10 * GIB, device_type="cpu", override="resident")
    assert forced.resident and forced.forced and "override" in forced.reason
    assert decide_warmup(0, device_type="cuda", total_bytes=GIB, free_bytes=GIB, override="stream").mode is WarmupMode.STREAM
    for bad in ("in-place", "keep", ""):
        with pytest.raises(ValueError, match="override"):
            decide_warmup(1, device_type="cpu", override=bad)
    for kwargs in ({"needed_bytes": -1}, {"needed_bytes": 1.5}, {"needed_bytes": True}):
        with pytest.raises(ValueError, match="needed_bytes"):
            decide_warmup(device_type="cpu", **kwargs)
    with pytest.raises(ValueError, match="budget_bytes"):
        decide_warmup(1, device_type="cuda", budget_bytes=-5, total_bytes=GIB)
    with pytest.raises(ValueError, match="total_bytes"):
        decide_warmup(1, device_type="cuda", free_bytes=GIB)


# ---------------------------------------------------------------------------------------------------- WarmLoader
class LimitedLoader(WarmLoader):
    """A loader whose device "holds" at most ``limit`` copies at once: the next one raises OutOfMemoryError."""

    limit = 2

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        if self.keep and self.kept_count >= self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
        return super()._copy(host)


def _params(n: int = 4) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3, 5)) for _ in range(n)]


def test_loader_keeps_copies_then_restores_or_commits():
    ps = _params()
    hosts = [p.data for p in ps]
    loader = WarmLoader(torch.device("cpu"), keep=True, same_device_copies=ps)
    loader.load(ps[:2])
    copies = [p.data for p in ps[:2]]
    copy_ptrs = [c.data_ptr() for c in copies]
    assert loader.copies == 2 and loader.copied_bytes == 2 * 60 and loader.kept_count == 2
    assert all(c.data_ptr() != h.data_ptr() and torch.equal(c, h) for c, h in zip(copies, hosts))
    loader.unload()  # kept copies survive the trap exit
    loader.load(ps[:3])  # only the new one is copied
    assert loader.copies == 3 and [p.data_ptr() for p in ps[:2]] == copy_ptrs and not loader.active
    assert loader.preload(ps) and loader.copies == 4 and loader.kept_bytes == 4 * 60
    assert loader.restore([ps[0], ps[0]]) == 60 and ps[0].data_ptr() == hosts[0].data_ptr()
    kept_ptr = ps[1].data.data_ptr()
    assert loader.commit([ps[1]]) == 60 and ps[1].data.data_ptr() == kept_ptr and loader.kept_count == 2
    assert loader.restore() == 120 and [p.data_ptr() for p in ps[2:]] == [h.data_ptr() for h in hosts[2:]]
    assert loader.kept_count == 0 and loader.restore() == 0 and loader.commit() == 0


def test_loader_detaches_whole_groups_in_order_or_nothing():
    ps = _params(4)
    hosts = [p.data for p in ps]
    loader = WarmLoader(torch.device("cpu"), keep=True, same_device_copies=ps)
    assert loader.preload(ps[:3]) and loader.holds_all(ps[:3]) and not loader.holds_all(ps)
    copies = [p.data for p in ps[:3]]
    removals = loader.removals
    with pytest.raises(RuntimeError, match="1 tensor"):  # ps[3] is not kept: nothing is detached
        loader.detach([[ps[0]], [ps[2], ps[3]]])
    assert loader.kept_count == 3 and loader.removals == removals
    groups = loader.detach([[ps[2], ps[0]], [ps[1]]])
    assert [[h.data_ptr() for h in g] for g in groups] == [[hosts[2].data_ptr(), hosts[0].data_ptr()],
                                                          [hosts[1].data_ptr()]]
    assert [p.data.data_ptr() for p in ps[:3]] == [c.data_ptr() for c in copies]  # still on their device copies
    assert loader.kept_count == 0 and loader.removals == removals + 1 and not loader.holds_all(ps[:1])
    assert loader.holds_all([])
    assert not loader.same_device_copies & {id(p) for p in ps[:3]}  # their device copies are theirs for good
    assert id(ps[3]) in loader.same_device_copies


def test_loader_detach_takes_any_iterables_and_refuses_a_tensor_listed_twice():
    ps = _params(3)
    loader = WarmLoader(torch.device("cpu"), keep=True, same_device_copies=ps)
    assert loader.preload(ps)
    with pytest.raises(RuntimeError, match="listed twice"):
        loader.detach([[ps[0], ps[1]], [ps[1]]])
    assert loader.kept_count == 3
    assert len(loader.detach([iter(ps[:2]), (p for p in ps[2:])])[1]) == 1 and loader.kept_count == 0


def test_loader_stream_mode_puts_back_after_each_trap():
    ps = _params(2)
    hosts = [p.data for p in ps]
    loader = WarmLoader(torch.device("cpu"), same_device_copies=ps)
    assert not loader.preload(ps) and loader.copies == 0  # preloading is a resident-mode thing
    for _ in range(3):
        loader.load(ps)
        assert loader.active and all(p.data_ptr() != h.data_ptr() and torch.equal(p.data, h) for p, h in zip(ps, hosts))
        loader.unload()
        assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ps, hosts))
    assert loader.copies == 6 and loader.kept_count == 0


def test_loader_times_only_streamed_dma_copies():
    """``load_timed`` times a copy only where the pair would time a DMA (CUDA, page-locked sources, stream
    mode): elsewhere it loads exactly as ``load`` does and returns None."""
    ps = _params(2)
    hosts = [p.data for p in ps]
    loader = WarmLoader(torch.device("cpu"), non_blocking=True, same_device_copies=ps)
    assert loader.load_timed(ps) is None and loader.active and loader.copies == 2
    assert all(torch.equal(p.data, h) and p.data_ptr() != h.data_ptr() for p, h in zip(ps, hosts))
    loader.unload()
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ps, hosts))
    keeper = WarmLoader(torch.device("cpu"), keep=True, non_blocking=True, same_device_copies=ps)
    assert keeper.load_timed(ps) is None and keeper.kept_count == 2 and not keeper.active
    assert keeper.load_timed(ps) is None and keeper.copies == 2  # kept: nothing to copy again


def test_loader_without_override_copies_nothing_on_its_own_device():
    ps = _params(2)
    loader = WarmLoader(torch.device("cpu"), keep=True)
    loader.load(ps)
    assert loader.copies == 0 and loader.kept_count == 0


def test_loader_out_of_memory_falls_back_to_streaming(caplog):
    ps = _params(4)
    hosts = [p.data for p in ps]
    loader = LimitedLoader(torch.device("cpu"), keep=True, same_device_copies=ps)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        assert not loader.preload(ps)
    assert loader.fell_back and not loader.keep and loader.kept_count == 0
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ps, hosts)), "kept copies must be given back"
    assert len([r for r in caplog.records if "out of device memory" in r.getMessage()]) == 1
    loader.load(ps[:3])  # streaming from now on
    assert loader.active and all(torch.equal(p.data, h) and p.data_ptr() != h.data_ptr() for p, h in zip(ps[:3], hosts))
    loader.unload()
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ps, hosts))


def test_loader_out_of_memory_inside_a_trap_loads_the_whole_trap_streamed():
    ps = _params(4)
    hosts = [p.data for p in ps]
    loader = LimitedLoader(torch.device("cpu"), keep=True, same_device_copies=ps)
    loader.load(ps[:1])
    loader.load(ps)  # the 3rd kept copy fails: every tensor of this trap must still be on the "device"
    assert loader.fell_back and loader.kept_count == 0 and len(loader._saved) == 4
    assert all(p.data_ptr() != h.data_ptr() and torch.equal(p.data, h) for p, h in zip(ps, hosts))
    loader.unload()
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ps, hosts))


# ---------------------------------------------------------------------------------------------------- engine (CPU)
def _offload(model, cfg, mode: str | None, name: str = "default"):
    om = ft.get_offload_manager(name)
    om.set_engine_policy(warmup=mode)
    ft.offload(model, cfg, name=name)
    return om


def _run(model, x, ref, om, extra: int = 2) -> list[Phase]:
    seen = []
    with torch.no_grad():
        for _ in range(om.iters_before_inference + extra):
            seen.append(om.phase)
            assert same(model(x), ref), f"output differs in phase {seen[-1]}"
    assert om.phase is Phase.INFERENCE
    return seen


def _candidates(om) -> set[str]:
    return {n for t in om.engine.traps.values() for n in t.candidates} - om.engine.shared


def _stream_copies(om) -> int:
    """Copies of a streamed warm-up: each trap call of a pass copies its candidates (DISCOVERY) or its exclusive
    tensors (PROFILING) that are not resident anyway."""
    cands, cfg = _candidates(om), om.config
    per_pass = {
        "discovery": sum(len(set(om.engine.traps[label].candidates) & cands) for label in om.engine.sequence),
        "profiling": sum(len(set(om.engine.exclusive.get(label, ())) & cands) for label in om.engine.sequence),
    }
    discovery = 0 if cfg.skip_discovery else cfg.discovery_iters
    return discovery * per_pass["discovery"] + cfg.profiling_iters * per_pass["profiling"]


CASES = {
    "mlp": lambda: (mlp_stack(), torch.randn(3, 16), cpu_config(load_strategy=ALL, profiling_iters=3)),
    "mlp-skip-discovery": lambda: (mlp_stack(), torch.randn(3, 16),
                                   cpu_config(load_strategy=ALL, skip_discovery=True)),
    "transformer-blocks": lambda: (tiny_transformer(), token_ids(),
                                   cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL)),
    "transformer-star": lambda: (tiny_transformer(), token_ids(), cpu_config(load_strategy=ALL)),  # tied, ModuleList
    "manual-block": lambda: (_manual(), torch.randn(3, 16), cpu_config(load_strategy=ALL)),
}


def _manual() -> ManualBlockModel:
    torch.manual_seed(0)
    return ManualBlockModel().eval()


@pytest.mark.parametrize("skip_discovery", [False, True])
@pytest.mark.parametrize("profiling_iters", [1, 2, 4])
def test_stream_copies_are_timed_between_the_first_profiling_pass_and_the_last(monkeypatch, profiling_iters,
                                                                              skip_discovery):
    """Which passes ask for timed copies: the PROFILING passes after the first and before the last (the first
    grows the allocator and waits for registrations; the last one's events would make the switch wait)."""
    asked: list[int] = []  # per call: the 1-based pass it was made in
    real = WarmLoader.load_timed

    def spy(loader, tensors):
        asked.append(len(seen))
        return real(loader, tensors)

    monkeypatch.setattr(WarmLoader, "load_timed", spy)
    model, x = mlp_stack(), torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    om = _offload(model, cpu_config(load_strategy=ALL, profiling_iters=profiling_iters,
                                    skip_discovery=skip_discovery), "stream")
    seen: list[Phase] = []
    with torch.no_grad():
        while om.phase is not Phase.INFERENCE:
            seen.append(om.phase)
            assert same(model(x), ref)
    first = 0 if skip_discovery else 1  # the first PROFILING pass's index
    timed = sorted(set(asked))
    assert timed == [p + 1 for p in range(first + 1, first + profiling_iters - 1)]  # 1-based: len(seen) in it
    calls = sum(1 for label in om.engine.sequence if om.engine.exclusive.get(label))
    assert len(asked) == calls * max(0, profiling_iters - 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_engine_exact_in_both_modes(case, mode):
    model, x, cfg = CASES[case]()
    x = x.to(DEVICE)
    ref = reference(model, x)
    before = snapshot(model)
    om = _offload(model, cfg, mode)
    assert om.engine.warm.decision.mode.value == mode and om.engine.warm.decision.forced
    pending = len(om.engine.warm.pending)
    assert (pending == len(_candidates(om))) if mode == "resident" else pending == 0
    seen = _run(model, x, ref, om, extra=0)
    assert seen[0] is (Phase.PROFILING if cfg.skip_discovery else Phase.DISCOVERY)
    warm = om.engine.warm.loader
    if mode == "resident":
        assert warm.copies == len(_candidates(om)) > 0, "a resident warm-up copies each tensor once"
    else:
        assert warm.copies == _stream_copies(om) > 0
    om.wait_for_host_blocks()  # after a stream-mode warm-up INFERENCE copies per call until the blocks are in
    copies = warm.copies
    with torch.no_grad():
        for _ in range(2):
            assert same(model(x), ref)
    assert warm.copies == copies
    assert warm.kept_count == 0 and not warm.active and not warm.fell_back
    ft.release()
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert same(reference(model, x), ref)


def _resident_mlp_without_discovery(profiling_iters: int):
    """An MLP stack offloaded with a resident warm-up and DISCOVERY skipped: (model, input, reference, manager)."""
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    om = _offload(model, cpu_config(load_strategy=ALL, skip_discovery=True, profiling_iters=profiling_iters),
                  "resident")
    return model, x, ref, om


def test_resident_copies_happen_before_every_timing_window():
    """skip_discovery: the first PROFILING pass is timed too, so the one sweep must precede its first trap."""
    model, x, ref, om = _resident_mlp_without_discovery(3)
    counts: list[int] = []
    mark_at = om.engine.clock.mark_at
    om.engine.clock.mark_at = lambda now: (counts.append(om.engine.warm.loader.copies), mark_at(now))[1]
    _run(model, x, ref, om)
    assert set(counts) == {16}
    # The first pass: one mark per trap entry and one at its end, and each entry after the first also closes
    # the window before it first (it may copy: the warm loader is asked once per trap). On the CPU both clocks
    # are the host's, so that pass keeps up and the next two mark only their first entry and their end
    # (flextensor.runtime.trap_windows).
    assert len(counts) == (1 + 3 * 2 + 1) + 2 * 2
    assert all(len(v) == 3 for v in om.profiling_durations.values())  # no pass excluded


class _SlowBlock(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 8), requires_grad=False)
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x @ self.weight


class _GapModel(nn.Module):
    """Two traps; 30 ms of work between them and 20 ms after the second (outside every trap)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SlowBlock(0.01), _SlowBlock(0.01)

    def forward(self, x):
        x = self.a(x)
        time.sleep(0.03)
        x = self.b(x)
        time.sleep(0.02)
        return x


@pytest.mark.skipif(DEVICE.type != "cpu", reason="perf_counter windows with sleeps: the CPU clock")
@pytest.mark.parametrize("mode", ["resident", "stream"])
def test_profiling_windows_run_entry_to_entry_and_never_hold_a_copy(mode, monkeypatch):
    """A trap's window is what can hide the next block's copy: from its entry to the next entry (the last
    trap's to the pass's end), so work between traps counts; a warm-up copy (slowed to 50 ms here) never does."""
    real_copy = WarmLoader._copy
    monkeypatch.setattr(WarmLoader, "_copy", lambda self, host: (time.sleep(0.05), real_copy(self, host))[1])
    model = _GapModel()
    om = _offload(model, cpu_config(include_patterns=["a", "b"], load_strategy=ALL, skip_discovery=True,
                                    profiling_iters=3), mode)
    with torch.no_grad():
        for _ in range(3):
            model(torch.ones(2, 8))
    durations = om.profiling_durations
    assert om.engine.warm.loader.copies == (2 if mode == "resident" else 6)  # the slow copies happened...
    for seconds in durations["a"]:
        assert 0.04 <= seconds < 0.085  # ...in no window: trap a (10 ms) + the gap (30 ms)
    for seconds in durations["b"]:
        assert 0.03 <= seconds < 0.075  # trap b (10 ms) + the tail of the pass (20 ms)


class _PausedMiddle(nn.Module):
    """Three traps; the middle one runs with profiling paused, inside the pass."""

    def __init__(self, manager_name: str) -> None:
        super().__init__()
        self.a, self.b, self.c = _SlowBlock(0.01), _SlowBlock(0.05), _SlowBlock(0.01)
        self.manager_name = manager_name

    def forward(self, x):
        x = self.a(x)
        with ft.pause_profiling(self.manager_name):
            x = self.b(x)
        return self.c(x)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="perf_counter windows with sleeps: the CPU clock")
def test_a_pause_inside_a_pass_ends_the_open_window():
    model = _PausedMiddle("paused")
    om = _offload(model, cpu_config(include_patterns=["a", "b", "c"], load_strategy=ALL, skip_discovery=True,
                                    profiling_iters=3), "resident", name="paused")
    with torch.no_grad():
        for _ in range(3):
            model(torch.ones(2, 8))
    durations = om.profiling_durations
    assert "b" not in durations and len(durations["a"]) == len(durations["c"]) == 3
    assert all(s < 0.04 for s in durations["a"])  # trap a alone (10 ms), not the 50 ms of b run while paused
    assert all(0.009 <= s < 0.04 for s in durations["c"])


def test_resident_profiling_checks_a_trap_once_then_skips_the_load_until_a_copy_is_given_up():
    """Once every tensor of a trap holds its kept copy, later PROFILING calls of that trap skip the loader (a
    per-trap check that cost a few microseconds per tensor on every pass)."""
    model, x, ref, om = _resident_mlp_without_discovery(4)
    loads: list[int] = []
    real_load = om.engine.warm.loader.load
    om.engine.warm.loader.load = lambda tensors: (loads.append(len(list(tensors))), real_load(tensors))[1]
    per_pass = []
    with torch.no_grad():
        for _ in range(3):
            before = len(loads)
            assert same(model(x), ref)
            per_pass.append(len(loads) - before)
    assert per_pass == [len(om.engine.traps), 0, 0]
    om.engine.warm.loader.commit(om.engine.tensor_objs(om.engine.exclusive[next(iter(om.engine.traps))]))  # a trap's copies are given up...
    with torch.no_grad():
        before = len(loads)
        assert same(model(x), ref)
    assert len(loads) - before == len(om.engine.traps)  # ...so every trap is checked again, once
    _run(model, x, ref, om)
    ft.release()


def test_resident_kept_across_passes_freed_before_blocks_and_reused_when_resident(monkeypatch):
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = _offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ft.NthLayerStrategy(2),
                                    profiling_iters=3), "resident")
    names = sorted(_candidates(om))
    originals = {n: om.engine.tensors[n].tensor.data for n in names}
    seen_at_build: list[int] = []
    real_loader = inference_mod.block_loader

    def loader_probe(*args, **kwargs):
        seen_at_build.append(om.engine.warm.loader.kept_count)  # device blocks are allocated here: no warm-up copy left
        return real_loader(*args, **kwargs)

    monkeypatch.setattr(inference_mod, "block_loader", loader_probe)
    kept_ptrs: dict[str, int] = {}
    with torch.no_grad():
        for i in range(om.iters_before_inference - 1):
            assert same(model(ids), ref)
            ptrs = {n: om.engine.tensors[n].tensor.data_ptr() for n in names}
            assert all(ptrs[n] != originals[n].data_ptr() for n in names)  # the kept copies, not the host data
            if i:
                assert ptrs == kept_ptrs, "kept copies must not be replaced between passes"
            kept_ptrs = ptrs
        assert same(model(ids), ref)  # the last PROFILING pass plans; the host blocks are built behind it
    assert om.phase is Phase.INFERENCE and seen_at_build == [], "no device block before the host blocks exist"
    om.wait_for_host_blocks()
    assert seen_at_build == [0] and om.engine.warm.loader.copies == len(names)
    offloaded = {n for ns in om.offloaded_tensors.values() for n in ns}
    stayed = set(names) - offloaded
    assert offloaded and stayed, "NthLayerStrategy(2) offloads some blocks and keeps others"
    assert all(om.engine.tensors[n].tensor.data_ptr() == kept_ptrs[n] for n in stayed), "resident: warm-up copy reused"
    _run(model, ids, ref, om, extra=2)


def test_release_during_resident_warmup_restores_the_original_storages():
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    before = snapshot(model)
    om = _offload(model, cpu_config(load_strategy=ALL, profiling_iters=3), "resident")  # "*": tied, ModuleList
    tensors = {n: om.engine.tensors[n].tensor for n in _candidates(om)}
    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
    with torch.no_grad():
        for _ in range(2):
            assert same(model(ids), ref)
    assert om.phase is Phase.PROFILING and om.engine.warm.loader.kept_count > 0
    kept = {n for n, t in tensors.items() if id(t) in om.engine.warm.loader._kept}
    made_resident = set(tensors) - kept  # used outside their trap: committed to the device after DISCOVERY
    assert kept and made_resident
    ft.release()
    assert {n: tensors[n].data_ptr() for n in kept} == {n: ptrs[n] for n in kept}, "no copy back: the originals"
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("preload", [True, False])
def test_data_dependent_trap_loads_when_first_needed(preload):
    """Layer 1 runs only for positive inputs: it gets its weights when it first runs, and only once."""
    torch.manual_seed(0)
    model = SkippingModel().eval()
    pos, neg = torch.ones(2, 16, device=DEVICE), -torch.ones(2, 16, device=DEVICE)
    ref_pos, ref_neg = reference(model, pos), reference(model, neg)
    om = _offload(model, cpu_config(include_patterns=["layers.*"], load_strategy=ALL, num_blocks=3,
                                    profiling_iters=3), "resident")
    if not preload:
        om.engine.warm.pending = []  # the lazy path: each trap copies its weights when it first needs them
    layer1 = {id(p) for p in model.layers[1].parameters()}
    with torch.no_grad():
        assert same(model(neg), ref_neg)  # DISCOVERY without layer 1
        assert om.engine.warm.loader.copies == (8 if preload else 6)
        assert (id(model.layers[1].weight) in om.engine.warm.loader._kept) == preload
        assert same(model(pos), ref_pos)  # layer 1 runs: its weights are copied now (lazy) and kept
        assert om.engine.warm.loader.copies == 8 and layer1 <= set(om.engine.warm.loader._kept)
        assert same(model(neg), ref_neg) and same(model(pos), ref_pos)
        assert om.phase is Phase.INFERENCE and om.engine.warm.loader.copies == 8
        for x, ref in [(neg, ref_neg), (pos, ref_pos), (pos, ref_pos)]:
            assert same(model(x), ref)


def test_out_of_memory_during_resident_warmup_falls_back(caplog):
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    om = _offload(model, cpu_config(load_strategy=ALL, profiling_iters=2), "resident")
    om.engine.warm.loader.__class__ = LimitedLoader  # the device "fits" two kept copies: the preload runs out of memory
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        _run(model, x, ref, om, extra=0)
    assert om.engine.warm.loader.fell_back and om.engine.warm.loader.copies == 2 + om.iters_before_inference * 16
    om.wait_for_host_blocks()  # built behind passes that copied per call, as the warm-up did after the fall-back
    with torch.no_grad():
        assert same(model(x), ref)
    assert len([r for r in caplog.records if "out of device memory" in r.getMessage()]) == 1


def test_one_info_line_says_the_mode_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="flextensor"):
        ft.offload(mlp_stack(), cpu_config(), name="cpu-run")
        _offload(mlp_stack(seed=1), cpu_config(), "stream", name="forced")
    lines = [r.getMessage() for r in caplog.records if "warm-up on" in r.getMessage()]
    assert len(lines) == 2
    if DEVICE.type == "cpu":
        assert lines[0].startswith("manager 'cpu-run': in-place warm-up on cpu: ") and "no copies" in lines[0]
    else:
        assert lines[0].startswith("manager 'cpu-run': resident warm-up on cuda:0: ") and "fit in" in lines[0]
    assert lines[1].startswith(f"manager 'forced': stream warm-up on {DEVICE}: forced")


# ---------------------------------------------------------------------------------------------------- CUDA
def _round512(n: int) -> int:  # the CUDA caching allocator's granularity (memory_allocated counts rounded blocks)
    return (n + 511) // 512 * 512


def _cuda_setup(strategy=ALL, **kwargs):
    model = tiny_transformer(d=256, heads=4).to(torch.bfloat16)  # ~1 MiB per block: far above rounding slack
    ids = token_ids().cuda()
    with torch.no_grad():
        model.cuda()
        ref = model(ids).float()
        ref = model(ids).float()  # twice: cuBLAS workspaces exist before any measurement
    model.cpu()
    kwargs.setdefault("profiling_iters", 3)
    cfg = ft.OffloadConfig(include_patterns=["class:DecoderBlock"], pinned_memory=True, load_strategy=strategy,
                           num_blocks=2, min_blocks=2, **kwargs)
    return model, ids, ref, cfg


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.cuda
def test_cuda_resident_warmup_copies_once_and_frees_at_inference():
    model, ids, ref, cfg = _cuda_setup()
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.engine.warm.decision.mode is WarmupMode.RESIDENT and not om.engine.warm.decision.forced, om.engine.warm.decision.reason
    names = sorted(_candidates(om))
    nbytes = {n: om.engine.tensors[n].tensor.numel() * om.engine.tensors[n].tensor.element_size() for n in names}
    slack = 512 * (len(names) + 8)
    base = _allocated()  # pre-warm-up: what offload() made resident
    with torch.no_grad():
        _close(model(ids), ref)  # DISCOVERY: the one sweep
        assert om.engine.warm.loader.copies == len(names) and om.engine.warm.loader.copied_bytes == sum(nbytes.values())
        held = _allocated() - base
        assert abs(held - sum(_round512(b) for b in nbytes.values())) <= slack, (held, nbytes)
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)
        assert om.engine.warm.loader.copies == len(names), "no warm-up pass after the first copies anything"
        assert om.engine.warm.loader.kept_count == 0
        blocks = om.loader.device_bytes
        after = _allocated() - base
        assert abs(after - _round512(om.loader.slot_bytes) * om.loader.num_slots) <= slack, (after, blocks)
        for _ in range(2):
            _close(model(ids), ref)
    assert all(b.tensor.is_pinned() for b in om.engine.inference.host_blocks) and om.engine.warm.staging.regions == []
    ft.release()


@pytest.mark.cuda
def test_cuda_resident_reuses_kept_copies_for_tensors_that_stay():
    model, ids, ref, cfg = _cuda_setup(strategy=ft.NthLayerStrategy(2))
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.engine.warm.decision.resident
    names = sorted(_candidates(om))
    with torch.no_grad():
        for _ in range(om.iters_before_inference - 1):
            _close(model(ids), ref)
        kept = {n: om.engine.tensors[n].tensor.data_ptr() for n in names}
        assert all(om.engine.tensors[n].tensor.is_cuda for n in names)
        _close(model(ids), ref)
        assert om.phase is Phase.INFERENCE
        stayed = set(names) - {n for ns in om.offloaded_tensors.values() for n in ns}
        assert stayed and all(om.engine.tensors[n].tensor.data_ptr() == kept[n] for n in stayed)
        for _ in range(2):
            _close(model(ids), ref)
    assert om.engine.warm.loader.copies == len(names)


@pytest.mark.cuda
def test_cuda_stream_warmup_copies_per_trap_call_and_holds_nothing():
    model, ids, ref, cfg = _cuda_setup()
    om = _offload(model, cfg, "stream")
    base = _allocated()
    with torch.no_grad():
        _close(model(ids), ref)
        assert _allocated() == base, "stream mode puts every copy back after its trap"
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)
    assert om.engine.warm.loader.copies == _stream_copies(om) == om.iters_before_inference * len(_candidates(om))


@pytest.mark.cuda
def test_cuda_small_budget_streams():
    model, ids, ref, cfg = _cuda_setup()
    needed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("blocks."))
    om = ft.get_offload_manager()
    om.set_memory_budget(needed - 1)  # less than the candidates alone (and the rest is resident too)
    ft.offload(model, cfg)
    assert om.engine.warm.decision.mode is WarmupMode.STREAM and "memory budget" in om.engine.warm.decision.reason
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            _close(model(ids), ref)
    assert om.engine.warm.loader.copies > len(_candidates(om))


@pytest.mark.cuda
def test_cuda_resident_warmup_copies_are_the_transfer_measurement(monkeypatch):
    """The one sweep of a resident warm-up is timed per trap; the switch to INFERENCE does not sweep again."""

    def no_sweep(*args, **kwargs):
        raise AssertionError("transfer_sweep ran although the warm-up copies were timed")

    import flextensor.engine.switch as switch_mod

    monkeypatch.setattr(switch_mod, "transfer_sweep", no_sweep)
    model, ids, ref, cfg = _cuda_setup()
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.engine.warm.decision.resident and om.engine.warm.loader.non_blocking
    with torch.no_grad():
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)
    per_trap = [sum(om.engine.tensors[n].tensor.numel() * om.engine.tensors[n].tensor.element_size() for n in t.candidates)
                for t in om.engine.traps.values()]
    assert [b for b, _s in om.engine.plan.samples] == sorted({b for b in per_trap if b})  # the fastest per size
    assert all(0 < s < 1 for _b, s in om.engine.plan.samples)
    om.wait_for_host_blocks()
    with torch.no_grad():
        _close(model(ids), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("profiling_iters", [2, 4])
def test_cuda_stream_warmup_copies_are_the_transfer_measurement(monkeypatch, profiling_iters):
    """A stream warm-up times its per-call copies in the PROFILING passes between the first and the last; the
    switch then fits them and sweeps only when no such pass exists (two PROFILING passes)."""
    import flextensor.engine.switch as switch_mod

    sweeps: list[list[int]] = []
    real_sweep = switch_mod.transfer_sweep

    def counted_sweep(device, trap_bytes, **kwargs):
        sweeps.append(list(trap_bytes))
        return real_sweep(device, trap_bytes, **kwargs)

    monkeypatch.setattr(switch_mod, "transfer_sweep", counted_sweep)
    model, ids, ref, cfg = _cuda_setup(profiling_iters=profiling_iters)
    om = ft.get_offload_manager()
    needed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("blocks."))
    om.set_memory_budget(needed - 1)
    ft.offload(model, cfg)
    assert om.engine.warm.decision.mode is WarmupMode.STREAM and om.engine.warm.loader.non_blocking
    timed: list[int] = []
    with torch.no_grad():
        while om.phase is not Phase.INFERENCE:
            # ~0.1 s of GPU sleep ahead of the pass: its copies are queued before the device gets to them, as in a
            # copy-bound pass (a pair whose start the device reached while the host still launched is dropped).
            torch.cuda._sleep(200_000_000)
            _close(model(ids), ref)
            timed.append(len(om.engine.warm.events))
    per_trap = {sum(om.engine.tensors[n].tensor.numel() * om.engine.tensors[n].tensor.element_size()
                    for n in om.engine.exclusive.get(label, ())) for label in om.engine.sequence}
    calls = sum(1 for label in om.engine.sequence if om.engine.exclusive.get(label))
    middle = profiling_iters - 2  # neither the first PROFILING pass nor the last
    assert timed[:-1] == [0] * (1 + 1) + [calls * k for k in range(1, middle + 1)]  # DISCOVERY, first PROFILING
    samples = om.engine.plan.samples
    if middle:
        assert sweeps == [] and [b for b, _s in samples] == sorted(per_trap - {0})
    else:
        assert len(sweeps) == 1
    assert samples and all(0 < s < 0.01 for _b, s in samples)  # MiB copies: never the sleep ahead of them
    om.wait_for_host_blocks()
    with torch.no_grad():
        _close(model(ids), ref)


@pytest.mark.cuda
def test_cuda_a_timed_copy_is_kept_only_when_the_device_did_not_wait_inside_it(monkeypatch):
    """A pair whose start event the device reached before the last copy was queued may contain host time (the
    device idled between them): dropped. Queued behind device work, the pair times the copy alone."""
    device = torch.device("cuda", torch.cuda.current_device())  # indexed, as a tensor's device is
    host = torch.randn(1 << 20).pin_memory()  # 4 MiB, page-locked: a DMA
    tensor = host.clone().pin_memory()
    loader = WarmLoader(device, non_blocking=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the copy is queued long before the device gets to it
    timed = loader.load_timed([tensor])
    assert timed is not None and timed[0] == host.numel() * host.element_size()
    _nbytes, start, end = timed
    end.synchronize()
    assert 0 < start.elapsed_time(end) < 10  # ms: the copy, not the sleep ahead of it
    assert torch.equal(tensor.data.cpu(), host) and tensor.device == device
    loader.unload()
    real_copy = WarmLoader._copy

    def blocked_host(self, source):  # the host held up between the start event and the copy (an allocation)
        time.sleep(0.02)
        return real_copy(self, source)

    monkeypatch.setattr(WarmLoader, "_copy", blocked_host)
    torch.cuda.synchronize()
    assert loader.load_timed([tensor]) is None and tensor.device == device  # copied, untimed
    loader.unload()
    assert tensor.device.type == "cpu"


def _spy_copy_streams(monkeypatch, *, hold_back_first: bool = False) -> list:
    """Record the copy stream of every warm-up copy (None: the current stream); with ``hold_back_first``, queue
    ~0.1 s of GPU sleep on the side stream ahead of its first copy, so a reader that does not wait reads junk."""
    streams: list = []
    original = WarmLoader._copy

    def copy(self, host):
        if hold_back_first and self.copy_stream is not None and not streams:
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(200_000_000)  # GPU clock cycles
        streams.append(self.copy_stream)
        return original(self, host)

    monkeypatch.setattr(WarmLoader, "_copy", copy)
    return streams


@pytest.mark.cuda
def test_cuda_profiling_preload_runs_on_a_side_stream_and_each_trap_waits_for_its_copy(monkeypatch):
    """With DISCOVERY skipped, the first pass's compute overlaps the warm-up sweep: the copies go on a side
    stream, held back here by a long sleep queued ahead of them, and each trap still reads its own weights."""
    streams = _spy_copy_streams(monkeypatch, hold_back_first=True)
    model, ids, ref, cfg = _cuda_setup(skip_discovery=True)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.engine.warm.decision.resident and om.engine.warm.loader.non_blocking and om.phase is Phase.PROFILING
    with torch.no_grad():
        _close(model(ids), ref)  # would read uninitialised device memory if a trap did not wait
        assert streams and all(s is not None and s != torch.cuda.current_stream() for s in streams)
        assert om.engine.warm.loader.copy_stream is None and om.engine.warm.ready == {} and om.engine.warm.last is None
        assert om.engine.warm.loader.copies == len(_candidates(om))
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)
    om.wait_for_host_blocks()
    with torch.no_grad():
        _close(model(ids), ref)


@pytest.mark.cuda
def test_cuda_the_preload_stream_is_made_in_offload_not_in_the_first_pass(monkeypatch):
    """The process's first stream creates PyTorch's stream pool (ms): offload() makes the overlapped preload's
    stream, so the first pass makes none and its first copy is not held back by that set-up."""
    streams = _spy_copy_streams(monkeypatch)
    model, ids, ref, cfg = _cuda_setup(skip_discovery=True)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    made_in_offload = om.engine.warm.stream
    assert made_in_offload is not None
    created = count_new_streams(monkeypatch)
    with torch.no_grad():
        _close(model(ids), ref)
    assert created == [] and om.engine.warm.stream is None
    assert streams and all(s == made_in_offload for s in streams)


@pytest.mark.cuda
def test_cuda_preload_failing_part_way_still_orders_the_copies_it_made(monkeypatch):
    """An error other than out-of-memory in the middle of the overlapped preload: the pass fails, and the copies
    made before it (held back on the side stream) are still waited for by the next pass's traps."""
    original = WarmLoader._copy
    calls = []

    def failing_copy(self, host):
        if self.copy_stream is not None and not calls:
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(200_000_000)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy refused")
        return original(self, host)

    monkeypatch.setattr(WarmLoader, "_copy", failing_copy)
    model, ids, ref, cfg = _cuda_setup(skip_discovery=True)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="copy refused"):
            model(ids)
        assert om.engine.warm.loader.copy_stream is None and om.engine.warm.ready == {} and om.engine.warm.last is None
        monkeypatch.setattr(WarmLoader, "_copy", original)
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)  # the rest is copied when first needed
    om.wait_for_host_blocks()
    with torch.no_grad():
        _close(model(ids), ref)


@pytest.mark.cuda
def test_cuda_discovery_preload_stays_on_the_compute_stream(monkeypatch):
    streams = _spy_copy_streams(monkeypatch)
    model, ids, ref, cfg = _cuda_setup(skip_discovery=False)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    with torch.no_grad():
        _close(model(ids), ref)
    assert streams and all(s is None for s in streams) and om.engine.warm.ready == {}


@pytest.mark.cuda
def test_cuda_profiling_clock_reuses_its_events(monkeypatch):
    """Two events per trap call and pass would be created without the pool; with it, two passes' worth at most
    (none at all once the passes after the first are timed on the host's clock: flextensor.runtime.trap_windows)."""
    created = []

    class CountingEvent(torch.cuda.Event):
        def __new__(cls, *args, **kwargs):
            created.append(1)
            return super().__new__(cls, *args, **kwargs)

    model, ids, ref, cfg = _cuda_setup(skip_discovery=True, profiling_iters=8)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    traps = len(om.engine.traps)
    with torch.no_grad():
        _close(model(ids), ref)  # the preload's own events are not the clock's
        monkeypatch.setattr(torch.cuda, "Event", CountingEvent)
        while om.phase is not Phase.INFERENCE:
            _close(model(ids), ref)
    assert len(created) <= 2 * 2 * traps, (len(created), traps)
    assert all(len(v) == 8 for v in om.profiling_durations.values())
    assert all(s > 0 for v in om.profiling_durations.values() for s in v)


# ---------------------------------------------------------------------------------------------------- warm samples
class _FakeStream:
    """One CUDA stream's timing events as the GPU completes them: in the order recorded."""

    def __init__(self) -> None:
        self.events: list[_FakeEvent] = []
        self.waits: list[_FakeEvent] = []  # the events synchronized on, in order

    def record(self, at_ms: float) -> "_FakeEvent":
        event = _FakeEvent(self, at_ms)
        self.events.append(event)
        return event


class _FakeEvent:
    """``synchronize`` completes every event recorded up to this one on its stream; ``elapsed_time`` needs both
    ends complete (CUDA raises otherwise), so reading a pair before its wait fails here as it would there."""

    def __init__(self, stream: _FakeStream, at_ms: float) -> None:
        self.stream, self.at_ms, self.done = stream, at_ms, False

    def synchronize(self) -> None:
        self.stream.waits.append(self)
        for event in self.stream.events[: self.stream.events.index(self) + 1]:
            event.done = True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_FakeEvent") -> float:
        if not (self.done and end.done):
            raise RuntimeError("elapsed_time of an event pair not yet complete")
        return end.at_ms - self.at_ms


def test_warm_samples_wait_once_for_the_last_copy_then_read_every_pair():
    """The warm-up's event pairs are recorded on one stream: one wait, on the last end event, covers them all;
    empty and zero-length pairs are still dropped, and the events are consumed."""
    stream = _FakeStream()
    pairs = [(1000, 0.0, 2.0), (0, 2.0, 3.0), (500, 3.0, 3.0), (2000, 3.0, 7.0)]  # (bytes, start ms, end ms)
    warm = SimpleNamespace(events=[(nbytes, stream.record(start), stream.record(end)) for nbytes, start, end in pairs])
    engine = SimpleNamespace(warm=warm)  # warm_samples reads only the warm-up's events
    last_end = warm.events[-1][2]
    assert warm_samples(engine) == [(1000, 0.002), (2000, 0.004)]
    assert stream.waits == [last_end]
    assert warm.events == [] and warm_samples(engine) == [] and stream.waits == [last_end]


def test_warm_samples_keep_the_fastest_copy_of_each_size():
    """Several timed copies of one size (one per pass and trap): the fastest is the sample, as a sweep keeps the
    fastest of its repeats; sizes come out sorted."""
    stream = _FakeStream()
    pairs = [(2000, 0.0, 5.0), (1000, 5.0, 8.0), (2000, 8.0, 12.0), (1000, 12.0, 14.0), (2000, 14.0, 20.0)]
    warm = SimpleNamespace(events=[(nbytes, stream.record(start), stream.record(end)) for nbytes, start, end in pairs])
    assert warm_samples(SimpleNamespace(warm=warm)) == [(1000, 0.002), (2000, 0.004)]


def test_warm_samples_wait_for_a_pair_on_another_stream():
    """Timed copies of passes run on different streams (a caller that switched streams): the one wait on the
    last end event does not complete the other stream's pairs, which are waited for on their own, not read
    unfinished."""
    first, second = _FakeStream(), _FakeStream()
    events = [(1000, first.record(0.0), first.record(3.0)), (2000, second.record(3.0), second.record(7.0)),
              (1000, first.record(7.0), first.record(9.0))]
    warm = SimpleNamespace(events=events)
    assert warm_samples(SimpleNamespace(warm=warm)) == [(1000, 0.002), (2000, 0.004)]
    assert first.waits == [events[-1][2]] and second.waits == [events[1][2]]
