"""Handing freed heap memory back to the operating system (glibc ``malloc_trim``).

Why: a weight that PyTorch frees goes back to ``malloc``. Large blocks are ``mmap``-ed and unmapped at once, but
glibc raises its mmap threshold as such blocks are freed (up to 32 MiB), so the tensors of a model built after
that live in the heap, and freeing them keeps the pages in the process (RSS) for the next ``malloc``. A creator
that frees its private copy of the weights while it fills the shared blocks would then hold both copies anyway.
``malloc_trim(0)`` releases the free pages of every arena (``MADV_DONTNEED``); without glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["return_free_heap"]

logger = logging.getLogger(__name__)

_malloc_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
    _malloc_trim = None


def return_free_heap() -> bool:
    """Give the heap's free pages back to the OS; True when something was released."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))
