"""Checkpoint fixtures: safetensors files (one file, or shards with an index) of the test models, their
profiles, and a model large enough (512 MiB) for the peak-RSS goals."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import flextensor as ft
from tests.helpers.models import DEVICE, MLPBlock, cpu_config, tiny_transformer, token_ids

#: 8 blocks of 2 x (1024 x 8192) float32 weights: 8 x 64 MiB + biases, about 512 MiB (a block is 1/8 of the model;
#: a real LLM layer is 1-4%).
BIG = dict(n=8, d=1024, h=8192)


class BigMLP(nn.Sequential):
    def __init__(self, n: int = BIG["n"], d: int = BIG["d"], h: int = BIG["h"]) -> None:
        super().__init__(*[MLPBlock(d, h) for _ in range(n)])


def big_mlp(seed: int = 0, **kwargs) -> BigMLP:
    """The 512 MiB model, built in RAM (creator factory, reference outputs)."""
    torch.manual_seed(seed)
    return BigMLP(**kwargs).eval()


def big_mlp_meta(**kwargs) -> BigMLP:
    """The same topology with its parameters on meta (what a follower and a checkpoint creator build)."""
    with ft.init_empty_weights():
        return BigMLP(**kwargs).eval()


def big_input(seed: int = 1, d: int = BIG["d"]) -> torch.Tensor:
    return torch.randn(2, d, generator=torch.Generator().manual_seed(seed))


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as safetensors saves it: contiguous, tied duplicates dropped (kept under the first name)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        out[key] = value.detach().contiguous()
    return out


def save_checkpoint(model: nn.Module, path: Path, *, shards: int = 1) -> Path:
    """``path/model.safetensors``, or ``shards`` files with ``model.safetensors.index.json`` (Hugging Face's
    layout). Returns what to pass as the checkpoint: the file, or the directory."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path / "model.safetensors"
    keys = list(tensors)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return path


def make_profile(model: nn.Module, x: torch.Tensor, directory: Path, *, include: list[str]) -> str:
    """Profile ``model`` with every matched module streamed and save the profile; the model is released."""
    cfg = cpu_config(include_patterns=include, load_strategy=ft.NthLayerStrategy(1))
    ft.offload(model, cfg, name="profiler")
    manager = ft.get_offload_manager("profiler")
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(x.to(DEVICE))
    ft.save_profile(str(directory), name="profiler")
    ft.release("profiler")
    return str(directory)


def tiny_profile(directory: Path) -> str:
    return make_profile(tiny_transformer(seed=0), token_ids(), directory, include=["blocks.*"])
