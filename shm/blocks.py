"""Shared host blocks for the offload engine: every packed block of a generation in one segment, the arena.

Why one segment
---------------
A follower maps the creator's host blocks before it is ready, and each mapping is a ``shm_open`` + ``fstat`` +
``mmap`` + ``close``: 0.8-1.5 ms per segment on the virtualised H200 host when several followers attach at
once, so 24 blocks in 24 segments cost 20-37 ms of a follower's time to ready, and the Python around each open
competed for the GIL with the model factory running beside it. One segment is one open and one mapping, and
the last participant has one name to unlink.

Layout (``/{ns}.g{gen}.h``, made by the generation's creator through its ``ShmOwner``, so journaled before it
exists and unlinked by the last participant)::

    block 0 at offset 0, block i at offset_(i-1) + nbytes_(i-1) rounded up to ARENA_ALIGN (4 KiB or the page)
    size: the end of the last block, rounded up to ARENA_ALIGN

The layout is a pure function of the block sizes in index order (:func:`arena_layout`), which every participant
reads from the published plan, so no offsets are published: every block of the plan names the arena segment,
and a follower computes the same offsets the creator used. Each block starts on its own page, so CUDA can
register the blocks one by one (``SharedSegment.pin(offset=, nbytes=)``, never two registrations on one page);
the padding is less than ``ARENA_ALIGN`` bytes per block.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from flextensor.shm.sizes import align_up

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.segment import SharedSegment

__all__ = ["ARENA_ALIGN", "ARENA_KIND", "ArenaLayout", "SharedBlockAllocator", "arena_layout", "as_layout"]

#: Resource kind of the arena segment (``/{ns}.g{gen}.h``).
ARENA_KIND = "h"
#: Every block starts on a page boundary (pinning is per page; see the module docstring). The host's page size
#: where it is larger (64 KiB on some aarch64 kernels); every participant runs on the same host, so all of them
#: compute the same layout.
ARENA_ALIGN = max(4096, mmap.PAGESIZE)


@dataclass(frozen=True)
class ArenaLayout:
    """Offsets of the blocks in the arena (index order) and the arena's size in bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int


def arena_layout(sizes: Sequence[int]) -> ArenaLayout:
    """Where each block of ``sizes`` (bytes, by block index) lives in the arena; ``ValueError`` for a size <= 0."""
    offsets, end = [], 0
    for index, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"host block {index} must have a positive integer size, got {size!r}")
        offsets.append(end)
        end = align_up(end + size, ARENA_ALIGN)
    return ArenaLayout(tuple(offsets), tuple(int(s) for s in sizes), end)


def as_layout(blocks: "Sequence[int] | ArenaLayout") -> ArenaLayout:
    """``blocks`` laid out, unless it is a layout already (a follower computes it once and passes it around)."""
    return blocks if isinstance(blocks, ArenaLayout) else arena_layout(blocks)


class SharedBlockAllocator:
    """Create (creator) or attach (followers) the arena of one sharing generation and view its blocks."""

    def __init__(self, owner: "ShmOwner") -> None:
        self.owner = owner

    @property
    def namespace(self) -> str:
        return self.owner.namespace

    @property
    def name(self) -> str:
        """The arena segment's name, which every block of a published plan carries."""
        return self.owner.resource_name(ARENA_KIND)

    def create(self, blocks: "Sequence[int] | ArenaLayout") -> "SharedSegment":
        """Create the arena for ``blocks`` (sizes, or their layout) (creator only; the owner journals it first,
        and hands out a segment prepared ahead with ``prepare_segments({ARENA_KIND: arena_layout(sizes).total})``).
        """
        if not self.owner.is_creator:
            raise RuntimeError(
                f"only the creator of {self.owner.namespace!r} allocates host blocks; followers call attach()"
            )
        layout = as_layout(blocks)
        if not layout.sizes:
            raise ValueError("no host block to allocate: the arena needs at least one block")
        return self.owner.create_segment(ARENA_KIND, layout.total)

    def attach(self, blocks: "Sequence[int] | ArenaLayout") -> "SharedSegment":
        """Map the creator's arena; refuse one smaller than the layout of ``blocks`` (sizes, or their layout
        computed once by the caller) needs."""
        layout = as_layout(blocks)
        segment = self.owner.open_segment(ARENA_KIND)
        if segment.size < layout.total:
            size = segment.size
            segment.close()
            raise ValueError(
                f"shared host blocks of {self.owner.namespace!r} hold {size} bytes but the published plan needs "
                f"{layout.total}: the plan and the blocks disagree; restart all workers of this namespace"
            )
        return segment

    @staticmethod
    def views(segment: "SharedSegment", blocks: "Sequence[int] | ArenaLayout") -> list["torch.Tensor"]:
        """One zero-copy ``uint8`` tensor per block, at its arena offset."""
        import torch

        layout = as_layout(blocks)
        return [segment.tensor(torch.uint8, (size,), offset=offset)
                for offset, size in zip(layout.offsets, layout.sizes)]
