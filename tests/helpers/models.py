"""Small test models for the engine tests, plus shared helpers.

The models cover what the engine must not break: tied weights (embedding/head), registered buffers (persistent
and not), a non-contiguous (transposed) parameter, norms, attention, a submodule shared by two blocks, and
data-dependent control flow. Everything is tiny so the CPU suite stays fast.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import flextensor as ft

# The compute device the engine picks: CUDA when present, else the CPU. On the CPU outputs must be EXACTLY equal to
# the plain model; on a GPU the reference runs on the GPU too and outputs must agree to float tolerance.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
#: Offload every offloadable tensor (every layer streams): exercises the loader and the host blocks deterministically.
ALL = ft.NthLayerStrategy(1)


def reference(model: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """The plain model's output on the compute device (the model is put back on the CPU afterwards)."""
    model.to(DEVICE)
    try:
        with torch.no_grad():
            return model(*(i.to(DEVICE) for i in inputs))
    finally:
        model.to("cpu")


def same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Exact equality on the CPU; float tolerance on a GPU (same kernels, but not bit-identical by contract)."""
    if DEVICE.type == "cpu":
        return torch.equal(out, ref)
    return out.shape == ref.shape and torch.allclose(out.float(), ref.float(), atol=1e-4, rtol=1e-4)


def cpu_config(**kwargs) -> ft.OffloadConfig:
    """A config usable on this CPU-only host (no pinning), with fast warm-up by default."""
    kwargs.setdefault("pinned_memory", False)
    kwargs.setdefault("profiling_iters", 2)
    kwargs.setdefault("num_blocks", 2)
    kwargs.setdefault("min_blocks", 2)
    return ft.OffloadConfig(**kwargs)


def errors_on_another_thread(*calls: Callable[[], object]) -> list[BaseException]:
    """Run each call on one other thread and return what they raised (managers and sessions belong to the
    thread that made them, so callers expect one RuntimeError per call)."""
    errors: list[BaseException] = []

    def run() -> None:
        for call in calls:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors


def count_new_streams(monkeypatch) -> list[int]:
    """Count the CUDA streams made from now on (one entry each). ``torch.cuda.current_stream()`` also builds
    ``Stream`` objects, around streams that exist already (``stream_id=...``): those are not counted."""
    made: list[int] = []
    real_stream = torch.cuda.Stream

    def counting_stream(*args, **kwargs):
        if "stream_id" not in kwargs:
            made.append(1)
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", counting_stream)
    return made


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached clones of every state_dict entry (values to compare after release)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------------------------
# MLP stack
# ----------------------------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def mlp_stack(n: int = 4, d: int = 16, h: int = 48, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[MLPBlock(d, h) for _ in range(n)]).eval()


# ----------------------------------------------------------------------------------------------------------------
# Transformer-like decoder
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d)
        # non-persistent buffer: not in state_dict, still must reach the device
        self.register_buffer("mask", torch.full((max_len, max_len), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + self.mask[:t, :t]
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, heads, max_len)
        self.norm2 = nn.LayerNorm(d)
        # a transposed (non-contiguous, dense) parameter: its strides must survive packing and release
        self.up_t = nn.Parameter(torch.randn(2 * d, d).t() * 0.1)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.silu(self.norm2(x) @ self.up_t))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.register_buffer("pos", 0.02 * torch.randn(max_len, d))  # persistent buffer
        self.blocks = nn.ModuleList([DecoderBlock(d, heads, max_len) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny_transformer(seed: int = 0, **kwargs) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs).eval()


def token_ids(batch: int = 2, t: int = 8, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, t), generator=g)


# ----------------------------------------------------------------------------------------------------------------
# Shared submodule, control flow, manual blocks
# ----------------------------------------------------------------------------------------------------------------


class SharingBlock(nn.Module):
    def __init__(self, d: int, shared: nn.Module) -> None:
        super().__init__()
        self.own = nn.Linear(d, d)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.own(x)) + self.shared(x)


class SharedSubmoduleModel(nn.Module):
    """Two blocks hold the same Linear: its parameters are used by two traps, so they must stay resident."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        shared = nn.Linear(d, d)
        self.blocks = nn.ModuleList([SharingBlock(d, shared), SharingBlock(d, shared), SharingBlock(d, nn.Linear(d, d))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def shared_model(seed: int = 0) -> SharedSubmoduleModel:
    torch.manual_seed(seed)
    return SharedSubmoduleModel().eval()


class SkippingModel(nn.Module):
    """Runs layer 1 only when the input sum is positive: the loader must resynchronise its schedule."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = bool(x.sum() <= 0)
        for i, layer in enumerate(self.layers):
            if i == 1 and skip:
                continue
            x = torch.tanh(layer(x))
        return x


class ManualBlockModel(nn.Module):
    """Uses ``ft.offload_block`` around code that reads parameters outside any patched module."""

    def __init__(self, d: int = 16, manager: str = "default") -> None:
        super().__init__()
        self.body = nn.Linear(d, d)
        self.w_head = nn.Parameter(torch.randn(d, d) * 0.1)
        self.b_head = nn.Parameter(torch.randn(d) * 0.1)
        self.manager = manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.body(x))
        with ft.offload_block("head", name=self.manager):
            x = x @ self.w_head + self.b_head
        return x


# ----------------------------------------------------------------------------------------------------------------
# transformers' Llama (no download: built from a config)
# ----------------------------------------------------------------------------------------------------------------


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2)


def tiny_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()
