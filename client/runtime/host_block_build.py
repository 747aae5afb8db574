"""Filling host blocks on a thread of their own: :class:`HostBlockBuild`.

The engine uses it to build INFERENCE's host blocks behind resident inference (``flextensor.engine.build`` says
when and why). Given block layouts, each block's source tensors and a provider, the thread reserves every
block size, then block by block allocates, copies the sources in, and hands the sources back to their owner
(``release_sources``: the staging unregisters and drops them), pausing between two unregistrations so the main
thread's launches get through. The caller starts it, polls ``done``, joins with ``wait`` or stops it with
``cancel``; an error is kept in ``error`` for the caller's thread to raise.

When the caller still reads the sources while the build runs (copies per call after a stream-mode warm-up), a
:class:`SourceHandover` moves each trap's tensors onto its block before that block's sources go: see
Note [sources handed over block by block].
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch

from flextensor.runtime.heap import return_free_heap
from flextensor.runtime.host_memory import BlockLayout, FillProgress, HostBlock, HostBlockProvider, block_views

__all__ = ["HostBlockBuild", "SourceHandover", "UNREGISTER_PAUSE_S"]

logger = logging.getLogger("flextensor.manager")

#: The build thread's pause between two ``cudaHostUnregister`` calls. Each call holds a driver lock that the main
#: thread's launches wait for: released in one piece, the staging of a plan that streams nothing stalled its first
#: inference pass for hundreds of milliseconds. With this pause, launch-bound passes run while the regions are
#: released at well under twice their idle time (``docs/benchmarks.md``, "Pinned host memory"); the build takes
#: about one pause per region longer.
UNREGISTER_PAUSE_S = 0.001


def _let_launches_through() -> None:
    """The pause itself (a function of its own so tests can record the pauses instead of sleeping)."""
    time.sleep(UNREGISTER_PAUSE_S)


class SourceHandover:
    """Moves each trap's tensors from their host originals onto their filled host block while the caller's thread
    still copies them per call, so the build frees the originals block by block.

    Note [sources handed over block by block]
    -----------------------------------------
    After a stream-mode warm-up the first inference passes copy every streamed trap's weights per call from the
    host originals until the blocks are installed. Kept until then, the originals and the blocks are two copies of
    everything offloaded. Instead, as soon as a block is filled the build thread
    points that trap's tensors at the block's views (the same bytes), and the originals are released: the copies
    per call read the block from then on. Two rules make that safe:

    - a trap's tensors change only while no call of that trap is between :meth:`using` and :meth:`done` (its
      tensors then hold device copies, and their host data waits in the warm loader to be put back), so
      :meth:`hand_over` waits for the call in flight to end;
    - copies already queued from an original may still run on the device: the staging synchronizes the device
      before it unregisters and drops a region, which is what frees it.

    :meth:`stop_waiting` (the caller's thread waits for the build, or cancels it) ends the wait: a hand-over still
    waiting then returns False, and those originals are released at the install instead. Waiting on would never
    end if the caller waits for the build from inside a call of that very trap.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self._stopped = False

    def using(self, label: str) -> None:
        """The caller's thread starts a call of trap ``label`` (its tensors will hold device copies)."""
        with self._changed:
            self._in_flight[label] = self._in_flight.get(label, 0) + 1

    def done(self, label: str) -> None:
        """That call ended: the tensors hold their host data again."""
        with self._changed:
            left = self._in_flight.get(label, 0) - 1
            if left > 0:
                self._in_flight[label] = left
            else:
                self._in_flight.pop(label, None)
                self._changed.notify_all()

    def stop_waiting(self) -> None:
        """From now on :meth:`hand_over` never waits (the caller's thread waits for the build)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def hand_over(self, label: str, move: Callable[[], None]) -> bool:
        """Run ``move`` (point trap ``label``'s tensors at its block) once no call of it is in flight; False
        without running it when :meth:`stop_waiting` came first."""
        with self._changed:
            while self._in_flight.get(label) and not self._stopped:
                self._changed.wait()
            if self._in_flight.get(label):
                return False
            move()
            return True


#: ``move(layout, block)``: point the layout's tensors at the block's views (run by :meth:`SourceHandover.hand_over`).
MoveOnto = Callable[[BlockLayout, HostBlock], None]


class HostBlockBuild:
    """Allocates and fills the host blocks of ``layouts`` from ``sources`` on a thread of its own."""

    def __init__(self, manager_name: str, layouts: Sequence[BlockLayout], sources: list[list[torch.Tensor]],
                 provider: HostBlockProvider, release_sources, device: torch.device,
                 release_after: Sequence[str] = (),
                 handover: tuple[SourceHandover, MoveOnto] | None = None) -> None:
        if len(sources) != len(layouts):
            raise ValueError("HostBlockBuild: one source list per layout is needed")
        self.manager_name = manager_name
        self.layouts = list(layouts)
        self.provider = provider
        self.blocks: list[HostBlock] = []
        self.error: BaseException | None = None
        self.finished = False  # every block built and the provider finished (not cancelled, no error)
        self.elapsed_s = 0.0
        self._sources = sources
        # callable(names, between): the staged originals of one block may go; ``between`` runs between two
        # unregistrations (PinnedStaging.release)
        self._release_sources = release_sources
        self._release_after = list(release_after)  # staged names of the tensors that stay resident
        # The caller still reads the sources: a block's go once its tensors were moved onto it; those the move
        # gave up on stay for the caller (Note [sources handed over block by block])
        self._handover = handover
        self.kept_sources: list[str] = []
        self._device = device
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ft-host-blocks", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> HostBlockBuild:
        """Start the build thread (idempotent)."""
        if not self.started:
            self._thread.start()
        return self

    @property
    def done(self) -> bool:
        """Started and finished (built, failed or cancelled)."""
        return self.started and not self._thread.is_alive()

    def wait(self) -> None:
        """Start the build if nobody did yet, and wait for it."""
        self._stop_handover()
        self.start()
        self._thread.join()

    def cancel(self) -> None:
        """Stop after the block in flight and join (release during the build); a build never started never runs."""
        self._cancel.set()
        self._stop_handover()
        if self.started:
            self._thread.join()
        else:
            self._sources = []

    def _stop_handover(self) -> None:
        """The caller's thread is about to wait for the build: a hand-over must not wait for it in turn."""
        if self._handover is not None:
            self._handover[0].stop_waiting()

    def _pause(self) -> None:
        """Between two unregistrations: let the main thread's launches through, unless the build is cancelled
        (``release()`` joins it, and its teardown unregisters the rest anyway)."""
        if not self._cancel.is_set():
            _let_launches_through()

    @staticmethod
    def _fill(block: HostBlock, layout: BlockLayout, sources: list[torch.Tensor], progress: FillProgress) -> None:
        """Copy one block's sources in. A function of its own so that no loop variable of the caller still holds
        a source (the last one of each block) once the block's originals are released: that tensor would stay
        allocated until the next block's copy, and its heap pages past the trim of the next ``allocate``."""
        for placement, view, source in zip(layout.tensors, block_views(block.tensor, layout.tensors), sources):
            view.copy_(source)
            progress.add(placement.nbytes)

    def _run(self) -> None:
        start = time.monotonic()
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            self.provider.reserve([layout.nbytes for layout in self.layouts])
            progress = FillProgress(self.manager_name, sum(p.nbytes for layout in self.layouts for p in layout.tensors))
            for layout in self.layouts:
                if self._cancel.is_set():
                    return
                block = self.provider.allocate(layout.index, layout.nbytes)
                self._fill(block, layout, self._sources[layout.index], progress)
                self.blocks.append(block)
                self._sources[layout.index] = []  # the build's references; the staging's go below
                names = [p.name for p in layout.tensors]
                if self._handover is not None:
                    self.provider.pin_filled(between=self._pause)  # the caller's copies now read this block
                    handover, move = self._handover
                    if not handover.hand_over(layout.label, lambda: move(layout, block)):
                        self.kept_sources.extend(names)
                        continue
                self._release_sources(names, self._pause)
            progress.finish()
            self._release_sources(self._release_after, self._pause)
            return_free_heap()  # the last block's originals: no later allocate() trims the heap for them
            if self._cancel.is_set():
                return
            self.provider.finish(between=self._pause)
            self.finished = True
        except BaseException as exc:  # noqa: BLE001 - raised on the manager's thread at install time
            self.error = exc
        finally:
            self._sources = []
            self.elapsed_s = time.monotonic() - start
            outcome = ("built" if self.finished else f"failed ({self.error})" if self.error is not None
                       else "cancelled")
            if self.layouts or not self.finished:  # an empty build that worked is reported at its install
                logger.info("manager %r: host blocks %s in the background after %.2f s (%d of %d blocks)",
                            self.manager_name, outcome, self.elapsed_s, len(self.blocks), len(self.layouts))
