"""Copying a large host range to the device at pinned speed without registering it: :class:`StagedCopy`.

Why
---
A session follower copies the resident tensors (embeddings, head, and every layer the plan keeps on the device:
a quarter of a model at ``max_gpu_mem_fraction=0.05``) from the shared store to the device before it is ready.
Its mapping of the store is not registered with CUDA, so a plain copy runs at pageable speed, a fraction of the
link's rate, and registering the range first costs more than the copy saves. Instead the bytes go through a
small pinned ring of this module's own (registered once), and from each slot to the device asynchronously on
the caller's stream, so the host side of one chunk overlaps the DMA of another (which runs at the link's rate,
faster than the host side). ``docs/benchmarks.md``, "A follower's resident copy", has the figures.

Where the bytes come from
-------------------------
Given the file that holds the range (``file=(fd, offset)``: the store's data segment, opened again by name), the
workers read it with ``pread`` straight into the ring: the kernel copies from the shared pages without mapping them
into this process. Read through a fresh mapping instead, every 4 KiB page costs a page-table fault (1.5 M of them
for 6 GiB); faulting them in ahead from several threads (``MADV_POPULATE_READ``) still held a follower to well
under the ``pread`` rate (in a sandbox each fault is the sandbox's work), and far under it when followers attach
together, and the populated mapping has to be torn down again at close. Without a file (a plain host
tensor, or a name already removed) the workers ``memmove`` from the mapping while a helper thread populates it
ahead of them (``flextensor.shm.prefault``).

Workers and ring
----------------
``threads`` workers (the calling thread is one of them) share ``slots`` slots of ``chunk_bytes``, each worker
owning its own (slot ``s`` belongs to worker ``s mod threads``). A worker claims the next chunk, waits until the
device finished reading its slot (an event per slot), fills the slot, and queues the slot's copy to the device.
No worker waits for another (there is no barrier per chunk), and a chunk needs the GIL (which a follower's model
factory holds most of the time meanwhile) about once, to queue its copy and event with the GIL kept, where the
CUDA runtime PyTorch loaded is found (:mod:`flextensor.runtime.pinned.bounce_chunks`; through PyTorch's calls otherwise,
about six hand-overs per chunk). While the caller's other thread runs Python beside the copy (``caller_free``
not set: a follower's factory), only ``threads_beside`` of the workers copy, because each GIL hand-over to a
worker is time that thread waits; a thread of the copy's own (``ft-staged-ramp``) starts the others once it is
set. Chunks are claimed from
a start that depends on the process id, so followers attaching together read different pages at any one time
(on Linux reading a shared page takes that page's lock).

Why its own threads rather than PyTorch's CPU copy: followers attach at once, and PyTorch's copy runs on as many
OpenMP threads as the host has cores in each of them (threads that spin between parallel regions). Copied that
way, three followers copying together each got a fraction of what one alone got, less than a third of it.

Life of the ring
----------------
:meth:`StagedCopy.prepare` allocates the ring (anonymous memory, transparent huge pages asked for), maps its
pages from several threads and registers it; :meth:`StagedCopy.prepare_in_background` does that on a thread
(``ft-staged-ring``) so that it overlaps the caller's other work, and a copy waits for it only if it is not done.
After the copy the ring is unregistered and unmapped: at once, or with ``background_release=True`` on the release
thread (``flextensor.shm.background_release``, as a session's close does with its segments), so that the caller
does not wait for the driver. :meth:`StagedCopy.close` releases a ring prepared and never used (call it always,
also after an error).

Ordering
--------
A slot is refilled only after the device finished reading it; before the ring is released every recorded copy
is waited for, also when an error stops the workers (each waits for its own slots), so the driver never reads
memory that is no longer registered. :meth:`StagedCopy.__call__` returns once ``dst`` holds every byte (the
caller's stream is idle as far as these copies go). Ranges below ``min_bytes`` are copied directly (registering
a ring would cost more than it saves); when the driver refuses the ring (``ulimit -l``), the copy is made
directly too, after one WARNING: correct, only slower. On a CPU destination (tests, hosts without CUDA) the same
chunking runs with synchronous copies and no events.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from flextensor.runtime.pinned.bounce_chunks import chunk_queue
from flextensor.shm.prefault import MAX_THREADS, populate_read, populate_write_range

__all__ = ["StagedCopy", "Piece", "CopyReport", "CHUNK_BYTES", "SLOTS", "MIN_BYTES", "THREADS", "THREADS_BESIDE"]

logger = logging.getLogger(__name__)

#: Bytes per slot of the pinned ring: large enough that a chunk's few GIL-holding calls stay small against its
#: copy, small enough that the ring (``SLOTS`` of them) is cheap to map and register.
CHUNK_BYTES = 8 << 20
#: Workers copying into the ring: one per core this process may run on, at most 16. A worker spends its time in
#: ``pread`` (the kernel's copy out of the shared pages), which one core does at a few GB/s: a follower's copy
#: grows with its workers up to 16, past what the link takes from the ring. Workers blocked in the kernel do not
#: spin, so followers attaching together share the cores without the OpenMP
#: penalty above.
THREADS = max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
#: Workers while the caller's thread runs Python beside the copy (``caller_free`` not set yet: a follower's model
#: factory): three per four cores, at most 12; the others start once it is set. Beside a model built on ``meta``,
#: 12 workers finish the copy and the factory sooner than 16, which slow the factory down by the GIL hand-overs
#: they ask for (``bench/experiment_attach_gil.py``; 12 workers in another process leave the factory as fast as
#: alone); with nothing beside it, 16 copy fastest.
THREADS_BESIDE = max(1, min(12, THREADS * 3 // 4))
#: Slots of the ring: two per worker, so a worker fills one while the device reads the other (256 MiB of pinned
#: ring with 16 workers, held by a follower only while it copies its resident tensors).
SLOTS = 2 * THREADS
#: Smaller ranges are copied directly.
MIN_BYTES = 64 << 20
#: Multiplier spreading process ids over a range's chunks (Knuth's multiplicative hash).
_SPREAD = 2654435761

_warned = False

_libc = ctypes.CDLL(None, use_errno=True)
_libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_libc.pread.restype = ctypes.c_ssize_t


class Piece(NamedTuple):
    """One range of a copy: host ``src`` into ``dst`` (both contiguous 1-D ``uint8``, the same size); ``file``
    is ``(fd, offset)`` of the file holding ``src``'s bytes from ``offset`` (read with ``pread``), or None."""

    dst: torch.Tensor
    src: torch.Tensor
    file: tuple[int, int] | None = None


class CopyReport(NamedTuple):
    """What one copy did: bytes, seconds, whether it went through the pinned ring and where its bytes were read
    (``file``: ``pread``; ``mapping``: ``memmove``; ``direct``: no ring), by how many workers, and what the ring
    cost: mapping its pages and registering it (wherever that ran) and the copy's wait for it."""

    nbytes: int
    seconds: float
    staged: bool
    source: str = "direct"
    threads: int = 0
    ring_populate_s: float = 0.0
    ring_register_s: float = 0.0
    ring_wait_s: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


class _Ring:
    """The pinned ring: one anonymous mapping, registered whole. Offers what the release thread asks of a segment
    (``name``, ``pinned``, ``unpin_one``, ``close``), so that it can be released there."""

    name = "staging ring"

    def __init__(self, size: int, register: Callable[[int, int], None], unregister: Callable[[int], None]) -> None:
        self._unregister = unregister
        self.registered = False
        self.populate_s = self.register_s = 0.0
        # Private: anonymous shared memory would be tmpfs pages (4 KiB each, slower to allocate); and huge pages
        # where the kernel offers them (several times faster to allocate).
        self._mapping: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        try:
            start = time.monotonic()
            try:
                # The pages now, from several threads, not in the driver (anonymous memory: no file's locks).
                populate_write_range(self.address, size, threads=MAX_THREADS)
            except OSError:
                pass  # only a speed-up: registration faults them in anyway
            registering = time.monotonic()
            self.populate_s = registering - start
            register(self.address, size)
            self.register_s = time.monotonic() - registering
            self.registered = True
        except BaseException:
            self.close()
            raise

    @property
    def pinned(self) -> bool:
        return self.registered

    def unpin_one(self) -> bool:
        """Unregister the ring (one driver call); False when it is not registered."""
        if not self.registered:
            return False
        self.registered = False
        self._unregister(self.address)
        return True

    def close(self) -> None:
        """Unregister (if still registered), then unmap; idempotent. A view still alive (a traceback's) keeps the
        mapping until it goes."""
        try:
            self.unpin_one()
        except RuntimeError as exc:  # forgotten: the unmap releases the pages
            logger.warning("could not unregister the staging ring: %s", exc)
        self.tensor = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


class _Job:
    """One copy's shared state for its workers: the chunks still to claim (of every piece), the slots and how their
    chunks reach the device (:mod:`flextensor.runtime.pinned.bounce_chunks`), the first error. Claiming a chunk takes no
    lock: ``next`` on a list iterator is one step under the GIL."""

    def __init__(self, pieces: Sequence[Piece], ring: _Ring, chunk: int, slots: int,
                 fill: Callable[[int, int, int, int], None], stream: "torch.cuda.Stream | None") -> None:
        self.pieces, self.chunk, self.fill, self.stream = list(pieces), chunk, fill, stream
        chunks = [(k, offset) for k, piece in enumerate(self.pieces) for offset in range(0, piece.dst.numel(), chunk)]
        first = os.getpid() * _SPREAD % max(1, len(chunks))
        self._order: Iterator[tuple[int, int]] = iter(chunks[first:] + chunks[:first])
        self._lock = threading.Lock()
        assert ring.tensor is not None
        self.address = ring.address
        stages = [ring.tensor.narrow(0, s * chunk, chunk) for s in range(slots)]
        with self.device_context():  # the queue's events belong to the stream's device, whichever is current here
            self.queue = chunk_queue([piece.dst for piece in self.pieces], stages, stream)
        self.error: BaseException | None = None
        self.exhausted = threading.Event()  # set once a worker found no chunk left (or an error stopped them)

    def claim(self) -> tuple[int, int] | None:
        """The next chunk to copy (its piece and offset there); None when none is left or a worker failed."""
        claimed = None if self.error is not None else next(self._order, None)
        if claimed is None:
            self.exhausted.set()
        return claimed

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc

    def work(self, own: list[int]) -> None:
        """Copy claimed chunks through the slots ``own`` until none is left; every copy queued from them is
        complete on return (also after an error, which is recorded for the caller)."""
        used: list[int] = []
        try:
            with self.device_context():
                self.queue.bind()
                for k in itertools.count():
                    claimed = self.claim()
                    if claimed is None:
                        return
                    piece, offset = claimed
                    slot = own[k % len(own)]
                    if slot in used:
                        self.queue.wait(slot)  # the device finished reading this slot
                    n = min(self.chunk, self.pieces[piece].dst.numel() - offset)
                    self.fill(self.address + slot * self.chunk, piece, offset, n)
                    if slot not in used:
                        used.append(slot)  # before the put: after a failed put, the finally still waits for the slot
                    self.queue.put(slot, piece, offset, n)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller once every worker is done
            self.fail(exc)
        finally:
            for slot in used:  # also after an error: the ring is released next
                try:
                    self.queue.wait(slot)
                except BaseException as exc:  # noqa: BLE001 - the first error is the one raised
                    self.fail(exc)

    def device_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.stream.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack


class StagedCopy:
    """``copy(dst, src, file=None)``: 1-D ``uint8`` ``src`` (host) into ``dst`` (same size, a device) through a
    pinned ring (see module docs).

    ``register(ptr, nbytes)`` / ``unregister(ptr)`` pin and unpin the ring (CUDA's by default; tests pass
    recording fakes). ``stream``: where the device copies are queued (default: the current stream of ``dst``'s
    device). ``background_release``: release the ring on the release thread after the copy instead of before
    returning. ``caller_free``: set once the caller's other thread stops running Python beside the copy (a
    follower's factory returned); until then only ``threads_beside`` workers copy, and the others start when it
    is set (None: all ``threads`` at once). ``last`` is the report of the latest copy.
    """

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, slots: int = SLOTS, min_bytes: int = MIN_BYTES,
                 threads: int = THREADS, threads_beside: int = THREADS_BESIDE,
                 register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None, stream: "torch.cuda.Stream | None" = None,
                 background_release: bool = False, caller_free: threading.Event | None = None) -> None:
        if chunk_bytes <= 0 or slots < 2 or threads < 1:
            raise ValueError(f"StagedCopy needs chunk_bytes > 0, at least 2 slots and 1 thread, got {chunk_bytes}, "
                             f"{slots} and {threads}")
        self.chunk_bytes = int(chunk_bytes)
        self.slots = int(slots)
        self.min_bytes = int(min_bytes)
        self.threads = min(int(threads), self.slots)
        self.threads_beside = max(1, min(int(threads_beside), self.threads))
        self._caller_free = caller_free
        self._register = register
        self._unregister = unregister
        self._stream = stream
        self._background_release = background_release
        self._ring: _Ring | None = None
        self._preparing: threading.Thread | None = None
        self.last: CopyReport | None = None

    # ------------------------------------------------------------------------------------------ the ring
    def prepare(self) -> None:
        """Allocate, map and register the ring now, unless it is ready; a refusal of the driver is logged (once
        per process) and the next copy is made directly."""
        global _warned
        if self._ring is not None:
            return
        register, unregister = self._pin_functions()
        size = self.slots * self.chunk_bytes
        try:
            self._ring = _Ring(size, register, unregister)
        except (RuntimeError, OSError) as exc:
            if not _warned:
                _warned = True
                logger.warning("could not register a %d MiB staging ring (%s); copying from pageable memory instead "
                               "(correct, slower)", size >> 20, exc)

    def prepare_in_background(self, device: "torch.device | None" = None) -> None:
        """Run :meth:`prepare` on a thread (``ft-staged-ring``), ``device`` current there (the CUDA context the
        registration uses); the next copy or :meth:`close` joins it."""
        if self._preparing is not None or self._ring is not None:
            return
        index = None
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()

        def run() -> None:
            if index is not None:
                torch.cuda.set_device(index)
            self.prepare()

        self._preparing = threading.Thread(target=run, name="ft-staged-ring", daemon=True)
        self._preparing.start()

    def close(self) -> None:
        """Wait for a preparation in flight and release a ring not used by a copy. Idempotent."""
        self._join_preparation()
        ring, self._ring = self._ring, None
        if ring is not None:
            self._release(ring)

    def _join_preparation(self) -> float:
        """Seconds waited for the preparing thread."""
        thread, self._preparing = self._preparing, None
        if thread is None:
            return 0.0
        start = time.monotonic()
        thread.join()
        return time.monotonic() - start

    def _pin_functions(self) -> tuple[Callable[[int, int], None], Callable[[int], None]]:
        if self._register is not None and self._unregister is not None:
            return self._register, self._unregister
        from flextensor.shm.pinning import host_register, host_unregister

        return (lambda ptr, nbytes: host_register(ptr, nbytes, read_only=True)), host_unregister

    def _release(self, ring: _Ring) -> None:
        if self._background_release:
            from flextensor.shm.background_release import release_in_background

            release_in_background(ring)
        else:
            ring.close()

    # ------------------------------------------------------------------------------------------ the copy
    def __call__(self, dst: torch.Tensor, src: torch.Tensor, file: tuple[int, int] | None = None) -> None:
        """Copy ``src`` into ``dst``. ``file``: ``(fd, offset)`` of a file whose bytes from ``offset`` are
        ``src``'s (its mapping): read from there with ``pread`` (``EOFError`` when the file is shorter)."""
        self.copy_pieces([Piece(dst, src, file)])

    def copy_pieces(self, pieces: Sequence[Piece]) -> None:
        """Copy every piece's ``src`` into its ``dst`` (as :meth:`__call__` does one), all through one ring, their
        chunks claimed by the workers from one list (a store in several segments is one copy). A piece may be a
        plain ``(dst, src, file)`` tuple."""
        pieces = [Piece(*piece) for piece in pieces]
        for piece in pieces:
            for t, what in ((piece.dst, "destination"), (piece.src, "source")):
                if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                    raise ValueError(f"StagedCopy: the {what} must be a contiguous 1-D uint8 tensor, got {t.dtype} "
                                     f"{tuple(t.shape)}")
            if piece.dst.numel() != piece.src.numel() or piece.src.device.type != "cpu":
                raise ValueError(f"StagedCopy copies a host range of {piece.src.numel()} bytes on {piece.src.device} "
                                 f"into as many bytes; got a destination of {piece.dst.numel()} on {piece.dst.device}")
        total = sum(piece.src.numel() for piece in pieces)
        start = time.monotonic()
        if total < self.min_bytes:
            self.close()
            for piece in pieces:
                piece.dst.copy_(piece.src)
            self.last = CopyReport(total, time.monotonic() - start, False)
            return
        waited = self._join_preparation()
        self.prepare()
        ring, self._ring = self._ring, None
        if ring is None:
            for piece in pieces:
                piece.dst.copy_(piece.src)
            self.last = CopyReport(total, time.monotonic() - start, False, ring_wait_s=waited)
            return
        try:
            source, threads = self._run(pieces, total, ring)
        finally:
            self._release(ring)
        self.last = CopyReport(total, time.monotonic() - start, True, source, threads, ring.populate_s,
                               ring.register_s, waited)

    def _run(self, pieces: Sequence[Piece], total: int, ring: _Ring) -> tuple[str, int]:
        """The workers' copy (see module docs); returns where the bytes were read and by how many workers."""
        device = pieces[0].dst.device if pieces else torch.device("cpu")
        stream = None
        if device.type == "cuda":
            stream = self._stream if self._stream is not None else torch.cuda.current_stream(device)
        reads = [piece.file for piece in pieces]
        addresses = [piece.src.data_ptr() for piece in pieces]

        def fill(address: int, piece: int, offset: int, nbytes: int) -> None:
            file = reads[piece]
            if file is not None:
                _read_file(file[0], address, nbytes, file[1] + offset)
            else:
                ctypes.memmove(address, addresses[piece] + offset, nbytes)

        mapped = [(addresses[k], piece.src.numel()) for k, piece in enumerate(pieces) if piece.file is None]
        source = "mapping" if mapped and len(mapped) == len(pieces) else "file" if not mapped else "file+mapping"
        threads = min(self.threads, -(-total // self.chunk_bytes))
        owned = [[s for s in range(self.slots) if s % threads == w] for w in range(threads)]
        job = _Job(pieces, ring, self.chunk_bytes, self.slots, fill, stream)
        helpers = [threading.Thread(target=job.work, args=(own,), name="ft-staged-copy", daemon=True)
                   for own in owned[1:]]
        waiting = self._caller_free is not None and not self._caller_free.is_set()
        first = min(self.threads_beside, threads) if waiting else threads  # workers started at once
        ramp = threading.Thread(target=_start_when_free, args=(self._caller_free, job, helpers[first - 1:]),
                                name="ft-staged-ramp", daemon=True) if waiting and first < threads else None
        prefault = None
        try:
            if mapped:
                prefault = threading.Thread(target=_prefault, args=(mapped, self.threads), name="ft-staged-prefault",
                                            daemon=True)
                prefault.start()
            for helper in helpers[:first - 1]:
                helper.start()
            if ramp is not None:
                ramp.start()
            job.work(owned[0])
        finally:
            job.exhausted.set()  # also after an error in this thread: the ramp starts no one any more
            if ramp is not None and ramp.ident is not None:
                ramp.join()
            for helper in helpers:
                if helper.ident is not None:
                    helper.join()
            threads = 1 + sum(helper.ident is not None for helper in helpers)
            if prefault is not None and prefault.ident is not None:
                prefault.join()
            with job.device_context():  # the events' device; the caller's current device is restored after
                job.queue.close()
        if job.error is not None:
            raise job.error
        return source, threads


def _start_when_free(caller_free: threading.Event, job: _Job, helpers: Sequence[threading.Thread]) -> None:
    """Start ``helpers`` once ``caller_free`` is set, unless the chunks ran out first (thread ``ft-staged-ramp``)."""
    while not job.exhausted.is_set():
        if caller_free.wait(0.005):
            for helper in helpers:
                if job.exhausted.is_set():
                    return
                helper.start()
            return


def _read_file(fd: int, address: int, nbytes: int, offset: int) -> None:
    """``nbytes`` of file ``fd`` from ``offset`` into memory at ``address`` (``pread``: ctypes releases the GIL)."""
    done = 0
    while done < nbytes:
        got = _libc.pread(fd, address + done, nbytes - done, offset + done)
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, f"reading {nbytes} bytes at offset {offset} of fd {fd} failed: {os.strerror(code)}")
        if got == 0:
            raise EOFError(f"the file (fd {fd}) ends before byte {offset + done}, inside the {nbytes} bytes read at "
                           f"offset {offset}: it was truncated while in use; restart the workers that share it")
        done += got


def _prefault(ranges: Sequence[tuple[int, int]], threads: int) -> None:
    """Fault the mapped sources in, ahead of the workers' ``memmove`` (a speed-up only)."""
    for address, nbytes in ranges:
        start = address - address % mmap.PAGESIZE  # madvise wants a page-aligned start
        try:
            populate_read(start, nbytes + address - start, threads=threads)
        except OSError as exc:
            logger.debug("pre-faulting the source of a staged copy failed: %s", exc)
            return
