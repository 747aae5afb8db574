"""The vLLM workers' settings and default patterns, without vLLM: what ``resolve_settings`` makes of the
environment, a config file and ``additional_config``, and which modules of a vLLM-shaped model the defaults trap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from flextensor.configuration.patterns import select_traps
from flextensor.contrib.vllm import VLLM_DEFAULT_EXCLUDE_PATTERNS, VLLM_DEFAULT_INCLUDE_PATTERNS, resolve_settings


def test_defaults_switch_offloading_on_with_the_vllm_patterns() -> None:
    settings = resolve_settings(None, cuda=False)
    config = settings.config
    assert config.enabled and not config.pinned_memory
    assert config.include_patterns == list(VLLM_DEFAULT_INCLUDE_PATTERNS)
    assert config.exclude_patterns == list(VLLM_DEFAULT_EXCLUDE_PATTERNS)
    assert settings.manager == "vllm" and settings.warmup_tokens is None and settings.namespace is None
    assert settings.defaults_applied == ("include_patterns", "exclude_patterns", "pinned_memory")
    assert resolve_settings({}, cuda=True).config.pinned_memory  # pinned host blocks where CUDA copies them


def test_environment_patterns_replace_the_defaults_one_list_at_a_time(monkeypatch) -> None:
    monkeypatch.setenv("FT_INCLUDE_PATTERNS", "model.layers.*")
    config = resolve_settings(None, cuda=False).config
    assert config.include_patterns == ["model.layers.*"]
    assert config.exclude_patterns == list(VLLM_DEFAULT_EXCLUDE_PATTERNS)
    monkeypatch.setenv("FT_EXCLUDE_PATTERNS", "")  # set, even empty: no excludes
    assert resolve_settings(None, cuda=False).config.exclude_patterns == []


def test_ft_enabled_and_pinned_memory_from_the_environment_win(monkeypatch) -> None:
    monkeypatch.setenv("FT_ENABLED", "0")
    assert not resolve_settings(None, cuda=False).config.enabled
    monkeypatch.setenv("FT_ENABLED", "1")
    monkeypatch.setenv("FT_PINNED_MEMORY", "1")  # explicit: kept, and the engine names its error on a CPU host
    assert resolve_settings(None, cuda=False).config.pinned_memory


def test_a_config_file_sets_patterns_and_the_environment_overrides_it(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ft.json"
    path.write_text(json.dumps({"include_patterns": ["class:*Block"], "profiling_iters": 3}))
    settings = resolve_settings({"flextensor": {"config_file": str(path), "warmup_tokens": 64}}, cuda=False)
    assert settings.config.enabled and settings.config.profiling_iters == 3
    assert settings.config.include_patterns == ["class:*Block"]
    assert settings.config.exclude_patterns == list(VLLM_DEFAULT_EXCLUDE_PATTERNS)
    assert settings.warmup_tokens == 64
    monkeypatch.setenv("FT_PROFILING_ITERS", "5")
    assert resolve_settings({"flextensor": {"config_file": str(path)}}, cuda=False).config.profiling_iters == 5


@pytest.mark.parametrize("options, message", [
    ({"flextensor": {"warmup_token": 8}}, "unknown option 'warmup_token'"),
    ({"flextensor": {"warmup_tokens": 0}}, "warmup_tokens'] must be an integer >= 1"),
    ({"flextensor": {"memory_budget_bytes": -1}}, "memory_budget_bytes'] must be an integer >= 0"),
    ({"flextensor": {"manager": "a/b"}}, "manager name"),
    ({"flextensor": ["config_file"]}, "must be a mapping of options"),
])
def test_bad_worker_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_settings(options, cuda=False)


def test_a_bad_environment_value_names_its_variable(monkeypatch) -> None:
    monkeypatch.setenv("FT_PROFILING_ITERS", "many")
    with pytest.raises(ValueError, match="FT_PROFILING_ITERS"):
        resolve_settings(None, cuda=False)


# ------------------------------------------------------------------------------------------------ the patterns
# Stand-ins with vLLM's class names and module paths (vllm/model_executor/models/llama.py, qwen2_moe.py).
def _named(name: str, base: type = nn.Module) -> type:
    return type(name, (base,), {})


class Linear(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, n))


RMSNorm, VocabParallelEmbedding, ParallelLMHead = _named("RMSNorm", Linear), _named("VocabParallelEmbedding", Linear), \
    _named("ParallelLMHead", Linear)


class LlamaAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = Linear(), Linear()


class LlamaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = Linear(), Linear()


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Linear()  # the router
        self.experts = Linear()
        self.shared_expert = LlamaMLP()
        self.shared_expert_gate = Linear(1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.self_attn = LlamaAttention()
        self.mlp = Qwen2MoeSparseMoeBlock() if moe else LlamaMLP()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()


class LlamaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding()
        self.layers = nn.ModuleList([LlamaDecoderLayer(), LlamaDecoderLayer(moe=True)])
        self.norm = RMSNorm()


class LlamaForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = ParallelLMHead()
        self.logits_processor = nn.Module()


def test_the_defaults_trap_each_decoder_layer_and_keep_routers_embeddings_and_the_head_resident() -> None:
    traps = select_traps(LlamaForCausalLM(), VLLM_DEFAULT_INCLUDE_PATTERNS, VLLM_DEFAULT_EXCLUDE_PATTERNS)
    assert [t.label for t in traps] == ["model.layers.0", "model.layers.1"]
    dense, moe = (set(t.param_names) for t in traps)
    assert dense == {f"model.layers.0.{p}.weight" for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")}
    assert "model.layers.1.mlp.experts.weight" in moe and "model.layers.1.mlp.shared_expert.down_proj.weight" in moe
    assert "model.layers.1.mlp.gate.weight" not in moe and "model.layers.1.mlp.shared_expert_gate.weight" not in moe


def test_with_the_catch_all_include_the_default_excludes_still_keep_the_head_and_embedding_resident() -> None:
    traps = select_traps(LlamaForCausalLM(), ["*"], VLLM_DEFAULT_EXCLUDE_PATTERNS)
    offloadable = {name for trap in traps for name in trap.param_names}
    assert offloadable and not offloadable & {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
