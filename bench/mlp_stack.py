"""The host-memory benchmarks' model: a stack of bfloat16 MLP blocks, cheap to build at any size.

Why a model of its own: the host-RAM benchmarks must fill tens of GiB in seconds and compute a reference at sizes
the GPU cannot hold. Every block is ``d x h`` up and ``h x d`` down (256 MiB at the default 4096 x 16384); the
weights are one random block's copies, scaled per layer (filling GiBs from a random generator would take
minutes), and the reference runs layer by layer on the device from the host weights, one block there at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from models import run_on_device

D, H = 4096, 16384
BLOCK_BYTES = 2 * D * H * 2
DTYPE = torch.bfloat16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def layers_for(gib: float) -> int:
    """The layer count closest to ``gib`` GiB of weights."""
    return max(1, round(gib * 2**30 / BLOCK_BYTES))


def build_meta(layers: int) -> Stack:
    """The model's structure on ``meta`` in its dtype (a sharing follower's model)."""
    with torch.device("meta"):
        return Stack(layers).to(DTYPE).eval()


def scale_of(layer: int) -> float:
    """Layer ``layer``'s weights are the base block's times this (1.0 for layer 0)."""
    return 1.0 + 0.01 * (layer % 7)


def base_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The one random block every layer is scaled from (``up``, ``down``), in bfloat16 on the host."""
    gen = torch.Generator().manual_seed(0)
    up = (torch.randn(H, D, generator=gen) * D ** -0.5).to(DTYPE)
    down = (torch.randn(D, H, generator=gen) * (0.1 * H ** -0.5)).to(DTYPE)
    return up, down


def build(layers: int, device: str) -> Stack:
    """The model in bfloat16 on ``device``, built without a float32 copy: one random block, copied and scaled.
    Layer 0 holds the random block itself, so nothing beside the model's own weights is alive once the first
    layer is built (a factory that held a spare block would add it to a creator's peak)."""
    model = build_meta(layers)
    up, down = (w.to(device) for w in base_weights())
    for i, block in enumerate(model.blocks):
        scale = scale_of(i)
        block.up.weight = nn.Parameter(up if i == 0 else up * scale, requires_grad=False)
        block.down.weight = nn.Parameter(down if i == 0 else down * scale, requires_grad=False)
    return model


def inputs(batch: int, seed: int = 1) -> torch.Tensor:
    """A batch of activations on the host, the same for every process."""
    return torch.randn(batch, D, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def reference(model: Stack, x: torch.Tensor) -> torch.Tensor:
    """Layer by layer on the device, each block's weights copied there and dropped after it
    (``models.run_on_device``)."""
    with torch.no_grad():
        x = x.cuda()
        for block in model.blocks:
            x = run_on_device(block, "cuda", x)
        return x.cpu()


def recipe_reference(layers: int, x: torch.Tensor, device: str = "cuda") -> torch.Tensor:
    """What :func:`reference` gives for ``build(layers, ...)``, from the recipe alone (the base block scaled per
    layer, on the host as :func:`build` scales it): no model in host RAM, so any process can compute it at any
    size, before the process that builds the model exists."""
    up, down = base_weights()
    scaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        x = x.to(device)
        for i in range(layers):
            k = i % 7
            if k not in scaled:
                scale = scale_of(i)
                scaled[k] = ((up if k == 0 else up * scale).to(device), (down if k == 0 else down * scale).to(device))
            w_up, w_down = scaled[k]
            x = x + torch.relu(x @ w_up.t()) @ w_down.t()
        return x.cpu()


def close_to(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal within bfloat16's rounding of a deep stack (the offloaded and the reference kernels may differ)."""
    return bool(torch.allclose(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2))
