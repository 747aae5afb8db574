"""Where the tensor store's records lie: the data in parts (:func:`store_layout`).

Why parts
---------
A creator whose model is in RAM allocates the store's pages as it copies, and tmpfs allocates one file's pages
under that file's locks (threads on one file stop at a fraction of what several files reach, whatever their
number; separate files allocate in parallel: ``flextensor.shm.blocks``). So the data is cut into parts like the
arena: part 0 is ``/{ns}.g{gen}.sd``, part ``k`` is ``.sd{k}`` (:func:`data_kind`).

Layout
------
A pure function of the records' keys and sizes (a record's key is its tie group's smallest name:
:func:`record_key`), so a creator can size the parts from its plan before it has the model, and gets the same
parts from the model later::

    records sorted by key: record i in part i % parts
    parts = min(STORE_MAX_PARTS, records, total // STORE_PART_MIN_BYTES), at least 1
            (total: every record's bytes rounded up to ALIGNMENT)
    a record at the end of its part's previous record, rounded up to ALIGNMENT; a part's size: its end

The creator fills the records in that order, so consecutive records lie in different files and their pages are
allocated in parallel, a worker per part (``populate_ahead.py``). Each record names its part in the manifest
(``manifest.py``), so a follower needs none of this: it maps the parts the manifest lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flextensor.shm.blocks import ARENA_MAX_PARTS, ARENA_PART_MIN_BYTES, part_kind
from flextensor.shm.sizes import align_up

__all__ = ["ALIGNMENT", "DATA_KIND", "STORE_MAX_PARTS", "STORE_PART_MIN_BYTES", "StoreLayout", "data_kind",
           "record_key", "store_layout"]

#: Resource kind of the data's first part (``/{ns}.g{gen}.sd``); part ``k`` is ``sd{k}`` (:func:`data_kind`).
DATA_KIND = "sd"
#: Alignment of every tensor span in its part: generous enough for vectorised copies and DMA.
ALIGNMENT = 256
#: The most parts, and the least bytes of a part (a small store stays one segment): the arena's, for its reasons.
STORE_MAX_PARTS = ARENA_MAX_PARTS
STORE_PART_MIN_BYTES = ARENA_PART_MIN_BYTES


def record_key(names: Iterable[str]) -> str:
    """A record's key in the layout: the smallest of its tie group's names (the same for a model's
    registrations and for a plan's tensor with its aliases)."""
    return min(names)


def data_kind(part: int) -> str:
    """The resource kind of data part ``part``: ``sd``, ``sd1``, ``sd2``, ..."""
    return part_kind(DATA_KIND, part)


@dataclass(frozen=True)
class StoreLayout:
    """Where each record lies, by its key (see :func:`store_layout`): ``(part, byte offset)``, and the parts'
    sizes; ``order`` is the keys in fill order."""

    order: tuple[str, ...]
    places: dict[str, tuple[int, int]]
    part_sizes: tuple[int, ...]

    @property
    def kinds(self) -> dict[str, int]:
        """Each part's resource kind -> its size (what a creator prepares ahead)."""
        return {data_kind(part): size for part, size in enumerate(self.part_sizes)}


def store_layout(sizes: dict[str, int], *, part_min_bytes: int | None = None) -> StoreLayout:
    """The layout of records of ``sizes`` (key -> bytes; the key is a tie group's smallest name): see the module
    docs. ``part_min_bytes``: the least bytes per part (default :data:`STORE_PART_MIN_BYTES`)."""
    if part_min_bytes is None:
        part_min_bytes = STORE_PART_MIN_BYTES
    order = tuple(sorted(sizes))
    total = sum(align_up(sizes[key], ALIGNMENT) for key in order)
    parts = max(1, min(STORE_MAX_PARTS, len(order), total // max(1, part_min_bytes)))
    ends = [0] * parts
    places: dict[str, tuple[int, int]] = {}
    for i, key in enumerate(order):
        part = i % parts
        places[key] = (part, ends[part])
        ends[part] = align_up(ends[part] + sizes[key], ALIGNMENT)
    return StoreLayout(order, places, tuple(max(end, ALIGNMENT) for end in ends))
