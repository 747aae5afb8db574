"""Allocate a fresh segment's pages before use, in parallel.

Why not only ``posix_fallocate``: on tmpfs it allocates and zeroes every 4 KiB page under the inode lock, in
one thread, several times slower than a plain copy into fresh anonymous memory (transparent huge pages), and
publishing paid for it (docs/benchmarks.md, Figures behind the code).
``MADV_POPULATE_WRITE`` (Linux 5.14) write-faults a range in without touching its bytes and leaves the pages
mapped for the creator's copy; faults on separate ranges proceed in parallel up to the file's own locks (a few
threads per file, :data:`WRITE_THREADS_PER_FILE`; separate files allocate side by side, which is why a large
arena is cut into parts, ``blocks.py``). Like ``posix_fallocate`` it reports a full ``/dev/shm`` as an error (never as
SIGBUS later). On kernels without it (``EINVAL``) the caller falls back to ``posix_fallocate``.

With huge pages (``segment_dir.py``) a fault allocates and zeroes a whole 2 MiB page, 512 times fewer faults, and
the file's locks are taken that much less often: a range is cut into pieces of whole huge pages (two threads
never fault one page, which would make one wait for the other's zeroing), at least :data:`MIN_HUGE_PIECE` each,
so a few threads reach memory speed with fewer, larger calls.

Reserving ahead of a writer (``SharedSegment.reserve_range``): on a tmpfs of huge pages ``posix_fallocate``
instead. There it allocates the pages and leaves their zeroing to the first touch, one fault per 2 MiB in the
writer's own thread, and a creator's piece-by-piece copy from RAM (``flextensor.sharing.publish``, reproduced
by ``bench/experiment_publish_pages.py``) ran more than twice as fast behind it as behind ``MADV_POPULATE_WRITE``
of the same ranges; on 4 KiB pages the two were even, and populating also fills the page tables a 4 KiB writer
would otherwise fault in (docs/benchmarks.md, Figures behind the code). That copy now writes into the files
instead and reserves nothing ahead (``flextensor.runtime.piece_copy``); a checkpoint's reads still do.

``MADV_POPULATE_READ`` is the follower's counterpart: the pages exist already, a fresh mapping only lacks page-
table entries. Filling them from several threads before ``cudaHostRegister`` roughly halves a follower's
registration (docs/benchmarks.md, Figures behind the code), because the driver's own walk of the range faults
the pages in one at a time, in one thread.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
#: Each thread populates ranges of this size; below it one call in the caller's thread is cheaper than a pool.
CHUNK = 64 << 20
MAX_THREADS = 16
#: Threads that allocate the pages of one file by default. tmpfs allocates a file's pages under that file's locks,
#: so past a few threads more only wait for each other (docs/benchmarks.md, Figures behind the code), and their
#: waiting takes cores from whatever fills other files meanwhile (a creator fills its store beside the arena's
#: parts: ``flextensor.shm.blocks``).
WRITE_THREADS_PER_FILE = 4
#: A range being allocated (``populate_write_range``) is cut into pieces of at least this size, as many as there
#: are threads: a creator allocates record by record and block by block, often tens of MiB each, and whole
#: ``CHUNK``-sized pieces would leave most threads idle (several threads allocate a range almost twice as fast as
#: one).
MIN_PIECE = 4 << 20
#: The least piece on huge pages: zeroing 2 MiB per fault runs at memory speed, so small pieces only add calls.
MIN_HUGE_PIECE = 32 << 20
#: Threads that pre-fault a range of huge pages for reading (:func:`read_threads`).
HUGE_READ_THREADS = 1
#: Threads that drop a mapping's page-table entries (:func:`drop_page_tables`).
DROP_THREADS = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``length`` bytes at ``address``: 0 on success, else its errno (ctypes releases the GIL
    around the call, so threads can advise ranges at once)."""
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def populate_write(mapping: mmap.mmap, size: int, *, page_size: int = mmap.PAGESIZE) -> bool:
    """Allocate and map every page of ``mapping`` (whose mount has pages of ``page_size`` bytes); False when the
    kernel lacks ``MADV_POPULATE_WRITE``.

    Raises ``OSError`` with the kernel's errno otherwise (``EFAULT``/``ENOMEM``/``ENOSPC``: no room left).
    """
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return populate_write_range(ctypes.addressof(anchor), size, page_size=page_size)
    finally:
        del anchor  # release the buffer export so the mapping can be closed later


def populate_write_range(address: int, size: int, *, threads: int | None = None,
                         page_size: int = mmap.PAGESIZE) -> bool:
    """Allocate and map every page of ``size`` bytes at ``address`` (a shared mapping whose mount has pages of
    ``page_size`` bytes), from as many threads as the range has :data:`MIN_PIECE` pieces (:data:`MIN_HUGE_PIECE`
    on huge pages, each a whole number of them; at most ``threads``, by default :data:`WRITE_THREADS_PER_FILE`);
    False when the kernel lacks ``MADV_POPULATE_WRITE``. ``OSError`` as :func:`populate_write`."""
    threads = max(1, min(threads or WRITE_THREADS_PER_FILE, MAX_THREADS, os.cpu_count() or 1))
    huge = page_size > mmap.PAGESIZE
    piece = max(MIN_HUGE_PIECE if huge else MIN_PIECE, min(CHUNK, -(-size // threads)))
    piece += -piece % page_size
    return _populate_range(address, size, MADV_POPULATE_WRITE, piece=piece, threads=threads)


def read_threads(page_size: int) -> int:
    """Threads worth pre-faulting a fresh mapping from (``populate_read``): :data:`MAX_THREADS` on base pages,
    where the faults are the cost; :data:`HUGE_READ_THREADS` on huge pages, where one fault maps 2 MiB and a
    GiB is 512 of them, so more threads only contend for the mapping's lock."""
    return HUGE_READ_THREADS if page_size > mmap.PAGESIZE else MAX_THREADS


def populate_read(address: int, size: int, *, threads: int = MAX_THREADS) -> bool:
    """Map every (existing) page of ``size`` bytes at ``address`` into this process, from up to ``threads``
    threads.

    False when the kernel lacks ``MADV_POPULATE_READ`` (the caller simply goes on: it is only a speed-up).
    """
    return _populate_range(address, size, MADV_POPULATE_READ, threads=threads)


def drop_page_tables(ranges: Sequence[tuple[int, int]], *, threads: int = DROP_THREADS) -> int:
    """Remove this process's page-table entries for ``(address, size)`` ranges of shared file mappings, from up
    to ``threads`` threads (``MADV_DONTNEED``: the pages stay in their files, registered pages stay registered,
    and a later access faults them in again); returns how many :data:`CHUNK` pieces the kernel refused.

    Why: a process that mapped tens of GiB of shared blocks in 4 KiB pages spends seconds as it dies tearing those
    entries down in one thread, several processes ending at once longer still; done from several threads just
    before the end it takes a third off the exit (``flextensor.shm.background_release``; docs/benchmarks.md, the
    exit floor).

    Plain threads, not a ``ThreadPoolExecutor``: this runs in ``atexit`` hooks, and by then the interpreter's
    shutdown has closed every executor to new work."""
    pieces = [(address + offset, min(CHUNK, size - offset))
              for address, size in ranges for offset in range(0, size, CHUNK)]
    threads = max(1, min(threads, os.cpu_count() or 1, len(pieces)))
    refused = [0] * threads

    def drop(index: int) -> None:
        refused[index] = sum(1 for address, size in pieces[index::threads] if madvise(address, size, MADV_DONTNEED))

    started = []
    for index in range(threads):
        worker = threading.Thread(target=drop, args=(index,), name="ft-drop", daemon=True)
        try:
            worker.start()
        except RuntimeError:  # some interpreters refuse new threads at exit: this thread drops the rest
            for rest in range(index, threads):
                drop(rest)
            break
        started.append(worker)
    for worker in started:
        worker.join()
    return sum(refused)


def _populate_range(address: int, size: int, advice: int, *, piece: int = CHUNK, threads: int = MAX_THREADS
                    ) -> bool:
    ranges = [(address + offset, min(piece, size - offset)) for offset in range(0, size, piece)]
    threads = min(threads, MAX_THREADS, os.cpu_count() or 1, len(ranges))
    if threads <= 1:
        results = [madvise(a, n, advice) for a, n in ranges]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ft-populate") as pool:
            results = list(pool.map(lambda r: madvise(r[0], r[1], advice), ranges))
    failures = [code for code in results if code]
    if not failures:
        return True
    if all(code == errno.EINVAL for code in failures):
        return False
    code = next(c for c in failures if c != errno.EINVAL)
    raise OSError(code, os.strerror(code))
