"""Registering a follower's shared host blocks with CUDA in the background, in the order the engine reads them.

Why
---
CUDA registration is per process: every follower must ``cudaHostRegister`` its own mapping of the shared host
blocks (page-aligned ranges of the arena's segments, ``blocks.py``) before the device can DMA from them at full
speed. That costs about a tenth of a second per GiB and grows when several followers register at once (the
driver serialises them), so registering everything before the model is handed back made a follower's time to
ready several times what the rest of attaching costs (docs/benchmarks.md, Figures behind the code). Nothing
needs a block registered before the first copy *from that block*: the pinner registers the blocks one by one on
a thread of its own, in schedule order, while the follower returns its model and starts its first forward; the
engine waits for a block only when it is about to copy it (:meth:`BackgroundPinner.wait`). Threads do not make
registration itself faster (one thread or sixteen take the same time), but pre-faulting the pages from several
threads does, so a small pool pre-faults the next blocks while the pinner registers the current one. On huge pages
(``segment_dir.py``) a block is 512 times fewer faults, so each block is pre-faulted from one thread
(``prefault.read_threads``).

Threads and states
------------------
- ``start()`` spawns the pinner thread (``ft-pin``). It sets the CUDA device of the caller first, so the
  registration never creates a context on another GPU.
- For each block in ``order``: stop requested? -> quit; else wait for its pre-fault (pool of
  :data:`PREFAULT_THREADS`, up to :data:`LOOKAHEAD` blocks ahead), ``segment.pin(read_only=True, offset=,
  nbytes=)`` of the block's range, then set the block's event. Blocks never named in ``order`` are registered
  last.
- A failure (driver refusal, often ``ulimit -l``) is logged once as a WARNING; the remaining blocks are left
  unregistered and every event is set, so copies proceed from pageable memory: correct, only slower.
- ``wait(block)`` returns once that block's event is set (registered, failed or stopped); after the last block
  it is a single attribute check.
- ``stop()`` asks the thread to stop after the block in flight; ``close()`` does and joins it. Only then may the caller unpin
  and unmap the segment (``SharedSegment.close`` unpins every range), so a registration never races an unmap.
- At interpreter exit, an ``atexit`` hook stops every pinner still running and joins it (the block in flight
  ends, at most :data:`EXIT_JOIN_S`): no registration is inside the driver while the driver's own exit handlers
  run (the hook is registered at the first ``start()``, after CUDA was initialised, so it runs before them), as
  ``flextensor.shm.background_release`` does for unregistering.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Sequence

from .prefault import populate_read, read_threads

if TYPE_CHECKING:  # pragma: no cover
    from .segment import SharedSegment

__all__ = ["BackgroundPinner", "PinRange"]

logger = logging.getLogger(__name__)

#: Threads that pre-fault blocks ahead of the registering thread.
PREFAULT_THREADS = 4
#: How many blocks ahead of the one being registered may be pre-faulted at once.
LOOKAHEAD = 8
#: Longest wait at exit for a pinner's block in flight.
EXIT_JOIN_S = 30.0

_running: "weakref.WeakSet[BackgroundPinner]" = weakref.WeakSet()
_exit_hooked = False


def _stop_at_exit() -> None:
    """Stop every pinner still running, then join each (its block in flight ends first)."""
    pinners = list(_running)
    for pinner in pinners:
        pinner.stop()
    deadline = time.monotonic() + EXIT_JOIN_S
    for pinner in pinners:
        thread = pinner._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


class PinRange(NamedTuple):
    """One host block: ``nbytes`` at page-aligned ``offset`` of ``segment``."""

    segment: "SharedSegment"
    offset: int
    nbytes: int


class BackgroundPinner:
    """Registers ``blocks`` (indexed by host block) on a background thread, first the blocks in ``order``."""

    def __init__(self, blocks: Sequence[PinRange], order: Sequence[int], *, device: int | None = None,
                 label: str = "") -> None:
        self._blocks = list(blocks)
        self._order = list(dict.fromkeys([*order, *range(len(self._blocks))]))  # first mention of each block
        if any(i < 0 or i >= len(self._blocks) for i in self._order):
            raise ValueError(f"pin order {list(order)} names a block outside 0..{len(self._blocks) - 1}")
        self._device = device
        self._label = label
        self._events = [threading.Event() for _ in self._blocks]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._all_done = not self._blocks
        self.error: BaseException | None = None
        self.pinned_blocks = 0
        self.elapsed_s = 0.0
        self.waited_s = 0.0

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> BackgroundPinner:
        global _exit_hooked
        if self._thread is None and not self._all_done:
            if not _exit_hooked:
                atexit.register(_stop_at_exit)
                _exit_hooked = True
            _running.add(self)
            self._thread = threading.Thread(target=self._run, name="ft-pin", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop after the block in flight and join the thread. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._release_waiters()

    def stop(self) -> None:
        """Ask the thread to stop after the block in flight, without waiting for it (:meth:`close` joins)."""
        self._stop.set()

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    @property
    def done(self) -> bool:
        """True once every block was handled (registered, or skipped after a failure or a stop)."""
        return self._all_done

    # ------------------------------------------------------------------------------------------ engine side
    def wait(self, block: int) -> None:
        """Return once block ``block`` is registered (or will not be: failure, stop). Cheap once all are done."""
        if self._all_done:
            return
        event = self._events[block]
        if not event.is_set():
            start = time.monotonic()
            event.wait()
            self.waited_s += time.monotonic() - start

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait for every block; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in self._events:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not event.wait(remaining):
                return False
        return True

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        start = time.monotonic()
        pool = ThreadPoolExecutor(min(PREFAULT_THREADS, len(self._order)), thread_name_prefix="ft-prefault")
        prefaults: dict[int, Future] = {}
        try:
            if self._device is not None:
                import torch

                torch.cuda.set_device(self._device)
            for position, block in enumerate(self._order):
                for ahead in self._order[position:position + LOOKAHEAD]:
                    if ahead not in prefaults:
                        upcoming = self._blocks[ahead]
                        prefaults[ahead] = pool.submit(populate_read, upcoming.segment.address + upcoming.offset,
                                                       upcoming.nbytes,
                                                       threads=read_threads(upcoming.segment.page_size))
                if self._stop.is_set():
                    break
                try:
                    prefaults.pop(block).result()
                except OSError as exc:  # a speed-up only: register anyway
                    logger.debug("pre-fault of block %d failed (%s); registering without it", block, exc)
                target = self._blocks[block]
                target.segment.pin(read_only=True, offset=target.offset, nbytes=target.nbytes)
                self.pinned_blocks += 1
                self.elapsed_s = time.monotonic() - start
                self._events[block].set()
        except BaseException as exc:  # noqa: BLE001 - reported once, copies fall back to pageable memory
            self.error = exc
            remedy = ("if the driver refused, raise `ulimit -l` or set pinned_memory=False"
                      if isinstance(exc, RuntimeError) else "this is a flextensor bug: please report it")
            logger.warning("%sregistering the shared host blocks with CUDA stopped after %d of %d blocks: %s: %s. "
                           "The rest are copied from pageable memory (correct, slower); %s",
                           f"{self._label}: " if self._label else "", self.pinned_blocks, len(self._order),
                           type(exc).__name__, exc, remedy)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.elapsed_s = time.monotonic() - start
            self._release_waiters()
            logger.debug("%s registered %d blocks in %.3f s", self._label or "pinner", self.pinned_blocks,
                         self.elapsed_s)

    def _release_waiters(self) -> None:
        for event in self._events:
            event.set()
        self._all_done = True
