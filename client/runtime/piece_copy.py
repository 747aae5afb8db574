"""Copying a creator's private tensors into their shared places on a pool of threads, in batches.

Why
---
A creator whose model is in RAM copies each tensor into its shared block piece by piece and gives each piece's
private pages back behind the copy (``flextensor.runtime.source_pages``). On a tmpfs of huge pages the shared
pages come reserved ahead with ``posix_fallocate`` (``flextensor.shm.prefault`` says why), which costs the cores
almost nothing, so the copy is the publish: one PyTorch copy per piece from the filling thread, the give-back
between copies, leaves most of the host's memory bandwidth unused. Here whole pieces are copied on a thread per
core, each giving back its own piece's pages (figures in docs/benchmarks.md, "Figures behind the code").
A piece is one ``memmove`` through ctypes: it releases the GIL and runs on one core, so the threads do not
multiply PyTorch's own intra-op threads; the store's fill and the arena's, which run side by side, share one
:class:`CopyPool`. On 4 KiB pages, where the pages are populated ahead on threads of their own, the same copy
measured slower than PyTorch's, so a creator uses this only where the pages come reserved
(``flextensor.sharing.creator``).

Batches
-------
The caller queues the pieces of one batch (an arena block, a store record) with :meth:`PieceCopier.copy`, then
closes it with :meth:`PieceCopier.end_batch` and a ``then`` callback (point the model at the copies). Batches
finish in order: a batch's ``then`` runs on the caller's thread once its pieces and every earlier batch's are
copied. ``end_batch`` waits for the oldest batches while those open hold more than ``open_bytes`` (default
:data:`OPEN_BYTES`), the newest always staying open, so the threads have the next pieces while one batch's last
pieces finish, and the bytes queued (pages taken ahead of the copy, private tensors not yet let go) stay bounded
by ``open_bytes`` plus two batches (the newest closed one and the one being queued). Whatever fails, no piece is still being copied once :meth:`PieceCopier.close`
returns: the caller may then free the sources or unmap the destinations.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

from flextensor.runtime.source_pages import SourcePages

__all__ = ["COPY_THREADS_MAX", "OPEN_BYTES", "CopyPool", "PieceCopier"]

#: The most threads of a pool (by default it has one per core: the copy runs at the memory's rate only with
#: every core copying, see docs/benchmarks.md).
COPY_THREADS_MAX = 32
#: Bytes of closed batches that may still be queued or copying (beyond the newest batch).
OPEN_BYTES = 512 << 20


class CopyPool:
    """The copy threads of one publish, shared by its fills (the store's and the arena's run side by side: one
    pool keeps them to one thread per core between them). ``with CopyPool() as pool: ...``"""

    def __init__(self, threads: int | None = None, *, label: str = "ft-piece-copy") -> None:
        cores = os.cpu_count() or 1
        self.threads = max(1, min(threads or cores, cores, COPY_THREADS_MAX))
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=label)

    def __enter__(self) -> "CopyPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, call: Callable[..., int], *args: object) -> Future[int]:
        return self._executor.submit(call, *args)

    def close(self) -> None:
        """Wait for the threads and stop them (idempotent)."""
        self._executor.shutdown(wait=True)


class PieceCopier:
    """One fill's batches of pieces, copied on a :class:`CopyPool` (see the module docstring). Not thread-safe:
    each fill has its own."""

    def __init__(self, pool: CopyPool, *, open_bytes: int = OPEN_BYTES) -> None:
        self.pool = pool
        self.released_bytes = 0  # source bytes given back behind the copies reported so far
        self._open_limit = open_bytes
        self._batch: list[Future[int]] = []
        self._batch_bytes = 0
        self._open: deque[tuple[list[Future[int]], int, Callable[[], None]]] = deque()
        self._open_bytes = 0

    def __enter__(self) -> "PieceCopier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def copy(self, into: int, out_of: int, nbytes: int, *, release: SourcePages | None = None, offset: int = 0,
             keep: object = None) -> None:
        """Queue a copy of ``nbytes`` from address ``out_of`` to ``into`` in the current batch; once copied, the
        source's whole pages inside it are given back (``release``: the source tensor's, ``offset`` being the
        piece's first byte in that tensor). ``keep`` (the two tensors, say) is held until the piece is copied or
        dropped, so whatever the caller drops or closes meanwhile, both addresses stay mapped while it copies."""
        self._batch.append(self.pool.submit(_copy_piece, into, out_of, nbytes, release, offset, keep))
        self._batch_bytes += nbytes

    def end_batch(self, then: Callable[[], None]) -> None:
        """Close the current batch; ``then`` runs once it and every batch before it are copied. Waits for the
        oldest batches while the open ones hold more than ``open_bytes`` (see the module docstring), and raises
        the first copy error."""
        self._open.append((self._batch, self._batch_bytes, then))
        self._open_bytes += self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        while len(self._open) > 1 and self._open_bytes - self._open[-1][1] > self._open_limit:
            self._finish_oldest()

    def drain(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for every batch closed so far and run their ``then`` in order; raises the first copy error. Stops
        before the next batch once ``cancelled()`` says so (the caller failed elsewhere) and returns False; the
        pieces not started yet are dropped by :meth:`close`."""
        while self._open:
            if cancelled is not None and cancelled():
                return False
            self._finish_oldest()
        return True

    def close(self) -> None:
        """Drop this fill's pieces not started yet and wait for those copying, without running ``then`` (after an
        error the caller throws the fill away; after :meth:`drain` nothing is left). Idempotent; the pool
        stays."""
        pending = [future for futures, _nbytes, _then in self._open for future in futures] + self._batch
        self._open.clear()
        self._batch, self._batch_bytes, self._open_bytes = [], 0, 0
        for future in pending:
            future.cancel()
        wait(pending)

    def _finish_oldest(self) -> None:
        futures, nbytes, then = self._open[0]
        errors = [error for error in (future.exception() for future in futures) if error is not None]
        if errors:
            raise errors[0]
        self._open.popleft()
        self._open_bytes -= nbytes
        self.released_bytes += sum(future.result() for future in futures)
        then()


def _copy_piece(into: int, out_of: int, nbytes: int, release: SourcePages | None, offset: int, keep: object) -> int:
    ctypes.memmove(into, out_of, nbytes)
    return release.release_inside(offset, offset + nbytes) if release is not None else 0
