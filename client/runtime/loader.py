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
(``flextensor.runtime.arena_loader.ArenaLoader``): same schedule, entries, resync, gate and copy stream
(:class:`StreamingLoader`, the part both share), other placement.

From the loader's creation on, and after every trap, its parameters point at a slot (device views), so the model
always looks as if it were on the device; their values are only valid inside the trap.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

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
            # (tens of cudaStreamCreate with the GIL held: 3-12 ms measured in a session follower). With a gate
            # (a follower whose blocks register in the background) it is taken at the first copy, which waits for
            # its block's registration anyway, so making the pool no longer competes with the user's model
            # factory for the GIL while the follower attaches. Without one it is taken here, at the switch to
            # INFERENCE, as the engine's other set-up is.
            self._side = None if host_block_gate is not None else torch.cuda.Stream(device=device)
        self.copies_issued = 0
        self.resyncs = 0
        self.probe: StallProbe | None = None  # set by the engine: samples the compute stream's stalls

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
        the loader's host time per streamed trap went from 105 to 40 us on the H200 host (2026-11-30). Setting a
        stream also makes its device current, so a caller whose current device is another one gets it back.
        """
        timing = self.timing
        if self.cuda and self._side is None:  # before the gate: made while the registration proceeds
            self._side = torch.cuda.Stream(device=self.device)
        if self._gate is not None:  # e.g. the block's background cudaHostRegister has not finished yet
            self._gate(block)
        side = self._side if self.cuda else None
        if side is not None:
            back = compute if compute is not None else self._compute_stream()
            device = torch.cuda.current_device()
            for event in waits:
                side.wait_event(event)
            torch.cuda.set_stream(side)
        try:
            span = timing.start_span(side) if timing is not None else None
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.cuda)
            if span is not None:
                timing.end_span(span, side)
            if side is not None:
                done.record(side)
        finally:
            if side is not None:
                torch.cuda.set_stream(back)
                if device != back.device_index:
                    torch.cuda.set_device(device)
        self.copies_issued += 1
        return span

    def abort(self) -> None:
        """Forget the running trap after an exception inside it (its range is still released in order)."""
        if self._active is not None:
            self.exit(-1)

    def exit(self, block: int) -> None:  # pragma: no cover - every loader defines it
        raise NotImplementedError

    def close(self) -> None:
        """Wait for in-flight copies (teardown, not the hot path); subclasses then drop their device memory."""
        if self.cuda and self._side is not None:
            self._side.synchronize()
        self._pending_timing.clear()


class BlockLoader(StreamingLoader):
    """Streams packed host blocks through ``num_slots`` device blocks, ordered by events."""

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
    ) -> None:
        super().__init__(device=device, layouts=layouts, host_blocks=host_blocks, params=params, schedule=schedule,
                         per_tensor=per_tensor, timing=timing, host_block_gate=host_block_gate,
                         host_views=host_views)
        device = self.device
        # Slots hold scheduled blocks only: after a replan (``flextensor.engine.replan``) the layouts also list
        # host blocks whose tensors are resident now.
        self.slot_bytes = max((self.layouts[b].nbytes for b in set(self.schedule)), default=0)
        self.num_slots = slot_count(num_slots, len(self.schedule)) if self.layouts else 0
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.num_slots)]
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._copy_pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        L = len(self.schedule)
        self._depth = max(0, min(self.num_slots - 1, L - 1))
        if self.cuda:
            self._copy_done = [torch.cuda.Event() for _ in range(self.num_slots)]
            self._reader_done = [torch.cuda.Event() for _ in range(self.num_slots)]
        # From the start, every streamed parameter rests on a device view (of the slot its first entry uses), as
        # it does between traps later: the model looks as if it were on the device before its first forward too,
        # which torch.compile needs (it traces the parameter swap in enter() only between views of one device).
        for block in set(self.schedule):
            slot = self.schedule.index(block) % self.num_slots
            for param, view in zip(self.params[block], self._device_views(block, slot)):
                param.data = view

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
        return self.slot_bytes * self.num_slots

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
        slot = entry % self.num_slots
        block = self.schedule[entry % len(self.schedule)]
        if self.per_tensor:
            pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = list(zip(self._device_views(block, slot),
                                                                         self.host_views(block)))
        else:
            pairs = (self._whole_block(block, slot),)
        if self.cuda:
            span = self._copy(block, pairs, (self._reader_done[slot],), self._copy_done[slot], compute)
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
        slot = entry % self.num_slots
        compute = self._compute_stream() if self.cuda else None
        probe = self.probe
        cpu_start = time.perf_counter() if probe is not None and not self.cuda and probe.sampling else None
        if entry > self._issued:
            for skipped in range(self._issued + 1, entry):
                self._pending_timing.pop(skipped, None)
            self._issue(entry, compute)
        timing = self.timing
        wait_span = None
        if compute is not None:
            if timing is not None:
                wait_span = timing.start_span(compute)
            if probe is not None:
                probe.wait_for_copy(compute, self._copy_done[slot])
            else:
                compute.wait_event(self._copy_done[slot])
            if wait_span is not None:
                timing.end_span(wait_span, compute)
        if timing is not None:
            timing.attach_transfer(self._pending_timing.pop(entry, None), wait_span)
        for param, view in zip(self.params[block], self._device_views(block, slot)):
            param.data = view
        self._active = (entry, slot)
        self._cursor = entry + 1
        for ahead in range(max(self._issued + 1, entry + 1), entry + self._depth + 1):
            self._issue(ahead, compute)
        if cpu_start is not None:  # synchronous copies: the trap (or the next one) waited for all of them
            probe.add_cpu_wait(time.perf_counter() - cpu_start)

    def exit(self, block: int) -> None:
        """Mark the running trap's slot free for reuse once the compute stream passes this point."""
        if self._active is None:
            return
        _entry, slot = self._active
        if self.cuda:
            self._reader_done[slot].record(self._compute_stream())
        self._active = None

    # -- teardown ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight copies (teardown, not the hot path), then drop the device slots."""
        super().close()
        self.slots = []
        self._views.clear()
        self._copy_pairs.clear()


disable_compile(BlockLoader, ("enter", "exit"))
