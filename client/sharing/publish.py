"""A session creator's publish: the resident tensors into the store, the streamed ones into the arena, at memory
speed, before the engine adopts the plan over the filled blocks.

Why the session fills the blocks itself
---------------------------------------
The engine can fill host blocks from a model (a provider hands them out block by block), but then the way the
pages come, the copy and the CUDA registration of the creator's own mapping all happen inside the engine's build,
one after the other, at a fraction of memory speed. Here the session fills the arena and
the store itself and hands the engine the filled blocks (``host_blocks``, as a follower does), so:

- the arena's pages are allocated on threads ahead of the copy (:class:`~flextensor.shm.populate_ahead.PopulateAhead`,
  a worker per arena part: tmpfs allocates one file's pages under that file's locks, ``flextensor.shm.blocks``)
  when they could not be allocated ahead of time (a model built in RAM: see ``flextensor.sharing.creator_source``), and the
  copy is PyTorch's multi-threaded CPU copy, straight from each model tensor into its place in its block (on a
  tmpfs of huge pages, where allocating a page is cheap and the copy is the publish, whole pieces written into
  the segments' files on a thread per core instead, the store's and the arena's on one pool, nothing allocated
  ahead: ``flextensor.runtime.piece_copy``); the
  arena fills on a thread (``ft-publish-blocks``) while the store fills, for the same reason (a failure of either
  stops the other before its next block or record);
- the creator's mapping is registered with CUDA in the background after READY, block by block in schedule order,
  exactly like a follower's (``flextensor.shm.background_pin``), instead of inside the publish;
- the resident tensors are published from the host, before the engine moves them to the device, instead of being
  copied back from the device afterwards.

Memory: one copy plus a window
------------------------------
Each model tensor is pointed at its shared copy (its block view, or its store record) as soon as that copy is
made, which frees the private copy; pages ahead of the copy are bounded by :func:`populate_window`. The arena and
the store are allocated and copied in pieces (:func:`fill_piece`), and a tensor that nothing else reads gives its
private pages back behind its copy, piece by piece (``flextensor.runtime.source_pages``): so a creator whose
factory built the model in RAM holds one copy of the weights plus the windows and a piece of each (the arena's
and the store's fill run side by side), whatever the size of its blocks and tensors (a tensor something else
still reads counts whole until its copy ends). With a copy pool (a tmpfs of huge pages,
``flextensor.runtime.piece_copy``) nothing is allocated ahead: each piece's write allocates its pages and its
source's pages go back right after, so a creator holds one copy plus the pieces being written (a tensor
something else still reads counts whole until its block or record is all written: the pool holds up to a few
blocks queued, every arena part's file having pieces to write). A tensor
on ``meta`` (a checkpoint creator) gets its bytes from ``weights``: a checkpoint tensor's read is queued into its
place (``read_into``) and the queued reads run together, in file order, over several threads (:func:`read_queued`):
the store's once it is laid out, then every block's in one run on a thread (:class:`BlockReads`), the arena's
pages allocated by the reader a bounded distance ahead of its reads, so reading the checkpoint and allocating its
pages overlap, and the engine's adoption and the plan's publication overlap the reads. Everything is read before
READY.

Order (see ``flextensor.sharing.creator``)
------------------------------------------
store (records copied or read, model pointed at them; on CUDA its mapping then registered on a thread, so the
engine's move of the resident tensors to the device runs at pinned speed) -> arena, block by block in index order
(from a model in RAM: beside the store, from its start) -> the engine adopts the plan (``host_blocks``; resident
tensors to the device) -> plan, READY. From a
checkpoint the arena's reads run on their thread from the start of the adoption until just before READY (a copy
from a block during the adoption waits for them: :meth:`BlockReads.gate`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import msgspec
import torch

from flextensor.loading.checkpoint import populate_pages
from flextensor.engine.adoption import layouts_from_state
from flextensor.engine.hooks import assign_data
from flextensor.runtime.heap import return_free_heap
from flextensor.runtime.host_memory import BlockLayout, FillProgress, block_views
from flextensor.runtime.piece_copy import OPEN_BYTES, CopyPool, PieceCopier
from flextensor.runtime.source_pages import SourcePages, releasable
from flextensor.runtime.thread_join import join_through_interrupts
from flextensor.shm.blocks import ARENA_ALIGN, ArenaLayout, arena_layout
from flextensor.shm.manifest import DTYPE_SIZES
from flextensor.shm.owner import ShmOwner
from flextensor.shm.populate_ahead import PieceCursor, PopulateAhead, cut_into_pieces
from flextensor.shm.store_layout import StoreLayout, record_key, store_layout
from flextensor.shm.tensor_store import SharedTensorStore
from flextensor.state import ModelTensor, TensorManagerState

__all__ = ["POPULATE_AHEAD_BYTES", "POPULATE_AHEAD_MIN_BYTES", "FILL_PIECE_BYTES", "FILL_PIECE_MIN_BYTES",
           "STORE_PIN_MIN_BYTES", "PublishPlan", "plan_publish", "populate_window", "fill_piece", "block_pieces",
           "arena_plan", "plan_store_layout", "publish_store", "fill_blocks", "BlockReads",
           "read_queued", "BackgroundCall"]

logger = logging.getLogger(__name__)

#: The most bytes of pages allocated ahead of the copy (see :func:`populate_window`).
POPULATE_AHEAD_BYTES = 1 << 30
#: The fewest (a smaller segment is allocated whole ahead).
POPULATE_AHEAD_MIN_BYTES = 4 << 20
#: The largest piece in which the arena's pages are allocated and a private tensor's pages given back
#: (:func:`fill_piece`).
FILL_PIECE_BYTES = 32 << 20
#: The smallest such piece: a huge page.
FILL_PIECE_MIN_BYTES = 2 << 20
#: A smaller store is not registered with CUDA: moving its tensors to the device from pageable memory is cheaper.
STORE_PIN_MIN_BYTES = 64 << 20


def populate_window(total: int) -> int:
    """Bytes of pages that may be allocated ahead of the copy into segments of ``total`` bytes: 1/32 of them,
    at least :data:`POPULATE_AHEAD_MIN_BYTES` and at most :data:`POPULATE_AHEAD_BYTES` (never more than
    ``total``).

    Why: the pages ahead are what a creator whose model is in RAM holds beyond the model (its private pages go
    back behind the copy, :func:`fill_blocks`), so 1/32 keeps that near 3% of the model, and 1 GiB is a few
    blocks of any model. Allocating tmpfs pages is slower than copying into them and runs one file at a time
    under that file's locks, so the publish runs at the allocation rate of the parts that have pages in flight;
    a window of several blocks keeps several parts allocating at once (``flextensor.shm.blocks``). A range
    larger than the window (a large store record) is allocated only when its copy starts."""
    return max(1, min(total, POPULATE_AHEAD_BYTES, max(POPULATE_AHEAD_MIN_BYTES, total // 32)))


def fill_piece(window: int) -> int:
    """The piece in which the arena's pages are allocated and a private tensor's pages given back, for a
    ``window`` (:func:`populate_window`): a quarter of it, so pages are allocated for the next pieces while one
    is copied, in whole huge pages, from :data:`FILL_PIECE_MIN_BYTES` to :data:`FILL_PIECE_BYTES`. Beyond the
    model a creator then holds the window and one piece (with a copy pool, which allocates nothing ahead, the
    pieces being written)."""
    quarter = window // 4
    return max(FILL_PIECE_MIN_BYTES, min(FILL_PIECE_BYTES, quarter - quarter % FILL_PIECE_MIN_BYTES))


def arena_plan(state: TensorManagerState, names: Sequence[str], layout: ArenaLayout) -> TensorManagerState:
    """``state`` with every host block naming its arena part's segment (``names``, in part order, ``layout``'s
    parts): what the published plan says."""
    blocks = [msgspec.structs.replace(b, name=names[layout.parts[b.index]]) for b in state.blocks]
    return msgspec.structs.replace(state, blocks=blocks)


def plan_store_layout(state: TensorManagerState) -> StoreLayout:
    """The layout of the store that publishes ``state``'s resident tensors (``SharedTensorStore``'s, from the same
    keys and sizes: ``flextensor.shm.tensor_store.store_layout``), so its parts can be made ahead of the copy."""
    sizes = {}
    for t in state.tensors:
        if not t.offloaded:
            numel = 1
            for n in t.shape:
                numel *= n
            sizes[record_key((t.name, *t.aliases))] = numel * DTYPE_SIZES.get(t.dtype, 1)
    return store_layout(sizes)


@dataclass(frozen=True)
class PublishPlan:
    """What a creator derives from its profile before its model is built, once: the arena's blocks and their
    layout, the resident tensors and the store's parts (so both are sized and made ahead of the copy), where the
    engine computes and whether the shared memory is registered with CUDA there."""

    state: TensorManagerState
    layouts: list[BlockLayout]  # per host block: where each tensor lies in it (checked against the plan)
    arena: ArenaLayout
    resident: list[str]
    store: StoreLayout
    device: torch.device
    pin: bool

    @property
    def store_bytes(self) -> int:
        return sum(self.store.part_sizes)

    @property
    def shared_bytes(self) -> int:
        """Bytes of /dev/shm the publication takes (arena and store)."""
        return self.arena.total + self.store_bytes

    @property
    def segment_sizes(self) -> dict[str, int]:
        """Every segment to make ahead, by kind (``SharedMemoryOwner.prepare_segments``)."""
        return {**self.store.kinds, **(self.arena.kinds if self.layouts else {})}


def plan_publish(state: TensorManagerState, device: torch.device, *, pinned_memory: bool,
                 align: int = ARENA_ALIGN) -> PublishPlan:
    """The :class:`PublishPlan` of a profile ``state`` (its blocks, placements and schedule checked); the arena's
    blocks start on multiples of ``align`` (``ShmOwner.block_alignment``)."""
    return PublishPlan(state=state, layouts=layouts_from_state(state),
                       arena=arena_layout([b.nbytes for b in state.blocks], align=align),
                       resident=[t.name for t in state.tensors if not t.offloaded], store=plan_store_layout(state),
                       device=device, pin=pinned_memory and device.type == "cuda")


def _weight(weights: Mapping[str, Any] | None, names: Sequence[str], dtype: torch.dtype,
            shape: Sequence[int]) -> Any:
    """The supplied weight of a meta tensor (under any of its names), checked against its dtype and shape."""
    for key in names:
        if weights is not None and key in weights:
            value = weights[key]
            if value.dtype != dtype or tuple(value.shape) != tuple(shape):
                raise ValueError(f"weight {key!r} has dtype {value.dtype} shape {tuple(value.shape)}, but the model "
                                 f"expects {dtype} {tuple(shape)}")
            return value
    raise ValueError(f"tensor {names[0]!r} is on the meta device and no weight for it was supplied; pass "
                     "checkpoint= (or a creator factory that builds the model with its weights)")


def _write(view: torch.Tensor, value: Any) -> None:
    """Fill ``view`` from a tensor, or queue a checkpoint tensor's read into it (``read_into``)."""
    read_into = getattr(value, "read_into", None)
    if read_into is not None:
        read_into(view)
    else:
        view.copy_(value)


def publish_store(namespace: str, model: torch.nn.Module, names: Sequence[str], owner: ShmOwner,
                  weights: Mapping[str, Any] | None, *, window: int,
                  stop: Callable[[], BaseException | None] | None = None,
                  report: dict[str, float] | None = None, copy_pool: CopyPool | None = None) -> SharedTensorStore:
    """Publish ``names`` (the plan's resident tensors) into the store and point the model's host tensors at their
    shared copies, record by record (a tensor on a device is copied and left there). A record's pages come in
    pieces (:func:`fill_piece`) and a host tensor is copied piece by piece, giving its private pages back behind
    the copy where nothing else reads them, as the arena's (:func:`fill_blocks`); on ``copy_pool``'s threads
    when given, a record per batch (``flextensor.runtime.piece_copy``).

    ``stop`` is asked before each record: an error it returns (the arena's fill beside the store failed) is
    raised at once, so the publish fails without filling the rest of a store it would throw away. ``report``
    gets the bytes given back early (``store_released_early_bytes``) and the copy threads
    (``store_copy_threads``)."""
    if copy_pool is not None and weights is not None:
        raise ValueError("publish_store: a copy pool writes a model held in RAM; a checkpoint's weights are read "
                         "into place: pass copy_pool or weights, not both")
    released = 0
    copier = PieceCopier(copy_pool) if copy_pool is not None else None
    written: dict[int, Any] = {}  # id -> segment the copier wrote into (its pages then come from the writes)
    failure: BaseException | None = None

    def failed() -> bool:  # the arena's fill beside the store failed meanwhile
        nonlocal failure
        failure = stop() if stop is not None else None
        return failure is not None

    def fill(record: Any, view: torch.Tensor, source: torch.Tensor, pieces: PieceCursor) -> None:
        nonlocal released
        if failed():
            raise failure  # type: ignore[misc]
        if source.is_meta:
            pieces.wait_through(record.nbytes)
            _write(view, _weight(weights, record.all_names, source.dtype, source.shape))
        else:
            released += _copy_in_pieces(view, source, 0, pieces, copier)
            if pieces.segment is not None:
                written.setdefault(id(pieces.segment), pieces.segment)
            if source.device.type != "cpu":
                return
            if copier is not None:  # pointed at its shared copy once the record is copied
                copier.end_batch(lambda: assign_data(source, view))
                return
        assign_data(source, view)  # frees the private copy (its bytes, for a meta tensor, come at read_queued)

    store: SharedTensorStore | None = None
    try:
        try:
            store = SharedTensorStore.create_from_model(namespace, model, names=names, shm_owner=owner, fill=fill,
                                                        window=window, piece=fill_piece(window),
                                                        reserve_ahead=copier is None)
            if copier is not None:
                if not copier.drain(cancelled=failed):
                    raise failure  # type: ignore[misc]
                released += copier.released_bytes
                for segment in written.values():
                    _reserve_whole(segment)
        finally:
            if copier is not None:
                copier.close()  # nothing copies into the store any more, before it is closed after an error too
    except BaseException:
        if store is not None:
            store.close()
        raise
    if report is not None:
        report["store_released_early_bytes"] = float(released)
        report["store_copy_threads"] = float(copy_pool.threads if copy_pool is not None else 0)
    return store


def _reserve_whole(segment: Any) -> None:
    """Every page of a segment the copy pool wrote into allocated: the writes allocated the pages they touched,
    which on huge pages is all of them, but where tmpfs fell back to 4 KiB pages the gaps between blocks and a
    part's tail would stay holes that a follower's pre-fault allocates, a SIGBUS on a full directory. Reserving
    pages that are there already only looks them up."""
    segment.reserve_range(0, segment.size)


def block_pieces(sizes: Sequence[int], piece: int) -> list[list[tuple[int, int]]]:
    """Each block's ``[0, size)`` cut into pieces of at most ``piece`` bytes (the last one shorter)."""
    return [cut_into_pieces(size, piece) for size in sizes]


def _copy_in_pieces(view: torch.Tensor, tensor: torch.Tensor, offset: int, pieces: PieceCursor,
                    copier: PieceCopier | None = None) -> int:
    """Copy ``tensor`` into ``view`` (its place at block byte ``offset``) piece by piece, each piece once its pages
    are allocated, giving the tensor's private pages back behind the copy where nothing else can read them
    (``flextensor.runtime.source_pages``). Returns the bytes given back.

    With a ``copier`` a host tensor's pieces are queued in its current batch instead, to be written into the
    file of the segment ``pieces`` lies in (``flextensor.runtime.piece_copy``: the copier counts what they give
    back), each reported written once queued, and the caller points the model at ``view`` only once the batch
    is written (until then the tensor must stay as it is). Nothing is reserved ahead of a copier (its writes
    allocate the pages), so anything else stored through ``view`` reserves its pages first."""
    nbytes = view.numel() * view.element_size()
    release = SourcePages(tensor) if releasable(tensor) else None  # asked before detach() makes an alias
    source = tensor.detach()
    whole = bool(nbytes) and source.is_contiguous() and view.is_contiguous()
    if copier is not None:
        assert pieces.segment is not None, "a copier writes into the segment's file: the cursor must name it"
        if whole and source.device.type == "cpu":
            for lo, hi in pieces.spans(offset, offset + nbytes):
                pieces.wait_through(hi)
                copier.write(pieces.segment, pieces.start + lo, source.data_ptr() + lo - offset, hi - lo,
                             release=release, offset=lo - offset, keep=source)
                pieces.written_through(hi)
            return 0
        if nbytes:  # stored through the view below, and nothing is reserved ahead of a copier
            pieces.segment.reserve_range(pieces.start + offset, nbytes)
    if not whole:
        pieces.wait_through(offset + nbytes)
        view.copy_(source)
        return 0
    into, out_of = view.view(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
    for lo, hi in pieces.spans(offset, offset + nbytes):
        pieces.wait_through(hi)
        into[lo - offset:hi - offset].copy_(out_of[lo - offset:hi - offset])
        if release is not None:
            release.through(hi - offset)
        pieces.written_through(hi)
    return release.released_bytes if release is not None else 0


def _populate_workers(parts: int, window: int, piece: int) -> int:
    """Threads that allocate the arena's pieces ahead of the copy: one per piece the window holds (at most two per
    core), and at least one per part. Why so many: the pieces ahead are the next blocks' pieces in order, a block's
    in one part, and tmpfs allocates one file's pages a few threads at a time but different files side by side;
    with a worker per part only, the window's first block would hold every worker, one file at a time."""
    return max(parts, min(window // piece, 2 * (os.cpu_count() or 1)))


def fill_blocks(tensors: Mapping[str, ModelTensor], layouts: Sequence[BlockLayout], blocks: Sequence[torch.Tensor],
                arenas: Sequence[Any], layout: ArenaLayout, weights: Mapping[str, Any] | None, *, label: str,
                cancel: threading.Event | None = None, copy_pool: CopyPool | None = None) -> dict[str, float]:
    """Copy every streamed tensor into its place in its block (``blocks``: views of the arena's parts ``arenas``
    laid out by ``layout``), block by block in index order, pointing each model tensor at its place as soon as it
    is copied.

    Pages not allocated yet come a window ahead of the copy (:func:`populate_window`), in pieces
    (:func:`fill_piece`), on several threads (consecutive blocks lie in different parts, whose pages are
    allocated in parallel: see ``flextensor.shm.blocks`` and :func:`_populate_workers`); each tensor is copied
    piece by piece and its private pages go back behind the copy where nothing else can read them, so beyond the
    model the creator holds the window and about a piece (a whole tensor where its pages cannot go back early).
    With a ``copy_pool`` a host tensor's pieces are written into the parts' files on its threads, a block per
    batch (``flextensor.runtime.piece_copy``), and the block's model tensors are pointed at their places once it
    is written. Returns seconds spent waiting for pages, the allocating threads'
    seconds, the bytes given back early and the copy threads; stops before the next block once ``cancel`` is set
    (the caller failed elsewhere). (A checkpoint's reads go through :class:`BlockReads`.)"""
    if copy_pool is not None and weights is not None:
        raise ValueError("fill_blocks: a copy pool writes a model held in RAM; a checkpoint's weights are read into "
                         "place: pass copy_pool or weights, not both")
    populate = None
    window = populate_window(layout.total)
    piece = fill_piece(window)
    bounds = block_pieces([b.nbytes for b in layouts], piece)
    first = [0]
    for block_bounds in bounds:
        first.append(first[-1] + len(block_bounds))
    if not all(arena.reserved for arena in arenas) and layouts and copy_pool is None:  # the pool's writes allocate
        ranges = [(arenas[layout.parts[b.index]], layout.offsets[b.index] + lo, hi - lo)
                  for b, block_bounds in zip(layouts, bounds) for lo, hi in block_bounds]
        workers = _populate_workers(len(arenas), window, piece)
        populate = PopulateAhead(ranges, window=window, workers=workers).start()
    copier = None
    if copy_pool is not None and layouts:  # enough blocks queued for every part's file to have pieces
        queued = len(layout.part_sizes) * max(b.nbytes for b in layouts)
        copier = PieceCopier(copy_pool, open_bytes=max(OPEN_BYTES, queued))
    progress = FillProgress(label, sum(p.nbytes for block in layouts for p in block.tensors))
    released = 0

    def point_at_copies(copied: list[tuple[torch.Tensor, Any]]) -> None:
        for tensor, view in copied:
            assign_data(tensor, view)  # frees the private copy (what is left of it)
            progress.add(view.nbytes)
        copied.clear()

    def block_done(copied: list[tuple[torch.Tensor, Any]]) -> None:
        point_at_copies(copied)  # a batch copied on the pool's threads (here: each tensor was, as it was copied)
        if populate is not None:
            return_free_heap()  # the private copies just freed go back before more pages are taken

    try:
        for k, (block_layout, block) in enumerate(zip(layouts, blocks)):
            if cancel is not None and cancel.is_set():
                return {}
            part = layout.parts[block_layout.index]
            pieces = PieceCursor(populate, first[k], bounds[k], segment=arenas[part],
                                 start=layout.offsets[block_layout.index])
            copied: list[tuple[torch.Tensor, Any]] = []
            for placement, view in zip(block_layout.tensors, block_views(block, block_layout.tensors)):
                entry = tensors[placement.name]
                tensor = entry.tensor
                end = placement.byte_offset + placement.nbytes
                if tensor.is_meta:  # a weight supplied as a tensor (the engine points the model at the view)
                    pieces.wait_through(end)
                    _write(view, _weight(weights, (entry.name, *entry.aliases), placement.dtype, placement.shape))
                    progress.add(placement.nbytes)
                else:
                    released += _copy_in_pieces(view, tensor, placement.byte_offset, pieces, copier)
                    copied.append((tensor, view))  # pointed at its place now, or once its batch is copied
                    if copier is None:
                        point_at_copies(copied)
                pieces.written_through(end)
            # Every page of the block is allocated, padding included (on the pool, by its writes, and the gaps
            # between blocks once every block is written: _reserve_whole).
            pieces.wait_through(block_layout.nbytes)
            pieces.written_through(block_layout.nbytes)  # in order: the next block's pieces come after these
            if copier is None:
                block_done(copied)
            else:
                copier.end_batch(lambda c=copied: block_done(c))
        if copier is not None:
            if not copier.drain(cancelled=None if cancel is None else cancel.is_set):
                return {}
            released += copier.released_bytes
            for arena in arenas:
                _reserve_whole(arena)
        progress.finish()
    finally:
        if copier is not None:
            copier.close()  # nothing copies once the caller goes on (after an error too)
        if populate is not None:
            populate.close()
    return {"populate_wait_s": populate.waited_s if populate else 0.0,
            "populate_s": populate.populate_s if populate else 0.0, "released_early_bytes": float(released),
            "copy_threads": float(copier.pool.threads if copier is not None else 0)}


class BlockReads:
    """Every streamed tensor read from the checkpoint into its place in its block, on a thread of its own
    (``ft-publish-read``), so that the engine's adoption and the plan's publication overlap the reads.

    Made on the caller's thread, it queues the reads (``weights``: a ``flextensor.loading.checkpoint.CheckpointWeights``)
    and takes them out of ``weights`` (``ReadPlan.detach``: a flush by the engine's adoption finds nothing left);
    a tensor the model already holds (not from the checkpoint) is copied now, and so is a strided place (read into
    a temporary first), their pages allocated before. The model's meta tensors are pointed at their places by the
    engine's adoption; a copy from block ``i`` waits for the reads through :meth:`gate`.

    Why one run of the reader for every block: reads in batches wait for the slowest range of each batch and let
    the disk's queue drain between them, and nothing here needs a bound on pages ahead of the reads (every page of
    the arena is written, there is no private copy to free meanwhile). The arena's pages are allocated by the
    reader ahead of its reads through the arena's ``reserve_range``, so a full ``/dev/shm`` is a
    ``ShmSpaceError`` naming the segment. :meth:`wait` joins the thread and raises its error; :meth:`stop`
    (always call it, also after an error elsewhere) cancels what is left and joins, so no thread writes into the
    arena once the caller cleans up."""

    def __init__(self, tensors: Mapping[str, ModelTensor], layouts: Sequence[BlockLayout],
                 blocks: Sequence[torch.Tensor], arenas: Sequence[Any], layout: ArenaLayout, weights: Any) -> None:
        for block_layout, block in zip(layouts, blocks):
            for placement, view in zip(block_layout.tensors, block_views(block, block_layout.tensors)):
                entry = tensors[placement.name]
                tensor = entry.tensor
                if not tensor.is_meta or not view.is_contiguous():  # written by a copy: its pages come first
                    arenas[layout.parts[block_layout.index]].reserve_range(
                        layout.offsets[block_layout.index] + placement.byte_offset, placement.nbytes)
                if tensor.is_meta:
                    _write(view, _weight(weights, (entry.name, *entry.aliases), placement.dtype, placement.shape))
                else:
                    view.copy_(tensor.detach())
                    assign_data(tensor, view)
        self._plan = weights.plan.detach()
        self._arenas = list(arenas)
        self.error: BaseException | None = None
        self.stats: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ft-publish-read", daemon=True)

    def start(self) -> "BlockReads":
        self._thread.start()
        return self

    def _run(self) -> None:
        arenas = self._arenas
        reserved = all(arena.reserved for arena in arenas)

        def reserve_in_arena(address: int, nbytes: int) -> bool | None:
            for arena in arenas:
                if arena.address <= address and address + nbytes <= arena.address + arena.size:
                    arena.reserve_range(address - arena.address, nbytes)
                    return None
            return populate_pages(address, nbytes)  # the reader's temporary for a strided place

        populate = None if reserved else reserve_in_arena

        try:
            try:
                stats = self._plan.read(populate=populate)
            except OSError as exc:
                if exc.errno == errno.EFAULT and not reserved:
                    # A read reached pages that could not be allocated before the populating thread did: name
                    # the cause (a full /dev/shm raises ShmSpaceError here) rather than "Bad address".
                    for arena in arenas:
                        arena.reserve_range(0, arena.size)
                raise
            self.stats = {"read_s": stats.read_s, "read_bytes": float(stats.nbytes), "populate_s": stats.populate_s,
                          "populated_bytes": float(stats.populated_bytes)}
        except BaseException as exc:  # noqa: BLE001 - raised by wait() on the caller's thread
            self.error = exc
        finally:
            self._done.set()

    def gate(self, then: Callable[[int], None] | None) -> Callable[[int], None]:
        """A host-block gate that waits for the reads, then for ``then`` (the registration's gate, if any)."""
        def wait(block: int) -> None:
            self._done.wait()
            if then is not None:
                then(block)
        return wait

    def wait(self) -> dict[str, float]:
        """Join the reads; raise their error, else return their seconds and bytes (read and populated ahead)."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.stats

    def stop(self) -> None:
        """Cancel the reads not started yet and join the thread. Idempotent."""
        if not self._done.is_set():
            self._plan.cancel()
        if self._thread.ident is not None:
            self._thread.join()


def read_queued(weights: Mapping[str, Any] | None) -> None:
    """Run the checkpoint reads queued into the store and the blocks (all together, file order)."""
    flush = getattr(weights, "flush", None)
    if flush is not None:
        flush()


class BackgroundCall:
    """One call on a thread of its own (``name``); :meth:`join` returns its error, if any.

    The creator fills the arena this way while it fills the store, and registers the store's mapping while the
    arena fills; on CUDA the thread makes the caller's device current first."""

    def __init__(self, call: Callable[[], None], *, device: int | None = None, name: str = "ft-publish-pin",
                 cancel: threading.Event | None = None) -> None:
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._call, self._device, self._cancel = call, device, cancel
        self._done = threading.Event()  # set as the call returns (see flextensor.runtime.thread_join)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            self._call()
        except BaseException as exc:  # noqa: BLE001 - returned by join()
            self.error = exc
        finally:
            self.seconds = time.monotonic() - start
            self._done.set()

    def failure(self) -> BaseException | None:
        """The call's error once it failed; None while it runs or after it succeeded (a look, no wait)."""
        return self.error

    def join(self) -> BaseException | None:
        """Wait for the call, even through an interrupt (which sets ``cancel``, then is re-raised once the thread
        ended): nothing may be cleaned up while the call still writes into it."""
        join_through_interrupts(self._thread, self._done, self._cancel)
        return self.error
