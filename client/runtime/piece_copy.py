"""Writing a creator's private tensors into their shared segments on a pool of threads, in batches.

Why
---
A creator whose model is in RAM copies each tensor into its shared block piece by piece and gives each piece's
private pages back behind the copy (``flextensor.runtime.source_pages``). On 4 KiB pages allocating the shared
pages is the slow part, and they are allocated ahead on threads of their own. On a tmpfs of huge pages
(``huge=always``, ``within_size``) a file's huge page is allocated in one step, so the copy is the publish: one
PyTorch copy per piece from the filling thread, the give-back between copies, leaves most of the host's memory
bandwidth unused. Here whole pieces go out on a thread per core, each giving back its own piece's pages
(figures in docs/benchmarks.md, "Figures behind the code").

A piece is written into the segment's file with ``pwrite``, not stored through the mapping: a store through
the mapping faults each huge page in, and tmpfs zeroes it first (a third pass over memory besides the read and
the write), while a write that covers a whole page fills it as it is (it is zeroed only around a write that
covers part of it), and allocates it: nothing is reserved ahead, and a full directory is an error from the
write (``SharedSegment.write_from``). Writes into one file wait for each other (the file's lock), writes into
different files do not, so a thread takes the oldest piece whose file has fewer than :data:`LANE_WRITERS`
writers (:class:`CopyPool`'s lanes), and the arena's blocks lie in turn in several parts
(``flextensor.shm.blocks``). ``pwrite`` releases the GIL and runs on one core, so the threads do not multiply
PyTorch's own intra-op threads; the store's fill and the arena's, which run side by side, share one pool. On
4 KiB pages a copy on a pool measured slower than PyTorch's from the filling thread, beside the threads that
allocate pages ahead, so a creator uses this on a tmpfs of huge pages only (``flextensor.sharing.creator``).

Batches
-------
The caller queues the pieces of one batch (an arena block, a store record) with :meth:`PieceCopier.write`, then
closes it with :meth:`PieceCopier.end_batch` and a ``then`` callback (point the model at the copies). Batches
finish in order: a batch's ``then`` runs on the caller's thread once its pieces and every earlier batch's are
written. ``end_batch`` waits for the oldest batches while those open hold more than ``open_bytes`` (default
:data:`OPEN_BYTES`), the newest always staying open, so the threads have the next pieces while one batch's last
pieces finish, and the bytes queued (private tensors not yet let go, where their pages cannot go back piece by
piece) stay bounded by ``open_bytes`` plus two batches (the newest closed one and the one being queued).
Whatever fails, no piece is still being written once :meth:`PieceCopier.close` returns, and the files it opened
are closed: the caller may then free the sources or close the segments.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from concurrent.futures import Future, wait
from typing import Callable, Hashable, Protocol

from flextensor.runtime.source_pages import SourcePages

__all__ = ["COPY_THREADS_MAX", "LANE_WRITERS", "OPEN_BYTES", "CopyPool", "PieceCopier"]

#: The most threads of a pool (by default it has one per core: the copy runs at the memory's rate only with
#: every core copying, see docs/benchmarks.md).
COPY_THREADS_MAX = 32
#: The most threads writing into one file at a time: one writes while the other gives its piece's source back;
#: more would only wait for the file's lock.
LANE_WRITERS = 2
#: Bytes of closed batches that may still be queued or being written (beyond the newest batch), at least.
OPEN_BYTES = 512 << 20


class SegmentFile(Protocol):
    """What a piece is written into: a shared segment (``flextensor.shm.segment.SharedSegment``)."""

    def open_file(self, *, write: bool = False) -> int: ...

    def write_from(self, fd: int, at: int, address: int, nbytes: int) -> None: ...


class CopyPool:
    """The writing threads of one publish, shared by its fills (the store's and the arena's run side by side: one
    pool keeps them to one thread per core between them). ``with CopyPool() as pool: ...``

    Each piece names its lane (its file): a free thread takes the oldest queued piece whose lane has fewer than
    ``lane_writers`` threads on it, so the threads spread over the files that have pieces queued instead of
    queueing on one file's lock (a block's pieces, in order, all go to one file)."""

    def __init__(self, threads: int | None = None, *, lane_writers: int = LANE_WRITERS,
                 label: str = "ft-piece-copy") -> None:
        cores = os.cpu_count() or 1
        self.threads = max(1, min(threads or cores, cores, COPY_THREADS_MAX))
        self._lane_writers = max(1, lane_writers)
        self._cond = threading.Condition()
        self._queue: deque[tuple[Hashable, Future[int], Callable[..., int], tuple[object, ...]]] = deque()
        self._busy: Counter[Hashable] = Counter()  # lane -> threads on it
        self._closing = False
        self._workers = [threading.Thread(target=self._work, name=f"{label}_{i}", daemon=True)
                         for i in range(self.threads)]
        for worker in self._workers:
            worker.start()

    def __enter__(self) -> "CopyPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, lane: Hashable, call: Callable[..., int], *args: object) -> Future[int]:
        """Queue ``call(*args)`` on ``lane``; its future can be cancelled until a thread takes it."""
        future: Future[int] = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("CopyPool is closed: make a new one")
            self._queue.append((lane, future, call, args))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Run what is queued, then stop the threads (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()

    def _take(self) -> tuple[Hashable, Future[int], Callable[..., int], tuple[object, ...]] | None:
        """The oldest queued piece whose lane has room (called holding the condition)."""
        for index, task in enumerate(self._queue):
            if self._busy[task[0]] < self._lane_writers:
                del self._queue[index]
                return task
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._take()
                while task is None:
                    if self._closing and not self._queue:
                        return
                    self._cond.wait()
                    task = self._take()
                lane, future, call, args = task
                self._busy[lane] += 1
            try:
                if future.set_running_or_notify_cancel():  # False: cancelled while queued
                    try:
                        future.set_result(call(*args))
                    except BaseException as exc:  # noqa: BLE001 - the future carries it to the caller
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._busy[lane] -= 1
                    self._cond.notify_all()


class PieceCopier:
    """One fill's batches of pieces, written on a :class:`CopyPool` (see the module docstring). Not thread-safe:
    each fill has its own. It opens each segment's file once, at its first piece, and closes them in
    :meth:`close`."""

    def __init__(self, pool: CopyPool, *, open_bytes: int = OPEN_BYTES) -> None:
        self.pool = pool
        self.released_bytes = 0  # source bytes given back behind the pieces reported so far
        self._files: dict[int, tuple[SegmentFile, int]] = {}  # id(segment) -> (segment, its fd, opened to write)
        self._closing: list[Future[int]] = []  # pieces close() has not seen finish yet
        self._open_limit = open_bytes
        self._batch: list[Future[int]] = []
        self._batch_bytes = 0
        self._open: deque[tuple[list[Future[int]], int, Callable[[], None]]] = deque()
        self._open_bytes = 0

    def __enter__(self) -> "PieceCopier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, segment: SegmentFile, at: int, out_of: int, nbytes: int, *, release: SourcePages | None = None,
              offset: int = 0, keep: object = None) -> None:
        """Queue the write of ``nbytes`` from address ``out_of`` into ``segment``'s file at byte ``at`` in the
        current batch; once written, the source's whole pages inside it are given back (``release``: the source
        tensor's, ``offset`` being the piece's first byte in that tensor). ``keep`` (the source tensor, say) is
        held until the piece is written or dropped, so whatever the caller drops meanwhile, the source stays
        mapped while it is read. Raises the segment's ``open_file`` error (its name gone, its file truncated)."""
        opened = self._files.get(id(segment))
        if opened is None:
            opened = self._files[id(segment)] = (segment, segment.open_file(write=True))
        self._batch.append(self.pool.submit(opened[1], _write_piece, segment, opened[1], at, out_of, nbytes, release,
                                            offset, keep))
        self._batch_bytes += nbytes

    def end_batch(self, then: Callable[[], None]) -> None:
        """Close the current batch; ``then`` runs once it and every batch before it are written. Waits for the
        oldest batches while the open ones hold more than ``open_bytes`` (see the module docstring), and raises
        the first error of a piece."""
        self._open.append((self._batch, self._batch_bytes, then))
        self._open_bytes += self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        while len(self._open) > 1 and self._open_bytes - self._open[-1][1] > self._open_limit:
            self._finish_oldest()

    def drain(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for every batch closed so far and run their ``then`` in order; raises the first error of a piece. Stops
        before the next batch once ``cancelled()`` says so (the caller failed elsewhere) and returns False; the
        pieces not started yet are dropped by :meth:`close`."""
        while self._open:
            if cancelled is not None and cancelled():
                return False
            self._finish_oldest()
        return True

    def close(self) -> None:
        """Drop this fill's pieces not started yet, wait for those being written and close the files, without
        running ``then`` (after an error the caller throws the fill away; after :meth:`drain` nothing is left).
        Idempotent; the pool stays."""
        # Held here until waited for: an interrupt in the wait leaves them for the next close(), which waits
        # again before it closes a file a piece may still be writing (its number could then name another file).
        self._closing.extend(future for futures, _nbytes, _then in self._open for future in futures)
        self._closing.extend(self._batch)
        self._open.clear()
        self._batch, self._batch_bytes, self._open_bytes = [], 0, 0
        for future in self._closing:
            future.cancel()
        wait(self._closing)
        self._closing.clear()
        files, self._files = self._files, {}
        for _segment, fd in files.values():
            os.close(fd)

    def _finish_oldest(self) -> None:
        futures, nbytes, then = self._open[0]
        errors = [error for error in (future.exception() for future in futures) if error is not None]
        if errors:
            raise errors[0]
        self._open.popleft()
        self._open_bytes -= nbytes
        self.released_bytes += sum(future.result() for future in futures)
        then()


def _write_piece(segment: SegmentFile, fd: int, at: int, out_of: int, nbytes: int, release: SourcePages | None,
                 offset: int, keep: object) -> int:
    """One piece, on a pool thread: written, then its source's pages given back."""
    segment.write_from(fd, at, out_of, nbytes)
    return release.release_inside(offset, offset + nbytes) if release is not None else 0
