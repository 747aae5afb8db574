"""The demo's model: a small pre-norm decoder in plain torch, sized by bytes rather than by name.

Why not a Hugging Face model: the demo must run on a fresh machine without a download, build a model of a given
size (about 1 GiB by default) in a couple of seconds, and give the engine one class to trap per layer
(``class:DemoBlock``). Layout: token + learned position embeddings, N ``DemoBlock`` (RMSNorm -> causal
self-attention -> RMSNorm -> SwiGLU MLP), a final RMSNorm and an untied head. No buffers: every tensor is a
parameter, so the checkpoint is exactly the state dict.

Three ways to get the model, one per role in the demo:

- :func:`build_random` (the parent): allocated once and filled in place with ``uniform_`` from a seeded
  generator under ``no_grad`` (about 1 s per GiB on one core; ``randn`` would allocate twice and is slower);
- :func:`load_checkpoint` (the elected creator): the topology on ``meta`` plus the safetensors file's tensors
  assigned in place (no random init, no second copy);
- :func:`build_meta` (followers): the topology only, on ``meta``; flextensor fills it from shared memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DemoSpec", "DemoBlock", "DemoModel", "BLOCK_PATTERN", "spec_for_size", "quick_spec", "build_random",
           "build_meta", "save_checkpoint", "load_checkpoint", "demo_tokens"]

#: What the engine traps: every decoder layer, and nothing else.
BLOCK_PATTERN = "class:DemoBlock"


@dataclass(frozen=True)
class DemoSpec:
    """Shape of a :class:`DemoModel`; ``dtype`` is a torch dtype name ("float32", "bfloat16")."""

    hidden: int
    heads: int
    mlp: int
    layers: int
    vocab: int
    max_len: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype, device="meta").element_size()

    def block_params(self) -> int:
        h = self.hidden
        return 4 * h * h + 3 * h * self.mlp + 2 * h  # qkv + out, gate/up/down, two norm scales

    def fixed_params(self) -> int:
        return 2 * self.vocab * self.hidden + self.max_len * self.hidden + self.hidden  # embed, head, pos, norm

    def total_params(self) -> int:
        return self.layers * self.block_params() + self.fixed_params()

    def total_bytes(self) -> int:
        return self.total_params() * self.itemsize

    def block_bytes(self) -> int:
        return self.block_params() * self.itemsize

    def to_dict(self) -> dict:
        return asdict(self)


def _mlp_width(hidden: int) -> int:
    """SwiGLU's usual ~8/3 expansion, rounded to a multiple of 64."""
    return 64 * max(1, round(hidden * 8 / 3 / 64))


def spec_for_size(size_gib: float, dtype: torch.dtype, *, min_layers: int = 8) -> DemoSpec:
    """The widest layout (hidden 2048, 1024, 512 or 256) that reaches ``size_gib`` with at least ``min_layers``
    layers: enough layers that streaming them is the point, wide enough that a layer is a realistic block."""
    if not size_gib > 0:
        raise ValueError(f"--size-gib must be > 0, got {size_gib}")
    target = size_gib * 2**30
    name = str(dtype).removeprefix("torch.")
    spec = None
    for hidden in (2048, 1024, 512, 256):
        base = DemoSpec(hidden=hidden, heads=hidden // 64, mlp=_mlp_width(hidden), layers=0,
                        vocab=min(16000, 32 * hidden), max_len=256, dtype=name)
        layers = max(1, round((target - base.total_bytes()) / base.block_bytes()))
        spec = DemoSpec(**{**base.to_dict(), "layers": layers})
        if layers >= min_layers:
            return spec
    assert spec is not None
    return spec


def quick_spec(dtype: torch.dtype, *, layers: int = 4) -> DemoSpec:
    """A tiny model (a few hundred KiB) for the test of the demo: same code path, seconds instead of a minute.
    Also what a worker runs once before its baseline is read, so library set-up is not counted as weights."""
    return DemoSpec(hidden=64, heads=4, mlp=_mlp_width(64), layers=layers, vocab=512, max_len=64,
                    dtype=str(dtype).removeprefix("torch."))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DemoBlock(nn.Module):
    """One decoder layer: the unit flextensor traps, keeps in one host block and streams to the device."""

    def __init__(self, spec: DemoSpec) -> None:
        super().__init__()
        h = spec.hidden
        self.heads = spec.heads
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate = nn.Linear(h, spec.mlp, bias=False)
        self.up = nn.Linear(h, spec.mlp, bias=False)
        self.down = nn.Linear(spec.mlp, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, h))
        z = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(z)) * self.up(z))


class DemoModel(nn.Module):
    def __init__(self, spec: DemoSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.max_len, spec.hidden)
        self.blocks = nn.ModuleList(DemoBlock(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_meta(spec: DemoSpec) -> DemoModel:
    """The topology on ``meta``: no memory, no initialisation (what a follower's factory returns)."""
    with torch.device("meta"):
        model = DemoModel(spec)
    return model.to(dtype=spec.torch_dtype).eval().requires_grad_(False)


@torch.no_grad()
def build_random(spec: DemoSpec, seed: int = 0, device: torch.device | str = "cpu") -> DemoModel:
    """A deterministic random model on ``device``, allocated once and filled in place.

    Matrices are uniform with the variance of N(0, 1/fan_in); the residual projections (``out``, ``down``) are
    scaled by 1/sqrt(2 * layers) so the hidden state stays O(1) however deep the stack (finite bf16 outputs).
    Filling bf16 on a CPU is slow (no vectorised path: ~10 s per GiB), so a GPU host builds on the GPU.
    """
    model = build_meta(spec).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    depth = 1.0 / math.sqrt(2 * spec.layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = 0.02 if name in ("embed.weight", "pos.weight") else 1.0 / math.sqrt(param.shape[-1])
        if name.endswith(("out.weight", "down.weight")):
            std *= depth
        bound = std * math.sqrt(3.0)
        param.uniform_(-bound, bound, generator=gen)
    return model


def save_checkpoint(model: nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)


def load_checkpoint(spec: DemoSpec, path: str) -> DemoModel:
    """What the elected creator's factory does: read the safetensors file into a model built on ``meta``."""
    from safetensors.torch import load_file

    model = build_meta(spec)
    model.load_state_dict(load_file(path, device="cpu"), assign=True, strict=True)
    return model.requires_grad_(False)


def demo_tokens(spec: DemoSpec, *, batch: int = 1, seq: int = 32, seed: int = 1) -> torch.Tensor:
    """The fixed input every process runs (generated on the CPU, so identical everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab, (batch, min(seq, spec.max_len)), generator=gen)
