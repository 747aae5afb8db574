"""The readers' queue of a checkpoint read, and the thread that allocates their destination pages ahead of them.

Why
---
A destination of :class:`~flextensor.loading.checkpoint.ReadPlan` is usually fresh memory (a host block nobody wrote
yet): its pages do not exist, and a read into it faults them in one at a time inside the copy, on the reader's
thread, so from disk every read is stretched by the page allocation. So while the readers work, a thread
allocates the pages of the ranges next in line (``MADV_POPULATE_WRITE``, several threads per range:
:func:`flextensor.shm.prefault.populate_write_range`), at most :data:`POPULATE_AHEAD_BYTES` ahead of them; a
range the readers reach first is skipped (they fault it in themselves, so from a warm page cache the two only add
up). Populating a page never changes its bytes, so a page two ranges share may be populated twice, harmlessly;
the thread only skips the part of a range it has just populated. The caller may pass its own ``populate(address, nbytes)`` (a shared
segment's, which names a full ``/dev/shm``): its error stops the reads and is raised. The default one,
:func:`populate_pages`, is only a speed-up: a kernel without the advice, or memory that refuses it, just leaves
the faults to the readers.

Why not :class:`flextensor.shm.populate_ahead.PopulateAhead`
-------------------------------------------------------------
That one is a gate for a single writer filling a segment created without its pages: the writer waits until each
range is allocated before it writes it, every range is allocated, and the allocation's error is the writer's.
Here several readers take ranges from a queue and never wait for the populating thread: it only races ahead of
them, passes over what they reached, stops for good when ``populate`` says it cannot, and a range is either
claimed by a reader or passed by the thread first, never both at once. One class for both would switch on a mode
in every method.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Generic, Protocol, Sequence, TypeVar

from flextensor.shm.prefault import MAX_THREADS, populate_write_range

__all__ = ["POPULATE_AHEAD_BYTES", "Populate", "populate_pages", "ReadQueue"]

logger = logging.getLogger(__name__)

#: Destination pages are allocated at most this many bytes ahead of the readers (see the module docstring).
POPULATE_AHEAD_BYTES = 1 << 30

#: ``populate(address, nbytes)``: allocate those pages; False means "cannot here" (stop trying), an error stops the
#: reads (see the module docstring).
Populate = Callable[[int, int], "bool | None"]


def populate_pages(address: int, nbytes: int) -> bool:
    """The default ``populate`` of a :class:`~flextensor.loading.checkpoint.ReadPlan`: allocate the pages of
    ``[address, address + nbytes)`` (``MADV_POPULATE_WRITE`` from several threads); False when this memory or
    kernel cannot (a speed-up only)."""
    try:
        return populate_write_range(address, nbytes, threads=MAX_THREADS)  # private memory: no file's locks
    except OSError as exc:
        logger.debug("populating %d bytes at %#x ahead of the reads failed (%s); the reads fault them in", nbytes,
                     address, exc)
        return False


class Span(Protocol):
    """A range the readers write: its size, and the page-aligned ``(address, nbytes)`` of memory it writes."""

    @property
    def nbytes(self) -> int: ...

    def pages(self) -> tuple[int, int]: ...


R = TypeVar("R", bound=Span)


class ReadQueue(Generic[R]):
    """The readers' queue of ``ranges`` (in the order they are read), and the thread (``ft-ckpt-populate``) that
    allocates the destination pages of the next ranges while the readers work, at most ``window`` bytes ahead of
    the first range not claimed (see the module docstring). ``error``: what ``populate`` raised;
    ``populated_bytes`` and ``populate_s``: what the thread did (read them after :meth:`stop`)."""

    def __init__(self, ranges: Sequence[R], populate: Populate | None, window: int) -> None:
        self.ranges = list(ranges)
        self.error: BaseException | None = None
        self.populated_bytes = 0
        self.populate_s = 0.0
        self._populate = populate
        self._window = window
        self._cond = threading.Condition()
        self._claimed = 0  # ranges [0, _claimed) went to readers
        self._end = [0]  # _end[k]: bytes of ranges [0, k)
        for r in self.ranges:
            self._end.append(self._end[-1] + r.nbytes)
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self, cancel: threading.Event) -> None:
        """Start the populating thread (none without ``populate``, a window or a second range); a ``populate``
        error sets ``cancel``, so the readers stop after the ranges in flight."""
        if self._populate is not None and self._window > 0 and len(self.ranges) > 1:
            self._thread = threading.Thread(target=self._run, args=(self._populate, cancel), name="ft-ckpt-populate",
                                            daemon=True)
            self._thread.start()

    def claim(self) -> R | None:
        """The next range for a reader, or None when every range was handed out."""
        with self._cond:
            if self._claimed >= len(self.ranges):
                return None
            r = self.ranges[self._claimed]
            self._claimed += 1
            self._cond.notify_all()
            return r

    def stop(self) -> None:
        """Stop the populating thread after the range in flight and join it. Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _next(self, position: int, cancel: threading.Event) -> int | None:
        """The next range to populate at or after ``position`` (waiting while it is too far ahead), or None."""
        with self._cond:
            while True:
                if self._stopped or cancel.is_set():
                    return None
                position = max(position, self._claimed)  # the readers took those: they fault them in
                if position >= len(self.ranges):
                    return None
                if self._end[position] - self._end[self._claimed] <= self._window:
                    return position
                self._cond.wait(0.1)

    def _run(self, populate: Populate, cancel: threading.Event) -> None:
        position = 0
        last = (0, 0)  # the span populated last: a page it shares with the next range is populated once
        while (found := self._next(position, cancel)) is not None:
            position = found
            address, nbytes = self.ranges[position].pages()
            if last[0] <= address < last[1]:
                if address + nbytes <= last[1]:  # inside it: nothing new
                    position += 1
                    continue
                nbytes -= last[1] - address
                address = last[1]
            begin = time.monotonic()
            try:
                supported = populate(address, nbytes) is not False
            except BaseException as exc:  # noqa: BLE001 - raised by ReadPlan.read once the readers stopped
                self.error = exc
                cancel.set()
                return
            finally:
                self.populate_s += time.monotonic() - begin
            if not supported:
                return
            self.populated_bytes += nbytes
            last = (address, address + nbytes)
            position += 1
