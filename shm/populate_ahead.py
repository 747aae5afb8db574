"""Allocating a segment's pages on a thread, a bounded window ahead of the writer: :class:`PopulateAhead`.

Why
---
A creator whose model is in RAM fills a segment created without its pages (``reserve=False``: the host holds the
private copy and the shared one at once only for what is in flight, see ``segment.py``). Each range must be
allocated before it is written (``SharedSegment.reserve_range``: parallel ``MADV_POPULATE_WRITE``, else
``posix_fallocate``), and allocating tmpfs pages is the slow part of publishing (``prefault.py``). Done just
before each copy, the creator alternates between the two and publishes at ``1 / (1/populate + 1/copy)``. Here a
thread allocates the next ranges while the caller copies into the current one, so publishing runs at the slower
of the two rates instead, and the caller holds at most ``window`` bytes of allocated, not yet written pages
beyond the range it is writing: the memory bound stays one copy plus a window.

Protocol
--------
``ranges`` are ``(offset, nbytes)`` in the order the caller writes them. The caller calls :meth:`wait` before
writing range ``i`` (it raises the allocation's error: ``ShmSpaceError`` for a full ``/dev/shm``) and
:meth:`done` once it is written, in order (a caller may write several ranges before it calls ``done`` for them,
e.g. reads it runs together). The thread allocates range ``j`` when the caller waits for it (or a later one), or
when ranges ``i + 1 .. j`` fit in ``window`` bytes, ``i`` being the first range not done yet; so a window
smaller than the next range means no allocation ahead of the caller at all. :meth:`close` stops the thread after the
range in flight and joins it (always call it, also after an error); ``waited_s`` is the time the caller spent
waiting for allocation, the part of the fill the window did not hide.

Not the checkpoint reader's
---------------------------
``flextensor.checkpoint_pages`` also allocates pages on a thread ahead of writers, for the checkpoint reader, but
there it is only a speed-up: several readers take ranges from a queue and never wait for it, and it passes over
the ranges they reached. Here each range must be allocated before it is written, so the writer waits for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

__all__ = ["PopulateAhead"]


class PopulateAhead:
    """Reserve ``ranges`` of ``segment`` on a thread (``ft-populate-ahead``), ``window`` bytes ahead of the caller."""

    def __init__(self, segment: Any, ranges: Sequence[tuple[int, int]], *, window: int) -> None:
        if window <= 0:
            raise ValueError(f"PopulateAhead: window must be > 0 bytes, got {window!r}")
        self._segment = segment
        self._ranges = [(int(o), int(n)) for o, n in ranges]
        self._window = int(window)
        self._cond = threading.Condition()
        self._populated = 0  # ranges [0, _populated) are allocated
        self._released = 0  # ranges [0, _released) were written (done)
        self._wanted = -1  # the latest range the caller waited for
        self._end = [0]  # _end[k]: bytes of ranges [0, k)
        for _offset, nbytes in self._ranges:
            self._end.append(self._end[-1] + nbytes)
        self._stop = False
        self.error: BaseException | None = None
        self.waited_s = 0.0
        self.populate_s = 0.0  # the thread's time in reserve_range
        self._thread = threading.Thread(target=self._run, name="ft-populate-ahead", daemon=True)

    def start(self) -> "PopulateAhead":
        self._thread.start()
        return self

    def wait(self, index: int) -> None:
        """Return once range ``index`` is allocated; raise the allocation error that stopped the thread."""
        with self._cond:
            if self._populated > index:
                return
            self._wanted = max(self._wanted, index)
            self._cond.notify_all()
            start = time.monotonic()
            self._cond.wait_for(lambda: self._populated > index or self.error is not None or self._stop)
            self.waited_s += time.monotonic() - start
            if self._populated > index:
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
        """Stop after the range in flight and join the thread. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()

    def _may_allocate(self, index: int) -> bool:
        """Range ``index`` is the first not written, or the caller waits for it (or a later one), or it is within
        the window beyond the first not written."""
        current = self._released
        return index <= max(current, self._wanted) or self._end[index + 1] - self._end[current + 1] <= self._window

    def _run(self) -> None:
        for index, (offset, nbytes) in enumerate(self._ranges):
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._may_allocate(index))
                if self._stop:
                    return
            start = time.monotonic()
            try:
                self._segment.reserve_range(offset, nbytes)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by wait()
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            finally:
                self.populate_s += time.monotonic() - start
            with self._cond:
                self._populated += 1
                self._cond.notify_all()
