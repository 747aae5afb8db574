"""A private tensor's pages handed back to the kernel piece by piece while its bytes are copied elsewhere.

Why
---
A session creator whose model is in RAM copies each weight into its shared block and then points the model at
the copy, which frees the private tensor (``flextensor.sharing.publish``). Until the tensor's last byte is copied
both copies of it exist, so without more the creator peaks at the model plus its largest tensor (a fused MLP
weight or an embedding: hundreds of MiB) plus the pages allocated ahead of the copy. Giving the private pages
back as each piece is copied (``madvise(MADV_DONTNEED)`` on the whole pages inside the piece) bounds that overlap
at one piece, whatever the tensor's size.

When it is safe
---------------
Only where nothing can read the private bytes again, which :func:`releasable` checks before the copy starts:

- the storage is the CPU allocator's own (``resizable``: not numpy's buffer, not a file or shared mapping, not
  a tensor made from a pointer) and not pinned (the caching pinned allocator hands its blocks out again);
- the tensor covers its storage exactly (offset 0, every byte, contiguous), so no other view reads the rest;
- the tensor's implementation is the storage's only user: no ``.data`` or ``detach()`` alias, no view, no
  second parameter object over it (a tied weight registered under two names is one object, and passes).

Anything else is copied whole and freed when the model lets go of it, as before. Between a release and the
caller pointing the model at the copy the tensor reads zeros where its pages went: callers point it there as
soon as the copy ends, or fail (a creator's model is then disposable, as after any failed publish). A refused
``madvise`` (locked pages, another platform) ends the releases for that tensor and costs nothing else.
"""

from __future__ import annotations

import logging
import mmap

import torch

from flextensor.shm.prefault import madvise

__all__ = ["releasable", "SourcePages"]

logger = logging.getLogger(__name__)

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)

#: What ``torch._C._storage_Use_Count`` reports for a storage used by one tensor only, read through a fresh
#: ``untyped_storage()`` wrapper (which holds a reference of its own while it is read).
_SOLE_USE_COUNT = 2


def releasable(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s pages may be given back piece by piece as it is copied (see the module docstring).
    Ask before taking any alias of it (``detach()`` is one)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if _MADV_DONTNEED is None or use_count is None:
        return False
    if tensor.device.type != "cpu" or tensor.is_meta or not tensor.is_contiguous() or tensor.storage_offset():
        return False
    storage = tensor.untyped_storage()
    if not storage.resizable() or storage.nbytes() != tensor.numel() * tensor.element_size():
        return False
    if storage.nbytes() < mmap.PAGESIZE or tensor.is_pinned():
        return False
    return use_count(storage._cdata) == _SOLE_USE_COUNT


class SourcePages:
    """Gives back the whole pages of a releasable tensor's first ``n`` bytes, ``n`` growing with its copy
    (:meth:`through`); a page that straddles the copied edge waits for the next call."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._address = tensor.data_ptr()
        self._nbytes = tensor.numel() * tensor.element_size()
        self._released = self._address + (-self._address % mmap.PAGESIZE)  # the first whole page
        self.released_bytes = 0
        self._failed = False

    def through(self, nbytes: int) -> None:
        """The tensor's bytes ``[0, nbytes)`` are copied: give back every whole page among them not given back yet."""
        if self._failed:
            return
        end = self._address + min(nbytes, self._nbytes)
        end -= end % mmap.PAGESIZE
        if end <= self._released:
            return
        assert _MADV_DONTNEED is not None  # releasable() said so
        error = madvise(self._released, end - self._released, _MADV_DONTNEED)
        if error:
            self._failed = True
            logger.debug("madvise(MADV_DONTNEED) refused (errno %d): this tensor is freed whole after its copy",
                         error)
            return
        self.released_bytes += end - self._released
        self._released = end

    def release_inside(self, lo: int, hi: int) -> int:
        """The tensor's bytes ``[lo, hi)`` are copied (others may not be yet): give back the whole pages inside that
        range, from any thread, and return their bytes. Pages that straddle two such ranges stay until the tensor
        is freed; :meth:`through` and ``released_bytes`` do not count what this gave back."""
        if self._failed:
            return 0
        start = self._address + lo
        start += -start % mmap.PAGESIZE
        end = self._address + min(hi, self._nbytes)
        end -= end % mmap.PAGESIZE
        if end <= start:
            return 0
        assert _MADV_DONTNEED is not None  # releasable() said so
        if madvise(start, end - start, _MADV_DONTNEED):
            self._failed = True
            return 0
        return end - start
