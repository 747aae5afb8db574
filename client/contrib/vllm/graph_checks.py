"""Compilation and CUDA-graph checks shared by both vLLM workers, and the warm-up passes kept out of compilation.

vLLM compiles a model's forward at its first call: ``@support_torch_compile`` wraps the inner model (Llama's
``model``), and in the modes vLLM uses by default the trace is made once and replayed without guards. A trace
made during the engine's warm-up would freeze DISCOVERY's or PROFILING's per-pass work into every later
forward, so :func:`uncompiled` keeps those passes eager (vLLM's own ``do_not_compile`` switch, per module) and
vLLM's first compiled trace sees the INFERENCE forward.

After the plan, :func:`check_capture` refuses what cannot be compiled or captured, naming the fix:

- a plan that streams layers to a CUDA device under vLLM's compilation (any mode but ``NONE``): a streamed
  trap's block loader must run between graphs, and vLLM compiles the whole forward with ``fullgraph=True``;
- CUDA graphs (any ``cudagraph_mode`` but ``NONE``) over streamed layers from pageable host blocks: a captured
  copy must read pinned memory (``pinned_memory=True``).

A plan that streams nothing (every layer resident, or a CPU computing from the host blocks in place) compiles
and captures as the plain model does. The engine checks the rest itself at capture time (a capture before
INFERENCE, or while host blocks are still being built, is a ``RuntimeError`` naming the fix).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig

from flextensor.configuration.config import OffloadConfig

__all__ = ["uncompiled", "streams_to_device", "check_capture"]

_EAGER_FIX = ("set enforce_eager=True (vllm serve --enforce-eager), or include/exclude patterns or a budget "
              "under which nothing streams")


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s forwards eagerly inside the block: every vLLM-compiled submodule skips its compiled path."""
    switched = []
    for module in model.modules():
        if getattr(module, "do_not_compile", True) is False:
            module.do_not_compile = True
            switched.append(module)
    try:
        yield
    finally:
        for module in switched:
            module.do_not_compile = False


def streams_to_device(offloaded: dict[str, list[str]], device_type: str) -> bool:
    """Whether a plan copies weights per pass: some tensors offloaded and a compute device other than the CPU
    (a CPU computes from the host blocks in place)."""
    return device_type != "cpu" and any(offloaded.values())


def check_capture(vllm_config: VllmConfig, config: OffloadConfig, *, streams: bool, manager: str) -> None:
    """Refuse vLLM compilation or CUDA graphs over a plan that cannot run under them (see the module docs)."""
    if not streams:
        return
    compilation = vllm_config.compilation_config
    if compilation.mode != CompilationMode.NONE:
        raise RuntimeError(
            f"flextensor manager {manager!r} streams layers to the device, but vLLM compiles the model's forward "
            f"into one graph (compilation mode {CompilationMode(compilation.mode).name}), and a streamed layer's "
            f"copies must run between graphs; {_EAGER_FIX}")
    mode = compilation.cudagraph_mode
    if mode is not None and mode != CUDAGraphMode.NONE and not config.pinned_memory:
        raise RuntimeError(
            f"flextensor manager {manager!r} streams layers from pageable host memory (pinned_memory=False), "
            f"which vLLM's CUDA graphs (cudagraph_mode {mode.name}) cannot capture; set FT_PINNED_MEMORY=1, or "
            f"{_EAGER_FIX}")
