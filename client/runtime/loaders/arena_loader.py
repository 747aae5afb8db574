"""The ``raw_block_transfer`` loader: every streamed block gets a byte range of ONE device arena, sized to it.

Why an arena: a slot loader gives every slot the largest streamed block's size, so a trap that streams only part
of its tensors (the rest stays resident under a memory budget) still costs a whole slot, and the budget keeps
less resident. Here each block takes only its own bytes, and the prefetch depth is whatever fits.

Layout (``flextensor.planning.arena_model``, the planner's model of this loader)
--------------------------------------------------------------------------------
- The arena holds any ``num_blocks`` consecutive entries of the schedule: ``window_bytes`` of the schedule's
  block sizes, the bytes the planner counted (``rotating_bytes``).
- Entry ``e`` (the ``e``-th streamed call, numbered across passes as in ``flextensor.runtime.loaders.block_loader``) is placed
  by next fit on a ring: right after entry ``e - 1``, or at offset 0 when it would cross the end. Offsets depend
  on the entry index only (skipped entries advance the ring too), so a block meets the same few offsets pass
  after pass; the device views and the copy's two sides are made once per (block, offset) and cached.

Ordering (CUDA), the slots' rules with "the slot's previous occupant" read as "the last writers of the bytes":
- ``copy_done[e]`` is recorded on the copy stream after entry ``e``'s copy; before trap ``e`` runs, the compute
  stream waits on it;
- ``reader_done[e]`` is recorded on the compute stream when trap ``e`` exits;
- the copy of entry ``e`` is *issued* only once every entry that last wrote a byte of its range has exited (or
  was skipped), and the copy stream then waits on those entries' ``reader_done`` before copying. The arena map
  knows those entries (``ArenaMap.owners``); every earlier reader of those bytes finished before their copies
  started, and copies run in order on the one copy stream, so no byte is overwritten before its last reader is
  done. An entry's ``reader_done`` is dropped (its event reused) once no byte of the arena names it any more.
- Entering trap ``e`` issues entry ``e`` if it was not prefetched (every earlier entry has exited then, so it
  can always be issued), then prefetches ``e + 1``, ``e + 2``, ... in order while their ranges are free in this
  sense, at most ``L - 1`` ahead (``L``: schedule length); the first one that is not stops the prefetch until
  the next trap. Copies are issued in entry order, as on the slots.

Resync (a pass that skips or reorders traps), the host-block gate and the copy stream are
:class:`~flextensor.runtime.loaders.block_loader.StreamingLoader`'s, shared with the slot loader. An entry skipped before its
copy was issued writes nothing; one skipped after it was (a prefetch) stays the last writer of its range with no
reader to wait for. On the CPU (no CUDA) copies are synchronous when issued and there are no events; the layout,
placement, ordering by exits and resync are the same.

CUDA-graph capture follows the slot loader's rules (Note [loader under CUDA-graph capture] in
``flextensor.runtime.loaders.block_loader``): a captured pass, and every pass after one, issues its own copies and none past
its end, its first copy waits for the compute stream, and later copies wait only for readers of the same pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from flextensor.planning.arena_model import ArenaMap, window_bytes
from flextensor.runtime.compile_guard import disable_compile
from flextensor.runtime.host_memory import BlockLayout, block_views
from flextensor.runtime.loaders.block_loader import BlockLoader, StreamingLoader
from flextensor.runtime.timing import TimingCollector

__all__ = ["ArenaLoader", "make_loader"]

logger = logging.getLogger(__name__)


class ArenaLoader(StreamingLoader):
    """Streams packed host blocks through one device arena holding any ``num_blocks`` consecutive blocks."""

    def __init__(
        self,
        *,
        device: torch.device,
        layouts: Sequence[BlockLayout],
        host_blocks: Sequence[torch.Tensor],
        params: Sequence[Sequence[torch.Tensor]],
        schedule: Sequence[int],
        num_blocks: int,
        timing: TimingCollector | None = None,
        host_block_gate: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(device=device, layouts=layouts, host_blocks=host_blocks, params=params, schedule=schedule,
                         timing=timing, host_block_gate=host_block_gate)
        if num_blocks < 1:
            raise ValueError(f"ArenaLoader: num_blocks must be >= 1 (consecutive blocks the arena holds), got "
                             f"{num_blocks}")
        self._sizes = [self.layouts[b].nbytes for b in self.schedule]
        #: The block count the arena is sized for (what the slot loader calls its slot count).
        self.num_slots = min(int(num_blocks), len(self.schedule)) if self.schedule else 0
        self.arena_bytes = window_bytes(self._sizes, num_blocks)
        self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=self.device)
        self._ring: ArenaMap[int] = ArenaMap(self.arena_bytes)  # placement; owners are entry indices
        self._offsets: dict[int, int] = {}  # entry -> offset, for the entries placed and not yet passed
        self._placed = -1  # highest entry placed
        self._kept_from = 0  # the entries before it are passed: their offsets are dropped
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._copy_pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._copy_done: dict[int, Any] = {}  # entry -> event, issued and not yet entered or skipped
        self._reader_done: dict[int, Any] = {}  # entry -> event, exited and still the last writer of some bytes
        self._spare_events: list[Any] = []
        # From the start every streamed parameter rests on a device view (at its first entry's offset), as it
        # does between traps later: the model looks as if it were on the device (torch.compile needs that).
        seen: set[int] = set()
        for entry, block in enumerate(self.schedule):
            if block not in seen:
                seen.add(block)
                for param, view in zip(self.params[block], self._device_views(block, self._offset(entry))):
                    param.data = view

    # -- layout --------------------------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        return self.arena_bytes

    def _offset(self, entry: int) -> int:
        """Entry ``entry``'s offset in the arena, placing every entry up to it in order (module docstring)."""
        offsets = self._offsets
        while self._placed < entry:
            self._placed += 1
            offsets[self._placed] = self._ring.place(self._sizes[self._placed % len(self._sizes)])
        return offsets[entry]

    def _device_views(self, block: int, offset: int) -> list[torch.Tensor]:
        key = (block, offset)
        views = self._views.get(key)
        if views is None:
            views = block_views(self.arena.narrow(0, offset, self.layouts[block].nbytes), self.layouts[block].tensors)
            self._views[key] = views
        return views

    def _whole_block(self, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(arena bytes, host bytes) of block ``block`` at ``offset``: the two sides of its one copy, made once."""
        key = (block, offset)
        pair = self._copy_pairs.get(key)
        if pair is None:
            nbytes = self.layouts[block].nbytes
            pair = (self.arena.narrow(0, offset, nbytes), self.host_blocks[block].narrow(0, 0, nbytes))
            self._copy_pairs[key] = pair
        return pair

    # -- events --------------------------------------------------------------------------------------------------
    def _event(self) -> Any:
        return self._spare_events.pop() if self._spare_events else torch.cuda.Event()

    def _retire(self, events: dict[int, Any], entry: int) -> None:
        event = events.pop(entry, None)
        if event is not None:
            self._spare_events.append(event)

    # -- hot path ------------------------------------------------------------------------------------------------
    def _free_for(self, entry: int, running: int) -> bool:
        """Whether entry ``entry``'s range holds no bytes an entry from ``running`` on may still read."""
        offset = self._offset(entry)
        owners = self._ring.owners(offset, self._sizes[entry % len(self._sizes)])
        return not owners or max(owners) < running

    def _issue(self, entry: int, compute: Any = None) -> None:
        """Copy entry ``entry`` into its range; the caller checked that every last writer there has exited."""
        block = self.schedule[entry % len(self.schedule)]
        offset = self._offset(entry)
        replaced = self._ring.write(offset, self.layouts[block].nbytes, entry)
        pairs = (self._whole_block(block, offset),)
        if self.cuda:
            # After a capture, only readers of this pass: the pass's first copy followed all earlier ones
            # (Note [loader under CUDA-graph capture] in flextensor.runtime.loaders.block_loader, rule 2).
            first = self._pass_first if self.self_contained else None
            waits = [self._reader_done[o] for o in replaced
                     if o in self._reader_done and (first is None or o >= first)]
            done = self._copy_done[entry] = self._event()
            span = self._copy(block, pairs, waits, done, compute)
            if replaced:
                live = {owner for _lo, _hi, owner in self._ring.spans}
                for owner in replaced:
                    if owner not in live:
                        self._retire(self._reader_done, owner)
        else:
            span = self._copy(block, pairs, (), None)
        if span is not None:
            self._pending_timing[entry] = span
        self._issued = entry

    def enter(self, block: int) -> None:
        """Make block ``block``'s tensors usable on the device, then prefetch what fits (never compiled: see
        ``BlockLoader.enter``)."""
        self._refuse_nesting(block)
        entry = self._find_entry(block)
        last = self._pass_bound(entry, entry + len(self.schedule) - 1)
        for passed in range(self._cursor, entry):  # skipped by a resync: nothing will read them
            self._retire(self._copy_done, passed)
            self._pending_timing.pop(passed, None)
        compute = self._compute_stream() if self.cuda else None
        probe = self.probe if not self.self_contained else None  # no stall sampling after a capture
        cpu_start = time.perf_counter() if probe is not None and not self.cuda and probe.sampling else None
        if entry > self._issued:
            self._offset(entry)  # places the skipped entries, which write nothing
            self._issue(entry, compute)
        offset = self._offsets[entry]
        for passed in range(self._kept_from, entry):
            self._offsets.pop(passed, None)
        self._kept_from = entry
        self._wait_for_copy(entry, compute, self._copy_done[entry] if compute is not None else None, probe)
        if compute is not None:
            self._retire(self._copy_done, entry)
        for param, view in zip(self.params[block], self._device_views(block, offset)):
            param.data = view
        self._active = (entry, offset)
        self._cursor = entry + 1
        ahead = max(self._issued + 1, entry + 1)
        while ahead <= last and self._free_for(ahead, entry):
            self._issue(ahead, compute)
            ahead += 1
        if cpu_start is not None and probe is not None:
            # synchronous copies: the trap (or the next one) waited for all of them
            probe.add_cpu_wait(time.perf_counter() - cpu_start)

    def exit(self, block: int) -> None:
        """Mark the running trap's range free for reuse once the compute stream passes this point."""
        if self._active is None:
            return
        entry, _offset = self._active
        if self.cuda:
            event = self._event()
            event.record(self._compute_stream())
            self._reader_done[entry] = event
        self._active = None

    def _forget_ahead(self, entries: range) -> None:
        for entry in entries:  # issued again in this pass (a captured pass is self-contained)
            self._retire(self._copy_done, entry)
        super()._forget_ahead(entries)

    # -- teardown ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight copies (teardown, not the hot path), then drop the arena."""
        super().close()
        self.arena = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._views.clear()
        self._copy_pairs.clear()
        self._copy_done.clear()
        self._reader_done.clear()
        self._spare_events.clear()


disable_compile(ArenaLoader, ("enter", "exit"))


def make_loader(
    transfer_mode: str,
    *,
    device: torch.device,
    layouts: Sequence[BlockLayout],
    host_blocks: Sequence[torch.Tensor],
    params: Sequence[Sequence[torch.Tensor]],
    schedule: Sequence[int],
    num_slots: int,
    small_slot: int = 0,
    timing: TimingCollector | None = None,
    host_block_gate: Callable[[int], None] | None = None,
) -> StreamingLoader:
    """The loader of ``transfer_mode``: an arena holding ``num_slots`` consecutive blocks for
    ``"raw_block_transfer"``, else ``num_slots`` slots (filled tensor by tensor for ``"strategy"``), the last one
    ``small_slot`` bytes when that is smaller (``flextensor.planning.slot_model``)."""
    common: dict[str, Any] = dict(device=device, layouts=layouts, host_blocks=host_blocks, params=params,
                                  schedule=schedule, timing=timing, host_block_gate=host_block_gate)
    if transfer_mode == "raw_block_transfer":
        return ArenaLoader(num_blocks=num_slots, **common)
    return BlockLoader(num_slots=num_slots, per_tensor=transfer_mode == "strategy", small_slot=small_slot, **common)
