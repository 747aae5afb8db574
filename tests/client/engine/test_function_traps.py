"""profile_mode="torch_function": exact outputs in every phase while the offloaded parameters are never touched.

On the CPU these tests stream through the loader (``stream_on_cpu``, this folder's conftest), so every trap's ops
read rotating slots, as on a GPU; on a GPU host they run on the GPU. The trap modules' parameters refuse
``.data`` assignment (:class:`LockedParameter`), so any reassignment by the engine fails the test; probes record
which storage the ops inside a trap read. References come from an identical twin of each model (same seed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flextensor as ft
from flextensor.manager import Phase
from tests.helpers.models import (
    ALL,
    DEVICE,
    ManualBlockModel,
    cpu_config,
    mlp_stack,
    reference,
    same,
    snapshot,
    tiny_llama,
    tiny_transformer,
    token_ids,
)


class LockedParameter(nn.Parameter):
    """A parameter class that refuses to have its data replaced (as some quantization wrappers do)."""

    def __setattr__(self, name, value):
        if name == "data":
            raise AttributeError("LockedParameter: its data cannot be replaced")
        super().__setattr__(name, value)


def lock(model: nn.Module) -> nn.Module:
    """Every parameter of ``model`` becomes a LockedParameter over the same values (tied ones stay tied). Lock
    only trap modules: parameters outside traps move to the device by reassignment, as in every mode."""
    locked: dict[int, LockedParameter] = {}
    for module in list(model.modules()):
        for attr, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in locked:
                    locked[id(param)] = LockedParameter(param.detach().clone(), requires_grad=param.requires_grad)
                module._parameters[attr] = locked[id(param)]
    return model


def storages(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Per parameter: the object's id, its data pointer and its storage's pointer (read outside any pass)."""
    return {n: (id(p), p.data_ptr(), p.untyped_storage().data_ptr()) for n, p in model.named_parameters()}


def plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output where its parameters are (after release: the CPU), on the compute device."""
    with torch.no_grad():
        return model(x.cpu()).to(DEVICE)


def fn_config(**kwargs) -> ft.OffloadConfig:
    kwargs.setdefault("load_strategy", ALL)
    return cpu_config(profile_mode="torch_function", transfer_mode="strategy", **kwargs)


def run_checked(model, x, ref, om, extra=3, out=lambda o: o):
    """Every phase's outputs equal ``ref``; no parameter of the model changes object, storage or value."""
    before, values = storages(model), snapshot(model)
    seen = []
    with torch.no_grad():
        for _ in range(om.iters_before_inference + extra):
            seen.append(om.phase)
            assert same(out(model(x)), ref), f"output differs in phase {seen[-1]}"
            assert storages(model) == before, f"a parameter's storage changed in phase {seen[-1]}"
    assert seen[0] is Phase.DISCOVERY and Phase.PROFILING in seen and seen[-1] is Phase.INFERENCE
    after = snapshot(model)
    assert all(torch.equal(after[k], values[k]) for k in values)
    return seen


class Probe(nn.Module):
    """A block that records the data pointer its ops see for its weight, through a view made in the forward."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_t = self.lin.weight.t()  # a view, made inside the trap
        self.seen.append(w_t.data_ptr())
        return torch.tanh(x @ w_t + self.lin.bias)


def _in_slots(ptr: int, loader) -> bool:
    return any(s.data_ptr() <= ptr < s.data_ptr() + s.numel() for s in loader.slots)


# ---------------------------------------------------------------------------------------------------- every phase
@pytest.mark.parametrize("warmup", [None, "resident", "stream"])
def test_mlp_stack_exact_with_parameters_untouched(warmup):
    model = lock(mlp_stack())
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(mlp_stack(), x)
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup=warmup)  # "resident"/"stream": the CPU copies the candidates as a GPU would
    ft.offload(model, fn_config(profiling_iters=2))
    seen = run_checked(model, x, ref, om)
    assert seen[:3] == [Phase.DISCOVERY, Phase.PROFILING, Phase.PROFILING]
    assert list(om.offloaded_tensors) == ["0", "1", "2", "3"]
    assert om.loader.copies_issued >= 4 * 3 and om.loader.per_tensor
    assert om.engine.inference.host_blocks == []  # streamed from the parameters themselves
    assert all(type(p) is LockedParameter for p in model.parameters())
    assert ft.request_strategy_replan() == 0 and not ft.strategy_replan_status().can_request  # no host blocks
    ft.release()
    assert om.engine is None
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in model.modules())
    assert same(plain(model, x), ref)


def test_ops_inside_a_trap_read_the_slots_not_the_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(Probe(), Probe(), Probe()).eval()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    own = [m.lin.weight.data_ptr() for m in model]
    for probe in model:
        probe.seen.clear()
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup="resident")  # warm-up copies are clones on the CPU: ops must read those too
    ft.offload(model, fn_config(profiling_iters=1))
    run_checked(model, x, ref, om, extra=2)
    for probe, ptr in zip(model, own):
        assert len(probe.seen) == 4 and ptr not in probe.seen  # DISCOVERY and PROFILING read warm-up copies
        assert all(_in_slots(p, om.loader) for p in probe.seen[2:])  # INFERENCE reads the rotating slots


class PreMadeView(nn.Module):
    """Holds a transposed view of its weight made at construction (outside any forward pass)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) * 0.2)
        self.w_t = self.weight.t()  # a plain attribute: a view of the parameter's storage
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.w_t.data_ptr())
        return torch.tanh(F.linear(x, self.w_t.t()) + x @ self.w_t)


def test_views_made_before_offload_are_rewritten_too():
    torch.manual_seed(0)
    model = nn.Sequential(PreMadeView(), PreMadeView()).eval()
    x = torch.randn(2, 16, device=DEVICE)
    with torch.no_grad():
        ref = model(x.cpu()).to(DEVICE)  # (moving the model would leave its pre-made views behind)
    own = [m.weight.data_ptr() for m in model]
    ft.offload(model, fn_config(profiling_iters=1))
    om = ft.get_offload_manager()
    run_checked(model, x, ref, om, extra=2)
    assert all(m.seen[0] == ptr and _in_slots(m.seen[-1], om.loader) for m, ptr in zip(model, own))


@pytest.mark.parametrize("patterns", [["*"], ["class:DecoderBlock"]])
def test_transformer_tied_and_transposed_weights_exact(patterns):
    model = tiny_transformer()
    lock(model.blocks)  # the tied embedding is moved (used by two traps), so it is not locked
    ids = token_ids().to(DEVICE)
    ref = reference(tiny_transformer(), ids)
    keys, up_t_stride = list(model.state_dict()), model.blocks[0].up_t.stride()
    ft.offload(model, fn_config(include_patterns=patterns))
    om = ft.get_offload_manager()
    run_checked(model, ids, ref, om)
    offloaded = {n for names in om.offloaded_tensors.values() for n in names}
    assert "embed.weight" not in offloaded  # tied to the head: used by two traps, so resident
    assert offloaded and all(om.engine.tensors[n].tensor is not model.get_parameter(n) for n in offloaded)
    if patterns != ["*"]:
        assert "blocks.0.up_t" in offloaded  # the transposed (non-contiguous) parameter
    assert model.blocks[0].up_t.stride() == up_t_stride != (64, 1)
    assert list(model.state_dict()) == keys
    ft.release()
    assert same(plain(model, ids), ref)


def test_llama_decoder_layers_exact():
    pytest.importorskip("transformers")
    model = tiny_llama()
    lock(model.model.layers)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = reference(tiny_llama(), ids).logits
    ft.offload(model, fn_config(include_patterns=["class:*DecoderLayer"], profiling_iters=1))
    om = ft.get_offload_manager()
    run_checked(model, ids, ref, om, extra=2, out=lambda o: o.logits)
    assert list(om.offloaded_tensors) == [f"model.layers.{i}" for i in range(4)]
    assert all(len(v) == 9 for v in om.offloaded_tensors.values())  # 7 linear weights + 2 norms
    ft.release()
    with torch.no_grad():
        assert same(model(ids.cpu()).logits.to(DEVICE), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compute device only")
def test_cpu_in_place_computes_from_the_parameters():
    model = lock(mlp_stack())
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = model(x)
    om = ft.get_offload_manager()
    om.set_engine_policy(stream_on_cpu=False)  # Note [CPU in place]
    ft.offload(model, fn_config())
    run_checked(model, x, ref, om)
    assert om.loader is None and len(om.offloaded_tensors) == 4


def test_release_without_preserving_drops_streamed_weights_to_meta():
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, fn_config())
    om = ft.get_offload_manager()
    run_checked(model, x, ref, om, extra=1)
    streamed = {n for names in om.offloaded_tensors.values() for n in names}
    ft.release(preserve_model=False)
    assert all(p.is_meta == (n in streamed) for n, p in model.named_parameters())


def test_saved_profile_adopted_in_this_mode(tmp_path):
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, fn_config(profiling_iters=1))
    om = ft.get_offload_manager()
    run_checked(model, x, ref, om, extra=1)
    om.save_profile(str(tmp_path))
    ft.release()
    twin = lock(mlp_stack())
    before = storages(twin)
    ft.offload_from_profile(twin, str(tmp_path), fn_config(), name="adopted")
    adopted = ft.get_offload_manager("adopted")
    assert adopted.phase is Phase.INFERENCE and list(adopted.offloaded_tensors) == ["0", "1", "2", "3"]
    with torch.no_grad():
        for _ in range(2):
            assert same(twin(x), ref)
    assert storages(twin) == before and adopted.loader.copies_issued > 0


def test_manual_blocks_keep_their_parameters_resident(caplog):
    model = ManualBlockModel()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, fn_config())
    om = ft.get_offload_manager()
    with caplog.at_level("WARNING", logger="flextensor"):
        run_checked(model, x, ref, om)
    assert list(om.offloaded_tensors) == ["body"]
    assert "offload_block('head') keeps its 2 parameters resident" in caplog.text


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("transfer_mode", ["allocation_block_transfer", None])
def test_block_transfer_modes_rejected_with_the_fix(transfer_mode):
    kwargs = {} if transfer_mode is None else {"transfer_mode": transfer_mode}
    with pytest.raises(ValueError, match=r"profile_mode.*requires transfer_mode='strategy'.*set transfer_mode="
                                         r"'strategy', or use profile_mode='view'"):
        ft.OffloadConfig(profile_mode="torch_function", **kwargs)


def test_shared_memory_rejected():
    with pytest.raises(ValueError, match="shm_enabled=True"):
        ft.OffloadConfig(profile_mode="torch_function", transfer_mode="strategy", shm_enabled=True,
                         shm_namespace="ns")


def test_compile_fn_rejected_and_model_left_alone():
    model = mlp_stack()
    with pytest.raises(ValueError, match="compile_fn cannot be used with profile_mode='torch_function'"):
        ft.get_offload_manager().offload(model, fn_config(), compile_fn=lambda m: m)
    assert "forward" not in model.__dict__ and ft.get_offload_manager().engine is None


class HiddenRead(nn.Module):
    """Reads its weight with torch functions disabled: no TorchFunctionMode sees the call."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return F.linear(x, self.lin.weight, self.lin.bias)


def test_a_read_the_mode_cannot_see_is_refused_in_discovery():
    model = nn.Sequential(nn.Linear(16, 16), HiddenRead()).eval()
    x = torch.randn(2, 16, device=DEVICE)
    before = snapshot(model)
    ft.offload(model, fn_config())
    with pytest.raises(RuntimeError, match=r"module '1' reads parameter '1.lin.weight' through a path "
                                           r"profile_mode='torch_function' cannot rewrite.*Use profile_mode='view'"):
        with torch.no_grad():
            model(x)
    ft.release()
    assert all(torch.equal(v, before[k]) for k, v in snapshot(model).items())


class Borrower(nn.Module):
    """Uses another layer's weight (held outside the module tree, so no trap owns it twice)."""

    def __init__(self, d: int, lender: nn.Linear) -> None:
        super().__init__()
        self.own = nn.Linear(d, d)
        self.lender = [lender]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(x) + x @ self.lender[0].weight


def test_a_streamed_weight_used_outside_its_trap_is_refused_not_read_stale():
    first = nn.Linear(16, 16)
    model = nn.Sequential(first, Borrower(16, first)).eval()
    x = torch.randn(2, 16, device=DEVICE)
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup="resident")  # PROFILING finds every warm-up copy on the device
    ft.offload(model, fn_config(skip_discovery=True, profiling_iters=1))  # nobody learns that '1' reads '0.weight'
    with torch.no_grad():
        model(x)
        with pytest.raises(RuntimeError, match=r"parameter '0.weight' is offloaded with trap '0' but was used by trap '1'"):
            model(x)


def test_loader_per_tensor_sources_are_checked_against_their_placements():
    from flextensor.runtime.host_memory import pack_block
    from flextensor.runtime.loaders.block_loader import BlockLoader

    layout = pack_block(0, "t", [("w", torch.float32, (4, 4), (4, 1))])
    source, shadow = torch.randn(4, 4), torch.zeros(4, 4)

    def make(views, per_tensor=True):
        return BlockLoader(device=torch.device("cpu"), layouts=[layout], host_blocks=(), params=[[shadow]],
                           schedule=[0], num_slots=2, per_tensor=per_tensor, host_views=views)

    with pytest.raises(ValueError, match="need per_tensor=True"):
        make([[source]], per_tensor=False)
    with pytest.raises(ValueError, match=r"host view of 'w' is torch.float32 \(4, 3\)"):
        make([[torch.zeros(4, 3)]])
    loader = make([[source]])
    loader.enter(0)
    assert torch.equal(shadow, source) and loader.slots[0].data_ptr() == shadow.data_ptr()


# ---------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("which", ["mlp", "llama"])
def test_cuda_close_with_parameters_left_on_the_host(which):
    if which == "llama":
        pytest.importorskip("transformers")
        model, x = tiny_llama(), torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
        patterns, out = ["class:*DecoderLayer"], (lambda o: o.logits.float())
    else:
        model, x, patterns, out = mlp_stack(), torch.randn(3, 16), ["*"], (lambda o: o.float())
    model = model.to(torch.bfloat16)
    x = x.cuda() if which == "llama" else x.to(torch.bfloat16).cuda()
    ref = out(reference(model, x))
    layers = model.model.layers if which == "llama" else model  # the trap modules: nothing else is streamed
    before = storages(layers)
    cfg = ft.OffloadConfig(include_patterns=patterns, profile_mode="torch_function", transfer_mode="strategy",
                           profiling_iters=2, num_blocks=2, min_blocks=2, load_strategy=ALL)
    ft.offload(model, cfg)
    om = ft.get_offload_manager()
    assert om.device.type == "cuda"
    phases = []
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 3):
            phases.append(phase := om.phase)
            torch.testing.assert_close(out(model(x)), ref, atol=3e-2, rtol=3e-2, msg=lambda m: f"{phase}: {m}")
            assert storages(layers) == before, f"a trap module's parameter changed in phase {phase}"
    assert phases[:3] == [Phase.DISCOVERY, Phase.PROFILING, Phase.PROFILING]
    assert om.phase is Phase.INFERENCE and om.loader.cuda and om.loader.copies_issued > 0
    streamed = [model.get_parameter(n) for names in om.offloaded_tensors.values() for n in names]
    assert len(streamed) == (36 if which == "llama" else 16)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in streamed)  # page-locked in place
    assert ft.get_gpu_memory_usage().block_bytes == om.loader.device_bytes > 0
    ft.release()
    assert storages(layers) == before and not any(p.is_pinned() for p in streamed)
    torch.testing.assert_close(out(reference(model, x)), ref, atol=3e-2, rtol=3e-2)
