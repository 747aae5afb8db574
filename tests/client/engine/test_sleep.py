"""sleep() / wake() of one process's offloaded model: the device memory goes, the plan stays, outputs are equal.

The engine's tests stream through the block loader also on a CPU (the CPU plays the device), so the loader's
slots and the private host copy of the resident tensors are exercised here exactly as on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import flextensor as ft
from flextensor.manager import Phase
from tests.helpers.models import ALL, DEVICE, cpu_config, mlp_stack, reference, same, tiny_transformer, token_ids


def _offloaded_transformer(**config):
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], **config))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            assert same(model(ids), ref)
    om.wait_for_host_blocks()
    return model, ids, ref, om


@pytest.mark.parametrize("transfer_mode", ["allocation_block_transfer", "raw_block_transfer", "strategy"])
def test_sleep_frees_every_device_byte_and_wake_resumes_with_equal_outputs(transfer_mode: str):
    model, ids, ref, om = _offloaded_transformer(load_strategy=ft.NthLayerStrategy(2), transfer_mode=transfer_mode)
    held = om.get_gpu_memory_usage()
    assert held.block_bytes > 0 and held.resident_bytes > 0  # some layers stream, others stay resident
    schedule = list(om.loader.schedule)
    plan = om.offloaded_tensors
    ft.sleep()
    assert om.phase is Phase.SLEEPING and om.asleep
    assert om.sleep_state.freed_bytes == held.total_bytes
    asleep = om.get_gpu_memory_usage()
    assert (asleep.block_bytes, asleep.resident_bytes) == (0, 0)  # all of held.total_bytes freed
    assert om.engine.inference.loader is None
    assert all(p.is_meta for p in model.parameters())
    seconds = ft.wake()
    assert seconds >= 0 and om.phase is Phase.INFERENCE and not om.asleep
    assert om.get_gpu_memory_usage() == held
    assert om.offloaded_tensors == plan and list(om.loader.schedule) == schedule  # same plan, no profiling
    with torch.no_grad():
        for _ in range(2):
            assert same(model(ids), ref)


def test_a_pass_while_asleep_raises_the_named_error_and_changes_nothing():
    model, ids, ref, om = _offloaded_transformer(load_strategy=ALL)
    ft.sleep()
    with pytest.raises(ft.ModelAsleepError, match=r"call wake\(\) first"), torch.no_grad():
        model(ids)
    with pytest.raises(RuntimeError, match="asleep"):  # ModelAsleepError is a RuntimeError
        om.export_state()
    ft.sleep()  # again: nothing to do
    assert om.asleep
    ft.wake()
    ft.wake()  # awake already: nothing to do
    with torch.no_grad():
        assert same(model(ids), ref)


def test_sleep_wake_cycles_keep_one_private_copy_of_the_resident_tensors():
    model, ids, ref, om = _offloaded_transformer(load_strategy=ft.NthLayerStrategy(2))
    resident = om.get_gpu_memory_usage().resident_bytes
    for _ in range(3):
        ft.sleep()
        state = om.sleep_state
        assert state.block is not None and state.layout is not None
        packed = sum(p.nbytes for p in state.layout.tensors)
        assert packed == resident  # every resident byte in the one host block, nothing twice
        ft.wake()
        assert state.block is None  # freed at the wake: host memory holds no second copy while awake
        with torch.no_grad():
            assert same(model(ids), ref)


def test_wake_sees_weights_changed_in_the_host_blocks_while_asleep():
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ALL))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            model(x)
    om.wait_for_host_blocks()
    ft.sleep()
    for block in om.engine.inference.host_blocks:  # what a shared session's update does to the arena
        block.tensor.zero_()
    ft.wake()
    with torch.no_grad():
        out = model(x)
    plain = mlp_stack()
    with torch.no_grad():
        for layer in plain:
            for p in layer.parameters():
                p.zero_()
    assert same(out, reference(plain, x))


def test_release_while_asleep_gives_the_weights_back():
    model, ids, ref, om = _offloaded_transformer(load_strategy=ft.NthLayerStrategy(2))
    ft.sleep()
    ft.release()
    assert all(not p.is_meta and p.device.type == "cpu" for p in model.parameters())
    assert same(reference(model, ids), ref)


def test_sleep_needs_inference():
    model = mlp_stack()
    ft.offload(model, cpu_config(load_strategy=ALL))
    with pytest.raises(RuntimeError, match="needs INFERENCE"):
        ft.sleep()


@pytest.mark.cuda
def test_on_cuda_sleep_returns_the_models_device_memory_and_wake_takes_it_back():
    (torch.ones(8, 8, device=DEVICE) @ torch.ones(8, 8, device=DEVICE)).sum().item()  # cuBLAS' workspace first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model, ids, ref, om = _offloaded_transformer(load_strategy=ft.NthLayerStrategy(2), pinned_memory=True)
    torch.cuda.synchronize()
    inputs_and_reference = ids.numel() * ids.element_size() + ref.numel() * ref.element_size()
    held = torch.cuda.memory_allocated() - base - inputs_and_reference
    assert held >= om.get_gpu_memory_usage().total_bytes > 0
    ft.sleep()
    left = torch.cuda.memory_allocated() - base - inputs_and_reference
    assert left <= 0.05 * held, (left, held)
    assert om.sleep_state.block.tensor.is_pinned()  # the private copy the wake reads at link rate
    ft.wake()
    with torch.no_grad():
        assert same(model(ids), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU computing from its host blocks in place")
def test_a_cpu_computing_in_place_keeps_its_tensors_as_they_are_and_copies_nothing():
    from flextensor.engine.policy import EnginePolicy

    ft.get_offload_manager().set_engine_policy(EnginePolicy())  # not the streaming path of this folder's tests
    model, ids, ref, om = _offloaded_transformer(load_strategy=ft.NthLayerStrategy(2))
    assert om.loader is None and om.engine.in_place
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    ft.sleep()
    state = om.sleep_state
    assert state.block is None and state.kept and state.freed_bytes == 0  # host memory already: no copy
    ft.wake()
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == storages
    with torch.no_grad():
        assert same(model(ids), ref)
