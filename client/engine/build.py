"""Plan -> host blocks + block loader: the INFERENCE build, now or on a thread behind resident inference.

The build (:func:`build_inference`, shared with adoption)
----------------------------------------------------------
It first ends a resident warm-up (the device copies of the tensors about to be offloaded are freed before any
device block exists, the tensors that stay resident keep their warm-up copy), then allocates or adopts host
blocks, copies weights in (from the model, or ``weights`` for meta tensors) unless a block is prefilled, points
each offloaded parameter at its host view (freeing the original storage), moves every other tensor to the
compute device, and creates the loader (:class:`~flextensor.runtime.loaders.block_loader.BlockLoader`, or
:class:`~flextensor.runtime.loaders.arena_loader.ArenaLoader` for ``raw_block_transfer``). Traps that never ran during
warm-up are not in the schedule, so their tensors stay resident. The provider (``EngineContext.provider_factory``)
is told every block size first (``reserve``), so pinned providers carve blocks out of a few arenas; a trap's
staged storages are unregistered and dropped as soon as its block is filled, so the original copy is freed
block by block. No staging registration outlives the build. The engine never joins a shared-memory namespace
itself: a shared provider comes from whoever holds the membership (the session).

Note [CPU in place]
-------------------
When the compute device is the CPU, the host blocks are in the memory the CPU computes from: every offloaded
tensor stays a view of its host block (of the shared arena, for a session's workers), and INFERENCE has no
loader, no rotating blocks and no per-pass copies; its traps call their forwards directly. A shared block is
then read by every worker in place, so N CPU workers pay for one copy of the offloaded weights, not N copies of
the rotating blocks. Outputs are bit-identical: the same kernels read the same bytes. (``EnginePolicy.stream_on_cpu``
makes a CPU stream through the loader as a GPU does, so tests on hosts without CUDA still run that path.)

The deferred build: why
-----------------------
At the end of PROFILING the plan is known, but the host blocks it streams from do not exist yet: they must be
allocated (PyTorch's pinned allocator: ``cudaHostAlloc``, which allocates, zeroes and locks, far slower than a
copy: seconds for a model of a few GiB the first time in a process) and filled. Doing that inside the last
profiling pass made the profile phase cost up to many times its ordinary forwards (``docs/benchmarks.md``,
"Pinned host memory"). After a *resident*
warm-up, though, every weight is already on the device: the model can run inference as it is, resident, while a
thread builds the host blocks. So the switch to INFERENCE is immediate, and the engine starts streaming at the
first pass boundary after the blocks are ready.

When (:func:`enter_inference` decides with :func:`can_defer`)
-------------------------------------------------------------
The blocks are private (not shared memory: a shared block is published by the creator synchronously), no meta
tensor is involved, and either

- the warm-up kept a device copy of every tensor the plan streams (resident warm-up, no fall-back). That includes
  a plan that streams nothing: its build makes no block but still unregisters the staged originals off the
  caller's thread; or
- the warm-up streamed (*stream* mode, or a resident one that fell back): every streamed tensor still holds its
  host original, and host RAM has room for an arena beside them (:data:`DEFER_HOST_MARGIN`). Until the blocks
  are installed, each streamed trap's weights are copied per call by the warm loader, exactly as in the
  PROFILING passes (``DeferredPlan.copied``); as each block is filled, its trap's tensors move onto it and the
  originals go (Note [sources handed over block by block] in ``flextensor.runtime.host_block_build``), so host
  RAM never holds both copies. Built synchronously instead, the blocks of a 24 GiB model held the last
  PROFILING pass for seconds.

Otherwise the build runs synchronously (:func:`build_inference`); a large one registers plain memory in place
(:data:`IN_PLACE_MIN_BYTES`) instead of allocating from PyTorch's pinned allocator.

Sequence and threads
--------------------
1. Main thread, at the switch (:func:`defer_inference`): the tensors that stay resident keep their warm-up copy
   (committed); the streamed ones keep theirs too for now, and their host data (the staged originals, pinned in
   place) is handed to the build. The phase becomes INFERENCE with no loader and no block map, so traps run on the
   device data they hold. The build thread starts when the first INFERENCE pass begins (or when something
   waits for the blocks): started inside the last PROFILING pass, its first pinned allocations held that pass
   up in the driver, and a process that only profiles and saves never needs the blocks' memory that soon.
2. Build thread (``ft-host-blocks``), :class:`HostBlockBuild`: reserve every block size with the provider, then
   block by block: allocate, copy each tensor from its host data, drop those sources and release their staging
   registration (so host RAM holds the originals and the blocks for about one arena at a time, as in the
   synchronous build; after a stream-mode warm-up the block is pinned and its tensors handed over first), region by
   region with a pause between (``UNREGISTER_PAUSE_S``; none once cancelled); finally ``provider.finish()``, which registers the filled blocks in place one at a time with the same
   pause between. On CUDA the thread first makes the manager's device current. Its pinned memory never comes
   from PyTorch's pinned allocator, whatever ``pinned_memory_mode``: each fresh arena there is one
   ``cudaHostAlloc``, which holds up every launch of the process while it runs, so the first inference passes
   stalled for it (``make_provider(..., register_in_place=True)``).
3. Main thread, at the start of the first pass after the build finished (``InferenceHandler.begin_pass``), or at any
   call that needs the INFERENCE layout (``export_state``, ``get_gpu_memory_usage``, ``offloaded_tensors``,
   ``loader``, ``save_profile``: they wait for the build): :func:`install_deferred` points every streamed tensor
   at its host view (its device copy is freed before the rotating device blocks are allocated), creates the
   loader and returns the cached device memory. Originals the hand-over had to leave (a wait for the build from
   inside a trap's call) are read no more: their registrations are released on a thread
   (``PinnedStaging.release_later``), which frees them. A build failure is raised there, naming the cause.
4. ``release()`` while the build runs: :meth:`HostBlockBuild.cancel` stops it after the block in flight and joins
   it; the provider is closed; the tensors still hold their device copies, which teardown moves back (or drops
   to ``meta`` with ``preserve_model=False``). After a failed build the same holds: the failure already closed
   the provider and unregistered the staging, and the model ran on resident (after a stream-mode warm-up: on
   copies per call, from the originals).
5. Offload timing (``offload_timing="eager"``) records no pass that ran before the switch: those passes stream
   nothing, and a report mixing them with streamed passes would say nothing true about either.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

from flextensor.engine.context import DeferredPlan, block_loader
from flextensor.engine.function_traps import build_indirect
from flextensor.engine.hooks import assign_data, bypass_resident_traps
from flextensor.engine.replan import attach_probe
from flextensor.runtime.host_block_build import HostBlockBuild, SourceHandover
from flextensor.runtime.host_memory import ARENA_MAX_BYTES, BlockLayout, FillProgress, HostBlock, block_view, block_views
from flextensor.runtime.sweep import device_memory

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.switch import Plan

__all__ = ["Weight", "build_inference", "bypass_untimed_traps", "can_defer", "defer_inference", "enter_inference",
           "install_deferred", "start_loader"]

logger = logging.getLogger("flextensor.manager")

#: A synchronous build of at least this many block bytes registers plain memory in place, whatever
#: ``pinned_memory_mode``: PyTorch's pinned allocator allocates each fresh arena with ``cudaHostAlloc``, which
#: allocates, zeroes and locks far slower than a copy runs, where filling fresh memory and registering it
#: (``cudaHostRegister`` of populated pages) costs a fraction of that (``docs/benchmarks.md``, "Pinned host
#: memory"). Smaller
#: builds keep the pinned allocator, whose cache serves a later build in the same process for free.
IN_PLACE_MIN_BYTES = 1 << 30
#: Host RAM left free when a build after a stream-mode warm-up is deferred: an arena in the making and the
#: originals it is filled from coexist, so it must fit in the available memory less this much (or a tenth of
#: it, when more); otherwise the build runs synchronously, freeing the originals block by block.
DEFER_HOST_MARGIN = 1 << 30


class Weight(Protocol):
    """A ``weights=`` value, the source of a tensor on ``meta``: a tensor, or a checkpoint tensor read lazily
    (``flextensor.loading.checkpoint.CheckpointTensor``, whose read :func:`_copy_weight` queues into the host block)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> torch.Size: ...

    def to(self, device: torch.device) -> torch.Tensor: ...


def enter_inference(ctx: EngineContext, plan: Plan) -> None:
    """Build INFERENCE for ``plan``: behind resident inference when every streamed weight is still on the device
    (:func:`can_defer`), else now."""
    layouts = list(plan.layouts)
    if ctx.function_traps is not None:  # profile_mode="torch_function": no host blocks to build
        build_indirect(ctx, layouts, list(plan.schedule), plan.num_slots)
    elif can_defer(ctx, layouts):
        defer_inference(ctx, layouts, list(plan.schedule), plan.num_slots)
    else:
        build_inference(ctx, layouts, list(plan.schedule), plan.num_slots)


def bypass_untimed_traps(ctx: EngineContext, streamed: set[str]) -> None:
    """Module traps outside ``streamed`` call their forwards directly, unless offload timing times every call."""
    if ctx.timing is None:  # offload timing times every trap call
        bypass_resident_traps(ctx.traps.values(), streamed)


def _lookup_weight(ctx, name: str, weights: Mapping[str, Weight] | None) -> Weight:
    entry = ctx.tensors[name]
    if weights is not None:
        for key in (name, *entry.aliases):
            if key in weights:
                value = weights[key]
                if value.dtype != entry.tensor.dtype or tuple(value.shape) != tuple(entry.tensor.shape):
                    raise ValueError(
                        f"weight {key!r} has dtype {value.dtype} shape {tuple(value.shape)}, but the model "
                        f"expects {entry.tensor.dtype} {tuple(entry.tensor.shape)}"
                    )
                return value
    raise ValueError(
        f"tensor {name!r} is on the meta device and no weight for it was supplied; pass weights={{name: tensor}} "
        "(e.g. safetensors.torch.load_file(...)) or materialize the model first"
    )


def _copy_weight(view: torch.Tensor, source) -> None:
    """Fill one host-block view. A lazily read weight (``flextensor.loading.checkpoint.CheckpointTensor``) queues a read
    straight into the view instead: the checkpoint is read once, into the block, with no staging copy."""
    read_into = getattr(source, "read_into", None)
    if read_into is not None:
        read_into(view)
    else:
        view.copy_(source)


def _flush_weights(weights: Mapping[str, Weight] | None) -> None:
    """Finish the queued checkpoint reads (``flextensor.loading.checkpoint.CheckpointWeights.flush``) before the blocks are
    pinned or read: every block exists by now, so the reads run together, in file order."""
    flush = getattr(weights, "flush", None)
    if flush is not None:
        flush()


def build_inference(
    ctx: EngineContext,
    layouts: list[BlockLayout],
    schedule: list[str],
    num_slots: int,
    host_blocks: Sequence[torch.Tensor] | None = None,
    weights: Mapping[str, Weight] | None = None,
    block_names: Sequence[str] | None = None,
    host_block_gate: Callable[[int], None] | None = None,
) -> None:
    """Host blocks for ``layouts`` (the provider's, or ``host_blocks`` given prefilled), tensors pointed at them,
    everything else on the device, then the loader (see the module docstring)."""
    _settle_warmup(ctx, {p.name for layout in layouts for p in layout.tensors})
    if host_blocks is None and layouts:
        _check_host_memory(ctx, layouts)
        # Blocks read from a checkpoint have no tensor to pin_memory(): they are registered in place at their
        # exact size, never rounded up by PyTorch's pinned allocator (up to 2x the model's host RAM); so are
        # large blocks (IN_PLACE_MIN_BYTES).
        large = sum(layout.nbytes for layout in layouts) >= IN_PLACE_MIN_BYTES  # see IN_PLACE_MIN_BYTES
        ctx.inference.provider = ctx.provider_factory(register_in_place=weights is not None or large)
        ctx.inference.provider.reserve([layout.nbytes for layout in layouts])
    blocks: list[HostBlock] = []
    ctx.inference.host_blocks = blocks  # filled as we go: on a failure, teardown finds every block in use
    progress = FillProgress(ctx.name, sum(p.nbytes for layout in layouts for p in layout.tensors))
    for layout in layouts:
        if host_blocks is not None:
            name = block_names[layout.index] if block_names else ""
            block = HostBlock(host_blocks[layout.index], name=name, prefilled=True)
        else:
            assert ctx.inference.provider is not None
            block = ctx.inference.provider.allocate(layout.index, layout.nbytes)
        blocks.append(block)
        for placement, view in zip(layout.tensors, block_views(block.tensor, layout.tensors)):
            tensor = ctx.tensors[placement.name].tensor
            if not block.prefilled:
                source = _lookup_weight(ctx, placement.name, weights) if tensor.is_meta else tensor.data
                _copy_weight(view, source)
                progress.add(placement.nbytes)
            assign_data(tensor, view)
            ctx.inference.placement[placement.name] = (layout.index, placement)
        ctx.warm.staging.release(p.name for p in layout.tensors)  # this block is filled: its sources may go
    _flush_weights(weights)
    progress.finish()
    if ctx.inference.provider is not None:
        ctx.inference.provider.finish()  # e.g. host_register pins the filled (populated) arenas now
    for name, entry in ctx.tensors.items():
        if name in ctx.inference.placement:
            continue
        if entry.tensor.is_meta:
            assign_data(entry.tensor, _lookup_weight(ctx, name, weights).to(ctx.device))
        else:
            ctx.to_device(entry.tensor)
    start_loader(ctx, layouts, blocks, schedule, num_slots, host_block_gate)


def _check_host_memory(ctx: EngineContext, layouts: Sequence[BlockLayout]) -> None:
    """Refuse a build whose host blocks would not fit in host RAM, before any is allocated.

    Blocks filled from host tensors replace them block by block (about one arena on top at most); blocks filled
    from device tensors (a model on the GPU) or from a checkpoint (meta tensors) are new host memory, all of it."""
    from flextensor.shm.preflight import check_host_memory

    sources = ((p.nbytes, ctx.tensors[p.name].tensor) for layout in layouts for p in layout.tensors)
    new = sum(nbytes for nbytes, tensor in sources if tensor.is_meta or tensor.device.type != "cpu")
    check_host_memory(
        f"manager {ctx.name!r}: building the host blocks of {len(layouts)} offloaded traps", new,
        "Free host RAM (other jobs, the page cache of files no longer needed), offload fewer layers "
        "(include_patterns / exclude_patterns, a larger max_gpu_mem_fraction), or run on a host with more RAM.")


def start_loader(ctx: EngineContext, layouts: list[BlockLayout], blocks: list[HostBlock], schedule: list[str],
                 num_slots: int, host_block_gate: Callable[[int], None] | None = None, *,
                 release_staging: bool = True) -> None:
    """The last step of every INFERENCE build: host blocks in place, tensors pointed at them; create the loader
    (none on a CPU compute device: Note [CPU in place]). ``release_staging=False``: the caller already handed the
    staged originals to a background release."""
    block_of = {layout.label: layout.index for layout in layouts}
    ctx.inference.layouts = layouts
    ctx.inference.host_blocks = blocks
    if release_staging:
        ctx.warm.staging.release_all()
    loader_schedule = [block_of[label] for label in schedule if label in block_of]
    missing = [layout.label for layout in layouts if layout.index not in loader_schedule]
    if missing:
        raise ValueError(f"offloaded trap(s) {missing} never appear in the trap schedule {schedule}")
    ctx.sequence = list(schedule)
    if ctx.in_place:
        ctx.inference.block_of = {}
        bypass_untimed_traps(ctx, set())
        return
    ctx.inference.block_of = block_of
    _read_state_dict_from_host_blocks(ctx)
    ctx.inference.loader = block_loader(ctx, layouts, blocks, loader_schedule, num_slots,
                                        small_slot=ctx.plan.small_slot, host_block_gate=host_block_gate)
    bypass_untimed_traps(ctx, set(block_of))
    attach_probe(ctx)  # latency mode: stalls on copies arm a replan (Note [replanning] in flextensor.engine.replan)


def _read_state_dict_from_host_blocks(ctx: EngineContext) -> None:
    """Between passes a streamed parameter points at a rotating device block, which holds whichever trap ran in
    it last: ``state_dict()`` (and ``save_pretrained``, which reads it) gets each streamed tensor's host view
    instead, under its name and its tied aliases. The hook goes at teardown."""
    placement, blocks, tensors = ctx.inference.placement, ctx.inference.host_blocks, ctx.tensors
    keys = {key: name for name in placement for key in (name, *tensors[name].aliases)}

    def host_values(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for key, name in keys.items():
            if prefix + key in state_dict:
                index, place = placement[name]
                state_dict[prefix + key] = block_view(blocks[index].tensor, place)

    ctx.inference.state_dict_hook = ctx.model.register_state_dict_post_hook(host_values)


def _settle_warmup(ctx: EngineContext, placed: set[str]) -> None:
    """End of a resident warm-up, before any host or device block exists.

    Tensors packed into host blocks get their host data back (their blocks are filled from it) and their
    warm-up device copies are freed now, so device memory never holds both the warm-up copies and the rotating
    device blocks; the other kept tensors stay resident and keep their warm-up copy (no second copy). The freed
    copies are handed back to the driver (``empty_cache``) once: they can be GiBs that other processes, or this
    device's free-memory readings, should see again.
    """
    ctx.warm.loader.unload()
    freed = ctx.warm.loader.restore([ctx.tensors[n].tensor for n in sorted(placed)])
    debug = logger.isEnabledFor(logging.DEBUG)
    kept = ctx.warm.loader.commit(count=debug)
    if freed and ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    if debug and (freed or kept):
        logger.debug("manager %r: warm-up copies freed: %d bytes (offloaded); kept as resident: %d bytes", ctx.name,
                     freed, kept)


def can_defer(ctx: EngineContext, layouts: Sequence[BlockLayout]) -> bool:
    """True when the build can run behind the first inference passes (see "When" in the module docs).

    After a resident warm-up: every streamed tensor holds a kept warm-up copy. Also with nothing to stream (no
    layouts): the build then has no block to make, but it still unregisters the staged originals on its thread,
    and that is the slow part of such a switch (``cudaHostUnregister`` of every offloadable weight: tenths of a
    second for a few GB, inside the last PROFILING pass). After a stream-mode warm-up: every
    streamed tensor is a real host tensor the warm loader copies per call, and the blocks fit beside them."""
    cfg = ctx.config
    loader = ctx.warm.loader
    if cfg.shm_enabled:
        return False
    tensors = ctx.tensors
    streamed = [tensors[p.name].tensor for layout in layouts for p in layout.tensors]
    if loader.keep and not loader.fell_back:
        return loader.holds_all(streamed)
    if ctx.in_place or not layouts or loader.active:
        return False
    if any(t.is_meta or t.device.type != "cpu" or loader.holds(t) for t in streamed):
        return False
    # The originals go block by block as the blocks fill (Note [sources handed over block by block]): beside
    # them, host RAM holds one arena in the making at most.
    _total, available = device_memory(torch.device("cpu"))
    needed = min(sum(layout.nbytes for layout in layouts), ARENA_MAX_BYTES + max(layout.nbytes for layout in layouts))
    return needed <= available - max(DEFER_HOST_MARGIN, available // 10)


def defer_inference(ctx: EngineContext, layouts: list[BlockLayout], schedule: list[str], num_slots: int) -> None:
    """Enter INFERENCE now and start building the host blocks (step 1 of the module docs): resident after a
    resident warm-up, copying each streamed trap's weights per call after a stream-mode one."""
    loader = ctx.warm.loader
    loader.unload()
    streamed = [[ctx.tensors[p.name].tensor for p in layout.tensors] for layout in layouts]
    copied: dict[str, list[torch.Tensor]] = {}
    if loader.keep and not loader.fell_back:
        sources = loader.detach(streamed)
    else:  # stream-mode warm-up: the host originals stay the tensors' data (and the copies' source) until install
        sources = [[t.data for t in tensors] for tensors in streamed]
        copied = {layout.label: tensors for layout, tensors in zip(layouts, streamed)}
    placed = {p.name for layout in layouts for p in layout.tensors}
    resident = [n for n, e in ctx.tensors.items() if n not in placed and (loader.holds(e.tensor) or (
        copied and not e.tensor.is_meta and e.tensor.device != ctx.device))]
    debug = logger.isEnabledFor(logging.DEBUG)
    kept = loader.commit(count=debug)  # everything else the warm-up copied stays resident for good
    still_host = {id(t) for tensors in copied.values() for t in tensors}
    for entry in ctx.tensors.values():  # (the warm-up holds no copy now: streamed ones detached, the rest committed)
        if not entry.tensor.is_meta and entry.tensor.device != ctx.device and id(entry.tensor) not in still_host:
            ctx.to_device(entry.tensor)
    provider = ctx.provider_factory(register_in_place=True)  # no cudaHostAlloc behind running passes
    # The build thread is the only user of the staging from here until install_deferred joined it (the warm
    # loader's copies per call read the staged memory, but neither register nor release it).
    handover = SourceHandover() if copied else None
    ctx.inference.deferred = HostBlockBuild(
        ctx.name, layouts, sources, provider, ctx.warm.staging.release, ctx.device, release_after=resident,
        handover=(handover, _move_onto_block(streamed)) if handover is not None else None)
    ctx.inference.deferred_plan = DeferredPlan(layouts, list(schedule), num_slots, streamed, copied, handover)
    ctx.sequence = list(schedule)
    bypass_untimed_traps(ctx, {layout.label for layout in layouts})
    if debug:
        logger.debug("manager %r: INFERENCE starts %s (%d bytes committed); %d host blocks build in the "
                     "background from the first inference pass", ctx.name,
                     "copying the streamed weights per call" if copied else "resident", kept, len(layouts))


def _move_onto_block(streamed: list[list[torch.Tensor]]) -> Callable[[BlockLayout, HostBlock], None]:
    """What the build's hand-over runs on its thread once a block is filled: the layout's tensors hold the block's
    views from then on (the same bytes as the originals they held)."""
    def move(layout: BlockLayout, block: HostBlock) -> None:
        for tensor, view in zip(streamed[layout.index], block_views(block.tensor, layout.tensors)):
            assign_data(tensor, view)
    return move


def install_deferred(ctx: EngineContext) -> None:
    """Wait for the build, then stream from its blocks (step 3 of the module docs). Raises the build's error."""
    build = ctx.inference.deferred
    if build is None:
        return
    build.wait()
    assert ctx.inference.deferred_plan is not None
    layouts, schedule, num_slots, streamed, copied, _handover = ctx.inference.deferred_plan
    ctx.inference.deferred = None
    ctx.inference.host_build_s = build.elapsed_s
    if build.error is not None:
        # Nothing of the failed build is kept: its blocks go, and so do the staged originals of the blocks it
        # never reached. The plan stays, so release(preserve_model=False) still drops the streamed weights.
        build.provider.close()
        ctx.warm.staging.release_all()
        raise RuntimeError(
            f"manager {ctx.name!r}: building the host blocks for INFERENCE failed: {build.error}. The model still "
            f"runs, {'copying the streamed weights per call' if copied else 'with every weight on the device'}; "
            "release() it, and lower the host memory needed (fewer "
            "offloaded layers, pinned_memory_mode='host_register') or free host RAM, then offload again"
        ) from build.error
    ctx.inference.deferred_plan = None
    ctx.inference.provider = build.provider
    for layout, block, tensors in zip(layouts, build.blocks, streamed):
        for placement, view, tensor in zip(layout.tensors, block_views(block.tensor, layout.tensors), tensors):
            assign_data(tensor, view)  # frees the warm-up device copy (or drops the host original)
            ctx.inference.placement[placement.name] = (layout.index, placement)
    if build.kept_sources:  # originals the hand-over left (Note [sources handed over block by block]): read no
        ctx.warm.staging.release_later(build.kept_sources)  # more, so released (and freed) off this thread
    elif layouts and ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the device copies just freed: GiBs other processes may want
    start_loader(ctx, layouts, build.blocks, schedule, num_slots, release_staging=not copied)
    if layouts:
        logger.info("manager %r: now streaming %d host blocks (built in %.2f s behind %s)", ctx.name, len(layouts),
                    build.elapsed_s, "copies per call" if copied else "resident inference")
    else:
        logger.info("manager %r: the plan streams nothing; the staged host weights were released in the "
                    "background (%.2f s)", ctx.name, build.elapsed_s)
