"""A session creator's steps: from the disk profile to a READY generation that followers attach to.

The creator (elected: the first to create the manager's coordinator segment, ``flextensor.sharing.session``)

1. reads the disk profile and runs the preflight (``/dev/shm`` room, ``RLIMIT_MEMLOCK`` when pinning);
2. has the resident tensors' store and the host blocks' segment (one arena, ``flextensor.shm.blocks``) made,
   without their pages, on a background thread (sizes from the profile) while ``creator_model_factory()`` (or
   the checkpoint's meta model) is built;
3. fills the store and then the arena from the model or its checkpoint, pointing the model at each shared
   copy as it is made (``flextensor.sharing.publish``: pages allocated a window ahead of the copy or the read, one
   copy of the weights in RAM), and adopts the profile over the filled blocks, as a follower does; with CUDA
   the creator's mapping is registered in the background like a follower's;
4. publishes the plan: the state rebuilt from the live allocation (``export_state()``, every block naming the
   arena), and flips the coordinator to READY. Publishing is ordered: store, blocks, plan, then state.

Any failure before READY is published first (``mark_failed``), so followers raise ``ShmCreatorFailedError``
with the creator's message, and only then cleaned up: whatever a step opened belongs to the manager's share
(:class:`~flextensor.sharing.share.ManagerShare`) as soon as it is open, so the session's cleanup closes it.
Kept apart from the session, which elects and then hands the share here or to the follower's steps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from torch import nn

from flextensor.configuration.config import OffloadConfig
from flextensor.engine.adoption import check_state
from flextensor.manager import OffloadManager, compute_device
from flextensor.profiles import read_profile
from flextensor.runtime.piece_copy import CopyPool
from flextensor.sharing.creator_source import CreatorSource
from flextensor.sharing.publish import (STORE_PIN_MIN_BYTES, BackgroundCall, BlockReads, PublishPlan, arena_plan,
                                        fill_blocks, plan_publish, populate_window, publish_store, read_queued)
from flextensor.sharing.share import PLAN_KIND, ManagerShare, block_pinner, device_index, timed_step
from flextensor.shm.blocks import SharedBlockAllocator
from flextensor.shm.preflight import check_shm_capacity, memlock_shortfall

__all__ = ["publish_as_creator"]

logger = logging.getLogger("flextensor.sharing.session")  # a session's steps log under the session's name


def publish_as_creator(share: ManagerShare, manager: OffloadManager, cfg: OffloadConfig, profile_dir: str,
                       source: CreatorSource, *, base: str) -> nn.Module:
    """Publish the generation ``share`` was elected creator of (see the module docstring) and return the model,
    offloaded by ``manager`` over the shared blocks; ``base`` is the session's namespace, for messages."""
    coordinator = share.coordinator
    owner = coordinator.memory_owner
    steps = share.steps
    try:
        device = compute_device(cfg)
        plan = plan_publish(read_profile(profile_dir), device, pinned_memory=cfg.pinned_memory,
                            align=owner.block_alignment)
        check_shm_capacity(share.namespace, plan.shared_bytes)
        if plan.pin:
            shortfall = memlock_shortfall(plan.shared_bytes)
            if shortfall:  # a warning: the NVIDIA driver does not charge cudaHostRegister to this limit
                logger.warning("session %s: %s", share.namespace, shortfall)
        # The segments are made while the model is built, without their pages: those come on a thread a window
        # ahead of the copy or the checkpoint read (flextensor.sharing.publish), so allocating tmpfs pages, the slow
        # part of publishing, overlaps the copy, and a model built in RAM is freed into them as they fill.
        owner.prepare_segments(plan.segment_sizes, reserve=False)
        with timed_step(steps, "factory"):
            model = source.build()
        logger.info("session %s: model built in %.2f s", share.namespace, steps["factory"])
        begin = time.monotonic()
        reads: BlockReads | None = None  # a checkpoint's block reads, running beside the adoption
        try:
            model, reads = _fill_shared(share, model, plan, cfg, source)
            published_plan = arena_plan(plan.state, SharedBlockAllocator(owner).names(plan.arena), plan.arena)
            gate: Callable[[int], None] | None = None
            if plan.pin and plan.layouts:
                share.pinner = block_pinner(share.segments, published_plan, plan.arena, device,
                                            label=f"session {share.namespace}")
                gate = share.pinner.wait
            if reads is not None:
                gate = reads.gate(gate)
            with timed_step(steps, "adopt"):  # the blocks are filled: the engine only points tensors at them
                proxy = manager.offload_from_state(model, published_plan, cfg, allow_strategy_replan=False,
                                                   host_blocks=share.block_views, host_block_gate=gate,
                                                   shm_owner=owner, weights=source.weights)
            with timed_step(steps, "plan"):
                published = manager.export_state()
                if sorted(t.name for t in published.tensors if not t.offloaded) != sorted(plan.resident):
                    raise RuntimeError(
                        f"internal error in session {base!r}: the adopted plan keeps other tensors "
                        "resident than the profile says; please report it (re-profiling may avoid it)")
                owner.write_blob(PLAN_KIND, published.to_json())
            if reads is not None:
                with timed_step(steps, "blocks_wait"):  # the reads' own seconds: publish["read_s"]
                    share.publish.update(reads.wait())
        finally:
            if reads is not None:
                reads.stop()  # after a failure: nothing writes into the arena once it is cleaned up
            source.close()
        if share.pinner is not None:
            share.pinner.start()  # after the adoption's device allocations and the reads, as a follower's
        assert share.store is not None  # _fill_shared published it
        share.shared_bytes = plan.arena.total + share.store.nbytes
        elapsed = max(time.monotonic() - begin, 1e-9)
        share.publish.update(seconds=elapsed, gbps=share.shared_bytes / elapsed / 1e9)
        logger.info("session %s: published %.1f MiB (%d blocks, %d resident tensors) in %.2f s (%.2f GB/s)",
                    share.namespace, share.shared_bytes / 2**20, len(published.blocks), len(plan.resident),
                    elapsed, share.shared_bytes / elapsed / 1e9)
        coordinator.notify_ready()
    except BaseException as exc:
        try:
            coordinator.mark_failed(exc)
        except Exception as publish_exc:  # noqa: BLE001 - the original error matters more
            logger.warning("session %s: could not publish the failure: %s", share.namespace, publish_exc)
        raise
    return proxy


def _fill_shared(share: ManagerShare, model: nn.Module, plan: PublishPlan, cfg: OffloadConfig,
                 source: CreatorSource) -> tuple[nn.Module, BlockReads | None]:
    """The store and the arena filled from the model (together, from a model in RAM), or the store then the
    arena from its checkpoint, and the model pointed at them; on CUDA the store's mapping is registered once it
    is filled, while the arena fills (see ``flextensor.sharing.publish``). A checkpoint's block reads
    are returned running (the caller adopts meanwhile, then waits for them). What it opens belongs to the
    share at once, so a failure is cleaned up by the caller's cleanup."""
    owner = share.coordinator.memory_owner
    steps = share.steps
    layouts, layout = plan.layouts, plan.arena
    views = []
    if layouts:
        share.segments.extend(SharedBlockAllocator(owner).create(layout))
        views = SharedBlockAllocator.views(share.segments, layout)
    share.block_views = views
    # Refuse a model that does not match the profile before anything of it changes.
    checked = check_state(model, plan.state, cfg, host_blocks=views, weights=source.weights)
    # A model in RAM fills the arena on a thread while the store fills here: their pages are different files,
    # which tmpfs allocates in parallel (see flextensor.shm.blocks), and allocating them is the slow part.
    # On a tmpfs of huge pages allocating a page is cheap and the copy is the publish: both fills write into their
    # segments' files on one pool of a thread per core (flextensor.runtime.piece_copy).
    pool = CopyPool(label="ft-publish-copy") if owner.huge_tmpfs and source.weights is None else None
    blocks_fill = None
    cancel = threading.Event()
    if layouts and source.weights is None:
        blocks_fill = BackgroundCall(lambda: share.publish.update(fill_blocks(
            checked.tensors, layouts, views, share.segments, layout, None, label=share.name, cancel=cancel,
            copy_pool=pool)), name="ft-publish-blocks", cancel=cancel)
    store_pin = None
    reads = None
    try:
        with timed_step(steps, "store"):
            share.store = publish_store(share.namespace, model, plan.resident, owner, source.weights,
                                        window=populate_window(plan.store_bytes),
                                        stop=None if blocks_fill is None else blocks_fill.failure,
                                        report=share.publish, copy_pool=pool)
            read_queued(source.weights)  # the resident tensors' checkpoint reads
        if plan.pin and share.store.nbytes >= STORE_PIN_MIN_BYTES:
            store_pin = BackgroundCall(share.store.pin, device=device_index(plan.device))
        with timed_step(steps, "blocks"):  # from a model in RAM: what the arena's fill took beyond the store's
            if layouts and source.weights is not None:
                reads = BlockReads(checked.tensors, layouts, views, share.segments, layout,
                                   source.weights).start()
            elif blocks_fill is not None:
                failure = blocks_fill.join()  # an interrupt here cancels the fill and still waits for it
                share.publish["blocks_fill_s"] = blocks_fill.seconds
                blocks_fill = None
                if failure is not None:
                    raise failure
    finally:
        if blocks_fill is not None:  # the store failed: stop the arena's fill before anything is cleaned up
            cancel.set()
            blocks_fill.join()  # also through an interrupt: the thread must be gone before the cleanup
        if pool is not None:
            pool.close()
        if store_pin is not None:  # never left running: a failure's cleanup unpins the store
            with timed_step(steps, "register_store_wait"):
                error = store_pin.join()
            share.publish["register_store_s"] = store_pin.seconds
            if error is not None:
                logger.warning("session %s: could not register the resident tensors' store with CUDA (%s); "
                               "they are copied to the device from pageable memory (correct, slower)",
                               share.namespace, error)
    return model, reads
