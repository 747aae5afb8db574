"""Undoing an offload: the teardown behind ``OffloadManager.release`` and failed setups.

Order matters, and is the same whether the manager reached INFERENCE or failed half-way through ``offload()``
or an adoption:

0. a host-block build still running behind resident inference (``flextensor.engine.build``) is cancelled and
   joined; the weights it would have streamed still hold their device copies;
1. the block loader stops (in-flight side-stream copies finish) and any warm-up device copies are dropped: a
   streamed trap's and the kept ones of a resident warm-up (``flextensor.engine.warmup``) get their original host data
   back, exactly as it was, with no device-to-host copy;
2. every tensor gets real data again: an offloaded tensor is copied out of its host block back to its original
   device (``preserve_model=True``) or becomes a ``meta`` tensor of the same shape (``preserve_model=False``);
   any other tensor returns to the device it came from;
3. the trap forwards are unpatched (the class was never touched); the manager unpatches the root forward;
4. the pinned warm-up staging is unregistered (after a device synchronize inside ``PinnedStaging``: a queued
   warm-up copy may still read it), then host blocks (unpinned/unmapped by their provider); the manager then
   leaves a shared-memory namespace it joined itself and drops the context, so it can offload again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flextensor.engine.function_traps import release_function_traps
from flextensor.engine.hooks import assign_data
from flextensor.runtime.host_memory import HostBlock, block_view

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext

__all__ = ["teardown", "close_resources"]


def teardown(ctx: EngineContext, preserve_model: bool) -> None:
    """Steps 0-4 of the module docstring for ``ctx`` (after profile_mode="torch_function" gave the model's own
    parameters their places back: ``flextensor.engine.function_traps``)."""
    release_function_traps(ctx, preserve_model)
    build, ctx.inference.deferred = ctx.inference.deferred, None
    if build is not None:  # host blocks still being built: stop it; the tensors still hold device copies
        build.cancel()
        ctx.inference.provider = build.provider
    plan, ctx.inference.deferred_plan = ctx.inference.deferred_plan, None  # also left by a failed build
    streamed = [t for tensors in plan.streamed for t in tensors] if plan is not None else []
    if not preserve_model:  # what INFERENCE would stream is dropped like streamed weights: onto meta
        for t in streamed:
            assign_data(t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    if ctx.inference.state_dict_hook is not None:
        ctx.inference.state_dict_hook.remove()
        ctx.inference.state_dict_hook = None
    if ctx.inference.loader is not None:
        ctx.inference.loader.close()
        ctx.inference.loader = None  # its references to the host blocks go with it (see _restore_from_blocks)
    ctx.warm.loader.unload()
    ctx.warm.loader.restore()
    _restore_from_blocks(ctx, preserve_model)
    for name, entry in ctx.tensors.items():
        t = entry.tensor
        if name not in ctx.inference.placement and preserve_model and not t.is_meta:
            target = _home_device(ctx, name)
            if t.device != target:
                t.data = t.data.to(target)
    for trap in ctx.traps.values():
        trap.uninstall()
    close_resources(ctx)


def _restore_from_blocks(ctx: EngineContext, preserve_model: bool) -> None:
    """Step 2 for the offloaded tensors, block by block: each tensor gets its bytes back from its host block (or
    becomes ``meta``), then the provider may free the block (``HostBlockProvider.release_block``). Copied out
    all at once, a model held in host blocks would exist twice at the peak of ``release()``; block by block it
    exists once plus an arena. The engine's references to the blocks go as they are released (the loader's
    went before), so an arena's memory is returned as soon as its last block is."""
    blocks: list[HostBlock | None] = list(ctx.inference.host_blocks)  # None once released
    ctx.inference.host_blocks = []
    by_block: dict[int, list[str]] = {}
    for name, (index, _placement) in ctx.inference.placement.items():
        by_block.setdefault(index, []).append(name)
    provider = ctx.inference.provider
    for index in sorted(by_block):
        block = blocks[index]
        assert block is not None
        for name in by_block[index]:
            t = ctx.tensors[name].tensor
            p = ctx.inference.placement[name][1]
            if preserve_model:
                target = _home_device(ctx, name)
                host_view = block_view(block.tensor, p)
                t.data = host_view.clone() if target.type == "cpu" else host_view.to(target)
                del host_view
            else:
                assign_data(t, torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device="meta"))
        blocks[index] = block = None  # the engine's last reference to the block: its arena may go now
        if provider is not None:
            provider.release_block(index)


def _home_device(ctx: EngineContext, name: str) -> torch.device:
    """Where tensor ``name`` goes back to: the device it came from (the CPU for one that came on ``meta``)."""
    orig = ctx.orig_device.get(name, torch.device("cpu"))
    return torch.device("cpu") if orig.type == "meta" else orig


def close_resources(ctx: EngineContext) -> None:
    """Step 4: staging registrations, the loader and the host blocks go (also after a failed build)."""
    ctx.warm.staging.release_all()
    ctx.inference.loader = None
    ctx.inference.host_blocks = []
    if ctx.inference.provider is not None:
        ctx.inference.provider.close()
        ctx.inference.provider = None
