"""``GPUMemoryUsage``: the device memory an offloaded model holds, as ``get_gpu_memory_usage`` reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = ["GPUMemoryUsage", "engine_memory_usage"]

MB = 1024 * 1024


@dataclass(frozen=True)
class GPUMemoryUsage:
    """Device memory held by the engine: rotating blocks + resident tensors (bytes and MB)."""

    block_bytes: int
    resident_bytes: int
    total_bytes: int
    block_mb: float = field(init=False)
    resident_mb: float = field(init=False)
    total_mb: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_mb", self.block_bytes / MB)
        object.__setattr__(self, "resident_mb", self.resident_bytes / MB)
        object.__setattr__(self, "total_mb", self.total_bytes / MB)

    # FlexTensor 0.5.0's names for the same numbers, so scripts written against it run unchanged.
    @property
    def blocks_bytes(self) -> int:
        return self.block_bytes

    @property
    def unmapped_tensors_bytes(self) -> int:
        return self.resident_bytes

    @property
    def blocks_mb(self) -> float:
        return self.block_mb

    @property
    def unmapped_tensors_mb(self) -> float:
        return self.resident_mb


def engine_memory_usage(ctx: EngineContext) -> GPUMemoryUsage:
    """What an engine in INFERENCE holds on its device: the loader's rotating blocks, and every tensor on the
    device that is neither streamed nor read in place from a host block (a block a replan made resident is)."""
    loader = ctx.inference.loader
    blocks = loader.device_bytes if loader is not None else 0
    off_device = {p.name for layout in ctx.inference.layouts if layout.label not in ctx.inference.resident_blocks
                  for p in layout.tensors}
    resident = sum(tensor_nbytes(e.tensor) for n, e in ctx.tensors.items()
                   if n not in off_device and e.tensor.device == ctx.device)
    return GPUMemoryUsage(blocks, resident, blocks + resident)
