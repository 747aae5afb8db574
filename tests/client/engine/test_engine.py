"""The offload engine on the CPU: exact outputs through every phase, phases, profiling control, API contracts."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.manager import Phase
from tests.helpers.models import (
    ALL,
    DEVICE,
    reference,
    same,
    ManualBlockModel,
    SkippingModel,
    cpu_config,
    mlp_stack,
    shared_model,
    snapshot,
    tiny_transformer,
    token_ids,
    errors_on_another_thread,
)


def run_phases(model, x, ref, manager, extra=3):
    """Run through every phase and a few inference passes; every output must equal ``ref`` (exactly on CPU)."""
    seen = []
    with torch.no_grad():
        for i in range(manager.iters_before_inference + extra):
            if i == manager.iters_before_inference:
                manager.wait_for_host_blocks()  # a resident warm-up (GPU) builds them behind the first passes
            seen.append(manager.phase)
            out = model(x)
            assert same(out, ref), f"output differs in phase {seen[-1]}"
    assert seen[-1] is Phase.INFERENCE
    return seen


def test_mlp_stack_exact_through_phases_and_release():
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    before = snapshot(model)
    cfg = cpu_config(load_strategy=ALL, profiling_iters=3)
    assert ft.offload(model, cfg) is model
    om = ft.get_offload_manager()
    assert om.iters_before_inference == 4
    seen = run_phases(model, x, ref, om)
    assert seen[:4] == [Phase.DISCOVERY, Phase.PROFILING, Phase.PROFILING, Phase.PROFILING]
    assert list(om.offloaded_tensors) == ["0", "1", "2", "3"]
    assert om.loader.copies_issued >= 4 * 3
    assert om.loader.resyncs == 0
    ft.release()
    after = snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())  # back on the original device
    assert same(reference(model, x), ref)


@pytest.mark.parametrize("transfer_mode", ["allocation_block_transfer", "strategy"])
@pytest.mark.parametrize("num_blocks", [2, 3])
def test_transformer_exact(transfer_mode, num_blocks):
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    keys = list(model.state_dict().keys())
    modules = dict(model.named_modules())
    up_t_stride = model.blocks[0].up_t.stride()
    cfg = cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, transfer_mode=transfer_mode,
                     num_blocks=num_blocks)
    proxy = ft.offload(model, cfg)
    assert proxy is model and isinstance(proxy, type(model))
    assert list(model.state_dict().keys()) == keys
    assert all(m is modules[n] for n, m in model.named_modules())
    om = ft.get_offload_manager()
    run_phases(model, ids, ref, om)
    assert list(om.offloaded_tensors) == [f"blocks.{i}" for i in range(4)]
    assert om.loader.num_slots == num_blocks
    # parameters keep their shape/stride as views into the device block
    assert model.blocks[0].up_t.stride() == up_t_stride
    assert list(model.state_dict().keys()) == keys
    ft.release()
    assert model.blocks[0].up_t.stride() == up_t_stride
    assert same(reference(model, ids), ref)


def test_tied_weights_and_buffers_stay_resident_with_star():
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    ft.offload(model, cpu_config(load_strategy=ALL))
    om = ft.get_offload_manager()
    run_phases(model, ids, ref, om)
    offloaded = {n for names in om.offloaded_tensors.values() for n in names}
    assert "embed.weight" not in offloaded  # used by the embed and head traps
    assert "norm.weight" in offloaded
    # "blocks" is a ModuleList (never called): its parameters are used outside traps, hence resident
    assert not any(n.startswith("blocks.") for n in offloaded)
    state = om.export_state()
    kinds = {t.name: (t.kind, t.persistent, t.offloaded) for t in state.tensors}
    assert kinds["pos"] == ("buffer", True, False)
    assert kinds["blocks.0.attn.mask"] == ("buffer", False, False)
    assert {t.name: t.aliases for t in state.tensors}["embed.weight"] == ["head.weight"]


def test_shared_submodule_resident_and_exact():
    model = shared_model()
    x = torch.randn(4, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(include_patterns=["blocks.*"], load_strategy=ALL))
    om = ft.get_offload_manager()
    run_phases(model, x, ref, om)
    offloaded = om.offloaded_tensors
    assert offloaded["blocks.0"] == ["blocks.0.own.weight", "blocks.0.own.bias"]
    assert "blocks.2.shared.weight" in offloaded["blocks.2"]  # not shared: offloadable
    assert not any("blocks.0.shared" in n for names in offloaded.values() for n in names)


def test_skip_discovery_phase_counts():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(skip_discovery=True, profiling_iters=2, load_strategy=ALL))
    om = ft.get_offload_manager()
    assert om.iters_before_inference == 2 and om.phase is Phase.PROFILING
    assert run_phases(model, x, ref, om)[:3] == [Phase.PROFILING, Phase.PROFILING, Phase.INFERENCE]


def test_control_flow_change_resynchronises():
    torch.manual_seed(0)
    model = SkippingModel().eval()
    pos, neg = torch.ones(2, 16, device=DEVICE), -torch.ones(2, 16, device=DEVICE)
    ref_pos, ref_neg = reference(model, pos), reference(model, neg)
    ft.offload(model, cpu_config(include_patterns=["layers.*"], load_strategy=ALL, num_blocks=3, min_blocks=2))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(pos)
        om.wait_for_host_blocks()
        for x, ref in [(pos, ref_pos), (neg, ref_neg), (neg, ref_neg), (pos, ref_pos), (pos, ref_pos)]:
            assert same(model(x), ref)
    assert om.loader.resyncs >= 2


def test_exception_inside_trap_then_exact_again():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ALL))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            model(x)
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 7, device=DEVICE))  # shape error inside trap "0"
        for _ in range(3):
            assert same(model(x), ref)


def test_suspend_resume_refcount_freezes_profiling_counter():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(profiling_iters=2, load_strategy=ALL))
    om = ft.get_offload_manager()
    with torch.no_grad():
        ft.suspend_profiling()
        model(x)  # DISCOVERY is not affected by suspension: it counts
        assert om.phase is Phase.PROFILING
        ft.suspend_profiling()
        ft.resume_profiling()  # one suspension still outstanding
        for _ in range(3):
            model(x)
        assert om.phase is Phase.PROFILING and om.profiling_durations == {}
        with ft.pause_profiling():  # nests with the raw calls
            model(x)
        ft.resume_profiling()
        assert not om.profiling_suspended
        model(x)
        assert om.phase is Phase.PROFILING and all(len(v) == 1 for v in om.profiling_durations.values())
        ft.clear_profiling_durations()
        assert om.profiling_durations == {}
        model(x)
        assert om.phase is Phase.INFERENCE
    with pytest.raises(RuntimeError, match="without a matching"):
        ft.resume_profiling()


def test_enabled_false_is_a_passthrough():
    model = mlp_stack()
    cfg = ft.OffloadConfig(enabled=False)  # pinned_memory=True is fine when disabled, even without CUDA
    assert ft.offload(model, cfg) is model
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in model.modules())
    om = ft.get_offload_manager()
    assert om.phase is None and om.iters_before_inference == 0
    ft.suspend_profiling()
    ft.suspend_profiling()
    ft.resume_profiling()
    assert not om.profiling_suspended
    with ft.offload_block("anything"):
        pass
    assert ft.collect_offload_timing() is None
    assert ft.get_gpu_memory_usage().total_bytes == 0


def test_pinned_memory_without_cuda_raises():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.raises(RuntimeError, match="pinned_memory=False"):
        ft.OffloadManager("x", ft.OffloadConfig())
    with pytest.raises(RuntimeError, match="pinned_memory=False"):
        ft.offload(mlp_stack(), ft.OffloadConfig(), name="pinned")


def test_manager_from_another_thread_raises():
    model = mlp_stack()
    ft.offload(model, cpu_config(), name="owned")
    errors = errors_on_another_thread(lambda: ft.get_offload_manager("owned"), lambda: model(torch.randn(1, 16)))
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) and "thread" in str(e) for e in errors)


def test_gpu_memory_usage_only_in_inference():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ALL))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        ft.get_gpu_memory_usage()
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    usage = ft.get_gpu_memory_usage()
    assert usage.block_bytes == om.loader.device_bytes > 0
    assert usage.total_bytes == usage.block_bytes + usage.resident_bytes
    assert usage.total_mb == pytest.approx(usage.total_bytes / 2**20)


@pytest.mark.parametrize("strategy", [None, ft.BudgetFillStrategy()])  # the budget-aware planners
def test_budget_respected(strategy):
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                [*model.parameters(), *model.buffers()]}.values())
    budget = total * 3 // 4  # only a plan that offloads every block fits (2 slots + fixed tensors)
    om = ft.get_offload_manager()
    om.set_memory_budget(budget)
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=strategy))
    run_phases(model, ids, ref, om)
    measured = om.loader.device_bytes + sum(
        e.tensor.numel() * e.tensor.element_size() for n, e in om.engine.tensors.items() if n not in om.engine.inference.placement)
    assert om.offloaded_tensors, "the budget forces offloading"
    assert measured <= budget
    assert ft.get_gpu_memory_usage().total_bytes == measured


def test_manual_offload_block():
    torch.manual_seed(0)
    model = ManualBlockModel().eval()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ALL))
    om = ft.get_offload_manager()
    run_phases(model, x, ref, om)
    assert om.offloaded_tensors["head"] == ["w_head", "b_head"]
    assert om.offloaded_tensors["body"] == ["body.weight", "body.bias"]


def test_offload_block_refused_with_skip_discovery_and_plain_before_offload():
    ran = []
    with ft.offload_block("x", name="fresh"):  # no model offloaded yet: plain code
        ran.append(1)
    assert ran == [1]
    ft.offload(mlp_stack(), cpu_config(skip_discovery=True), name="skip")
    with pytest.raises(RuntimeError, match="skip_discovery"):
        with ft.offload_block("x", name="skip"):
            pass


def test_nested_traps_are_refused():
    model = mlp_stack()
    ft.offload(model, cpu_config(include_patterns=["0"]))
    with pytest.raises(RuntimeError, match="cannot nest"):
        with ft.offload_block("outer"):
            model[0](torch.randn(1, 16, device=DEVICE))


def test_release_without_preserving_puts_offloaded_on_meta():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ALL))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    weight = model[1].fc1.weight
    ft.release(preserve_model=False)
    assert weight is model[1].fc1.weight and weight.is_meta and weight.shape == (48, 16)
    assert "default" not in ft.api.managers()


def test_compile_fn_applied_per_trap():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    compiled: list[nn.Module] = []

    def compile_fn(module):
        compiled.append(module)
        return module

    ft.offload(model, cpu_config(load_strategy=ALL), compile_fn=compile_fn)
    assert len(compiled) == 4
    run_phases(model, x, ref, ft.get_offload_manager())


def test_second_model_on_same_manager_refused():
    ft.offload(mlp_stack(), cpu_config())
    with pytest.raises(RuntimeError, match="another model"):
        ft.offload(mlp_stack(seed=1))
    with pytest.raises(RuntimeError, match="release"):
        ft.set_config(cpu_config())


def test_instrumentation_written(tmp_path):
    out = tmp_path / "instr"
    ft.offload(mlp_stack(), cpu_config(enable_instrumentation=True, instrumentation_output_dir=str(out)))
    record = (out / "default.offload_manager.json").read_text()
    assert '"traps"' in record and '"0"' in record


@pytest.mark.cuda
@pytest.mark.parametrize("mode,transfer_mode", [("torch", "allocation_block_transfer"), ("host_register", "strategy")])
def test_cuda_transformer_bf16_close_and_pinned_modes(mode, transfer_mode):
    model = tiny_transformer().to(torch.bfloat16)
    ids = token_ids().cuda()
    with torch.no_grad():
        ref = model.cuda()(ids).float()
    model.cpu()
    before = snapshot(model)
    cfg = ft.OffloadConfig(include_patterns=["class:DecoderBlock"], pinned_memory=True, pinned_memory_mode=mode,
                           transfer_mode=transfer_mode, profiling_iters=2, load_strategy=ALL, num_blocks=2,
                           min_blocks=2)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.device.type == "cuda"
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
        om.wait_for_host_blocks()  # resident warm-up: the host blocks were built behind the first passes
        for _ in range(3):
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    assert om.loader.cuda and om.loader.copies_issued > 0
    assert all(b.tensor.is_pinned() for b in om.engine.inference.host_blocks)
    assert model.blocks[0].up_t.device.type == "cuda"
    usage = ft.get_gpu_memory_usage()
    assert usage.block_bytes == om.loader.device_bytes > 0
    ft.release()
    after = snapshot(model)
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], before[k]) for k in before)


@pytest.mark.cuda
def test_cuda_memory_mode_budget():
    model = tiny_transformer()
    ids = token_ids().cuda()
    with torch.no_grad():
        ref = model.cuda()(ids)
    model.cpu()
    cfg = ft.OffloadConfig(include_patterns=["class:DecoderBlock"], profiling_iters=2, num_blocks=2, min_blocks=2,
                           max_gpu_mem_fraction=0.5)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            torch.testing.assert_close(model(ids), ref, atol=1e-4, rtol=1e-4)
    free, total = torch.cuda.mem_get_info()
    assert ft.get_gpu_memory_usage().total_bytes <= 0.5 * total


def test_the_plan_charges_each_streamed_trap_the_loaders_cost():
    """The engine plans with a stream cost per trap, from each trap's PROFILING windows on the device's and the
    host's clocks: NthLayer(1) over the four layers of the stack is estimated at no less than their costs, and
    its explanation says so. On the CPU (both clocks are the host's: launch-bound) each pays the whole
    ``STREAMED_TRAP_COST_S``."""
    from flextensor.engine.switch import STREAMED_TRAP_COST_S, trap_stream_cost

    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=2))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    assert om.phase is Phase.INFERENCE and len(om.offloaded_tensors) == 4
    assert sorted(om.engine.profile.host_durations) == sorted(om.engine.profile.durations) and all(len(v) == 2 for v in om.engine.profile.host_durations.values())
    costs = [trap_stream_cost(om.engine.plan.compute_s[label], om.engine.profile.host_durations[label], 1) for label in om.engine.plan.compute_s]
    line = next(line for line in om.engine.plan.explanation if "estimated overhead" in line)
    assert f"(of which {sum(costs) * 1e3:.3f} ms the streamed traps' own cost)" in line
    estimated_ms = float(line.split("estimated overhead ")[1].split(" ms")[0])
    assert estimated_ms >= sum(costs) * 1e3 - 1e-3
    if DEVICE.type == "cpu":  # perf_counter on both sides, read microseconds apart
        for label, seconds in om.engine.profile.durations.items():
            assert om.engine.profile.host_durations[label] == pytest.approx(seconds, abs=10e-6)
        assert sum(costs) == pytest.approx(4 * STREAMED_TRAP_COST_S, rel=0.2)


def test_diagnostics_tables_logged(caplog):
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(enable_diagnostics=True, load_strategy=ALL))
    om = ft.get_offload_manager()
    with caplog.at_level("INFO", logger="flextensor"), torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    text = caplog.text
    for title in ("Memory Transfer Statistics", "Trap Duration Statistics", "Block Assignment"):
        assert title in text
    notice = [r for r in caplog.records if r.levelno == 25]
    assert notice and "Block Assignment" in notice[0].getMessage()


def test_filling_host_blocks_logs_progress_with_bytes_and_rate(monkeypatch, caplog):
    """A long fill (here forced: interval 0) logs how many bytes are done and at what rate."""
    import logging

    import flextensor.runtime.host_memory as host_memory

    monkeypatch.setattr(host_memory, "PROGRESS_INTERVAL_S", 0.0)
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    with caplog.at_level(logging.INFO, logger="flextensor.runtime.host_memory"):
        ft.offload(model, cpu_config(load_strategy=ALL))
        run_phases(model, x, ref, ft.get_offload_manager(), extra=1)
    lines = [r.getMessage() for r in caplog.records if "host blocks" in r.getMessage()]
    assert any("filling host blocks" in line for line in lines)
    assert lines[-1].startswith("manager 'default': filled host blocks") and "GB/s" in lines[-1]
    assert "(100%)" in lines[-1]


def _is_wrapper(module: nn.Module) -> bool:
    """The trap's enter/exit wrapper (a function), as opposed to a bypass (a partial) or no patch at all."""
    forward = module.__dict__.get("forward")
    return hasattr(forward, "__flextensor_trap__") and not isinstance(forward, functools.partial)


@pytest.mark.parametrize("resident_warmup", [False, True])
def test_inference_calls_resident_traps_directly_and_streamed_ones_through_the_wrapper(resident_warmup):
    """A trap that streams nothing has nothing to do at entry or exit in INFERENCE: its module calls the original
    forward directly (marked as the trap's, so resident_units still finds it); release restores the class's."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    om = ft.get_offload_manager()
    if resident_warmup:
        om.set_engine_policy(warmup="resident")  # the switch defers the build: traps are bypassed at the switch
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2)))
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            assert all(_is_wrapper(model[i]) for i in range(4))  # every trap is wrapped while profiling
            assert same(model(x), ref)
    assert om.phase is Phase.INFERENCE
    assert [_is_wrapper(model[i]) for i in range(4)] == [True, False, True, False]
    for i in (1, 3):
        direct = model[i].__dict__["forward"]
        assert direct.__flextensor_trap__ == str(i)
    assert [n for n, _ in ft.resident_units()] == ["1", "3"]
    om.wait_for_host_blocks()
    with torch.no_grad():
        for _ in range(2):
            assert same(model(x), ref)
    assert om.loader.copies_issued > 0
    ft.release()
    assert all("forward" not in model[i].__dict__ for i in range(4))
    assert same(reference(model, x), ref)


def test_offload_timing_keeps_every_trap_wrapped_in_inference():
    """Offload timing times every trap call, the resident ones too: no trap is bypassed."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2), offload_timing="eager"))
    run_phases(model, x, ref, ft.get_offload_manager())
    assert all(_is_wrapper(model[i]) for i in range(4))
    report = ft.collect_offload_timing()
    assert {s.label for s in report.per_trap} == {"0", "1", "2", "3"}


def test_a_bypassed_compiled_trap_keeps_the_original_signature_and_output():
    """With compile_fn the trap calls the compiled shim; bypassed, it still does, under the original's name."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    signature = inspect.signature(model[1].forward)
    compiled: list[nn.Module] = []

    def compile_fn(module):
        compiled.append(module)
        return module

    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2)), compile_fn=compile_fn)
    run_phases(model, x, ref, ft.get_offload_manager())
    direct = model[1].__dict__["forward"]
    assert isinstance(direct, functools.partial) and direct.func is compiled[1]
    assert inspect.signature(direct) == signature and direct.__name__ == "forward"
    ft.release()
    assert "forward" not in model[1].__dict__


def test_a_forward_replaced_after_offload_is_not_bypassed_and_instance_forwards_come_back():
    """A hook that wrapped the trap's forward after offload() keeps being called in INFERENCE; a module whose
    forward was already an instance attribute before offload() gets exactly that one back at release."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    own = model[3].forward  # the bound method, set as an instance attribute by the user before offload()
    model[3].forward = own
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2)))
    calls = []
    trap_forward = model[1].forward

    def hook(*args, **kwargs):
        calls.append(1)
        return trap_forward(*args, **kwargs)

    model[1].forward = hook
    om = ft.get_offload_manager()
    run_phases(model, x, ref, om, extra=2)
    assert model[1].__dict__["forward"] is hook and not om.engine.traps["1"].bypassed
    assert len(calls) == om.iters_before_inference + 2  # called in every pass, INFERENCE too
    assert om.engine.traps["3"].bypassed
    ft.release()
    assert model[3].__dict__["forward"] is own
    assert same(reference(model, x), ref)


def test_state_dict_of_a_streamed_model_reads_the_host_blocks_and_saves_round_trip(tmp_path):
    """Between passes streamed parameters point at rotating device blocks; state_dict() still gives every
    tensor's own values (from its host block), so a checkpoint saved from it loads into a plain model."""
    from safetensors.torch import load_file, save_file

    model = tiny_transformer()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    ids = token_ids().to(DEVICE)
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, profiling_iters=2))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            model(ids)
    om.wait_for_host_blocks()
    assert om.loader is not None and om.offloaded_tensors
    state = model.state_dict()
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[k].cpu(), plain[k].cpu()) for k in plain)
    copies = {k: v.cpu().clone(memory_format=torch.contiguous_format) for k, v in state.items()}  # untie, pack
    save_file(copies, str(tmp_path / "model.safetensors"))
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], plain[k].cpu()) for k in plain)
    ft.release()
    after = model.state_dict()
    assert all(torch.equal(after[k].cpu(), plain[k].cpu()) for k in plain)
