"""Filling host blocks on a thread of their own: :class:`HostBlockBuild`.

The engine uses it to build INFERENCE's host blocks behind resident inference (``flextensor.engine.build`` says
when and why). Given block layouts, each block's source tensors and a provider, the thread reserves every
block size, then block by block allocates, copies the sources in, and hands the sources back to their owner
(``release_sources``: the staging unregisters and drops them), pausing between two unregistrations so the main
thread's launches get through. With ``keep_sources`` the sources are still read by the caller (copies per call
until the blocks are installed) and stay where they are; only ``release_after`` is handed back. The caller starts it, polls ``done``, joins with ``wait`` or stops it with
``cancel``; an error is kept in ``error`` for the caller's thread to raise.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import torch

from flextensor.runtime.heap import return_free_heap
from flextensor.runtime.host_memory import BlockLayout, FillProgress, HostBlock, HostBlockProvider, block_views

__all__ = ["HostBlockBuild", "UNREGISTER_PAUSE_S"]

logger = logging.getLogger("flextensor.manager")

#: The build thread's pause between two ``cudaHostUnregister`` calls. Each call holds a driver lock that the main
#: thread's launches wait for: released in one piece, the 4.3 GB staging of a plan that streams nothing stalled
#: its first inference pass for 214-745 ms (H200 host). With this pause, while 4 GiB in 64 regions were released,
#: launch-bound passes took 4.3 ms (median) and 5.9 ms at most against 2.8 ms idle; the build takes about one
#: pause per region longer.
UNREGISTER_PAUSE_S = 0.001


def _let_launches_through() -> None:
    """The pause itself (a function of its own so tests can record the pauses instead of sleeping)."""
    time.sleep(UNREGISTER_PAUSE_S)


class HostBlockBuild:
    """Allocates and fills the host blocks of ``layouts`` from ``sources`` on a thread of its own."""

    def __init__(self, manager_name: str, layouts: Sequence[BlockLayout], sources: list[list[torch.Tensor]],
                 provider: HostBlockProvider, release_sources, device: torch.device,
                 release_after: Sequence[str] = (), keep_sources: bool = False) -> None:
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
        self._keep_sources = keep_sources  # the caller still reads the sources: they are not released here
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
        self.start()
        self._thread.join()

    def cancel(self) -> None:
        """Stop after the block in flight and join (release during the build); a build never started never runs."""
        self._cancel.set()
        if self.started:
            self._thread.join()
        else:
            self._sources = []

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
                if not self._keep_sources:
                    self._release_sources([p.name for p in layout.tensors], self._pause)
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
