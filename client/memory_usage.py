"""What an offloaded model holds on its device (``get_gpu_memory_usage``) and what it streams to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = ["GPUMemoryUsage", "engine_memory_usage", "offloaded_tensors"]

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
    off_device = {name for names in offloaded_tensors(ctx).values() for name in names}
    resident = sum(tensor_nbytes(e.tensor) for n, e in ctx.tensors.items()
                   if n not in off_device and e.tensor.device == ctx.device)
    return GPUMemoryUsage(blocks, resident, blocks + resident)


def offloaded_tensors(ctx: EngineContext) -> dict[str, list[str]]:
    """Trap label -> names of the tensors an engine in INFERENCE streams from that trap's host block (a block a
    replan made resident streams nothing)."""
    inference = ctx.inference
    return {layout.label: [p.name for p in layout.tensors] for layout in inference.layouts
            if layout.label not in inference.resident_blocks}
