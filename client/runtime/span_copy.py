"""Copying a private host tensor into its shared place on several threads, its pages given back behind the copy.

Why
---
A creator publishing a model held in RAM copies each tensor into its shared block piece by piece and gives the
private pages of each piece back once it is copied (``flextensor.runtime.source_pages``). Once the shared pages
come cheaply (huge pages reserved ahead, ``flextensor.shm.prefault``) the copy is the whole cost, and one
PyTorch copy per piece followed by the give-back from the calling thread left most of the memory bandwidth
unused: the same pieces cut into spans of :data:`COPY_SPAN` bytes on 8 threads, each thread giving back its own
span's pages, published about 1.6x faster (docs/benchmarks.md, Figures behind the code). A span is one
``memmove`` through ctypes: it releases the GIL and runs on one core, so the threads do not multiply PyTorch's
own intra-op threads (which a user's model shares).

Order
-----
:meth:`SpanCopier.copy` keeps the caller's order where it matters: a piece is copied only once the caller said
its pages may be written (``before``), pieces finish in order (``after``: the caller reports them written and
gives back the pages that straddle two pieces), and at most :data:`PIECES_IN_FLIGHT` pieces are in flight, so a
creator holds that many pieces twice at most. Whatever happens, no span is still being copied when ``copy``
returns or raises: the source may be freed right after.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from flextensor.runtime.source_pages import SourcePages

__all__ = ["COPY_THREADS", "COPY_SPAN", "PIECES_IN_FLIGHT", "SpanCopier"]

#: Threads of one copier (a store's fill and an arena's fill run side by side, each with its own).
COPY_THREADS = 8
#: Bytes one thread copies at a time: a whole number of huge pages, so two threads never fault one huge page.
COPY_SPAN = 4 << 20
#: Pieces whose spans may be in flight at once.
PIECES_IN_FLIGHT = 2


class SpanCopier:
    """A pool of copy threads for one fill (``with SpanCopier() as copier: ...``)."""

    def __init__(self, threads: int | None = None, *, label: str = "ft-copy") -> None:
        self.threads = max(1, min(threads or COPY_THREADS, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=label)

    def __enter__(self) -> "SpanCopier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the threads and stop them (idempotent)."""
        self._pool.shutdown(wait=True)

    def copy(self, into: int, out_of: int, pieces: Sequence[tuple[int, int]], *, release: SourcePages | None,
             before: Callable[[int], None], after: Callable[[int], None]) -> None:
        """Copy bytes ``[lo, hi)`` of each piece from address ``out_of + lo`` to ``into + lo`` (``pieces`` in
        increasing order, offsets from the source's first byte). ``before(hi)`` is called before a piece's spans
        are started, ``after(hi)`` once a piece and every piece before it are copied (in order); each span gives
        back the source's whole pages inside it (``release``), ``after`` the rest. The first error is raised once
        nothing is copying any more."""
        in_flight: deque[tuple[int, list[Future]]] = deque()
        try:
            for lo, hi in pieces:
                before(hi)
                in_flight.append((hi, [self._pool.submit(_copy_span, into + start, out_of + start, end - start,
                                                         release, start)
                                       for start, end in _spans(lo, hi)]))
                while len(in_flight) > PIECES_IN_FLIGHT:
                    _finish(in_flight.popleft(), after)
            while in_flight:
                _finish(in_flight.popleft(), after)
        finally:
            for _hi, futures in in_flight:  # after an error: nothing may copy once the caller goes on
                for future in futures:
                    future.cancel()
                    if not future.cancelled():
                        future.exception()


def _spans(lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at multiples of :data:`COPY_SPAN` from ``lo``."""
    return [(start, min(start + COPY_SPAN, hi)) for start in range(lo, hi, COPY_SPAN)]


def _copy_span(into: int, out_of: int, nbytes: int, release: SourcePages | None, offset: int) -> None:
    ctypes.memmove(into, out_of, nbytes)
    if release is not None:
        release.release_inside(offset, offset + nbytes)


def _finish(entry: tuple[int, list[Future]], after: Callable[[int], None]) -> None:
    """Wait for every span of a piece (all of them, also after one failed), then report it or raise."""
    hi, futures = entry
    errors = [error for error in (future.exception() for future in futures) if error is not None]
    if errors:
        raise errors[0]
    after(hi)
