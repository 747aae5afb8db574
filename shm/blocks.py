"""Shared host blocks for the offload engine: every packed block of a generation in a few segments, the arena.

Why a few segments, not one per block or one for all
----------------------------------------------------
A follower maps the creator's host blocks before it is ready, and each mapping is a ``shm_open`` + ``fstat`` +
``mmap`` + ``close``, about a millisecond per segment on a virtualised host when several followers attach at
once, so one segment per block adds tens of milliseconds to a follower's time to ready. One segment for
everything, on the other hand, caps how fast a creator gets its pages: tmpfs allocates the pages of one file
under that file's locks, so parallel ``MADV_POPULATE_WRITE`` on one segment stops at a fraction of what several
segments reach, whatever the thread count (``bench/shm_rates.py``; the figures are in docs/benchmarks.md,
Figures behind the code). Allocating those pages is the slow part of publishing a model built in RAM. So the
arena is cut into parts: at most :data:`ARENA_MAX_PARTS`, each of at least :data:`ARENA_PART_MIN_BYTES` (a
small arena stays one segment), and blocks go to the parts in turn (block ``i`` to part ``i % parts``), so the
blocks a creator fills next, in index order, lie in different files and their pages are allocated in parallel.

Layout (part 0 is ``/{ns}.g{gen}.h``, part ``k`` is ``/{ns}.g{gen}.h{k}``, each made by the generation's
creator through its ``ShmOwner``, so journaled before it exists and unlinked by the last participant)::

    parts   = min(ARENA_MAX_PARTS, number of blocks, total block bytes // ARENA_PART_MIN_BYTES), at least 1
    block i in part i % parts, at the end of the previous block of that part rounded up to align
    part k's size: the end of its last block, rounded up to align

``align`` is the page of the namespace's directory (``ARENA_ALIGN``, 4 KiB, on ``/dev/shm``; 2 MiB on huge pages:
``segment_dir.block_alignment``, ``ShmOwner.block_alignment``), so every block has its pages to itself.

The layout is a pure function of the block sizes in index order (:func:`arena_layout`), which every participant
reads from the published plan, so no offsets are published: every block of the plan names its part's segment,
and a follower computes the same parts and offsets the creator used. Each block starts on its own page, so CUDA
can register the blocks one by one (``SharedSegment.pin(offset=, nbytes=)``, never two registrations on one
page); the padding is less than ``ARENA_ALIGN`` bytes per block.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from flextensor.shm.sizes import align_up

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.segment import SharedSegment

__all__ = ["ARENA_ALIGN", "ARENA_KIND", "ARENA_MAX_PARTS", "ARENA_PART_MIN_BYTES", "ArenaLayout",
           "SharedBlockAllocator", "arena_kind", "arena_layout", "as_layout", "part_kind"]

#: Resource kind of the arena's first part (``/{ns}.g{gen}.h``); part ``k`` is ``h{k}`` (:func:`arena_kind`).
ARENA_KIND = "h"
#: Every block starts on a page boundary (pinning is per page; see the module docstring). The host's page size
#: where it is larger (64 KiB on some aarch64 kernels); every participant runs on the same host, so all of them
#: compute the same layout.
ARENA_ALIGN = max(4096, mmap.PAGESIZE)
#: The most parts an arena is cut into: past 8 parts allocation gains little (docs/benchmarks.md, Figures behind
#: the code), and each part is one more open for a follower.
ARENA_MAX_PARTS = 8
#: An arena part holds at least this many bytes of blocks.
ARENA_PART_MIN_BYTES = 256 << 20


def part_kind(first: str, part: int) -> str:
    """The resource kind of part ``part`` of a resource cut into parts whose first part is ``first``: ``first``,
    then ``first`` + the part's number."""
    return first if part == 0 else f"{first}{part}"


def arena_kind(part: int) -> str:
    """The resource kind of arena part ``part``: ``h``, ``h1``, ``h2``, ..."""
    return part_kind(ARENA_KIND, part)


@dataclass(frozen=True)
class ArenaLayout:
    """Where each block lives (index order): its part and its offset there; each part's size in bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    parts: tuple[int, ...]
    part_sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        """Bytes of every part together (what the arena takes from ``/dev/shm``)."""
        return sum(self.part_sizes)

    @property
    def kinds(self) -> dict[str, int]:
        """Each part's resource kind and size, in part order (what a creator prepares)."""
        return {arena_kind(part): size for part, size in enumerate(self.part_sizes)}


def arena_layout(sizes: Sequence[int], *, align: int = ARENA_ALIGN) -> ArenaLayout:
    """Where each block of ``sizes`` (bytes, by block index) lives in the arena, each starting on a multiple of
    ``align`` bytes (a power of two, at least :data:`ARENA_ALIGN`); ``ValueError`` for a size <= 0."""
    if align < ARENA_ALIGN or align & (align - 1):
        raise ValueError(f"arena alignment must be a power of two >= {ARENA_ALIGN}, got {align!r}")
    for index, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"host block {index} must have a positive integer size, got {size!r}")
    count = max(1, min(ARENA_MAX_PARTS, len(sizes), sum(sizes) // ARENA_PART_MIN_BYTES))
    ends = [0] * count
    offsets, parts = [], []
    for index, size in enumerate(sizes):
        part = index % count
        parts.append(part)
        offsets.append(ends[part])
        ends[part] = align_up(ends[part] + size, align)
    return ArenaLayout(tuple(offsets), tuple(int(s) for s in sizes), tuple(parts),
                       tuple(ends) if sizes else ())


def as_layout(blocks: "Sequence[int] | ArenaLayout") -> ArenaLayout:
    """``blocks`` laid out, unless it is a layout already (a follower computes it once and passes it around)."""
    return blocks if isinstance(blocks, ArenaLayout) else arena_layout(blocks)


class SharedBlockAllocator:
    """Create (creator) or attach (followers) the arena parts of one sharing generation and view its blocks."""

    def __init__(self, owner: "ShmOwner") -> None:
        self.owner = owner

    @property
    def namespace(self) -> str:
        return self.owner.namespace

    def names(self, blocks: "Sequence[int] | ArenaLayout") -> list[str]:
        """The segment name of each part, in part order (the published plan names each block's part)."""
        return [self.owner.resource_name(arena_kind(part)) for part in range(len(as_layout(blocks).part_sizes))]

    def create(self, blocks: "Sequence[int] | ArenaLayout") -> list["SharedSegment"]:
        """Create the arena's parts for ``blocks`` (sizes, or their layout) (creator only; the owner journals each
        first, and hands out segments prepared ahead with ``prepare_segments(arena_layout(sizes).kinds)``)."""
        if not self.owner.is_creator:
            raise RuntimeError(
                f"only the creator of {self.owner.namespace!r} allocates host blocks; followers call attach()"
            )
        layout = as_layout(blocks)
        if not layout.sizes:
            raise ValueError("no host block to allocate: the arena needs at least one block")
        return self._each_part(layout, lambda kind, size: self.owner.create_segment(kind, size))

    def attach(self, blocks: "Sequence[int] | ArenaLayout") -> list["SharedSegment"]:
        """Map the creator's arena parts; refuse a part smaller than the layout of ``blocks`` (sizes, or their
        layout computed once by the caller) needs."""
        def open_part(kind: str, size: int) -> "SharedSegment":
            segment = self.owner.open_segment(kind)
            if segment.size < size:
                held = segment.size
                segment.close()
                raise ValueError(
                    f"shared host blocks of {self.owner.namespace!r}: {segment.name} holds {held} bytes but the "
                    f"published plan needs {size}: the plan and the blocks disagree; restart all workers of this "
                    "namespace"
                )
            return segment

        return self._each_part(as_layout(blocks), open_part)

    @staticmethod
    def _each_part(layout: ArenaLayout, make: "Callable[[str, int], SharedSegment]") -> list["SharedSegment"]:
        """``make`` every part in order; on an error the parts made so far are closed (unmapped) again."""
        segments: list["SharedSegment"] = []
        try:
            for kind, size in layout.kinds.items():
                segments.append(make(kind, size))
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        return segments

    @staticmethod
    def views(segments: "Sequence[SharedSegment]", blocks: "Sequence[int] | ArenaLayout") -> list["torch.Tensor"]:
        """One zero-copy ``uint8`` tensor per block, at its offset in its part (``segments``: the parts in order)."""
        import torch

        return [segment.tensor(torch.uint8, (size,), offset=offset)
                for segment, offset, size in SharedBlockAllocator.ranges(segments, blocks)]

    @staticmethod
    def ranges(segments: "Sequence[SharedSegment]", blocks: "Sequence[int] | ArenaLayout"
               ) -> list[tuple["SharedSegment", int, int]]:
        """Each block's ``(part segment, offset, size)``, in index order."""
        layout = as_layout(blocks)
        return [(segments[part], offset, size)
                for offset, size, part in zip(layout.offsets, layout.sizes, layout.parts)]
