"""Shared host blocks for the offload engine.

When sharing is on, each offloaded trap's packed host block is one segment ``/{ns}.g{gen}.b{index}`` created by
the generation's creator through its ``ShmOwner`` (so it is journaled before it exists and unlinked by the last
participant), and attached by followers by index. The allocator deals in segments; the engine wraps each as a
``uint8`` tensor and pins it in place when pinned memory is asked for (``SharedSegment.pin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.segment import SharedSegment


def block_kind(index: int) -> str:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"host block index must be a non-negative int, got {index!r}")
    return f"b{index}"


class SharedBlockAllocator:
    """Allocate (creator) or attach (followers) the engine's host blocks in one sharing generation."""

    def __init__(self, owner: "ShmOwner") -> None:
        self.owner = owner

    @property
    def namespace(self) -> str:
        return self.owner.namespace

    def allocate(self, index: int, nbytes: int) -> "SharedSegment":
        """Create block ``index`` of ``nbytes`` (creator only; the owner journals it first)."""
        if not self.owner.is_creator:
            raise RuntimeError(
                f"only the creator of {self.owner.namespace!r} allocates host blocks; followers call attach()"
            )
        if nbytes <= 0:
            raise ValueError(f"host block {index} must have a positive size, got {nbytes}")
        return self.owner.create_segment(block_kind(index), nbytes)

    def attach(self, index: int, nbytes: int) -> "SharedSegment":
        """Open block ``index`` published by the creator; refuse one smaller than the plan says."""
        segment = self.owner.open_segment(block_kind(index))
        if segment.size < nbytes:
            size = segment.size
            segment.close()
            raise ValueError(
                f"shared host block {index} of {self.owner.namespace!r} holds {size} bytes but the published plan "
                f"needs {nbytes}: the plan and the blocks disagree; restart all workers of this namespace"
            )
        return segment
