"""The INFERENCE host blocks built behind resident inference (``flextensor.deferred_build``).

On a CPU host the resident warm-up is forced (``set_engine_policy(warmup=...)``), so the candidates are "copied" as a GPU
would copy them, and the deferral runs exactly as it does after a resident warm-up on a GPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import flextensor as ft
import flextensor.runtime.host_block_build as deferred_mod
import flextensor.standalone_namespace as providers_mod  # where the manager's engine gets its providers
from flextensor.runtime.host_memory import block_view
from flextensor.engine.phase import Phase
from tests.helpers.fake_cudart import FakeCudart, inject_staging
from tests.helpers.models import (
    ALL,
    DEVICE,
    cpu_config,
    reference,
    same,
    snapshot,
    tiny_transformer,
    token_ids,
)


class SlowOrFailingProvider:
    """Wraps the real provider: optional delay per block, an error at block ``fail_at``, and a record of calls."""

    def __init__(self, inner, *, delay: float = 0.0, fail_at: int | None = None,
                 gate: threading.Event | None = None, steps: threading.Semaphore | None = None) -> None:
        self.inner, self.delay, self.fail_at, self.gate, self.steps = inner, delay, fail_at, gate, steps
        self.allocated: list[int] = []
        self.closed = False
        self.thread_names: set[str] = set()

    def reserve(self, sizes):
        return self.inner.reserve(sizes)

    def allocate(self, index, nbytes):
        self.thread_names.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.steps is not None:  # one block per step
            assert self.steps.acquire(timeout=10)
        time.sleep(self.delay)
        if index == self.fail_at:
            raise RuntimeError("cudaHostAlloc: out of memory (pinned)")
        self.allocated.append(index)
        return self.inner.allocate(index, nbytes)

    def pin_filled(self, between=None):
        return self.inner.pin_filled(between=between)

    def finish(self, between=None):
        return self.inner.finish(between=between)

    def release_block(self, index):
        return self.inner.release_block(index)

    def close(self):
        self.closed = True
        return self.inner.close()


@pytest.fixture
def provider_wrap(monkeypatch):
    made: list[SlowOrFailingProvider] = []

    def install(**kwargs):
        real = providers_mod.make_provider

        def make(config, device, **kw):
            wrapper = SlowOrFailingProvider(real(config, device, **kw), **kwargs)
            made.append(wrapper)
            return wrapper

        monkeypatch.setattr(providers_mod, "make_provider", make)
        return made

    return install


def _offload_resident(model, **cfg):
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup="resident")
    cfg.setdefault("include_patterns", ["class:DecoderBlock"])
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=2, **cfg))
    return om


def _profiled_resident():
    """The tiny transformer, its weights before, input, reference output, and its manager right after the switch
    to INFERENCE (resident warm-up forced, so the host blocks are being built in the background)."""
    model = tiny_transformer()
    before = snapshot(model)
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = _offload_resident(model)
    _warm_up(model, ids, ref, om)
    return model, before, ids, ref, om


def _warm_up(model, ids, ref, om) -> None:
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            assert same(model(ids), ref)


def test_inference_starts_resident_then_streams_from_the_next_pass_after_the_build(provider_wrap):
    made = provider_wrap(gate=(gate := threading.Event()))
    model, before, ids, ref, om = _profiled_resident()
    assert om.phase is Phase.INFERENCE and om.engine.inference.loader is None and om.engine.inference.deferred is not None
    with torch.no_grad():
        for _ in range(2):  # the build is held: these passes run with every weight on the device
            assert same(model(ids), ref)
    assert om.engine.inference.loader is None and not om.engine.inference.deferred.done
    gate.set()
    om.engine.inference.deferred.wait()
    with torch.no_grad():
        assert same(model(ids), ref)  # this pass installs the blocks first, then streams
    assert om.engine.inference.deferred is None and om.engine.inference.loader is not None and om.engine.inference.loader.copies_issued > 0
    assert made[0].thread_names == {"ft-host-blocks"} and made[0].allocated == list(range(len(om.engine.inference.layouts)))
    assert len(om.engine.inference.placement) > 0
    for index, placement in om.engine.inference.placement.values():  # each host view holds the weight it streams
        assert torch.equal(block_view(om.engine.inference.host_blocks[index].tensor, placement).cpu(), before[placement.name])
    ft.release()
    assert same(reference(model, ids), ref)


def test_the_build_starts_with_the_first_inference_pass_not_inside_the_last_profiling_pass(provider_wrap):
    """Its first pinned allocations would hold the last profiling pass up in the driver; and a model released
    right after profiling never allocates host blocks at all."""
    made = provider_wrap()
    model, before, ids, ref, om = _profiled_resident()
    assert om.phase is Phase.INFERENCE and not om.engine.inference.deferred.started and made[0].allocated == []
    assert not any(t.name == "ft-host-blocks" for t in threading.enumerate())
    with torch.no_grad():
        assert same(model(ids), ref)  # resident; the build runs behind it from now on
    assert om.engine.inference.deferred.started
    om.wait_for_host_blocks()
    assert made[0].allocated == list(range(len(om.engine.inference.layouts)))
    ft.release()

    made = provider_wrap()
    model, before, ids, ref, om = _profiled_resident()
    ft.release()  # straight after profiling: nothing was built
    assert made[-1].allocated == [] and made[-1].closed
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_build_unregisters_the_staging_region_by_region_with_a_pause_between(provider_wrap, monkeypatch):
    """cudaHostUnregister holds a driver lock the main thread's launches wait for: the build thread pauses between
    two regions, so inference passes meanwhile are held up by one region at a time, not by the whole model."""
    provider_wrap()
    fake = FakeCudart()
    fake.synchronize = lambda: fake.calls.append(("sync", threading.current_thread().name))
    pauses: list[str] = []

    def pause() -> None:
        pauses.append(threading.current_thread().name)
        fake.calls.append(("pause",))

    monkeypatch.setattr(deferred_mod, "_let_launches_through", pause)
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = ft.get_offload_manager()
    inject_staging(monkeypatch, fake.staging(policy=lambda cfg, dev: True))
    om.set_engine_policy(warmup="resident")
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, profiling_iters=2))
    staged = {p for _, p, _ in fake.registers}
    assert len(staged) > 2
    _warm_up(model, ids, ref, om)
    assert om.engine.inference.deferred is not None and not om.engine.inference.deferred.started
    with torch.no_grad():
        assert same(model(ids), ref)  # the build starts behind this pass
    om.wait_for_host_blocks()
    assert set(fake.unregisters) == staged and not fake.live
    assert pauses and set(pauses) == {"ft-host-blocks"}
    # Within each of the build thread's release calls (each starts with a sync), two unregistrations always have
    # a pause between them; the main thread's releases (end of warm-up) do not pause.
    groups: list[list[str]] = []
    current: list[str] = []
    for call in fake.calls:
        if call[0] == "sync":
            current = []
            if call[1] == "ft-host-blocks":
                groups.append(current)
        elif call[0] in ("unregister", "pause"):
            current.append(call[0])
    assert any(group.count("unregister") >= 2 for group in groups)
    for group in groups:
        assert group == ["unregister"] + ["pause", "unregister"] * (len(group) // 2), group
    with torch.no_grad():
        assert same(model(ids), ref)
    ft.release()
    assert same(reference(model, ids), ref)


def test_a_cancelled_build_stops_pausing_between_unregistrations(monkeypatch):
    """release() joins a cancelled build, and its teardown unregisters the rest anyway: no pause is worth it."""
    pauses: list[int] = []
    monkeypatch.setattr(deferred_mod, "_let_launches_through", lambda: pauses.append(1))
    build = deferred_mod.HostBlockBuild("m", [], [], provider=None, release_sources=None,  # type: ignore[arg-type]
                                        device=torch.device("cpu"))
    build._pause()
    build._cancel.set()
    build._pause()
    assert pauses == [1]


def test_reports_and_state_wait_for_the_build(provider_wrap):
    provider_wrap(delay=0.05)
    model, _before, ids, ref, om = _profiled_resident()
    assert om.engine.inference.deferred is not None
    offloaded = om.offloaded_tensors  # waits, then installs
    assert om.engine.inference.deferred is None and om.engine.inference.loader is not None and sum(map(len, offloaded.values())) > 0
    state = om.export_state()
    assert len(state.blocks) == len(offloaded)


def test_release_during_the_build_stops_it_and_restores_the_model(provider_wrap):
    made = provider_wrap(delay=0.2)
    model, before, ids, ref, om = _profiled_resident()
    layouts = len(om.engine.inference.deferred.layouts)
    assert layouts >= 2 and not om.engine.inference.deferred.done
    ft.release()
    assert made[0].closed and len(made[0].allocated) < layouts  # stopped after the block in flight
    assert not any(t.name == "ft-host-blocks" for t in threading.enumerate())
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_failed_build_raises_at_the_switch_and_the_model_keeps_working_resident(provider_wrap):
    made = provider_wrap(fail_at=1)
    model, before, ids, ref, om = _profiled_resident()
    om.engine.inference.deferred.wait()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"building the host blocks for INFERENCE failed: "
                                                             r"cudaHostAlloc: out of memory \(pinned\).*release\(\)"):
        model(ids)
    assert made[0].closed, "the failed build's blocks are let go at once, not at release()"
    with torch.no_grad():
        assert same(model(ids), ref)  # nothing streams; every weight is still on the device
    assert om.engine.inference.loader is None and om.engine.inference.deferred is None
    ft.release()
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_after_a_failed_build_release_without_preserving_still_drops_streamed_weights(provider_wrap):
    provider_wrap(fail_at=0)
    model, _before, ids, _ref, om = _profiled_resident()
    streamed = [t for tensors in om.engine.inference.deferred_plan.streamed for t in tensors]
    with pytest.raises(RuntimeError, match="building the host blocks"):
        om.wait_for_host_blocks()
    ft.release(preserve_model=False)
    assert streamed and all(t.is_meta for t in streamed)


def test_a_report_asked_for_inside_a_pass_never_swaps_weights_under_a_running_trap(provider_wrap):
    provider_wrap(gate=(gate := threading.Event()))
    model, _before, ids, ref, om = _profiled_resident()
    seen: list[bool] = []

    def ask_for_a_report(module, args):  # a user's hook inside a trap: the build finishes right now
        gate.set()
        om.engine.inference.deferred.wait()
        seen.append(bool(om.offloaded_tensors))  # waits for the build; must not install under this trap

    handle = model.blocks[0].attn.register_forward_pre_hook(ask_for_a_report)
    try:
        with torch.no_grad():
            assert same(model(ids), ref)
    finally:
        handle.remove()
    assert seen == [False] and om.engine.inference.deferred is not None and om.engine.inference.deferred.done
    with torch.no_grad():
        assert same(model(ids), ref)  # installed at this pass's start, then streamed
    assert om.engine.inference.deferred is None and om.engine.inference.loader is not None and om.engine.inference.loader.copies_issued > 0


def test_offload_timing_records_only_the_passes_that_stream(provider_wrap):
    provider_wrap(gate=(gate := threading.Event()))
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = _offload_resident(model, offload_timing="eager")
    _warm_up(model, ids, ref, om)
    with torch.no_grad():
        for _ in range(2):
            assert same(model(ids), ref)  # resident: the build is held
    gate.set()
    om.wait_for_host_blocks()
    with torch.no_grad():
        for _ in range(3):
            assert same(model(ids), ref)
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 3
    assert all(r.transfer_ms > 0 for snap in report.passes for r in snap.per_trap if r.label in om.offloaded_tensors)


def _profiled_streaming(**cfg):
    """As :func:`_profiled_resident`, with a stream-mode warm-up (each trap's weights copied per call)."""
    model = tiny_transformer()
    before = snapshot(model)
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup="stream")
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, profiling_iters=2,
                                 **cfg))
    _warm_up(model, ids, ref, om)
    return model, before, ids, ref, om


def test_after_a_stream_mode_warm_up_the_build_runs_behind_passes_that_copy_per_call(provider_wrap, monkeypatch):
    made = provider_wrap(gate=(gate := threading.Event()))
    fake = FakeCudart()
    inject_staging(monkeypatch, fake.staging(policy=lambda cfg, dev: True))
    model, before, ids, ref, om = _profiled_streaming()
    inference = om.engine.inference
    staged = {p for _, p, _ in fake.registers}
    assert inference.deferred is not None and inference.loader is None and set(inference.deferred_plan.copied)
    streamed = [t for tensors in inference.deferred_plan.streamed for t in tensors]
    loader = om.engine.warm.loader
    copies = loader.copies
    with torch.no_grad():
        for _ in range(2):  # the build is held: every streamed trap's weights are copied per call, from the originals
            assert same(model(ids), ref)
    assert loader.copies == copies + 2 * len(streamed) and not loader.active
    assert all(t.device.type == "cpu" for t in streamed)  # between calls: the originals, still staged
    assert fake.live and not inference.deferred.done
    gate.set()
    om.wait_for_host_blocks()  # installs: the tensors point at their host blocks; the originals' staging goes
    om.engine.warm.staging.join()
    assert set(fake.unregisters) == staged and not fake.live
    assert made[0].thread_names == {"ft-host-blocks"} and inference.loader is not None
    for index, placement in inference.placement.values():
        assert torch.equal(block_view(inference.host_blocks[index].tensor, placement), before[placement.name])
    copies = loader.copies
    with torch.no_grad():
        assert same(model(ids), ref)
    assert loader.copies == copies and inference.loader.copies_issued > 0  # the block loader streams now
    ft.release()
    assert same(reference(model, ids), ref)


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def test_after_a_stream_mode_warm_up_each_filled_block_replaces_its_originals_at_once(provider_wrap, monkeypatch):
    """Block by block: as soon as block k is filled its trap's tensors view it and the originals are unregistered
    (and so freed), while the passes go on copying per call, now from the blocks already filled."""
    provider_wrap(steps=(steps := threading.Semaphore(0)))
    fake = FakeCudart()
    inject_staging(monkeypatch, fake.staging(policy=lambda cfg, dev: True))
    model, before, ids, ref, om = _profiled_streaming()
    plan, build = om.engine.inference.deferred_plan, om.engine.inference.deferred
    originals = [[t.untyped_storage().data_ptr() for t in tensors] for tensors in plan.streamed]
    assert len(plan.layouts) >= 2 and set(fake.live) >= {p for ptrs in originals for p in ptrs}
    with torch.no_grad():
        assert same(model(ids), ref)  # starts the build, which waits for a step per block
    for k, layout in enumerate(plan.layouts):
        steps.release()
        _until(lambda: len(build.blocks) > k and not set(originals[k]) & set(fake.live), f"block {k} replaced")
        block = build.blocks[k].tensor
        start, end = block.data_ptr(), block.data_ptr() + block.numel()
        assert all(start <= t.data_ptr() < end for t in plan.streamed[k]), "the tensors view their block"
        later = {p for ptrs in originals[k + 1:] for p in ptrs}
        assert later <= set(fake.live), "the originals of blocks not yet filled stay staged"
        for placement, tensor in zip(layout.tensors, plan.streamed[k]):
            assert torch.equal(tensor, before[placement.name])
        with torch.no_grad():
            assert same(model(ids), ref)  # copies per call, from the blocks filled so far
    om.wait_for_host_blocks()
    assert build.kept_sources == [] and om.engine.inference.loader is not None
    with torch.no_grad():
        assert same(model(ids), ref)
    ft.release()
    assert same(reference(model, ids), ref) and not fake.live


def test_no_deferral_after_a_stream_mode_warm_up_without_host_memory_for_an_arena(provider_wrap, monkeypatch):
    import flextensor.engine.build as build_mod

    made = provider_wrap()
    monkeypatch.setattr(build_mod, "DEFER_HOST_MARGIN", 1 << 60)  # no room for an arena beside the originals
    _model, _before, _ids, _ref, om = _profiled_streaming()
    inference = om.engine.inference
    # built synchronously at the switch: one provider, the build's own, and no build thread
    assert inference.deferred is None and inference.loader is not None and made == [inference.provider]


@pytest.mark.parametrize("preserve", [True, False])
def test_release_during_a_build_after_a_stream_mode_warm_up(provider_wrap, preserve):
    provider_wrap(gate=(gate := threading.Event()))
    model, before, ids, ref, om = _profiled_streaming()
    streamed = [t for tensors in om.engine.inference.deferred_plan.streamed for t in tensors]
    with torch.no_grad():
        assert same(model(ids), ref)  # the build starts (and waits at the gate)
    gate.set()
    ft.release(preserve_model=preserve)
    if preserve:
        after = snapshot(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    else:
        assert streamed and all(t.is_meta for t in streamed)


def test_a_failed_build_after_a_stream_mode_warm_up_keeps_copying_per_call(provider_wrap):
    provider_wrap(fail_at=1)
    model, _before, ids, ref, om = _profiled_streaming()
    with torch.no_grad():
        assert same(model(ids), ref)
    om.engine.inference.deferred.wait()
    with pytest.raises(RuntimeError, match="copying the streamed weights per call"):
        om.wait_for_host_blocks()
    with torch.no_grad():
        assert same(model(ids), ref)
    ft.release()
    assert same(reference(model, ids), ref)


def test_release_without_preserving_during_the_build_puts_streamed_weights_on_meta(provider_wrap):
    provider_wrap(delay=0.2)
    model, _before, ids, ref, om = _profiled_resident()
    streamed = [t for tensors in om.engine.inference.deferred_plan.streamed for t in tensors]
    assert not om.engine.inference.deferred.done  # 0.2 s per block: still building
    ft.release(preserve_model=False)
    assert streamed and all(t.is_meta for t in streamed)
    assert not model.embed.weight.is_meta  # resident weights stay real
