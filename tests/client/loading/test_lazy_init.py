"""``ft.load_model_from_profile``: a meta model, every tensor read once from safetensors into its final place,
outputs equal to the plain model; missing keys, wrong shapes and truncated files are named and leave nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.loading.checkpoint import SafetensorsCheckpoint
from flextensor.loading.lazy_init import init_empty_weights, prepare_checkpoint
from flextensor.manager import Phase
from tests.helpers.checkpoints import checkpoint_tensors, save_checkpoint, tiny_profile
from tests.helpers.models import (
    ALL,
    TinyTransformer,
    cpu_config,
    reference,
    same,
    tiny_transformer,
    token_ids,
)


@pytest.fixture
def profile(tmp_path: Path) -> str:
    return tiny_profile(tmp_path / "profile")


def _manager(name: str = "lazy") -> ft.OffloadManager:
    ft.init(cpu_config(include_patterns=["blocks.*"], load_strategy=ALL), name=name)
    return ft.get_offload_manager(name)


@pytest.mark.parametrize("shards", [1, 3])
def test_outputs_equal_the_plain_model_from_one_file_or_shards(tmp_path: Path, profile: str, shards: int) -> None:
    source = tiny_transformer(seed=0)
    ids = token_ids()
    expected = reference(source, ids)
    path = save_checkpoint(source, tmp_path / "ckpt", shards=shards)
    assert "head.weight" not in SafetensorsCheckpoint(path)  # tied to embed.weight: saved once
    manager = _manager()
    model = ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(path), strict=True)
    assert isinstance(model, TinyTransformer) and not model.training
    assert manager.phase is Phase.INFERENCE and manager.offloaded_tensors  # the profile's plan streams blocks
    assert model.head.weight is model.embed.weight  # the tie survived the meta build
    with torch.no_grad():
        for _ in range(2):
            assert same(model(ids.to(manager.device)), expected)


def test_a_checkpoint_larger_than_the_available_host_ram_is_refused_before_any_block(
        tmp_path: Path, profile: str, monkeypatch) -> None:
    import flextensor.shm.preflight as preflight
    from flextensor.shm.errors import HostMemoryError

    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt")
    monkeypatch.setattr(preflight, "host_available_bytes", lambda meminfo="/proc/meminfo": 1 << 30)
    manager = _manager()
    with pytest.raises(HostMemoryError, match=r"needs .* of host RAM and the host has 1\.0 GiB available") as info:
        ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(path), strict=True)
    assert 0 < info.value.wanted < 1 << 20 and info.value.available == 1 << 30
    assert "offload fewer layers" in str(info.value)
    assert manager.model is None and manager.phase is None
    monkeypatch.setattr(preflight, "host_available_bytes", lambda meminfo="/proc/meminfo": 1 << 40)
    model = ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(path), strict=True)
    with torch.no_grad():
        assert same(model(token_ids().to(manager.device)), reference(tiny_transformer(seed=0), token_ids()))


def test_missing_key_strict_raises_key_error_naming_it_and_leaves_nothing(tmp_path: Path, profile: str) -> None:
    tensors = checkpoint_tensors(tiny_transformer(seed=0))
    del tensors["blocks.2.down.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "m.safetensors"))
    manager = _manager()
    with pytest.raises(KeyError, match=r"blocks\.2\.down\.weight"):
        ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(tmp_path / "m.safetensors"),
                                   strict=True)
    assert manager.model is None and manager.phase is None


def test_missing_key_not_strict_is_zero_filled_with_a_warning(tmp_path: Path, profile: str, caplog) -> None:
    tensors = checkpoint_tensors(tiny_transformer(seed=0))
    del tensors["blocks.2.down.bias"]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "m.safetensors"))
    with caplog.at_level(logging.WARNING, logger="flextensor.loading.lazy_init"):
        model = ft.load_model_from_profile(_manager(), profile, TinyTransformer,
                                           safetensor_path=str(tmp_path / "m.safetensors"))
    assert any("blocks.2.down.bias" in r.getMessage() and "zero-filled" in r.getMessage() for r in caplog.records)
    manager = ft.get_offload_manager("lazy")
    assert torch.count_nonzero(_host_value(manager, "blocks.2.down.bias")) == 0
    assert torch.equal(_host_value(manager, "blocks.1.down.bias"), tensors["blocks.1.down.bias"])
    assert model.blocks[2].down.bias.shape == (32,)


def _host_value(manager: ft.OffloadManager, name: str) -> torch.Tensor:
    """An offloaded tensor's value in its host block (outside a forward its parameter may view a device slot)."""
    from flextensor.runtime.host_memory import block_view

    inference = manager.engine.inference
    index, placement = inference.placement[name]
    return block_view(inference.host_blocks[index].tensor, placement).clone()


def test_wrong_shape_is_a_value_error_naming_the_tensor(tmp_path: Path, profile: str) -> None:
    tensors = checkpoint_tensors(tiny_transformer(seed=0))
    tensors["blocks.1.attn.qkv.weight"] = torch.zeros(96, 31)
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "m.safetensors"))
    manager = _manager()
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight"):
        ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(tmp_path / "m.safetensors"))
    assert manager.model is None


def test_wrong_dtype_is_a_value_error_naming_the_tensor(tmp_path: Path, profile: str) -> None:
    tensors = checkpoint_tensors(tiny_transformer(seed=0))
    tensors["norm.weight"] = tensors["norm.weight"].half()
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=r"'norm\.weight'.*float16"):
        ft.load_model_from_profile(_manager(), profile, TinyTransformer, safetensor_path=str(tmp_path / "m.safetensors"))


def test_truncated_checkpoint_is_a_value_error_and_leaves_nothing(tmp_path: Path, profile: str) -> None:
    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt")
    path.write_bytes(path.read_bytes()[:-4096])
    manager = _manager()
    with pytest.raises(ValueError, match="truncated"):
        ft.load_model_from_profile(manager, profile, TinyTransformer, safetensor_path=str(path))
    assert manager.model is None


def test_missing_safetensor_path_and_wrong_manager_are_refused(profile: str) -> None:
    with pytest.raises(ValueError, match="safetensor_path"):
        ft.load_model_from_profile(_manager(), profile, TinyTransformer)
    with pytest.raises(TypeError, match="OffloadManager"):
        ft.load_model_from_profile("lazy", profile, TinyTransformer, safetensor_path="x")


def test_init_empty_weights_puts_parameters_on_meta_keeps_buffers_and_ties() -> None:
    with init_empty_weights():
        model = TinyTransformer()
    assert all(p.is_meta for p in model.parameters())
    assert not model.pos.is_meta and not model.blocks[0].attn.mask.is_meta
    assert model.head.weight is model.embed.weight
    assert not nn_register_parameter_patched()


def nn_register_parameter_patched() -> bool:
    from torch import nn

    return nn.Module.register_parameter.__qualname__ != "Module.register_parameter"


def test_meta_non_persistent_buffer_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt")
    with torch.device("meta"):
        model = TinyTransformer()
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.mask.*init_empty_weights"):
        prepare_checkpoint(model, SafetensorsCheckpoint(path))
    assert all(p.is_meta for p in model.parameters())  # refused before the model was touched


def test_diagnose_logs_where_every_tensor_comes_from(tmp_path: Path, profile: str, caplog) -> None:
    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="flextensor.loading.lazy_init"):
        ft.load_model_from_profile(_manager(), profile, TinyTransformer, safetensor_path=str(path), diagnose=True)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "head.weight" not in SafetensorsCheckpoint(path)
    assert "embed.weight [parameter aliases ['head.weight']] <- checkpoint 'embed.weight'" in text
    assert "blocks.0.attn.mask [buffer] <- constructor (non-persistent buffer)" in text


def test_a_transformers_llama_saved_sharded_by_save_pretrained(tmp_path: Path) -> None:
    """A real architecture, saved the way users get it (``save_pretrained`` shards + index), loaded on meta."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from tests.helpers.checkpoints import make_profile
    from tests.helpers.models import llama_config, tiny_llama

    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    source = tiny_llama()
    expected = reference(source, ids).logits
    source.save_pretrained(tmp_path / "llama", max_shard_size="100KB", safe_serialization=True)
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 2
    profile = make_profile(tiny_llama(), ids, tmp_path / "profile", include=["class:*DecoderLayer"])
    ft.init(cpu_config(include_patterns=["class:*DecoderLayer"], load_strategy=ALL), name="lazy")
    manager = ft.get_offload_manager("lazy")
    model = ft.load_model_from_profile(manager, profile, LlamaForCausalLM, model_args=(llama_config(),),
                                       safetensor_path=str(tmp_path / "llama"), strict=True)
    assert list(manager.offloaded_tensors) == [f"model.layers.{i}" for i in range(4)]
    with torch.no_grad():
        assert same(model(ids.to(manager.device)).logits, expected)


def test_every_checkpoint_byte_is_read_exactly_once(tmp_path: Path, profile: str) -> None:
    """Offloaded tensors are read into their blocks, resident ones into their own tensor: no tensor twice."""
    from flextensor.profiles import read_profile

    checkpoint = SafetensorsCheckpoint(save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt", shards=2))
    with init_empty_weights():
        model = TinyTransformer()
    weights = prepare_checkpoint(model, checkpoint, strict=True)
    manager = _manager()
    state = read_profile(profile)
    assert any(t.offloaded for t in state.tensors) and any(not t.offloaded for t in state.tensors)
    manager.offload_from_state(model, state, weights=weights)
    assert weights.bytes_read == checkpoint.nbytes


# ------------------------------------------------------------------------------------------ initialisers on meta
def _counting(monkeypatch, name: str) -> list[tuple[str, str]]:
    """Replace ``torch.nn.init.<name>`` with a counting pass-through; the calls it sees (name, device type)."""
    seen: list[tuple[str, str]] = []
    original = getattr(torch.nn.init, name)

    def counted(tensor, *args, **kwargs):
        seen.append((name, tensor.device.type))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, name, counted)
    return seen


def test_initialisers_pass_over_meta_tensors_and_initialise_real_ones(monkeypatch) -> None:
    """Inside ``skip_init_on_meta`` a module built on meta calls no initialiser, one built on the CPU gets its
    usual initialisation (the same values as outside, from the same seed), and afterwards every initialiser is
    the one that was there before."""
    from flextensor.loading.lazy_init import skip_init_on_meta

    seen = _counting(monkeypatch, "kaiming_uniform_") + _counting(monkeypatch, "uniform_")
    before = {name: getattr(torch.nn.init, name) for name in ("kaiming_uniform_", "uniform_", "normal_", "zeros_")}
    torch.manual_seed(3)
    expected = torch.nn.Linear(8, 4)
    seen.clear()
    with skip_init_on_meta():
        with torch.device("meta"):
            meta = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Embedding(5, 3), torch.nn.LayerNorm(3))
        calls_on_meta = len(seen)
        torch.manual_seed(3)
        real = torch.nn.Linear(8, 4)
    assert meta[0].weight.is_meta and meta[1].weight.shape == (5, 3)
    assert calls_on_meta == 0
    assert torch.equal(real.weight, expected.weight) and torch.equal(real.bias, expected.bias)
    assert {name: getattr(torch.nn.init, name) for name in before} == before


def test_nested_and_concurrent_contexts_restore_the_initialisers_once_the_last_ends() -> None:
    """Two threads in the context at once, one of them nesting it: the initialisers stay wrapped until the last
    one leaves, then each is exactly the original again."""
    import threading

    from flextensor.loading.lazy_init import skip_init_on_meta

    originals = {name: getattr(torch.nn.init, name) for name in ("uniform_", "kaiming_normal_", "orthogonal_")}
    first_in, second_out = threading.Event(), threading.Event()
    wrapped_while_other_inside: list[bool] = []

    def other() -> None:
        with skip_init_on_meta():
            first_in.set()
            second_out.wait(10)
            wrapped_while_other_inside.append(torch.nn.init.uniform_ is not originals["uniform_"])

    thread = threading.Thread(target=other)
    thread.start()
    assert first_in.wait(10)
    with skip_init_on_meta(), skip_init_on_meta():
        assert all(getattr(torch.nn.init, name) is not fn for name, fn in originals.items())
    second_out.set()
    thread.join(10)
    assert wrapped_while_other_inside == [True]
    assert {name: getattr(torch.nn.init, name) for name in originals} == originals


def test_a_patch_made_inside_the_context_is_left_in_place() -> None:
    """Code that replaces an initialiser while the context is open (another library's own context) keeps its
    replacement when the context ends: only the context's own wrappers are undone."""
    from flextensor.loading.lazy_init import skip_init_on_meta

    def theirs(tensor, *args, **kwargs):
        return tensor

    original = torch.nn.init.normal_
    try:
        with skip_init_on_meta():
            torch.nn.init.normal_ = theirs
        assert torch.nn.init.normal_ is theirs
    finally:
        torch.nn.init.normal_ = original
