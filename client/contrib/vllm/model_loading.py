"""Building a vLLM model for the offload engine: with its weights in host RAM, or on ``meta`` for a follower.

Why not vLLM's own ``get_model``: it loads the weights onto the engine's device (the model may not fit there,
which is why it is offloaded), and on the CPU backend it repacks every linear layer's weight into a kernel's
private format (oneDNN or sgl-kernel handles that the module's parameters no longer show) and frees the
parameter. The offload engine can only place, share and stream what a module's parameters hold, and a packed
copy per engine is the private host copy that sharing exists to avoid. So the weights are loaded into host RAM
with vLLM's own loader (every load format and weight-name mapping of the model class), and on the CPU backend
the unquantized linear and embedding layers are set to compute with ``torch.nn.functional.linear`` from their
parameters, as vLLM itself does for a layer it marks to skip the dispatch.

The follower's model is the same class built on the ``meta`` device, and vLLM's post-load processing run over
it, which on meta tensors changes nothing but the per-layer attributes vLLM's kernels read. Its parameters and
buffers (rotary caches, attention scales included) all come from the session's shared copy, which publishes
every registered tensor. (``ft.init_empty_weights`` would keep computed buffers real, but it rebuilds each
parameter as ``type(param)(meta)``, and vLLM's parameter classes take other constructor arguments.)

Quantized models are outside this path: their post-load processing repacks or converts weights for the device,
which would have to happen in every engine.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

__all__ = ["load_host_model", "build_meta_model", "discard_model", "check_loadable"]

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format print it

_HOST = torch.device("cpu")


def check_loadable(vllm_config: VllmConfig) -> None:
    """Refuse what this loading path does not cover, before anything is loaded (``ValueError`` with the fix)."""
    if vllm_config.quant_config is not None:
        raise ValueError(
            f"flextensor's vLLM workers offload unquantized models; this one is quantized "
            f"({type(vllm_config.quant_config).__name__}), whose weights vLLM converts for its kernels after "
            "loading. Serve it with vLLM's own worker (drop worker_cls), or an unquantized checkpoint")
    if vllm_config.lora_config is not None:
        raise ValueError("flextensor's vLLM workers do not support LoRA adapters (enable_lora); drop worker_cls "
                         "or serve without LoRA")
    if vllm_config.speculative_config is not None:
        raise ValueError("flextensor's vLLM workers do not support speculative decoding (a second model); drop "
                         "worker_cls or the speculative config")


@contextlib.contextmanager
def _load_device(vllm_config: VllmConfig, device: torch.device) -> Iterator[None]:
    """vLLM's loaders read the load device from the shared config: point it at ``device`` for this load only."""
    load_config = vllm_config.load_config
    saved = load_config.device
    load_config.device = str(device)
    try:
        yield
    finally:
        load_config.device = saved


def _weights_stay_parameters(model: nn.Module) -> None:
    """CPU backend: unquantized linear layers compute from their parameters (vLLM's skip of its weight packing)."""
    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(getattr(module, "quant_method", None),
                                                         UnquantizedLinearMethod):
            module._cpu_skip_gemm_dispatch = True


def _drop_packed_copies(model: nn.Module) -> None:
    """CPU backend: embeddings and heads keep their weight but got a packed copy for the logits GEMM; use the
    parameter instead, so the packed copy is freed (it would be private to this engine)."""
    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            module.cpu_linear = torch.nn.functional.linear


def load_host_model(vllm_config: VllmConfig) -> nn.Module:
    """The model with its weights read by vLLM's loader into host RAM, as parameters (see the module docs)."""
    model_config = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    create_model = loader.create_model

    def create_with_parameter_weights(**kwargs: object) -> nn.Module:
        model = create_model(**kwargs)  # type: ignore[arg-type]
        _weights_stay_parameters(model)
        return model

    loader.create_model = create_with_parameter_weights  # type: ignore[method-assign]  # this loader only
    with _load_device(vllm_config, _HOST):
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
    _drop_packed_copies(model)
    return model


def build_meta_model(vllm_config: VllmConfig) -> nn.Module:
    """The same model class with its parameters on ``meta`` (buffers real), post-processed as a loaded one."""
    model_config = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
        model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
    _weights_stay_parameters(model)
    process_weights_after_loading(model, model_config, _HOST)
    _drop_packed_copies(model)
    return model.eval()


def discard_model(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Forget a model built in this engine before another is built: vLLM's attention layers register themselves
    by name in the compilation config as they are built, and a second model of the same class would collide.
    For a worker built as a follower whom the election then made creator (a rare race, see
    ``flextensor.sharing.session``)."""
    registered = vllm_config.compilation_config.static_forward_context
    ours = {id(module) for module in model.modules()}
    for name in [name for name, layer in registered.items() if id(layer) in ours]:
        del registered[name]
