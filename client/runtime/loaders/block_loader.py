"""The INFERENCE block loader: host blocks -> a few rotating device blocks, one trap ahead of compute.

Schedule and slots
------------------
The *schedule* is the list of offloaded traps (as host block indices) in the order one forward pass invokes
them (a trap invoked twice appears twice). The loader numbers invocations with an ever-growing *entry* index
``e``; entry ``e`` runs host block ``schedule[e % L]`` from device slot ``e % num_slots``. Entering trap ``e``
issues the copies of entries ``e+1 .. e+depth`` (``depth = min(num_slots - 1, L - 1)``), wrapping into the next
pass, so the copy of trap N+1 overlaps the compute of trap N.

Ordering (CUDA), without any device-wide synchronize:

- ``copy_done[s]`` is recorded on the side stream after the copy into slot ``s``; before trap ``e`` runs, the
  compute stream waits on ``copy_done[e % num_slots]`` (a trap never starts before its weights arrived);
- ``reader_done[s]`` is recorded on the compute stream after the trap that read slot ``s``; the side stream
  waits on it before copying into ``s`` again (a block is never overwritten before its last reader finished).
  Entry ``e`` is issued only once entry ``e - num_slots`` (the previous occupant) has exited, because
  ``depth < num_slots``.

If a pass invokes traps in another order than the schedule (data-dependent control flow, an aborted pass), the
loader resynchronises: it searches the schedule forward (cyclically) for the trap being entered, skips the
entries in between, and issues the copy on demand. Results stay exact; only overlap is lost.

On the CPU (no CUDA) the "device" slots are CPU tensors, copies are synchronous ``copy_`` calls done when the
entry is issued, and no events exist; every other step (layout, slots, views, rotation, resync) is the same.

Host block gate
---------------
A shared session's follower registers its mappings of the host blocks with CUDA in the background
(``flextensor.shm.background_pin``). ``host_block_gate(block)`` is called before every copy from a host block and
returns once the block is registered, so no copy reads a block while the driver is still pinning it, and the
first forward waits only for the blocks it reaches before registration does.

Transfer modes
--------------
``allocation_block_transfer`` copies a trap's packed host block with ONE copy; ``strategy`` issues one copy per
tensor (host view -> the tensor's place in the slot). Both use the same slots and events. With ``host_views`` the
per-tensor copies read the given tensors instead of views of packed host blocks (``profile_mode=
"torch_function"`` streams from the model's own parameters, which it never moves into a block:
``flextensor.engine.function_traps``).
``raw_block_transfer`` streams through one device arena instead of slots
(``flextensor.runtime.loaders.arena_loader.ArenaLoader``): same schedule, entries, resync, gate and copy stream
(:class:`StreamingLoader`, the part both share), other placement.

From the loader's creation on, and after every trap, its parameters point at a slot (device views), so the model
always looks as if it were on the device; their values are only valid inside the trap.

Note [loader under CUDA-graph capture]
--------------------------------------
A CUDA graph captured around a forward pass records the device work the pass enqueues: the copies from pinned
host blocks into the slots (or the arena), the event records and the stream waits. The loader's host-side
bookkeeping (which entry goes where, what is prefetched) runs once, at capture, and every replay repeats that one
schedule at the same addresses. Two rules make a replay correct, also after eager passes or other replays:

1. *A captured pass is self-contained.* Eager passes prefetch across the pass boundary: the next pass's first
   copies are issued under this pass's last traps. A replay cannot rely on that: the copies a previous pass
   issued are not part of the graph, and copies a graph issued for "the next pass" would land where the next
   replay does not read (entry ``e`` uses slot ``e % num_slots``, and a pass of ``L`` entries shifts the slots
   by ``L % num_slots``; arena offsets move on likewise). So in a captured pass
   (:meth:`StreamingLoader.begin_pass` with ``capturing``) the copies prefetched by the pass before are
   forgotten and issued again inside the capture, no copy is issued past the pass's last entry, and the pass
   ends by joining the copy stream into the compute stream (a capture must end with every stream it forked
   joined). The pass starts and ends with no copy in flight, so every replay finds the state the capture saw.
   Cost: each replay's first copy is not hidden under the previous pass's last trap (one block per pass: ~1%
   of a 16-layer transfer-bound pass, nothing when compute-bound).
2. *Stream order instead of stale events.* Inside a capture only events recorded in that capture may be waited
   on, and after it the loader's events hold what was recorded before it, not what the replays did. So in a
   self-contained pass the first copy follows everything already enqueued on the compute stream
   (``wait_stream``: a previous pass or replay has finished reading every slot), later copies follow it in the
   copy stream's order, and a reader's event is waited on only when that reader ran in this pass. Once a pass
   was captured every later pass is self-contained too: the loader cannot see replays, which may run between
   any two eager passes.

After a capture the loader also stops feeding the stall probe (``flextensor.runtime.stall_probe``): the replan a
stall arms rebuilds the loader, and its new device memory is not what the captured graphs read. A replan
requested explicitly still runs; its caller captures the graphs again (the replan API says so).

Nothing in a captured pass synchronizes or queries the device. Capture needs pinned copy sources (a copy from
pageable memory is not capturable; ``is_pinned`` asks the driver, which a capture forbids, so it is asked after
eager passes) and, for a shared session's follower, every block past its background registration (the gate is
not called while capturing, and a registration running during a capture fails): one eager pass through the
loader must come first. :meth:`StreamingLoader.begin_pass` checks and raises ``RuntimeError`` naming the fix.
``torch.cuda.graph`` synchronizes before it captures, so no copy of an earlier pass still writes the device
memory when the capture's copies are recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from flextensor.planning.slot_model import SlotRing, slot_sizes, small_slot_for
from flextensor.runtime.compile_guard import disable_compile
from flextensor.runtime.host_memory import BlockLayout, block_views
from flextensor.runtime.stall_probe import StallProbe
from flextensor.runtime.timing import CurrentStream, TimingCollector

__all__ = ["BlockLoader", "StreamingLoader"]

logger = logging.getLogger(__name__)


def slot_count(num_slots: int, schedule_len: int) -> int:
    """Device blocks a loader allocates: ``num_slots``, at least one, never more than schedule entries."""
    return max(1, min(int(num_slots), max(schedule_len, 1)))


def _check_host_views(layouts: Sequence[BlockLayout], host_views: Sequence[Sequence[torch.Tensor]],
                      per_tensor: bool) -> None:
    """Per-tensor sources must match their placements (a packed copy needs a packed host block)."""
    if not per_tensor:
        raise ValueError("BlockLoader: host_views (one source tensor per placement) need per_tensor=True")
    for layout, views in zip(layouts, host_views):
        if len(views) != len(layout.tensors):
            raise ValueError(f"BlockLoader: block {layout.index} (trap {layout.label!r}) places "
                             f"{len(layout.tensors)} tensors but {len(views)} host views were given")
        for place, view in zip(layout.tensors, views):
            if view.dtype != place.dtype or tuple(view.shape) != tuple(place.shape):
                raise ValueError(f"BlockLoader: host view of {place.name!r} is {view.dtype} "
                                 f"{tuple(view.shape)}, its placement {place.dtype} {tuple(place.shape)}")


class StreamingLoader:
    """What every block loader shares: the checked blocks and schedule, entries and resync, host views, the gate
    and the copy stream (module docstring). Subclasses place entries on the device and order their copies."""

    num_slots: int  # the device blocks (slots, or the consecutive blocks an arena holds): set by each subclass

    def __init__(
        self,
        *,
        device: torch.device,
        layouts: Sequence[BlockLayout],
        host_blocks: Sequence[torch.Tensor],
        params: Sequence[Sequence[torch.Tensor]],
        schedule: Sequence[int],
        per_tensor: bool = False,
        timing: TimingCollector | None = None,
        host_block_gate: Callable[[int], None] | None = None,
        host_views: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        sources = host_blocks if host_views is None else host_views
        if not (len(layouts) == len(sources) == len(params)):
            raise ValueError(f"{type(self).__name__}: layouts, host blocks and parameter lists must have the same "
                             "length")
        if any(b < 0 or b >= len(layouts) for b in schedule):
            raise ValueError(f"{type(self).__name__}: schedule {list(schedule)} names a block outside "
                             f"0..{len(layouts) - 1}")
        if host_views is not None:
            _check_host_views(layouts, host_views, per_tensor)
            host_blocks = ()
        for layout, host in zip(layouts, host_blocks):
            if host.dtype != torch.uint8 or host.dim() != 1 or host.numel() < layout.nbytes:
                raise ValueError(
                    f"host block {layout.index} (trap {layout.label!r}) must be a 1-D uint8 tensor of at least "
                    f"{layout.nbytes} bytes, got dtype={host.dtype} shape={tuple(host.shape)}"
                )
        if device.type == "cuda" and device.index is None:  # its streams and the caller's: on one known device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.layouts = list(layouts)
        self.host_blocks = list(host_blocks)
        self.params = [list(p) for p in params]
        self.schedule = list(schedule)
        self.per_tensor = per_tensor
        self.timing = timing
        self._gate = host_block_gate
        self.cuda = device.type == "cuda"
        # Host views are only read by per-tensor copies (transfer_mode="strategy"); built on first use, since a
        # view per tensor costs a few microseconds each and a shared-session follower's adoption waits for them.
        self._host_views: dict[int, list[torch.Tensor]] = {}
        if host_views is not None:
            self._host_views = {index: list(views) for index, views in enumerate(host_views)}
        self._cursor = 0  # the next entry expected
        self._issued = -1  # highest entry whose copy was issued
        self._active: tuple[int, int] | None = None  # (entry, where) of the trap running now
        self._pending_timing: dict[int, Any] = {}
        self._side: Any = None
        if self.cuda:
            self._compute_stream = CurrentStream(device)  # the caller's stream, looked up cheaply per trap
            # The copy stream comes from PyTorch's stream pool, which creates all of its streams on first use
            # (tens of cudaStreamCreate with the GIL held: milliseconds in a session follower). With a gate
            # (a follower whose blocks register in the background) it is taken at the first copy, which waits for
            # its block's registration anyway, so making the pool no longer competes with the user's model
            # factory for the GIL while the follower attaches. Without one it is taken here, at the switch to
            # INFERENCE, as the engine's other set-up is.
            self._side = None if host_block_gate is not None else torch.cuda.Stream(device=device)
        self.copies_issued = 0
        self.resyncs = 0
        self.probe: StallProbe | None = None  # set by the engine: samples the compute stream's stalls
        # CUDA-graph capture (Note [loader under CUDA-graph capture]).
        self.captures = 0  # passes captured so far
        self.self_contained = False  # every pass starts and ends with no copy in flight (after a capture)
        self._capturing = False
        self._pass_first: int | None = None  # entry of this self-contained pass's first trap
        self._pass_copies = 0  # copies issued in this self-contained pass
        self._gated: set[int] = set()  # blocks past host_block_gate
        self._unpinned: list[int] | None = None  # scheduled blocks with a pageable source, known after a pass
        self._pinning_known = False

    @property
    def host_block_gate(self) -> Callable[[int], None] | None:
        """The gate every copy from a host block waits on (a loader made again after a sleep keeps it)."""
        return self._gate

    def host_views(self, block: int) -> list[torch.Tensor]:
        """Zero-copy host views of block ``block``'s tensors (layout order)."""
        views = self._host_views.get(block)
        if views is None:
            views = block_views(self.host_blocks[block], self.layouts[block].tensors)
            self._host_views[block] = views
        return views

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the loader's rotating blocks take."""
        raise NotImplementedError

    def _find_entry(self, block: int) -> int:
        L = len(self.schedule)
        for k in range(L):
            if self.schedule[(self._cursor + k) % L] == block:
                if k:
                    self.resyncs += 1
                return self._cursor + k
        raise RuntimeError(
            f"host block {block} (trap {self.layouts[block].label!r}) is not in the loader's schedule; traps that "
            "never ran during discovery/profiling must stay resident"
        )

    def _refuse_nesting(self, block: int) -> None:
        if self._active is not None:
            raise RuntimeError(
                f"trap {self.layouts[block].label!r} entered while trap "
                f"{self.layouts[self.schedule[self._active[0] % len(self.schedule)]].label!r} is running; traps "
                "cannot nest"
            )

    def _copy(self, block: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], waits: Sequence[Any],
              done: Any, compute: Any = None) -> Any:
        """Copy host block ``block`` as ``(device, host)`` pairs; returns the timing span (or None).

        On CUDA the copy stream first waits on ``waits`` (the readers of the bytes it overwrites) and records
        ``done`` after the copy; on the CPU the copy is synchronous. ``compute`` is the caller's current stream
        when the caller already looked it up. The copy is enqueued with the side stream made current and the
        caller's stream set back by id, instead of ``with torch.cuda.stream(side)``: the context manager
        resolves the device index twice and builds a ``Stream`` object per copy: with the copy views made once,
        the loader's host time per streamed trap fell to less than half. Setting a
        stream also makes its device current, so a caller whose current device is another one gets it back
        (without creating a context there).
        """
        timing = self.timing
        if self.cuda and self._side is None:  # before the gate: made while the registration proceeds
            self._side = torch.cuda.Stream(device=self.device)
        if self._gate is not None and not self._capturing:  # e.g. its background cudaHostRegister is running
            self._gate(block)
            self._gated.add(block)
        side = self._side if self.cuda else None
        if side is not None:
            back = compute if compute is not None else self._compute_stream()
            device = torch.cuda.current_device()
            if self.self_contained and self._pass_copies == 0:  # after all that came before (rule 2)
                side.wait_stream(back)
            else:
                for event in waits:
                    side.wait_event(event)
            torch.cuda.set_stream(side)
        try:
            span = timing.start_span(side) if timing is not None else None
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.cuda)
            if span is not None and timing is not None:
                timing.end_span(span, side)
            if side is not None:
                done.record(side)
        finally:
            if side is not None:
                torch.cuda.set_stream(back)
                if device != back.device_index:
                    # As torch.cuda.device's exit does: back to the caller's device only where it already has a
                    # context; a rank that never chose a device must not get one on cuda:0 from a copy.
                    torch.cuda._maybe_exchange_device(device)
        self.copies_issued += 1
        self._pass_copies += 1
        return span

    # -- passes (Note [loader under CUDA-graph capture]) --------------------------------------------------------
    def begin_pass(self, capturing: bool = False) -> None:
        """A forward pass starts; ``capturing``: its device work is being captured into a CUDA graph.

        A captured pass, and every pass after one, is self-contained: copies the previous pass issued ahead for
        this one are forgotten (issued again inside this pass), none is issued past its end."""
        if capturing:
            self._check_capturable()
            self.captures += 1
            self.self_contained = True
        self._capturing = capturing
        if not self.self_contained:
            return
        self._forget_ahead(range(self._cursor, self._issued + 1))
        self._issued = min(self._issued, self._cursor - 1)
        self._pass_first = None
        self._pass_copies = 0

    def end_pass(self) -> None:
        """The pass ended: a captured one joins the copy stream into the compute stream (a capture must end with
        every forked stream joined; a copy a skipped trap never waited for would be left out otherwise)."""
        if self.cuda and self._capturing and self._pass_copies and self._side is not None:
            self._compute_stream().wait_stream(self._side)
        elif self.cuda and not self._capturing and not self._pinning_known:
            self._note_pinning()
        self._capturing = False
        self._pass_first = None

    def _pass_bound(self, entry: int, last: int) -> int:
        """``last`` (the last entry to prefetch when entering ``entry``), no further than a self-contained
        pass's end (rule 1)."""
        if not self.self_contained:
            return last
        if self._pass_first is None:
            self._pass_first = entry
        return min(last, self._pass_first + len(self.schedule) - 1)

    def _forget_ahead(self, entries: range) -> None:
        """Entries a previous pass issued ahead: their copies will be issued again in this pass."""
        for entry in entries:
            self._pending_timing.pop(entry, None)

    def _wait_for_copy(self, entry: int, compute: Any, copy_done: Any, probe: StallProbe | None) -> None:
        """Order the compute stream after entry ``entry``'s copy (``copy_done``; none on the CPU, whose copies
        are synchronous), timing the stall for offload timing and for a sampling stall probe, and attribute the
        copy and its stall to the trap now starting."""
        timing = self.timing
        wait_span = None
        if compute is not None:
            if timing is not None:
                wait_span = timing.start_span(compute)
            if probe is not None:
                probe.wait_for_copy(compute, copy_done)
            else:
                compute.wait_event(copy_done)
            if wait_span is not None and timing is not None:
                timing.end_span(wait_span, compute)
        if timing is not None:
            timing.attach_transfer(self._pending_timing.pop(entry, None), wait_span)

    def _check_capturable(self) -> None:
        if self._active is not None:
            raise RuntimeError("a CUDA-graph capture began inside a trap: capture whole forward passes")
        if self._gate is not None and not set(self.schedule) <= self._gated:
            raise RuntimeError(
                "CUDA-graph capture began before every host block passed its background registration (a shared "
                "session's follower registers them behind its first passes); run one eager forward pass before "
                "capturing (torch.cuda.graph's usual warm-up does)"
            )
        if self.cuda and self._unpinned is None:
            raise RuntimeError(
                "CUDA-graph capture began before any eager forward pass streamed through this loader (that pass "
                "checks that the host blocks are pinned: a capture cannot); run one eager pass before capturing, "
                "as torch.cuda.graph's usual warm-up does"
            )
        if self._unpinned:
            labels = [self.layouts[b].label for b in self._unpinned]
            raise RuntimeError(
                f"CUDA-graph capture needs pinned copy sources, but the blocks of {labels[:3]} are pageable (a copy "
                "from pageable memory cannot be captured); offload with pinned_memory=True"
            )

    def _note_pinning(self) -> None:
        """After an eager pass: which scheduled blocks copy from pageable memory (asked here, never in a
        capture). Final at once for private blocks; a follower's blocks are asked again after each pass until
        its background registration pinned them all."""
        pending = self._unpinned if self._unpinned is not None else sorted(set(self.schedule))

        def pinned(block: int) -> bool:
            if self.host_blocks:
                return self.host_blocks[block].is_pinned()
            return all(view.is_pinned() for view in self.host_views(block))

        self._unpinned = [b for b in pending if not pinned(b)]
        self._pinning_known = not self._unpinned or self._gate is None

    def abort(self) -> None:
        """Forget the running trap after an exception inside it (its range is still released in order)."""
        if self._active is not None:
            self.exit(-1)

    def enter(self, block: int) -> None:  # pragma: no cover - every loader defines it
        raise NotImplementedError

    def exit(self, block: int) -> None:  # pragma: no cover - every loader defines it
        raise NotImplementedError

    def close(self) -> None:
        """Wait for in-flight copies (teardown, not the hot path); subclasses then drop their device memory."""
        if self.cuda and self._side is not None:
            self._side.synchronize()
        self._pending_timing.clear()


class BlockLoader(StreamingLoader):
    """Streams packed host blocks through ``num_slots`` device blocks, ordered by events.

    ``small_slot``: the last slot takes only that many bytes (``flextensor.planning.slot_model``, the planner's
    model of it): entries then go to the least recently used slot that holds them instead of slot
    ``e % num_slots``, and a prefetch stops at the first entry whose slot's previous entry has not exited yet
    (with one size that is the ``depth`` bound itself).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        layouts: Sequence[BlockLayout],
        host_blocks: Sequence[torch.Tensor],
        params: Sequence[Sequence[torch.Tensor]],
        schedule: Sequence[int],
        num_slots: int,
        per_tensor: bool = False,
        timing: TimingCollector | None = None,
        host_block_gate: Callable[[int], None] | None = None,
        host_views: Sequence[Sequence[torch.Tensor]] | None = None,
        small_slot: int = 0,
    ) -> None:
        super().__init__(device=device, layouts=layouts, host_blocks=host_blocks, params=params, schedule=schedule,
                         per_tensor=per_tensor, timing=timing, host_block_gate=host_block_gate,
                         host_views=host_views)
        device = self.device
        # Slots hold scheduled blocks only: after a replan (``flextensor.engine.replan``) the layouts also list
        # host blocks whose tensors are resident now.
        self.slot_bytes = max((self.layouts[b].nbytes for b in set(self.schedule)), default=0)
        self.num_slots = slot_count(num_slots, len(self.schedule)) if self.layouts else 0
        self.small_slot = small_slot_for(self.slot_bytes, self.num_slots, small_slot)
        self.slot_sizes = slot_sizes(self.slot_bytes, self.num_slots, self.small_slot)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for size in self.slot_sizes]
        # With a small slot: placement by SlotRing, entry -> (slot, the slot's previous entry or -1), in order.
        self._ring: SlotRing[int] | None = SlotRing(self.slot_sizes) if self.small_slot else None
        self._placement: dict[int, tuple[int, int]] = {}
        self._placed = -1
        self._kept_from = 0  # the entries before it are passed: their placements are dropped
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._copy_pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        L = len(self.schedule)
        self._depth = max(0, min(self.num_slots - 1, L - 1))
        if self.cuda:
            self._copy_done = [torch.cuda.Event() for _ in range(self.num_slots)]
            self._reader_done = [torch.cuda.Event() for _ in range(self.num_slots)]
        self._read_in_pass: set[int] = set()  # slots read in this self-contained pass (their reader_done is ours)
        # From the start, every streamed parameter rests on a device view (of the slot its first entry uses), as
        # it does between traps later: the model looks as if it were on the device before its first forward too,
        # which torch.compile needs (it traces the parameter swap in enter() only between views of one device).
        for block in set(self.schedule):
            slot = self._slot(self.schedule.index(block))
            for param, view in zip(self.params[block], self._device_views(block, slot)):
                param.data = view

    def _slot(self, entry: int) -> int:
        """Entry ``entry``'s slot: ``entry % num_slots``, or with a small slot the ring's placement, which places
        every entry up to it in order (skipped entries too, so placement depends on the entry index alone)."""
        ring = self._ring
        if ring is None:
            return entry % self.num_slots
        placement = self._placement
        while self._placed < entry:
            self._placed += 1
            block = self.schedule[self._placed % len(self.schedule)]
            slot, previous = ring.place(self.layouts[block].nbytes, self._placed)
            placement[self._placed] = (slot, -1 if previous is None else previous)
        return placement[entry][0]

    def _slot_busy(self, entry: int, running: int) -> bool:
        """Whether entry ``entry``'s slot still belongs to an entry from ``running`` on (not exited yet)."""
        if self._ring is None:
            return False  # one size: the prefetch depth (num_slots - 1 ahead) already keeps off running slots
        self._slot(entry)
        return self._placement[entry][1] >= running

    # -- views ---------------------------------------------------------------------------------------------------
    def _device_views(self, block: int, slot: int) -> list[torch.Tensor]:
        key = (block, slot)
        views = self._views.get(key)
        if views is None:
            views = block_views(self.slots[slot], self.layouts[block].tensors)
            self._views[key] = views
        return views

    @property
    def device_bytes(self) -> int:
        return sum(self.slot_sizes)

    # -- hot path ------------------------------------------------------------------------------------------------
    def _whole_block(self, block: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot bytes, host bytes) of block ``block`` in ``slot``: the two sides of its one packed copy, made
        once (two ``narrow`` calls per copy are a few microseconds of host time in a launch-bound pass)."""
        key = (block, slot)
        pair = self._copy_pairs.get(key)
        if pair is None:
            nbytes = self.layouts[block].nbytes
            pair = (self.slots[slot].narrow(0, 0, nbytes), self.host_blocks[block].narrow(0, 0, nbytes))
            self._copy_pairs[key] = pair
        return pair

    def _issue(self, entry: int, compute: Any = None) -> None:
        """Start the copy of entry ``entry`` into its slot (side stream on CUDA, after the slot's last reader;
        synchronous on the CPU). ``compute``: the caller's current stream, when it looked it up already."""
        slot = self._slot(entry)
        block = self.schedule[entry % len(self.schedule)]
        if self.per_tensor:
            pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = list(zip(self._device_views(block, slot),
                                                                         self.host_views(block)))
        else:
            pairs = (self._whole_block(block, slot),)
        if self.cuda:
            read = not self.self_contained or slot in self._read_in_pass  # else: stream order (rule 2)
            waits = (self._reader_done[slot],) if read else ()
            span = self._copy(block, pairs, waits, self._copy_done[slot], compute)
        else:
            span = self._copy(block, pairs, (), None)
        if span is not None:
            self._pending_timing[entry] = span
        self._issued = entry

    def enter(self, block: int) -> None:
        """Make block ``block``'s tensors usable on the device, then prefetch the next entries.

        Never traced by torch.compile (dynamo breaks the graph here and runs it eagerly): it swaps parameter
        data and orders streams with CUDA events, which dynamo in torch 2.11 refuses to trace ("expected event to
        be a torch.Event object"), and it is host-side bookkeeping that a compiled graph should not capture
        (Note [compile-disabled on dynamo's import] in ``flextensor.runtime.compile_guard``).
        """
        self._refuse_nesting(block)
        entry = self._find_entry(block)
        slot = self._slot(entry)
        compute = self._compute_stream() if self.cuda else None
        last = self._pass_bound(entry, entry + self._depth)
        probe = self.probe if not self.self_contained else None  # no stall sampling after a capture (Note)
        cpu_start = time.perf_counter() if probe is not None and not self.cuda and probe.sampling else None
        if entry > self._issued:
            for skipped in range(self._issued + 1, entry):
                self._pending_timing.pop(skipped, None)
            self._issue(entry, compute)
        self._wait_for_copy(entry, compute, self._copy_done[slot] if compute is not None else None, probe)
        for param, view in zip(self.params[block], self._device_views(block, slot)):
            param.data = view
        self._active = (entry, slot)
        self._cursor = entry + 1
        for ahead in range(max(self._issued + 1, entry + 1), last + 1):
            if self._slot_busy(ahead, entry):
                break
            self._issue(ahead, compute)
        if self._ring is not None:
            for passed in range(self._kept_from, entry):
                self._placement.pop(passed, None)
            self._kept_from = entry
        if cpu_start is not None and probe is not None:
            # synchronous copies: the trap (or the next one) waited for all of them
            probe.add_cpu_wait(time.perf_counter() - cpu_start)

    def exit(self, block: int) -> None:
        """Mark the running trap's slot free for reuse once the compute stream passes this point."""
        if self._active is None:
            return
        _entry, slot = self._active
        if self.cuda:
            self._reader_done[slot].record(self._compute_stream())
        if self.self_contained:
            self._read_in_pass.add(slot)
        self._active = None

    def begin_pass(self, capturing: bool = False) -> None:
        super().begin_pass(capturing)
        self._read_in_pass.clear()

    # -- teardown ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight copies (teardown, not the hot path), then drop the device slots."""
        super().close()
        self.slots = []
        self._views.clear()
        self._copy_pairs.clear()


disable_compile(BlockLoader, ("enter", "exit"))
