"""The page cache of a few files, for benchmarks that time reads from a warm cache and from disk.

Why a check and not only an eviction: ``posix_fadvise(POSIX_FADV_DONTNEED)`` is advice. On tmpfs (``/dev/shm``,
often ``/tmp``) the cached pages are the file and stay; pages that are dirty, or mapped by a process, are kept
too. :func:`resident_bytes` asks the kernel (``mincore`` over a mapping that is never touched, so asking faults
nothing in), so a "cold" measurement can say when it was not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import subprocess
import time
from typing import Iterable, Sequence

__all__ = ["resident_bytes", "evict", "make_resident", "timed_cat", "filesystem_type"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _resident(path: str) -> int:
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path!r} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path!r} failed")
            resident = sum(1 for flag in bytes(vector) if flag & 1)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(size, resident * mmap.PAGESIZE)


def resident_bytes(paths: Iterable[str]) -> int:
    """Bytes of ``paths`` in the page cache now (whole pages, capped at each file's size)."""
    return sum(_resident(str(p)) for p in paths)


def evict(paths: Iterable[str]) -> None:
    """Ask the kernel to drop ``paths`` from the page cache: each file's dirty pages are written first
    (``fsync``: dirty pages are never dropped), then ``POSIX_FADV_DONTNEED`` on the whole file. Check the result
    with :func:`resident_bytes`."""
    for path in paths:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_cat(paths: Sequence[str]) -> float:
    """Seconds ``cat PATHS > /dev/null`` takes (the reference a checkpoint read from disk is compared with)."""
    start = time.monotonic()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.monotonic() - start


def make_resident(paths: Sequence[str]) -> int:
    """Read ``paths`` once unless they are all cached already; returns the bytes cached afterwards."""
    total = sum(os.path.getsize(p) for p in paths)
    if resident_bytes(paths) < total:
        timed_cat(paths)
    return resident_bytes(paths)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (its longest mount point in ``/proc/mounts``): ``tmpfs``
    means the page cache is the file and cannot be dropped."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            mount = mount.replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind
