"""Benchmark models: a transformer-like decoder built from plain torch, of any size, built in seconds.

Why a home-made model: the benchmarks need a model whose size (GiB) and compute per layer (batch x sequence)
can be dialled independently, that builds deterministically from a seed without a download, and whose layer
class has a known name for ``include_patterns=["class:DecoderBlock"]``. The layout is the usual pre-norm
decoder: token embedding, N ``DecoderBlock`` (RMSNorm -> causal self-attention through
``scaled_dot_product_attention`` -> RMSNorm -> MLP), a final RMSNorm and an untied head. The head only sees the
last position (what a prefill step needs), so a long sequence makes the *blocks* compute-bound without a
vocabulary-sized activation.

Building is fast: the module tree is made on ``meta`` (no allocation, no default init), moved with
``to_empty`` to the target device and filled in place from a seeded generator on that device. Same seed, same
spec, same device and dtype -> the same weights. ``bf16`` on GPU, ``float32`` on CPU (see :func:`default_dtype`).

A model larger than the device (:func:`fits_on_device`) is built in host RAM by
:func:`build_model_in_host_ram`: one piece (embedding, block, norm, head) at a time is drawn on the device from
the same generator, in the same order, then moved to the host, so the weights equal :func:`build_model`'s and
the host never holds more than the model. Its reference output comes from :func:`layerwise_forward`, which runs
the pieces one at a time on the device with their weights copied there and dropped after (:func:`run_on_device`).

Only ``DecoderBlock`` ends in ``Block``, so ``class:*Block`` selects exactly the layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelSpec",
    "BenchTransformer",
    "DecoderBlock",
    "BLOCK_PATTERN",
    "default_device",
    "default_dtype",
    "build_model",
    "build_model_in_host_ram",
    "build_meta_model",
    "fits_on_device",
    "init_weights_",
    "layerwise_forward",
    "make_tokens",
    "model_pieces",
    "run_on_device",
]

BLOCK_PATTERN = "class:DecoderBlock"
#: Device memory left free beside a model built whole on the device: the forward's activations, the math
#: libraries' workspaces and the caching allocator's rounding (see :func:`fits_on_device`).
DEVICE_MARGIN_BYTES = 4 << 30


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a :class:`BenchTransformer`. ``head_dim`` fixes the number of heads (hidden // head_dim)."""

    hidden: int = 4096
    layers: int = 16
    vocab: int = 32000
    mlp_ratio: int = 2
    head_dim: int = 128

    def __post_init__(self) -> None:
        if self.hidden % self.head_dim:
            raise ValueError(f"ModelSpec: hidden={self.hidden} is not a multiple of head_dim={self.head_dim}")

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def block_params(self) -> int:
        """Parameters of one decoder block: qkv + out projections, MLP up + down, two norm scales."""
        h = self.hidden
        return 4 * h * h + 2 * self.mlp_ratio * h * h + 2 * h

    def total_params(self) -> int:
        return self.layers * self.block_params() + 2 * self.vocab * self.hidden + self.hidden

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.block_params() * _itemsize(dtype)

    def total_bytes(self, dtype: torch.dtype) -> int:
        return self.total_params() * _itemsize(dtype)

    def tensor_count(self) -> int:
        """Parameters + buffers in the state dict (6 per block, embedding, final norm, head)."""
        return 6 * self.layers + 3

    def to_dict(self) -> dict:
        return asdict(self)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.head_dim = spec.heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden, bias=False)
        self.out = nn.Linear(spec.hidden, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.up = nn.Linear(spec.hidden, spec.mlp_ratio * spec.hidden, bias=False)
        self.down = nn.Linear(spec.mlp_ratio * spec.hidden, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class DecoderBlock(nn.Module):
    """One layer: the unit the engine traps and streams (``class:DecoderBlock``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BenchTransformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderBlock(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, -1]))  # logits of the last position only


def default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where tensor cores make it the natural choice, float32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_meta_model(spec: ModelSpec, dtype: torch.dtype) -> BenchTransformer:
    """The topology only, on ``meta``: what a follower builds (no memory, no init)."""
    with torch.device("meta"):
        model = BenchTransformer(spec)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def model_pieces(model: BenchTransformer) -> list[tuple[str, nn.Module]]:
    """The model's pieces in the order its forward runs them, which is also the order of its parameters:
    ``embed``, every ``layers.i``, ``norm``, ``head`` (each piece named by its prefix in the state dict)."""
    return [("embed", model.embed), *((f"layers.{i}", block) for i, block in enumerate(model.layers)),
            ("norm", model.norm), ("head", model.head)]


def _weight_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _fill_parameter_(name: str, param: torch.Tensor, gen: torch.Generator, layers: int) -> None:
    """Draw one parameter (``name`` as in the model's ``named_parameters``) from ``gen``.

    Norm scales are 1; matrices are N(0, 1/fan_in), residual outputs scaled down by sqrt(2 * layers) so the
    hidden state stays O(1) through deep stacks (finite bf16 outputs to compare).
    """
    if name.endswith("norm.weight"):
        param.fill_(1.0)
        return
    std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(param.shape[-1])
    if name.endswith(("attn.out.weight", "mlp.down.weight")):
        std *= 1.0 / math.sqrt(2 * max(1, layers))
    param.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights_(model: BenchTransformer, seed: int) -> BenchTransformer:
    """Fill every parameter in place, in ``named_parameters`` order, from one generator on their device."""
    gen = _weight_generator(next(model.parameters()).device, seed)
    for name, param in model.named_parameters():
        _fill_parameter_(name, param, gen, model.spec.layers)
    return model


def build_model(
    spec: ModelSpec, device: torch.device | str, dtype: torch.dtype | None = None, seed: int = 0
) -> BenchTransformer:
    """A deterministic, initialised model in eval mode with ``requires_grad=False`` on ``device``."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    model = build_meta_model(spec, dtype).to_empty(device=device)
    return init_weights_(model, seed)


def fits_on_device(nbytes: int, device: torch.device | str, margin: int = DEVICE_MARGIN_BYTES) -> bool:
    """Whether ``nbytes`` of weights can be built whole on ``device``: its free memory less ``margin``. The CPU
    always can (building there is building in host RAM)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return nbytes + margin <= free


@torch.no_grad()
def build_model_in_host_ram(
    spec: ModelSpec, device: torch.device | str, dtype: torch.dtype | None = None, seed: int = 0
) -> BenchTransformer:
    """What ``build_model(spec, device, dtype, seed)`` gives, moved to the host, without the device ever holding
    more than one piece of it: the model is made on ``meta``, then each piece (:func:`model_pieces`) in turn is
    drawn on ``device`` from one generator, exactly as :func:`init_weights_` draws it, and moved to host memory
    (:func:`_to_host`). Host RAM grows by the model's bytes plus one staging buffer of its largest tensor;
    ``dtype`` defaults to ``device``'s. With ``device`` the CPU, the pieces are drawn in host RAM directly, in the
    same order (the same weights as :func:`build_model` on the CPU, which is what the CPU tests check)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    model = build_meta_model(spec, dtype)
    gen = _weight_generator(device, seed)
    bounce = None
    if device.type != "cpu":  # on the CPU each piece is drawn where it stays
        largest = max(param.numel() * param.element_size() for param in model.parameters())
        bounce = torch.empty(largest, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for prefix, piece in model_pieces(model):
        piece.to_empty(device=device)
        for name, param in piece.named_parameters(prefix=prefix):
            _fill_parameter_(name, param, gen, spec.layers)
            if bounce is not None:
                param.data = _to_host(param.data, bounce)  # the device copy goes with its last reference
    del bounce
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _to_host(tensor: torch.Tensor, bounce: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fresh host memory, through ``bounce`` (bytes, pinned when ``tensor`` is on a GPU).

    Why not ``tensor.to("cpu")``: fresh host pages are faulted in by whoever writes them first, and a copy from
    the device into pageable memory writes them on one thread, well below memory speed. Here the device copies
    into pinned memory at the link's rate, and a host copy (split over torch's intra-op threads) fills the new
    pages.
    """
    staged = bounce[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    staged.copy_(tensor)
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(staged)


@torch.no_grad()
def run_on_device(module: nn.Module, device: torch.device | str, *args: torch.Tensor) -> torch.Tensor:
    """``module(*args)`` with its parameters and buffers copied to ``device`` for this call only: the module keeps
    its host tensors, and the device copies are dropped when the call returns."""
    tensors = {name: t.to(device) for name, t in (*module.named_parameters(), *module.named_buffers())}
    return torch.func.functional_call(module, tensors, args)


@torch.no_grad()
def layerwise_forward(model: BenchTransformer, tokens: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``model(tokens)`` on ``device`` for a model held in host RAM, one piece on the device at a time (each
    through :func:`run_on_device`): the same operations as :meth:`BenchTransformer.forward`, in the same order, so
    the same output (tests/test_bench_scale.py checks it)."""
    x = run_on_device(model.embed, device, tokens.to(device))
    for block in model.layers:
        x = run_on_device(block, device, x)
    return run_on_device(model.head, device, run_on_device(model.norm, device, x[:, -1]))


def make_tokens(spec: ModelSpec, batch: int, seq: int, device: torch.device | str, seed: int = 1) -> torch.Tensor:
    """Deterministic token ids (generated on CPU so every device and process gets the same input)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(spec.vocab, (batch, seq), generator=gen).to(device)


def worker_env(device_name: str, dtype_name: str, spec_fields: dict):
    """A benchmark worker's torch set-up, outside every timed region: the device made current and its CUDA
    context created, and one tiny model built on ``meta`` (the first one in a process costs about a second of
    one-off torch set-up). Returns ``(torch, device, dtype, spec)``."""
    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
    spec = ModelSpec(**spec_fields)
    build_meta_model(ModelSpec(hidden=spec.head_dim, layers=1, vocab=16, head_dim=spec.head_dim), dtype)
    return torch, device, dtype, spec


def add_model_arguments(parser) -> None:
    """The benchmark transformer's size and its two inputs, as ``bench_engine`` and ``bench_graph`` take them
    (unset sizes and shapes are filled in by each benchmark, per device)."""
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--small", type=int, nargs=2, metavar=("B", "S"), help="transfer-bound input (batch, seq)")
    parser.add_argument("--large", type=int, nargs=2, metavar=("B", "S"), help="compute-bound input (batch, seq)")
