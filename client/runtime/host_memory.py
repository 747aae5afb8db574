"""Host blocks: where offloaded weights live between their trips to the device.

Each block holds one trap's tensors in the packed layout of :mod:`flextensor.runtime.packed_layout` (its
names are re-exported here); this module allocates the memory the layout is laid over.

Providers
---------
:class:`HostBlockProvider` allocates the blocks. The engine first announces every block size of the build
(:meth:`HostBlockProvider.reserve`), then asks for the blocks one by one, in index order, fills them, and calls
:meth:`HostBlockProvider.finish` before any device copy reads them.

- ``pageable``: ``torch.empty`` (no pinning; the CPU-only path, and ``pinned_memory=False``);
- ``torch``: PyTorch's caching pinned allocator (``torch.empty(..., pin_memory=True)``, what ``pin_memory()``
  uses), so the blocks are ordinary torch-pinned memory, returned to PyTorch's pinned cache when freed;
- ``host_register``: ``torch.empty``, filled, then ``cudaHostRegister`` in place (exact size) at
  :meth:`HostBlockProvider.finish`; falls back to ``torch`` with a WARNING when the cudart binding is unusable;
- ``shm``: page-aligned ranges of one POSIX shared-memory segment (the generation's arena) through
  ``flextensor.shm.blocks.SharedBlockAllocator`` (creator allocates, followers attach), registered in place with
  ``segment.pin()`` when pinning is asked for.

Arenas (the three private providers)
------------------------------------
Instead of one allocation per block, consecutive blocks share an *arena*: one allocation, each block a
``narrow`` view of it at a multiple of 4096 bytes from the arena's start (:func:`plan_arenas` groups them). Why:

- PyTorch's pinned allocator rounds every request up to a power of two, and fresh pinned memory comes from
  ``cudaHostAlloc``, which is slow per byte (it allocates, zeroes and locks). A 268 MB layer block costs 512 MiB;
  16 of them 8 GiB. Grouping blocks so that each arena fills its power of two closely (7 + 7 + 2 layers: 2 + 2
  + 1 GiB) page-locks 5 GiB instead, ~40% less work on the first build and less idle memory left in PyTorch's
  pinned cache afterwards. The blocks stay ordinary torch-pinned memory (same allocator as ``pin_memory()``);
- ``host_register`` makes one ``cudaHostRegister`` call per arena instead of per block.

An arena holds at most :data:`ARENA_MAX_BYTES` (unless one block is larger): blocks are filled in order and
the weights they replace are freed block by block, so the transient host memory of a build stays around one
arena above the model, not twice the model. An arena lives as long as any block view of it (PyTorch keeps the
storage alive); the provider drops its own references at :meth:`HostBlockProvider.close` (and unregisters
``host_register`` arenas there, after the engine stopped copying from them).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from flextensor.runtime.heap import return_free_heap
from flextensor.runtime.packed_layout import (ALIGN, BlockLayout, TensorPlacement, block_view, block_views,
                                              pack_block, packed_stride)
from flextensor.shm.sizes import align_up

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.shm.owner import ShmOwner

__all__ = [
    "ALIGN",
    "TensorPlacement",
    "BlockLayout",
    "HostBlock",
    "HostBlockProvider",
    "PageableProvider",
    "TorchPinnedProvider",
    "HostRegisterProvider",
    "ShmProvider",
    "ArenaProvider",
    "ARENA_MAX_BYTES",
    "plan_arenas",
    "make_provider",
    "FillProgress",
    "PROGRESS_INTERVAL_S",
    "pack_block",
    "block_view",
    "block_views",
    "packed_stride",
]

logger = logging.getLogger(__name__)

PAGE = 4096
ARENA_MAX_BYTES = 2 << 30


# ----------------------------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class HostBlock:
    """An allocated host block. ``prefilled`` is True when it was attached with data already in it (an SHM
    follower): the engine must not copy weights into it. ``name`` is the SHM name, '' for private memory."""

    tensor: torch.Tensor
    name: str = ""
    prefilled: bool = False


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _greedy_groups(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Consecutive blocks packed (page-aligned) into groups of at most ``cap`` bytes; a larger block stands alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        size = align_up(size, PAGE)
        if current and used + size > cap:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        groups.append(current)
    return groups


def _group_bytes(sizes: Sequence[int], group: Sequence[int]) -> int:
    return sum(align_up(sizes[i], PAGE) for i in group)


def plan_arenas(sizes: Sequence[int], *, power_of_two: bool, max_arena_bytes: int = ARENA_MAX_BYTES) -> list[list[int]]:
    """Group block indices ``0..len(sizes)-1`` (consecutive, in order) into arenas.

    ``power_of_two=False`` (exact allocations): fill each arena up to ``max_arena_bytes``. ``power_of_two=True``
    (PyTorch's pinned allocator rounds each request up to a power of two): try every power-of-two arena cap up to
    ``max_arena_bytes`` and keep the grouping with the fewest bytes after rounding (ties: the smaller cap, i.e.
    less transient memory).
    """
    if not sizes:
        return []
    if not power_of_two:
        return _greedy_groups(sizes, max_arena_bytes)
    best: tuple[int, int, list[list[int]]] | None = None
    cap = _pow2_ceil(min(align_up(s, PAGE) for s in sizes))
    while True:
        groups = _greedy_groups(sizes, cap)
        cost = sum(_pow2_ceil(_group_bytes(sizes, g)) for g in groups)
        if best is None or cost < best[0]:
            best = (cost, cap, groups)
        if cap >= max_arena_bytes or len(groups) == 1:
            break
        cap *= 2
    return best[2]


class HostBlockProvider:
    """Allocates host blocks and frees/unpins them on :meth:`close`."""

    kind = "abstract"
    pinned = False

    def reserve(self, sizes: Sequence[int]) -> None:
        """Announce the sizes of blocks ``0..len(sizes)-1`` before they are allocated (default: ignored)."""

    def allocate(self, index: int, nbytes: int) -> HostBlock:  # pragma: no cover - interface
        raise NotImplementedError

    def pin_filled(self, between: Callable[[], None] | None = None) -> None:
        """The blocks allocated so far are filled and may be read from now on: pin them if pinning waits for the
        fill (default: nothing). ``between``, when given, runs between two driver calls that hold up the
        process's launches (a background build's pause)."""

    def finish(self, between: Callable[[], None] | None = None) -> None:
        """Every block was allocated and filled; the engine copies from them from now on (default:
        :meth:`pin_filled`)."""
        self.pin_filled(between)

    def release_block(self, index: int) -> None:
        """Block ``index`` is never read again (its tensors were copied out): the provider may free its memory
        once nothing else it allocated with it is in use (default: nothing until :meth:`close`). Lets a teardown
        that copies a model out of its blocks hold one copy plus an arena, not two copies."""

    def close(self) -> None:
        """Release what the provider holds (unpin, unmap). Tensors still viewing a block keep its memory."""


class ArenaProvider(HostBlockProvider):
    """Carves reserved blocks out of arenas (see "Arenas" in the module docstring); subclasses allocate arenas.

    A block that was not reserved (or is asked for with another size) gets an arena of its own.
    """

    power_of_two = False

    def __init__(self, *, max_arena_bytes: int | None = None) -> None:
        self.max_arena_bytes = ARENA_MAX_BYTES if max_arena_bytes is None else max_arena_bytes
        self._slots: dict[int, tuple[int, int, int]] = {}  # block index -> (group, byte offset, nbytes)
        self._group_bytes: list[int] = []
        self._arenas: dict[int, torch.Tensor] = {}
        self._extra: list[torch.Tensor] = []
        self._in_use: dict[int, set[int]] = {}  # group -> its blocks allocated and not yet released

    def reserve(self, sizes: Sequence[int]) -> None:
        self._slots, self._group_bytes = {}, []
        for group_index, group in enumerate(plan_arenas(sizes, power_of_two=self.power_of_two,
                                                        max_arena_bytes=self.max_arena_bytes)):
            offset = 0
            for index in group:
                self._slots[index] = (group_index, offset, int(sizes[index]))
                offset += align_up(int(sizes[index]), PAGE)
            self._group_bytes.append(offset)

    @property
    def arena_bytes(self) -> list[int]:
        """Bytes requested per arena allocated so far (reserved groups, then unreserved blocks)."""
        return [a.numel() for _, a in sorted(self._arenas.items())] + [a.numel() for a in self._extra]

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        # The engine dropped the previous blocks' source weights: hand their heap pages back before this block's
        # pages are touched, so the build holds one copy of the weights plus a block, not two copies.
        return_free_heap()
        slot = self._slots.get(index)
        if slot is None or slot[2] != nbytes:
            extra = self._new_arena(align_up(max(nbytes, 1), PAGE))
            self._extra.append(extra)
            return HostBlock(extra.narrow(0, 0, nbytes))
        group, offset, _ = slot
        arena = self._arenas.get(group)
        if arena is None:
            arena = self._arenas[group] = self._new_arena(self._group_bytes[group])
        self._in_use.setdefault(group, set()).add(index)
        return HostBlock(arena.narrow(0, offset, nbytes))

    def release_block(self, index: int) -> None:
        """Drop an arena once every block allocated in it was released (an unreserved block keeps its arena
        until :meth:`close`). Its memory goes back when the last view of it goes."""
        slot = self._slots.get(index)
        if slot is None or index not in self._in_use.get(slot[0], ()):
            return
        group = slot[0]
        self._in_use[group].discard(index)
        if not self._in_use[group]:
            del self._in_use[group]
            arena = self._arenas.pop(group, None)
            if arena is not None:
                self._free_arena(arena)

    def _free_arena(self, arena: torch.Tensor) -> None:
        """An arena leaves the provider (no block of it is read any more); subclasses undo what they did to it."""

    def _new_arena(self, nbytes: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        self._arenas.clear()
        self._extra.clear()
        self._slots.clear()
        self._in_use.clear()


class PageableProvider(ArenaProvider):
    kind = "pageable"

    def _new_arena(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


#: PyTorch's allocator setting that backs its pinned allocations with ``malloc`` + ``cudaHostRegister`` (pages
#: faulted in by 8 threads) instead of ``cudaHostAlloc``: still PyTorch's caching pinned allocator.
PINNED_REGISTER_SETTING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_allocator_hint_logged = False
_allocator_hint_lock = threading.Lock()  # two build threads may start their first arena together


def pinned_allocator_hint(environ: Any) -> str | None:
    """The advice :class:`TorchPinnedProvider` logs once per process, or None when the allocator is set up so.

    Why: by default a fresh pinned allocation is one ``cudaHostAlloc``, during which every CUDA launch of the
    process waits: a launch-bound pass on another thread takes as long as the allocation, which for an arena of
    gigabytes is most of a second; with :data:`PINNED_REGISTER_SETTING` the allocation is several times faster
    and that pass waits a fraction of it (``docs/benchmarks.md``, "Pinned host memory"). The background build of
    the INFERENCE host blocks makes such allocations while
    the first inference passes run. The setting is the process's, read when CUDA starts, so flextensor only
    says so instead of changing it.

    Read as PyTorch reads it: ``PYTORCH_CUDA_ALLOC_CONF`` when set (even empty), else ``PYTORCH_ALLOC_CONF``;
    comma-separated ``key:value`` pairs, whitespace ignored, the last value of a key counts. (A setting made at
    run time through ``torch.cuda.memory._set_allocator_settings`` is not seen.)
    """
    name = "PYTORCH_CUDA_ALLOC_CONF" if "PYTORCH_CUDA_ALLOC_CONF" in environ else "PYTORCH_ALLOC_CONF"
    conf = "".join((environ.get(name) or "").split())
    register = None
    for pair in conf.split(","):
        key, _, value = pair.partition(":")
        if key == "pinned_use_cuda_host_register":
            register = value
    if register == "True":
        return None
    return ("host blocks come from PyTorch's pinned allocator through cudaHostAlloc, which holds up every CUDA "
            "launch of this process while it runs (most of a second for an arena of a few GiB), so a background "
            f"build stalls the first inference passes; add {PINNED_REGISTER_SETTING} to {name} before the "
            "process starts, or use pinned_memory_mode='host_register'")


class TorchPinnedProvider(ArenaProvider):
    """PyTorch's caching pinned allocator (``pinned_memory_mode="torch"``), power-of-two aware arenas."""

    kind = "torch"
    pinned = True
    power_of_two = True

    def _new_arena(self, nbytes: int) -> torch.Tensor:
        global _allocator_hint_logged
        if not _allocator_hint_logged:  # on the build thread, once per process: see pinned_allocator_hint
            with _allocator_hint_lock:
                first, _allocator_hint_logged = not _allocator_hint_logged, True
            hint = pinned_allocator_hint(os.environ) if first else None
            if hint is not None:
                logger.info(hint)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostRegisterProvider(ArenaProvider):
    """Plain host arenas registered in place with ``cudaHostRegister``, block by block (exact size, no rounding).

    Registration waits for :meth:`finish` (the engine calls it once every block is filled): on fresh memory
    ``cudaHostRegister`` must fault in and zero every page itself, in one thread inside the driver; after the
    fill - a parallel copy that faults the pages in anyway - it only locks populated pages, which is much
    faster. Each block is registered on its own: every call holds a driver lock that the process's kernel
    launches wait for, so a block at a time, with ``between`` (a background build's pause) after each, holds a
    running forward up for one block's registration at most, where a whole arena in one call held it for all of
    the arena's registration. Arenas start
    on a page and blocks on page boundaries within them, so no two registrations share a page; every copy the
    loader makes reads one block, hence one registration.
    """

    kind = "host_register"
    pinned = True

    def __init__(self, *, max_arena_bytes: int | None = None) -> None:
        super().__init__(max_arena_bytes=max_arena_bytes)
        self._unregistered: list[torch.Tensor] = []  # allocated blocks, registered at finish()
        self._registered: list[tuple[int, torch.Tensor]] = []

    def _new_arena(self, nbytes: int) -> torch.Tensor:
        # Anonymous pages of their own: page-aligned, and the storage starts where block 0 does, so a block
        # view's is_pinned() (PyTorch asks about the storage's start) sees the registration.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        block = super().allocate(index, nbytes)
        self._unregistered.append(block.tensor)
        return block

    def pin_filled(self, between: Callable[[], None] | None = None) -> None:
        from flextensor.shm.pinning import host_register

        while self._unregistered:
            if between is not None and self._registered:
                between()
            block = self._unregistered[0]
            try:
                host_register(block.data_ptr(), block.numel())
            except RuntimeError:
                from flextensor.runtime.pinned.in_place import clear_cuda_error

                clear_cuda_error()  # the caller gets the exception; torch must not trip over the stale error later
                raise
            self._registered.append((block.data_ptr(), self._unregistered.pop(0)))

    def _free_arena(self, arena: torch.Tensor) -> None:
        """Unregister the arena's blocks before its memory can go (a registered range must not be unmapped)."""
        start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
        inside = [entry for entry in self._registered if start <= entry[0] < end]
        self._registered = [entry for entry in self._registered if not start <= entry[0] < end]
        self._unregistered = [t for t in self._unregistered if not start <= t.data_ptr() < end]
        self._unregister(inside)

    @staticmethod
    def _unregister(entries: list[tuple[int, torch.Tensor]]) -> None:
        from flextensor.shm.pinning import host_unregister

        for ptr, _tensor in reversed(entries):
            try:
                host_unregister(ptr)
            except RuntimeError as exc:  # teardown must go on; the process exit releases the pages anyway
                from flextensor.runtime.pinned.in_place import clear_cuda_error

                clear_cuda_error()
                logger.warning("could not unregister host block at %#x: %s", ptr, exc)

    def close(self) -> None:
        # The provider keeps a reference to every registered block, so the memory cannot be freed (and reused
        # by another allocation) while it is still registered.
        self._unregistered.clear()
        registered, self._registered = self._registered, []
        self._unregister(registered)
        super().close()


class ShmProvider(HostBlockProvider):
    """Host blocks in POSIX shared memory: every block a page-aligned range of one of the generation's arena
    parts (``flextensor.shm.blocks``).

    The creator of the sharing generation creates the arena (fresh blocks, ``prefilled=False``); a follower maps
    the creator's (``prefilled=True``: the weights are already there). Both happen in :meth:`reserve`, which
    gets every block size at once. When ``pin``, the creator registers each part once in :meth:`finish`, after
    the fill (pages populated); a follower registers right after mapping (nothing to fill).
    """

    kind = "shm"

    def __init__(self, owner: ShmOwner, *, pin: bool) -> None:
        from flextensor.shm.blocks import SharedBlockAllocator

        self.owner = owner
        self.pinned = pin
        self._allocator = SharedBlockAllocator(owner)
        self._parts: list[Any] = []
        self._views: list[torch.Tensor] = []
        self._ranges: list[tuple[Any, int, int]] = []  # each block's (part, offset, size)

    def reserve(self, sizes: Sequence[int]) -> None:
        if self._parts:
            raise RuntimeError(f"the shared host blocks of {self.owner.namespace!r} were already reserved")
        sizes = [int(n) for n in sizes]
        if not sizes:
            return
        from flextensor.shm.blocks import arena_layout

        creator = bool(self.owner.is_creator)
        layout = arena_layout(sizes, align=self.owner.block_alignment)  # once, for the segments and the views
        self._parts = self._allocator.create(layout) if creator else self._allocator.attach(layout)
        self._views = self._allocator.views(self._parts, layout)
        self._ranges = self._allocator.ranges(self._parts, layout)
        if self.pinned and not creator:  # the device only ever reads host blocks (host -> device copies)
            for part in self._parts:
                part.pin(read_only=True)

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        if not self._parts or not 0 <= index < len(self._views):
            raise RuntimeError(f"shared host block {index} was not reserved: call reserve() with every block size "
                               "first (the arena is laid out for all of them at once)")
        view = self._views[index]
        if view.numel() != nbytes:
            raise ValueError(f"shared host block {index} was reserved with {view.numel()} bytes, not {nbytes}")
        part, offset, _size = self._ranges[index]
        if self.owner.is_creator and not part.reserved:
            # An arena whose pages come as it is filled (a creator that frees its private weights meanwhile):
            # the previous blocks' sources are gone by now, so their heap pages go back to the OS before this
            # block's pages are taken (see flextensor.runtime.heap).
            return_free_heap()
            part.reserve_range(offset, nbytes)
        return HostBlock(view, name=part.name, prefilled=not self.owner.is_creator)

    def finish(self, between: Callable[[], None] | None = None) -> None:
        if self.pinned:
            for part in self._parts:
                if not part.pinned:
                    part.pin(read_only=True)

    def close(self) -> None:
        parts, self._parts = self._parts, []
        self._views, self._ranges = [], []
        for part in parts:
            try:
                # A pinned part is unregistered and unmapped on the release thread: unregistering GiBs takes the
                # driver seconds that close() and release() need not wait for (flextensor.shm.background_release).
                part.close(background=True)
            except Exception as exc:  # noqa: BLE001 - teardown goes on; the last participant unlinks the name
                logger.warning("could not close the shared host blocks %s: %s", getattr(part, "name", "?"), exc)


def make_provider(config: Any, device: torch.device, *, shm_owner: ShmOwner | None = None,
                  register_in_place: bool = False) -> HostBlockProvider:
    """The provider the config asks for. ``pinned_memory`` on a CPU compute device is refused earlier, at
    manager construction; here it can only mean CUDA.

    ``register_in_place``: pinned blocks are plain memory registered in place, block by block
    (:class:`HostRegisterProvider`), whatever ``pinned_memory_mode`` says. Two builds ask for it: one on a thread
    while inference runs (PyTorch's pinned allocator, ``pinned_memory_mode="torch"``, allocates with
    ``cudaHostAlloc``, which holds every kernel launch of the process until it returns), and one that reads a
    checkpoint (exact-size blocks, never rounded up to a power of two)."""
    pin = bool(config.pinned_memory) and device.type == "cuda"
    if config.shm_enabled:
        if shm_owner is None:
            raise RuntimeError(
                "shm_enabled=True needs a shared-memory owner for the host blocks; use SharedOffloadSession, or "
                "pass shm_owner (a ShmCoordinator's memory_owner) to OffloadManager.offload"
            )
        return ShmProvider(shm_owner, pin=pin)
    if not pin:
        return PageableProvider()
    if config.pinned_memory_mode == "host_register" or register_in_place:
        from flextensor.shm.pinning import cudart_available

        if cudart_available():
            return HostRegisterProvider()
        logger.warning(
            "registering host blocks in place (pinned_memory_mode='host_register', or a background build) needs "
            "the CUDA runtime binding torch.cuda.cudart(), which is unusable here; falling back to PyTorch's "
            "pinned allocator (tensor.pin_memory())"
        )
    return TorchPinnedProvider()


#: A host-block fill that runs longer than this logs its progress (bytes, rate) at this interval.
PROGRESS_INTERVAL_S = 2.0


class FillProgress:
    """Logs how far filling the host blocks got, so a multi-GiB publish is visibly alive (and how fast)."""

    def __init__(self, manager: str, total: int) -> None:
        self.manager, self.total, self.done = manager, total, 0
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self._log(now, "filling host blocks")

    def finish(self, between: Callable[[], None] | None = None) -> None:
        now = time.monotonic()
        if self.done and now - self.start >= PROGRESS_INTERVAL_S:  # nothing to say for prefilled blocks
            self._log(now, "filled host blocks")

    def _log(self, now: float, what: str) -> None:
        elapsed = max(now - self.start, 1e-9)
        logger.info("manager %r: %s: %.1f of %.1f MiB (%.0f%%) in %.1f s, %.2f GB/s", self.manager, what,
                    self.done / 2**20, self.total / 2**20, 100 * self.done / max(self.total, 1), elapsed,
                    self.done / elapsed / 1e9)
