"""Copying a large host range to the device at pinned speed without registering it: :class:`StagedCopy`.

Why
---
A session follower copies the resident tensors (embeddings, head, and every layer the plan keeps on the device:
6.3 GB of a 24 GiB model at ``max_gpu_mem_fraction=0.05``) from the store's fresh mapping to the device before it
is ready. That mapping is not registered with CUDA, so the driver bounces the copy through a small pinned buffer
of its own, from one thread: 8.7 GB/s on the H200 host, 0.72 s for 6.3 GB. Registering the range first costs
63-150 ms/GiB on a fresh mapping, about as much. Instead, :class:`StagedCopy` bounces it through a ring of its
own (:data:`SLOTS` chunks of :data:`CHUNK_BYTES`, registered once): each chunk is copied into a free slot by
:data:`THREADS` threads (``memmove``, one piece each), and from there to the device asynchronously on the
caller's stream, so the host copy of chunk ``k + 1`` overlaps the DMA of chunk ``k`` (at 55 GB/s, faster than the
host copy). Meanwhile as many helper threads map the source's pages into this process ahead of the copy
(``MADV_POPULATE_READ``, ``flextensor.shm.prefault``): a fresh mapping of shared pages otherwise faults in
4 KiB at a time inside the copy.

Why a few threads of its own rather than PyTorch's CPU copy: followers attach at once, and PyTorch's copy runs
on as many OpenMP threads as the host has cores in each of them (threads that spin between parallel regions).
Copied that way on the H200 host, three followers copying together got 3.1 GB/s each where one alone got
14.6 GB/s. A small fixed pool per process leaves room for the others.

Ordering
--------
A slot is refilled only after the device finished reading it (an event per slot); before the ring is
unregistered every recorded copy is waited for, also when an error interrupts the loop, so the driver never
reads memory that is no longer registered. :meth:`StagedCopy.__call__` returns once ``dst`` holds every byte
(the caller's stream is idle as far as these copies go). Ranges below :data:`MIN_BYTES` are copied directly
(registering the ring would cost more than it saves); when the driver refuses the ring (``ulimit -l``), the
copy is made directly too, after one WARNING: correct, only slower.

On a CPU destination (tests, hosts without CUDA) the same chunking runs with synchronous copies and no events.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

from flextensor.shm.prefault import populate_read, populate_write_range

__all__ = ["StagedCopy", "CopyReport", "CHUNK_BYTES", "SLOTS", "MIN_BYTES", "THREADS"]

logger = logging.getLogger(__name__)

#: Bytes per slot of the pinned ring: large enough that the per-chunk Python work (a few microseconds of torch
#: calls, which need the GIL that a follower's model factory holds most of the time) stays small against the copy.
CHUNK_BYTES = 64 << 20
#: Slots of the ring: a few, so the host copy never waits for the device.
SLOTS = 4
#: Smaller ranges are copied directly.
MIN_BYTES = 2 * CHUNK_BYTES
#: Threads copying each chunk into the ring (and mapping the source's pages ahead of them).
THREADS = 4

_warned = False


class CopyReport(NamedTuple):
    """What one copy did: bytes, seconds, and whether it went through the pinned ring."""

    nbytes: int
    seconds: float
    staged: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


class StagedCopy:
    """``copy(dst, src)``: 1-D ``uint8`` ``src`` (host) into ``dst`` (same size, a device) through a pinned ring.

    ``register(ptr, nbytes)`` / ``unregister(ptr)`` pin and unpin the ring (CUDA's by default; tests pass
    recording fakes). ``stream``: where the device copies are queued (default: the current stream of ``dst``'s
    device). ``last`` is the report of the latest copy.
    """

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, slots: int = SLOTS, min_bytes: int = MIN_BYTES,
                 threads: int = THREADS, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None,
                 stream: "torch.cuda.Stream | None" = None) -> None:
        if chunk_bytes <= 0 or slots < 2 or threads < 1:
            raise ValueError(f"StagedCopy needs chunk_bytes > 0, at least 2 slots and 1 thread, got {chunk_bytes}, "
                             f"{slots} and {threads}")
        self.chunk_bytes = int(chunk_bytes)
        self.slots = int(slots)
        self.min_bytes = int(min_bytes)
        self.threads = int(threads)
        self._register = register
        self._unregister = unregister
        self._stream = stream
        self.last: CopyReport | None = None

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for t, what in ((dst, "destination"), (src, "source")):
            if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"StagedCopy: the {what} must be a contiguous 1-D uint8 tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if dst.numel() != src.numel() or src.device.type != "cpu":
            raise ValueError(f"StagedCopy copies a host range of {src.numel()} bytes on {src.device} into as many "
                             f"bytes; got a destination of {dst.numel()} on {dst.device}")
        start = time.monotonic()
        staged = src.numel() >= self.min_bytes and self._copy_staged(dst, src)
        if not staged:
            dst.copy_(src)
        self.last = CopyReport(src.numel(), time.monotonic() - start, staged)

    # ------------------------------------------------------------------------------------------ the ring
    def _pin_functions(self) -> tuple[Callable[[int, int], None], Callable[[int], None]]:
        if self._register is not None and self._unregister is not None:
            return self._register, self._unregister
        from flextensor.shm.pinning import host_register, host_unregister

        return (lambda ptr, nbytes: host_register(ptr, nbytes, read_only=True)), host_unregister

    def _copy_staged(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """The ring copy; False (nothing copied) when the ring could not be registered."""
        global _warned
        register, unregister = self._pin_functions()
        size = self.slots * self.chunk_bytes
        mapping = mmap.mmap(-1, size)
        ring = torch.frombuffer(mapping, dtype=torch.uint8)
        address = ring.data_ptr()
        try:
            try:
                populate_write_range(address, size)  # the ring's pages now, not one by one in the driver
            except OSError:
                pass  # only a speed-up: registration faults them in anyway
            try:
                register(address, size)
            except RuntimeError as exc:
                if not _warned:
                    _warned = True
                    logger.warning("could not register a %d MiB staging ring (%s); copying %d MiB from pageable "
                                   "memory instead (correct, slower)", size >> 20, exc, src.numel() >> 20)
                return False
            try:
                self._run(dst, src, ring)
            finally:
                unregister(address)
            return True
        finally:
            del ring
            try:
                mapping.close()
            except BufferError:  # a traceback still holds a view of it: unmapped when that goes
                pass

    def _run(self, dst: torch.Tensor, src: torch.Tensor, ring: torch.Tensor) -> None:
        """The loop keeps its Python work per chunk small (views, events and the stream are made before it): each
        step needs the GIL, which a follower's model factory holds most of the time meanwhile."""
        cuda = dst.device.type == "cuda"
        total, chunk = src.numel(), self.chunk_bytes
        offsets = range(0, total, chunk)
        targets = [dst.narrow(0, o, min(chunk, total - o)) for o in offsets]
        slots = [ring.narrow(0, i * chunk, chunk) for i in range(self.slots)]
        staging = [slots[k % self.slots].narrow(0, 0, t.numel()) for k, t in enumerate(targets)]
        src_ptr, ring_ptr = src.data_ptr(), ring.data_ptr()
        piece = max(1 << 20, -(-chunk // self.threads))
        prefault = threading.Thread(target=_prefault, args=(src_ptr, total, self.threads), name="ft-staged-prefault",
                                    daemon=True)
        prefault.start()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ft-staged-copy")
        stream = None
        if cuda:
            stream = self._stream if self._stream is not None else torch.cuda.current_stream(dst.device)
        events = [torch.cuda.Event() for _ in range(self.slots)] if cuda else []
        used = [False] * self.slots
        try:
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for k, (offset, stage, target) in enumerate(zip(offsets, staging, targets)):
                    slot = k % self.slots
                    if used[slot]:
                        events[slot].synchronize()  # the device finished reading this slot
                    n = target.numel()
                    base = ring_ptr + slot * chunk
                    for future in [pool.submit(ctypes.memmove, base + p, src_ptr + offset + p, min(piece, n - p))
                                   for p in range(0, n, piece)]:
                        future.result()
                    if cuda:
                        target.copy_(stage, non_blocking=True)
                        events[slot].record(stream)
                        used[slot] = True
                    else:
                        target.copy_(stage)
        finally:
            for slot, event in enumerate(events):  # also after an error: the ring is unregistered next
                if used[slot]:
                    event.synchronize()
            pool.shutdown(wait=True)
            prefault.join()


def _prefault(address: int, nbytes: int, threads: int) -> None:
    start = address - address % mmap.PAGESIZE  # madvise wants a page-aligned start
    try:
        populate_read(start, nbytes + address - start, threads=threads)
    except OSError as exc:  # a speed-up only
        logger.debug("pre-faulting the source of a staged copy failed: %s", exc)
