"""Page-locking threads and the warm-up's launches take turns: :class:`LaunchTurns`.

Why
---
While any thread of the process is inside ``cudaHostRegister``, the driver holds a lock that every kernel launch
and every copy queued by another thread waits for. Several threads registering back to back keep it held the
whole time: launches and copies queued meanwhile wait for all of the registration, through PyTorch's binding and
through ctypes alike; the GIL is not the cause (Python on the launching thread runs at its usual speed
meanwhile). So the first warm-up pass of a large model, whose storages are page-locked on a thread while it
runs (``PinnedStaging.stage_in_background``), launched almost nothing until the last region was registered: it
took the registration's time *plus* its own.

The two sides now take turns. A trap's warm-up copies take the turn (:meth:`take`) once their regions are
registered, and hold it until the trap's compute is launched; new registrations wait meanwhile, and the ones in
flight (one per registering thread) finish before :meth:`take` returns. Launching takes a fraction of a
millisecond per trap, so registration loses little, and what is launched runs on the GPU while the next regions
are registered. Of the variants tried (``bench/experiment_profile_phase.py``; ``docs/benchmarks.md``, "The
profile phase alone"), holding the turn until the compute is launched, with four registering threads, gave the
shortest first pass; handing it back once a trap's copies were queued gave back most of the gain, and two
registering threads a little of it.

Every take drains the calls in flight: the registering threads that finish meanwhile start nothing, so each
take costs the registration about half a call on every thread (a call pins one storage). A timeline of that
pass showed the cost: with the turn given back at every trap's exit, the turn was taken hundreds of times and
registration ran with fewer calls in flight than threads for a quarter of its time. So the
turn is kept across traps: at a trap's exit it goes back only once it was held for :data:`LAUNCH_SLICE_S`
(:meth:`give_between_traps`); a copy that must wait for its region gives it back first, as before, and so does
the end of the pass. The pass, which trails the registration, then launches every trap whose regions the drain
finished in one turn instead of taking a turn per trap. A trap called outside a pass gives it back at its exit.
The price: host work between two traps that blocks (a ``.item()``, a synchronize) keeps the turn meanwhile, as
it kept it inside a trap before; only the first pass of a large model registers while it runs.

States: ``launching`` (a launching thread holds the turn: no registration starts), ``registering`` (registration
calls in flight), ``closed`` (the staging thread ended: :meth:`take` and :meth:`registration` are free). Anyone
waiting for a region gives the turn back first (``PinnedStaging.wait_for``, ``PinnedStaging.join``), so a thread
holding the turn never waits for a registration that waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

__all__ = ["LAUNCH_SLICE_S", "LaunchTurns"]

#: How long a launching thread may keep the turn across traps before a trap's exit gives it back (module docs):
#: several traps' launches (a fraction of a millisecond each), short against one registration call.
LAUNCH_SLICE_S = 0.010


class LaunchTurns:
    """The turn between registration calls (many threads) and a launching thread (one at a time); see module docs.

    Created closed (nothing to take turns with); :meth:`open` when a background registration starts, :meth:`close`
    when it ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._launching = False
        self._registering = 0
        self._closed = True
        self._taken_at = 0.0  # perf_counter() when the turn was last taken

    def open(self) -> None:
        """A background registration starts (none may be in flight: the staging joined the last one first)."""
        with self._cond:
            self._closed, self._launching, self._registering = False, False, 0

    def close(self) -> None:
        """The registrations are over: every waiter goes on, and taking the turn costs nothing from now on."""
        with self._cond:
            self._closed, self._launching = True, False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def held(self) -> bool:
        """True while a launching thread holds the turn."""
        return self._launching

    def take(self) -> None:
        """Hold the turn for launching: no registration starts until :meth:`give`, and those in flight end first.
        Taking it again while held returns at once.

        Any thread may give the turn back (one that waits for the registration gives it so that it cannot wait
        for itself), also while this waits: the turn is then asked for again, so that this returns once the
        calls in flight end rather than once the registration has run out."""
        if self._closed or self._launching:  # unlocked fast path: only the launching thread sets it True
            return
        with self._cond:
            while not self._closed:
                self._launching = True  # first: no new registration starts while the ones in flight end
                if self._registering == 0:
                    self._taken_at = time.perf_counter()
                    return
                self._cond.wait()

    def give(self) -> None:
        """Give the turn back (no-op when not held): registrations go on."""
        if not self._launching:
            return
        with self._cond:
            self._launching = False
            self._cond.notify_all()

    def give_between_traps(self) -> None:
        """At a trap's exit: give the turn back if it was held for :data:`LAUNCH_SLICE_S` or longer, else keep it
        for the next trap's launches (module docs: each take drains the registration calls in flight)."""
        if self._launching and time.perf_counter() - self._taken_at >= LAUNCH_SLICE_S:
            self.give()

    @contextlib.contextmanager
    def registration(self) -> Iterator[None]:
        """Around one registration call: starts only while no launching thread holds the turn."""
        with self._cond:
            self._cond.wait_for(lambda: not self._launching or self._closed)
            self._registering += 1
        try:
            yield
        finally:
            with self._cond:
                self._registering -= 1
                if self._registering == 0:
                    self._cond.notify_all()
