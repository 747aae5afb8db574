"""Allocating segments' pages on threads, a bounded window ahead of the writer: :class:`PopulateAhead`.

Why
---
A creator whose model is in RAM fills a segment created without its pages (``reserve=False``: the host holds the
private copy and the shared one at once only for what is in flight, see ``segment.py``). Each range must be
allocated before it is written (``SharedSegment.reserve_range``: parallel ``MADV_POPULATE_WRITE``, else
``posix_fallocate``), and allocating tmpfs pages is the slow part of publishing (``prefault.py``). Done just
before each copy, the creator alternates between the two and publishes at ``1 / (1/populate + 1/copy)``. Here a
thread allocates the next ranges while the caller copies into the current one, so publishing runs at the slower
of the two rates instead, and the caller holds at most ``window`` bytes of allocated, not yet written pages
beyond the ranges it has not reported done: the memory bound stays one copy plus a window (a caller that reports
ranges once their copies are queued, not made, adds what it has queued).

Protocol
--------
``ranges`` are ``(segment, offset, nbytes)`` in the order the caller writes them. The caller calls :meth:`wait`
before writing range ``i`` (it raises the allocation's error: ``ShmSpaceError`` for a full ``/dev/shm``) and
:meth:`done` once it is written, in order (a caller may write several ranges before it calls ``done`` for them,
e.g. reads it runs together). A worker thread takes the next range not taken yet, ``j``, when the caller waits
for it (or a later one), or when ranges ``i + 1 .. j`` fit in ``window`` bytes, ``i`` being the first range not
done yet; so a window smaller than the next range means no allocation ahead of the caller at all. :meth:`close`
stops the workers after the ranges in flight and joins them (always call it, also after an error); ``waited_s``
is the time the caller spent waiting for allocation, the part of the fill the window did not hide.

Several workers
---------------
tmpfs allocates the pages of one file under that file's locks, so threads on one segment stop at a fraction of
what several segments reach, which allocate in parallel (see ``flextensor.shm.blocks``). With ``workers > 1``
each worker takes ranges in turn and allocates its range from ``threads`` threads of its own, so ranges in different
segments (an arena's parts hold consecutive blocks) are allocated at once; ranges still complete out of order,
and :meth:`wait` waits for its own range only. The threads per range are the cores shared among the ranges the
window lets be in flight, at most what one file can use (``prefault.WRITE_THREADS_PER_FILE``).

Pieces
------
A writer that frees what it copies as it goes (a creator's private tensor) gains from ranges smaller than what it
copies at once: one block, or one record, is then several ranges, allocated a piece at a time within the window,
and :class:`PieceCursor` keeps the writer's place in such a run (wait for the pieces under the bytes it is about to
write, report the pieces it wrote, in order).

Not the checkpoint reader's
---------------------------
``flextensor.loading.checkpoint_pages`` also allocates pages on a thread ahead of writers, for the checkpoint reader, but
there it is only a speed-up: several readers take ranges from a queue and never wait for it, and it passes over
the ranges they reached. Here each range must be allocated before it is written, so the writer waits for it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from .prefault import WRITE_THREADS_PER_FILE

if TYPE_CHECKING:
    from .segment import SharedSegment

__all__ = ["PopulateAhead", "PieceCursor", "cut_into_pieces"]


class PopulateAhead:
    """Reserve ``ranges`` (``(segment, offset, nbytes)``) on ``workers`` threads (``ft-populate-ahead``),
    ``window`` bytes ahead of the caller."""

    def __init__(self, ranges: Sequence[tuple[Any, int, int]], *, window: int, workers: int = 1,
                 threads: int | None = None) -> None:
        if window <= 0:
            raise ValueError(f"PopulateAhead: window must be > 0 bytes, got {window!r}")
        if workers < 1:
            raise ValueError(f"PopulateAhead: workers must be >= 1, got {workers!r}")
        self._ranges = [(segment, int(o), int(n)) for segment, o, n in ranges]
        self._window = int(window)
        #: Threads each range is allocated from: a share of the cores among the ranges the window lets be in flight
        #: at once (the first not written, and as many more as fit in the window, at most one per worker), at most
        #: what one file can use (``prefault.WRITE_THREADS_PER_FILE``, all a single worker gets).
        largest = max((n for _s, _o, n in self._ranges), default=1)
        in_flight = max(1, min(workers, 1 + self._window // max(1, largest)))
        self._threads = threads or max(1, min(WRITE_THREADS_PER_FILE, (os.cpu_count() or 1) // in_flight))
        self._cond = threading.Condition()
        self._taken = 0  # ranges [0, _taken) were taken by a worker
        self._allocated = [False] * len(self._ranges)
        self._released = 0  # ranges [0, _released) were written (done)
        self._wanted = -1  # the latest range the caller waited for
        self._end = [0]  # _end[k]: bytes of ranges [0, k)
        for _segment, _offset, nbytes in self._ranges:
            self._end.append(self._end[-1] + nbytes)
        self._stop = False
        self.error: BaseException | None = None
        self.waited_s = 0.0
        self.populate_s = 0.0  # the workers' time in reserve_range, summed
        self._workers = [threading.Thread(target=self._run, name="ft-populate-ahead", daemon=True)
                         for _ in range(min(workers, max(1, len(self._ranges))))]

    def start(self) -> "PopulateAhead":
        for worker in self._workers:
            worker.start()
        return self

    def wait(self, index: int) -> None:
        """Return once range ``index`` is allocated; raise the allocation error that stopped the workers."""
        with self._cond:
            if self._allocated[index]:
                return
            self._wanted = max(self._wanted, index)
            self._cond.notify_all()
            start = time.monotonic()
            self._cond.wait_for(lambda: self._allocated[index] or self.error is not None or self._stop)
            self.waited_s += time.monotonic() - start
            if self._allocated[index]:
                return
            if self.error is not None:
                raise self.error
            raise RuntimeError(f"PopulateAhead was closed before range {index} was allocated")

    def done(self, index: int) -> None:
        """Range ``index`` is written: its bytes leave the window (call in order, after :meth:`wait`)."""
        with self._cond:
            if index != self._released:
                raise ValueError(f"PopulateAhead.done({index}) out of order: range {self._released} is next")
            self._released += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop after the ranges in flight and join the workers. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for worker in self._workers:
            if worker.ident is not None:
                worker.join()

    def _may_allocate(self, index: int) -> bool:
        """Range ``index`` is the first not written, or the caller waits for it (or a later one), or it is within
        the window beyond the first not written."""
        current = self._released
        return index <= max(current, self._wanted) or self._end[index + 1] - self._end[current + 1] <= self._window

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self.error is not None or self._taken >= len(self._ranges)
                                    or self._may_allocate(self._taken))
                if self._stop or self.error is not None or self._taken >= len(self._ranges):
                    return
                index = self._taken
                self._taken += 1
            segment, offset, nbytes = self._ranges[index]
            start = time.monotonic()
            try:
                segment.reserve_range(offset, nbytes, threads=self._threads)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by wait()
                with self._cond:
                    if self.error is None:
                        self.error = exc
                    self._cond.notify_all()
                return
            finally:
                with self._cond:
                    self.populate_s += time.monotonic() - start
            with self._cond:
                self._allocated[index] = True
                self._cond.notify_all()


def cut_into_pieces(size: int, piece: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into ``[start, end)`` pieces of at most ``piece`` bytes (one empty piece for size 0)."""
    return [(lo, min(lo + piece, size)) for lo in range(0, size, piece)] or [(0, 0)]


class PieceCursor:
    """A writer's place in one run of consecutive ranges of a :class:`PopulateAhead`: ranges ``first ..``, whose
    bytes are ``bounds`` (``(start, end)`` from the run's start, in order). ``populate`` None: every page was
    allocated ahead and there is nothing to wait for. ``segment`` and ``start``: where the run lies (its segment,
    its first byte there), for a writer that writes into the segment's file rather than through a view."""

    def __init__(self, populate: PopulateAhead | None, first: int, bounds: Sequence[tuple[int, int]], *,
                 segment: "SharedSegment | None" = None, start: int = 0) -> None:
        self._populate, self._first, self._bounds = populate, first, bounds
        self.segment, self.start = segment, start
        self._waited = 0  # ranges [0, _waited) of the run were waited for
        self._written = 0  # ranges [0, _written) of the run were reported written

    def wait_through(self, end: int) -> None:
        """Bytes ``[0, end)`` of the run may be written: their pages are allocated (raises the allocation's error)."""
        while self._waited < len(self._bounds) and self._bounds[self._waited][0] < end:
            if self._populate is not None:
                self._populate.wait(self._first + self._waited)
            self._waited += 1

    def written_through(self, end: int) -> None:
        """Bytes ``[0, end)`` of the run are written: their whole ranges leave the window."""
        while self._written < len(self._bounds) and self._bounds[self._written][1] <= end:
            if self._populate is not None:
                self._populate.done(self._first + self._written)
            self._written += 1

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` cut at the ranges' edges."""
        return [(max(lo, start), min(hi, end)) for lo, hi in self._bounds if lo < end and hi > start]
