"""What a session follower opens from the creator's publication while the user's model factory runs.

Why
---
A follower's time to ready is the sum of its steps, and two of them do not need the model at all: mapping the
shared tensor store and the host-block arena (a ``shm_open`` + ``mmap`` each: 0.3-1.5 ms on a virtualised host,
more when several followers attach at once), and copying the resident tensors (embeddings, norms, head) from
the store to the device. The factory, on the other hand (normally a model built on ``meta``), is pure Python
and touches neither. So once the published plan is read, :class:`FollowerPrefetch` does the former on a thread
(``ft-attach``) while the caller's thread runs the factory; the session joins it before it validates the model
against the publication. The system calls and the reads of the copy release the GIL, so the two really overlap;
the thread keeps its own Python work small (one arena instead of a segment per block, about one GIL hand-over
per chunk of the copy), because every bytecode it runs is time the factory waits for the GIL.

Ordering and ownership
----------------------
1. ``start()``: the thread checks that every host block of the plan names this generation's arena (a plan from
   another namespace or generation is refused) and attaches the store. On a CUDA device it then allocates the
   device buffer of the resident tensors and copies every store record into it
   (:meth:`SharedTensorStore.copies_on`: one range per part of the store) through a small pinned ring
   (:class:`~flextensor.runtime.pinned.bounce_copy.StagedCopy`: the store's mapping is not registered, and a copy from
   it directly would run at pageable speed), reading the store's file with ``pread`` (no page of the store is
   faulted into this process), and synchronizes its own stream, so the copies are complete before anyone can
   read them, whatever stream the caller uses. Beside the copy, which needs neither, a thread of its own
   (``ft-attach-blocks``) maps the arena, then allocates and frees the loader's rotating device blocks, which
   leaves them in PyTorch's caching allocator for the adoption to take (``cudaMalloc`` calls are slow while
   other followers register their blocks, tens of milliseconds for a large model, which would otherwise come
   before the copy). The copy's thread joins that one before it ends, and raises
   its error after its own. The ring is mapped and registered on a thread of its own too (``ft-staged-ring``)
   from the store's attach on, and handed to the release thread after the copy; a ring not used (an error came
   first) is released before the thread ends. On a CPU device there is no copy, and the thread maps the arena
   itself. PyTorch's stream pool is not made (the loader takes its copy stream at its first copy).
2. ``join()`` waits for the thread (through an interrupt too, re-raised after) and the caller takes over
   everything it opened, *also when it failed or the factory failed*: the caller
   (``flextensor.sharing.follower.attach_when_ready``, or ``SharedOffloadSession._join_while_building`` for the
   coordinator too) puts it into the manager's share first, so the session's cleanup closes it, and only then
   raises the thread's error. Nothing the thread opened is ever left without an owner.
3. The thread never touches the model or the manager; it only reads the publication.

Joining on the thread
---------------------
A follower that joined a generation not READY yet waits for READY on the thread too (``elect`` waits, then reads
the plan), so its model is built while the creator publishes, and the attach starts the moment READY comes; a
factory that fails, or an interrupt, cancels that wait (:meth:`FollowerPrefetch.cancel`). The other way round,
an error the thread meets while the factory runs (the creator died or failed) is raised once the factory
returns: the factory is the caller's code and is never interrupted. When a READY
generation already exists (``peek_ready``, read without the coordinator lock), the caller is
almost certainly a follower, so the session starts the factory at once and lets the thread join the generation
first (``elect``: the election under the coordinator lock, the daemon registration, the plan), then do the
above. With several followers arriving together the lock is taken in turn, and that wait now overlaps the
factory instead of preceding it. The thread waits for the lock a short while only (``ELECT_LOCK_WAIT_S``) so
that its work stays bounded (that bound is the election's alone: the coordinator keeps the session's timeout
for its later registrations and its close); if it gives up, or the join made this process the creator (the
generation ended between the peek and the join), or the generation is not READY, the session continues on its
own thread with what the thread returned (the model the factory built is then used as it is, or dropped for
the creator's).

CUDA's start
------------
In a process that has not used CUDA yet, the thread starts it (driver and primary context: seconds), once the
generation is READY: started before the wait for READY (on the caller's thread, or on one of its own), it held
that wait up, and a creator killed meanwhile was reported seconds after the SIGKILL, well past a lease of 1 s. A server whose workers pick their device first (``torch.cuda.set_device``, as under
``torchrun``) has CUDA up already, and the thread copies on the caller's current stream.

``timings`` reports seconds per part, for ``session.report()``: ``store`` and ``resident`` on the thread, and on a
CUDA device ``blocks`` and ``slots`` beside ``resident`` (on ``ft-attach-blocks``), so those parts overlap and are
not to be summed (on a CPU device ``blocks`` runs on the thread, after ``store``).
The join is not among them: ``elect`` times its own parts (the session reports ``join``, ``daemon`` and
``plan``). The ring's parts run on its own thread and are not among them either: ``copy_report`` (a
:class:`~flextensor.runtime.pinned.bounce_copy.CopyReport`) gives them, with where the bytes were read, the rate, and
the part of ``resident`` spent waiting for the ring.

The arena's layout (:func:`flextensor.shm.blocks.arena_layout`) is computed once, on the thread, from the plan's
block sizes: the thread checks the plan's block names and maps the arena's parts with it and keeps it as
``layout``, from which the session makes the blocks' views and its registration ranges.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

import torch

from flextensor.runtime.loaders.block_loader import slot_count
from flextensor.runtime.pinned.bounce_copy import CopyReport, StagedCopy
from flextensor.runtime.thread_join import join_through_interrupts
from flextensor.planning.plan_model import effective_blocks
from flextensor.shm.blocks import ArenaLayout, SharedBlockAllocator, arena_layout
from flextensor.shm.tensor_store import SharedTensorStore

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.segment import SharedSegment
    from flextensor.state import TensorManagerState

__all__ = ["FollowerPrefetch", "ELECT_LOCK_WAIT_S"]

logger = logging.getLogger(__name__)

#: How long the thread waits for the coordinator lock before it leaves the join to the caller's thread.
ELECT_LOCK_WAIT_S = 2.0


class FollowerPrefetch:
    """Attach the store, open the host blocks and copy the resident tensors, on a thread (see module docs).

    Given ``owner`` and ``state``, the generation is joined and its plan read. Given ``elect`` instead (alone:
    mixing the two roles is a ``ValueError``), the thread first calls it to join the generation (see "Joining on
    the thread" in the module docs): it returns the coordinator and, for a follower of a READY generation, the
    published plan, or ``(None, None)`` when it gave up waiting for the coordinator lock; the thread continues
    only with a plan.
    """

    def __init__(self, namespace: str, device: torch.device, *, num_blocks: int, min_blocks: int,
                 owner: "ShmOwner | None" = None, state: "TensorManagerState | None" = None,
                 elect: "Callable[[], tuple[ShmCoordinator | None, TensorManagerState | None]] | None" = None,
                 cancel: threading.Event | None = None) -> None:
        _check_roles(owner, state, elect)
        #: Set by :meth:`cancel`: an ``elect`` that waits (for READY) watches it and gives up.
        self.cancelled = cancel if cancel is not None else threading.Event()
        self._namespace = namespace
        self._owner = owner
        self._elect = elect
        self._num_blocks, self._min_blocks = num_blocks, min_blocks
        self._blocks: list[Any] = []
        self._slots = 0
        self._device = device
        self._cuda = device.type == "cuda"
        # The caller's current stream: copies and cached allocations land in its pool, where the caller's
        # later allocations (the loader's device blocks) look for them. A process that has not used CUDA yet
        # has no stream but the default one, which the thread then takes itself (see "CUDA's start").
        self._stream = torch.cuda.current_stream(device) if self._cuda and torch.cuda.is_initialized() else None
        self.coordinator: "ShmCoordinator | None" = None  # joined by the thread (``elect``)
        self.state = state  # the published plan (None until read when electing on the thread)
        self.layout: ArenaLayout | None = None  # the arena's layout, computed once on the thread
        self.store: SharedTensorStore | None = None
        self.segments: list["SharedSegment"] = []
        self.device_copies: dict[str, torch.Tensor] | None = None  # record name -> copy (CUDA device only)
        self.copy_report: CopyReport | None = None  # how the resident copy went (CUDA device only)
        self.error: BaseException | None = None
        #: Set by :meth:`factory_returned`: the resident copy then adds the workers it held back (see StagedCopy).
        self.caller_free = threading.Event()
        self._side_error: BaseException | None = None  # from the thread beside the copy (``ft-attach-blocks``)
        self.timings: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="ft-attach", daemon=True)
        self._done = threading.Event()  # set as _run ends (see flextensor.runtime.thread_join)

    def start(self) -> "FollowerPrefetch":
        self._thread.start()
        return self

    def factory_returned(self) -> None:
        """The caller's thread stopped running the model factory: the copy may use every core now."""
        self.caller_free.set()

    def cancel(self) -> None:
        """Tell an ``elect`` still waiting (for READY) to give up; the thread's other steps are bounded anyway."""
        self.cancelled.set()

    def join(self) -> None:
        """Wait for the thread to finish, even through an interrupt (which cancels a wait for READY, then is
        re-raised): only then may the caller take over what it opened, and the thread's work is bounded (opens
        and copies, at most ``ELECT_LOCK_WAIT_S`` of waiting for the coordinator lock, and a wait for READY that
        :meth:`cancel` ends)."""
        join_through_interrupts(self._thread, self._done, self.cancelled)

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        copier: StagedCopy | None = None
        try:
            if self._elect is not None:  # not timed here: elect times its parts (see "Joining on the thread")
                self.coordinator, self.state = self._elect()
                if self.coordinator is None or self.state is None:
                    return  # the caller takes over: the lock was busy, or this is no follower of a READY generation
                self._owner = self.coordinator.memory_owner
            if self._cuda and self._stream is None:  # after the wait for READY: see "CUDA's start"
                torch.cuda.set_device(self._device)
                self._stream = torch.cuda.current_stream(self._device)  # this thread's: the default stream
            assert self._owner is not None and self.state is not None
            self._blocks = self.state.blocks_in_order()
            streamed = {b.label for b in self._blocks}
            slots = effective_blocks(self._num_blocks, self._min_blocks, len(self._blocks))
            self._slots = slot_count(slots, sum(label in streamed for label in self.state.schedule)) \
                if self._blocks else 0
            # The arena's layout, once (the session reuses it): which part and offset each block has.
            self.layout = arena_layout([b.nbytes for b in self._blocks], align=self._owner.block_alignment)
            parts = SharedBlockAllocator(self._owner).names(self.layout)
            for position, block in enumerate(self._blocks):
                if block.index != position or block.name != parts[self.layout.parts[position]]:
                    raise ValueError(
                        f"published plan names host block {block.index} {block.name!r}, but this generation "
                        f"keeps it in {parts[self.layout.parts[position]]!r}: the plan belongs to another "
                        "namespace or generation; restart the workers"
                    )
            start = time.monotonic()
            self.store = SharedTensorStore.attach(self._namespace, shm_owner=self._owner)
            opened = time.monotonic()
            self.timings["store"] = opened - start
            if self._stream is None:  # no device copy: the arena is all that is left
                self._open_blocks(self._owner)
                self.timings["blocks"] = time.monotonic() - opened
                return
            torch.cuda.set_device(self._device)
            copier = StagedCopy(stream=self._stream, background_release=True, caller_free=self.caller_free)
            if self.store.nbytes >= copier.min_bytes:  # the ring's pages and registration, beside the steps below
                copier.prepare_in_background(self._device)
            with torch.cuda.stream(self._stream):
                # The resident copies' buffer first: allocated after the cached device blocks, it could be carved
                # out of one of them, and the loader would have to allocate that block again.
                resident = self.store.device_buffer(self._device)
            # The arena and the device blocks are not needed by the copy: they open beside it (see "Ordering").
            side = threading.Thread(target=self._blocks_and_slots, args=(self._owner,), name="ft-attach-blocks",
                                    daemon=True)
            side.start()
            try:
                copying = time.monotonic()
                # PyTorch's stream pool is not made here: the loader takes its copy stream at its first copy.
                with torch.cuda.stream(self._stream):
                    self.device_copies = self.store.copies_on(self._device, buffer=resident, fill=copier.copy_pieces)
                    done = torch.cuda.Event()
                    done.record(self._stream)
                done.synchronize()  # the copies are complete before any stream reads them
                self.timings["resident"] = time.monotonic() - copying
                self.copy_report = copier.last
            except BaseException:
                side.join()  # never left running: the caller takes over what it opened
                if self._side_error is not None:  # the copy's error is raised; this one would be lost
                    logger.warning("session %s: opening the arena beside the failed resident copy failed too: %r",
                                   self._namespace, self._side_error)
                raise
            side.join()
            if self._side_error is not None:
                raise self._side_error
        except BaseException as exc:  # noqa: BLE001 - raised on the session's thread after join()
            # The frames the error carries from this thread (copies_on's, the fill's) hold views of the store's
            # mapping: kept, they would keep it mapped after the session closes the store, for as long as the
            # caller keeps the error. Their locals are dropped (this frame's own, still running, are kept).
            traceback.clear_frames(exc.__traceback__)
            self.error = exc
        finally:
            try:
                if copier is not None:
                    copier.close()  # a ring prepared and not used (an error came first) is released too
            finally:
                self._done.set()

    def _blocks_and_slots(self, owner: "ShmOwner") -> None:
        """Beside the resident copy (thread ``ft-attach-blocks``): map the arena, then leave the loader's device
        blocks in the cache; an error is kept for :meth:`_run` to raise once the copy is done."""
        try:
            start = time.monotonic()
            self._open_blocks(owner)
            opened = time.monotonic()
            self.timings["blocks"] = opened - start
            torch.cuda.set_device(self._device)
            with torch.cuda.stream(self._stream):
                self._warm_device_cache(max((b.nbytes for b in self._blocks), default=0))
            self.timings["slots"] = time.monotonic() - opened
        except BaseException as exc:  # noqa: BLE001 - raised by _run after the copy
            self._side_error = exc

    def _warm_device_cache(self, slot_bytes: int) -> None:
        """Allocate the loader's rotating device blocks and free them together, into PyTorch's cache, where the
        loader's same-sized allocations find them (all are held until the last is made, so that each is a block
        of its own)."""
        held = [torch.empty(slot_bytes, dtype=torch.uint8, device=self._device) for _ in range(self._slots)]
        del held

    def _open_blocks(self, owner: "ShmOwner") -> None:
        """Map the arena's parts holding every host block (a few opens: see ``flextensor.shm.blocks``)."""
        if self._blocks:
            assert self.layout is not None  # laid out when the plan's blocks were checked
            self.segments = SharedBlockAllocator(owner).attach(self.layout)


def _check_roles(owner: "ShmOwner | None", state: "TensorManagerState | None", elect: Callable[..., Any] | None
                 ) -> None:
    """Refuse a mix of the two roles: a follower that joined passes ``owner`` and ``state``; one joining on the
    thread passes ``elect`` alone, whose coordinator supplies the owner and whose plan is the state, so an
    ``owner`` or ``state`` given beside it would be silently replaced (``ValueError`` naming what to pass)."""
    if elect is not None:
        mixed = [name for name, value in (("owner", owner), ("state", state)) if value is not None]
        if mixed:
            raise ValueError(
                f"FollowerPrefetch got elect together with {' and '.join(mixed)}: they are exclusive roles (elect "
                "joins the generation on the thread and takes the owner and plan from it); pass elect alone, or "
                "owner and state without elect"
            )
    elif owner is None or state is None:
        missing = " and ".join(name for name, value in (("owner", owner), ("state", state)) if value is None)
        raise ValueError(
            f"FollowerPrefetch got no {missing}: pass owner and state (the joined generation's memory owner and "
            "its published plan), or elect alone to join the generation on the thread"
        )
